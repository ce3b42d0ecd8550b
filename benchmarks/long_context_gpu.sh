#!/bin/bash
# The long-context trainer figures of docs/PERFORMANCE.md on one GPU: the 0.6B shape in bf16
# at 1 x 8,192 / 16,384 / 32,768 tokens and a GRPO-like batch of 64 rows of 256..8,192 tokens
# (packed), each beside transformers (SDPA) doing the same work; the short shape (4 x 2,048)
# with this tree and, when BEFORE names a checkout of the code before the change, with that.
# One JSON line per run on stdout (and in $OUT/long_context.jsonl when OUT is set).
set -uo pipefail
out=${OUT:-/tmp}/long_context.jsonl
run() { echo "== $*" >&2; timeout 900 python benchmarks/trainer_bench.py --device cuda --size 0.6b --bf16 "$@" | tail -1 | tee -a "$out"; }
run --batch 4 --seq 2048 --steps 3 --train-only --anchor
if [ -n "${BEFORE:-}" ]; then
  (cd "$BEFORE" && PYTHONPATH="${SITE:-/tmp/site}:$BEFORE" timeout 900 python benchmarks/trainer_bench.py --device cuda --size 0.6b --bf16 --batch 4 --seq 2048 --steps 3 | tail -1 | sed 's/^{/{"before": true, /' | tee -a "$out")
fi
for seq in 8192 16384 32768; do run --batch 1 --seq $seq --steps 2 --train-only --anchor; done
run --batch 64 --lengths 256,8192 --packed --micro-batch-tokens 32768 --steps 1 --train-only --anchor
