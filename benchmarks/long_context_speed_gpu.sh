#!/bin/bash
# Issue 49's figures on one GPU, each side by side in one run. PART picks one call's worth
# (each under the device's 10 minutes a call):
#   grpo (default): the GRPO step benchmark (one GPU, Defer-swap, --bf16), this tree and BEFORE's
#     alternated twice (after, before, after, before: neither side gets the other's warm caches
#     alone);
#   resident: the same benchmark as it is, with the engines at 0.4 of the GPU (the trainer's
#     state may then stay on the device between steps), and at 0.4 with micro-batches of 32,768
#     tokens (default 8,192), alternated twice;
#   long: one GRPO step of 64 samples with 8,192-token responses (phases and memory);
#   trainer: the trainer against transformers on a GRPO-like batch (64 rows of 256..8,192
#     tokens, packed micro-batches of 32,768) and at 1 x 32,768 (ours alone: its MFU);
#   trainer4b: the 4B shape at 1 x 8,192 against transformers, twice, then where its step goes
#     (trainer_profile.py) and the trainer's CUDA tests (needs an H200: call the device with
#     needs_h200; our peak is about 104 GB);
#   decode: the built-in engine's decode at 8,192-token prompts (batches 1, 16, 64) with this
#     tree, this tree without programmatic dependent launch (RELAY_DECODE_PDL=0) and BEFORE's,
#     at the judge's length (10,112-token prompts: max_context_len 10,240),
#     the decode timeline at batch 16;
#   sweep: the decode attention kernel alone over its launch choices at 8,192 and 10,240
#     positions (what a retune would take), SDPA's backends;
#   tests: the CUDA tests of the kernels these figures rest on (engines and trainer, -m gpu).
# BEFORE: a checkout of the tree to compare with; SITE: where the carried wheels are installed.
# One JSON line per run on stdout and in $OUT/speed.jsonl (OUT: where to write, default /tmp).
set -uo pipefail
out=${OUT:-/tmp}/speed.jsonl
site=${SITE:-/tmp/site}
run() { echo "== $*" >&2; timeout "$1" "${@:2}" 2>&1 | grep -v USDT | tail -1 | sed "s/^{/{${TAG:-}/" | tee -a "$out"; }
before() { [ -n "${BEFORE:-}" ] && (cd "$BEFORE" && PYTHONPATH="$site:$BEFORE" TAG='"before": true, ' run "$@"); }
case "${PART:-grpo}" in
grpo)
  G="python benchmarks/grpo_step_bench.py --device cuda --size 0.6b --gpus 1 --modes defer --train-args=--bf16"
  for _ in 1 2; do
    run 140 $G --steps 3
    before 140 $G --steps 3
  done
  ;;
resident)
  G="python benchmarks/grpo_step_bench.py --device cuda --size 0.6b --gpus 1 --modes defer --train-args=--bf16"
  for _ in 1 2; do
    run 100 $G --steps 3
    run 100 $G --steps 3 --mem-fraction 0.4
    run 100 $G --steps 3 --mem-fraction 0.4 "--train-args=--bf16 --micro-batch-tokens 32768"
  done
  ;;
long)
  run 570 python benchmarks/grpo_step_bench.py --device cuda --size 0.6b --gpus 1 --modes defer \
    --train-args=--bf16 --steps 1 --prompts 8 --n 8 --response-len 8192
  ;;
trainer)
  TB="python benchmarks/trainer_bench.py --device cuda --size 0.6b --bf16 --train-only"
  run 300 $TB --batch 64 --lengths 256,8192 --packed --micro-batch-tokens 32768 --steps 2 --anchor
  run 120 $TB --batch 1 --seq 32768 --steps 2
  ;;
trainer4b)
  T4="python benchmarks/trainer_bench.py --device cuda --size 4b --bf16 --train-only --batch 1 --seq 8192"
  run 150 $T4 --steps 2 --anchor
  run 150 $T4 --steps 2 --anchor
  timeout 120 python benchmarks/trainer_profile.py --device cuda --size 4b --bf16 --batch 1 --seq 8192 2>&1 \
    | grep -v USDT | tail -40
  timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/trainer/test_gpu.py -k "fused or clip or automatic" --tb=short 2>&1 | grep -v Warning | tail -30
  ;;
decode)
  E="python benchmarks/engine_bench.py --size 0.6b --new 128 --skip-hf-above 0 --no-swap"
  run 90 $E --prompt 8192 --batches 1,16,64
  RELAY_DECODE_PDL=0 TAG='"pdl": false, ' run 90 $E --prompt 8192 --batches 1,16,64
  before 90 $E --prompt 8192 --batches 1,16,64
  run 90 $E --prompt 10112 --batches 1,16,64
  run 60 python benchmarks/decode_timeline.py --size 0.6b --batch 16 --prompt 8192 --new 64
  ;;
sweep)
  run 300 python benchmarks/decode_kernel_sweep.py --context 8192 --batches 1,16,64
  run 180 python benchmarks/decode_kernel_sweep.py --context 10240 --batches 16,64
  run 40 python benchmarks/sdpa_variants.py
  ;;
tests)
  timeout 420 python -m pytest -q -m gpu -p no:cacheprovider tests/engines/test_gpu.py \
    tests/trainer/test_lm_head_kernel.py tests/trainer/test_rope_kernel.py tests/trainer/test_swiglu_kernel.py \
    tests/trainer/test_rms_norm_kernel.py 2>&1 | tail -15
  ;;
*) echo "PART must be grpo, resident, long, trainer, trainer4b, decode, sweep or tests, not ${PART}" >&2; exit 2 ;;
esac
