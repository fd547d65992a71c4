#!/usr/bin/env bash
# Every GPU measurement of docs/benchmarks/ in one go, most valuable first; results land in $RES as they come
# (a run cut short leaves every finished one). Start it detached on the GPU machine and poll:
#   source .whl/prelude.sh && RES=/tmp/res setsid nohup bash tests/gpu/run_all.sh > /tmp/run_all.log 2>&1 &
# Each phase has its own time limit; a failed or timed-out phase is recorded and the next one runs.
set -u
. "$(dirname "$0")/phase.sh"

phase gpu-tests 420 bash -c "python3 -m pytest -q -rs tests/gpu > $RES/gpu-tests.log 2>&1"
phase rates 120 $B rates --out "$OUT" --attn-lengths 32k,128k
phase overlap 60 $B overlap --out "$OUT" --seq 64k
# Full depth (32 layers), LoRA r=16: peaks at 8-32K for every rung, step times at 64K, 128K for the recipe's rung.
phase ladder 720 $B ladder --out "$OUT" --phase hf,tiled_loss,tiled_mlp,offload,mini_seq:8k,16k,32k:1 \
  --phase tiled_loss,tiled_mlp,offload,mini_seq:64k:2 --phase offload:128k:1
phase maxlen-hf 200 $B maxlen --out "$OUT" --rung hf --fit-lengths 8k,16k --start 24k --len-step 4k --max-tries 4
phase maxlen-tiled_loss 300 $B maxlen --out "$OUT" --rung tiled_loss --fit-lengths 16k,32k --start 64k --max-tries 3
# Offloaded rungs at 2 layers: the device working set of a layer at long lengths (full-depth peak = this peak +
# the other 30 layers' weights and adapter state; host = 31 checkpoints).
phase maxlen-offload-2l 330 $B maxlen --out "$OUT" --rung offload --layers 2 --fit-lengths 64k,128k \
  --start 256k --len-step 32k --max-tries 2 --max-len 640k
phase maxlen-mini_seq-2l 330 $B maxlen --out "$OUT" --rung mini_seq --layers 2 --fit-lengths 64k,128k \
  --start 256k --len-step 32k --max-tries 2 --max-len 640k
phase maxlen-tiled_mlp 360 $B maxlen --out "$OUT" --rung tiled_mlp --fit-lengths 32k,64k --start 128k \
  --len-step 16k --max-tries 2
echo "=== $(date +%T) all done" | tee "$RES/DONE"
