#!/bin/bash
# Issue 49's figures on one GPU, each side by side in one run: the trainer against
# transformers (SDPA, AdamW) at 4 x 2,048 and 1 x 8,192 tokens (0.6B shape, bf16), the same
# with the tree before the change (BEFORE: a checkout of it); the built-in engine's decode at
# 8,192-token prompts (batches 1, 16, 64) with this tree and BEFORE's; the decode timeline at
# batch 16 (the share of a step outside the CUDA graph); SDPA's GQA and varlen choices.
# PART=grpo instead: the GRPO step benchmark (one GPU, Defer-swap, --bf16) with this tree and
# BEFORE's, then one step of 64 samples with 8,192-token responses (phases and memory).
# One JSON line per run on stdout and in $OUT/speed.jsonl (OUT: where to write, default /tmp).
set -uo pipefail
out=${OUT:-/tmp}/speed.jsonl
site=${SITE:-/tmp/site}
run() { echo "== $*" >&2; timeout "$1" "${@:2}" 2>&1 | grep -v USDT | tail -1 | sed "s/^{/{${TAG:-}/" | tee -a "$out"; }
before() { [ -n "${BEFORE:-}" ] && (cd "$BEFORE" && PYTHONPATH="$site:$BEFORE" TAG='"before": true, ' run "$@"); }
if [ "${PART:-}" = grpo ]; then
  G="python benchmarks/grpo_step_bench.py --device cuda --size 0.6b --gpus 1 --modes defer --train-args=--bf16"
  before 240 $G --steps 3
  run 240 $G --steps 3
  run 540 $G --steps 1 --prompts 8 --n 8 --response-len 8192
  exit 0
fi
TB="python benchmarks/trainer_bench.py --device cuda --size 0.6b --bf16 --train-only"
E="python benchmarks/engine_bench.py --size 0.6b --prompt 8192 --new 128 --batches 1,16,64 --skip-hf-above 0 --no-swap"
run 90 $TB --batch 1 --seq 8192 --steps 2 --anchor
run 90 $E
before 90 $E
before 60 $TB --batch 1 --seq 8192 --steps 2
run 90 $TB --batch 4 --seq 2048 --steps 3 --anchor
run 60 python benchmarks/decode_timeline.py --size 0.6b --batch 16 --prompt 8192 --new 64
run 40 python benchmarks/sdpa_variants.py
