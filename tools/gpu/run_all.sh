#!/usr/bin/env bash
# Every GPU measurement of docs/benchmarks/ in one go, most valuable first; results land in $RES as they come
# (a run cut short leaves every finished one). Start it detached on the GPU machine and poll:
#   source .whl/prelude.sh && RES=/tmp/res setsid nohup bash tools/gpu/run_all.sh > /tmp/run_all.log 2>&1 &
# Each phase has its own time limit; a failed or timed-out phase is recorded and the next one runs.
# `lstune bench` writes each phase's bench.json, bench.md and plots to $RES/<phase>/ (every trial in a fresh
# process, its record in trials/ as soon as it ends); bench_ladder.py does what lstune bench does not (overlap,
# the deep model's longest sequence through a shallow one plus ballast).
set -u
. "$(dirname "$0")/phase.sh"
L="python3 -m lstune bench --model llama-3.1-8b --lora-r 16"

phase gpu-tests 420 bash -c "python3 -m pytest -q -rs tests/gpu > $RES/gpu-tests.log 2>&1"
# ALST Table 1 at full depth: every rung at 8-32K (step time, MFU, peaks, the estimate's error) and the kernel rates.
phase ladder 900 $L --ablation --seq-len 8k --lengths 8k,16k,32k --rates --trial-timeout 300 --output-dir "$RES/ladder"
# Step times at 64K and 128K for the rungs that fit there.
phase long 900 $L --rungs tiled_loss,tiled_mlp,offload,mini_seq --seq-len 64k --lengths 64k,128k --steps 2 \
  --trial-timeout 400 --output-dir "$RES/long"
# Longest sequence of the rungs that stay on the device (8K resolution, from 32K).
phase maxlen 1500 $L --rungs hf,tiled_loss,tiled_mlp --find-max-len --seq-len 32k --len-step 8k --max-len 192k \
  --steps 1 --trial-timeout 300 --output-dir "$RES/maxlen"
phase overlap 60 $B overlap --out "$OUT" --seq 64k
# Offloaded rungs: their device limit at full depth is a 2-layer model's plus the other 30 layers' bytes
# (full-depth steps at 350-500K take 8-15 minutes each).
phase maxlen-mini_seq-deep 330 $B maxlen --out "$OUT" --rung mini_seq --layers 2 --as-layers 32 \
  --fit-lengths 64k,128k --start 384k --len-step 32k --max-tries 2 --max-len 704k
phase maxlen-offload-deep 330 $B maxlen --out "$OUT" --rung offload --layers 2 --as-layers 32 \
  --fit-lengths 64k,128k --start 320k --len-step 32k --max-tries 2 --max-len 704k
echo "=== $(date +%T) all done" | tee "$RES/DONE"
