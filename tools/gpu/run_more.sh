#!/usr/bin/env bash
# The second GPU run of 2026-11-23 (the first, run_all.sh, was cut by the lease after its ladder): the new CUDA
# tests, the longest sequence of the offloaded rungs at full depth through a 2-layer model carrying the other
# 30 layers' device bytes, the full-depth longest sequence of the tiled rungs, and the Qwen3-8B recipe via the CLI.
set -u
. "$(dirname "$0")/phase.sh"
phase gpu-tests-new 150 bash -c "python3 -m pytest -q -rs tests/gpu -k 'overlap or lora or peak_memory' > $RES/gpu-tests-2.log 2>&1"
phase maxlen-mini_seq-deep 200 $B maxlen --out "$OUT" --rung mini_seq --layers 2 --as-layers 32 \
  --fit-lengths 64k,128k --start 384k --len-step 32k --max-tries 2 --max-len 704k
phase maxlen-offload-deep 200 $B maxlen --out "$OUT" --rung offload --layers 2 --as-layers 32 \
  --fit-lengths 64k,128k --start 320k --len-step 32k --max-tries 2 --max-len 704k
phase maxlen-tiled_loss 200 $B maxlen --out "$OUT" --rung tiled_loss --start 104k --len-step 8k --max-tries 2
phase qwen3-recipe 200 bash -c "python3 -m lstune train --config recipes/qwen3-8b/128k-1xh100.yaml --model qwen3-8b \
  --data builtin:passkey --seq-len 32k --max-steps 3 --save-every 3 --output-dir /tmp/qwen3 > $RES/qwen3-recipe.log 2>&1; \
  cp /tmp/qwen3/metrics.jsonl $RES/qwen3-metrics.jsonl"
phase maxlen-tiled_mlp 300 $B maxlen --out "$OUT" --rung tiled_mlp --start 144k --len-step 16k --max-tries 2
echo "=== $(date +%T) all done" | tee "$RES/DONE"
