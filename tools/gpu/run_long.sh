#!/usr/bin/env bash
# Issue 31 (1): one real full-depth (32-layer) Llama-3.1-8B LoRA r=16 step at $LEN tokens (default 384K) on an
# H100 80 GB with lstune's defaults, through `lstune bench` (fingerprint, both device peaks, host RSS, step time and
# the estimate's prediction for each in one record). The estimate's plan for 384K on an H100 with a 125 GiB host
# (2026-11-28): tiled MLP and loss, mini-sequence, checkpoints offloaded (2 kept on the device), attention
# recomputed in backward; device 61.3 GiB, host 95.0 GiB, step ~430 s. A lease is 15 minutes, start-up included,
# one command at most 10: so the step is the lease's first and only long work, started detached (setsid: it
# outlives the command) while this script polls it, samples device and host memory every 5 s (how far a step that
# the window cuts got), and packs everything into one archive under the results folder after each poll minute.
# Whatever time the command has left after the step goes to the CUDA tests.
#   RESULTS_DIR=$OUT; source .whl/prelude.sh && bash tools/gpu/run_long.sh $OUT 580
# A second call on the still-warm machine polls a step the first call left running:
#   bash tools/gpu/run_long.sh $OUT 150 poll
set -u
dest=$1 budget=${2:-580} mode=${3:-start}
LEN=${LEN:-384k} MODEL=${MODEL:-llama-3.1-8b}
RES=/tmp/res
mkdir -p "$RES"
start=$SECONDS

pack() { tar czf "$dest/res.tgz" -C "$RES" . 2>/dev/null; cp "$RES/long.log" "$dest/" 2>/dev/null; true; }
running() { [ -f "$RES/bench.pid" ] && kill -0 "$(cat "$RES/bench.pid")" 2>/dev/null; }

if [ "$mode" = start ]; then
  cp "$dest/fingerprint.txt" "$RES/" 2>/dev/null
  # The samplers run in their own session with no tie to this command's output (a pipe left open would hold the
  # command until they end); they stop with the step.
  setsid nohup nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu,power.draw --format=csv -l 5 \
    > "$RES/smi.csv" 2>&1 < /dev/null &
  echo $! > "$RES/samplers.pid"
  setsid nohup bash -c 'while true; do echo "$(date +%T) $(free -m | awk "/Mem:/{print \$3}")"; sleep 5; done' \
    > "$RES/host-used-mib.txt" 2>&1 < /dev/null &
  echo $! >> "$RES/samplers.pid"
  echo "=== $(date +%T) full-depth $LEN: lstune bench (detached)"
  setsid nohup bash -c "echo \$\$ > $RES/bench.pid; exec python3 -m lstune bench --model $MODEL --lora-r 16 \
    --rungs lstune --seq-len $LEN --lengths $LEN --warmup 0 --steps 1 --trial-timeout 840 \
    --output-dir $RES/full-depth-$LEN" > "$RES/long.log" 2>&1 < /dev/null &
  sleep 5
fi

last_pack=$SECONDS
while running && [ $((SECONDS - start)) -lt "$budget" ]; do
  sleep 5
  if [ $((SECONDS - last_pack)) -ge 60 ]; then pack; last_pack=$SECONDS; fi
done
if running; then
  echo "=== $(date +%T) step still running after $((SECONDS - start)) s; poll again"
  tail -5 "$RES/long.log"; pack; exit 0
fi
kill $(cat "$RES/samplers.pid" 2>/dev/null) 2>/dev/null
echo "=== $(date +%T) bench done ($((SECONDS - start)) s into this command)"
tail -25 "$RES/long.log"
pack

# The CUDA tests in what is left (issue 31 (3)), the quick files first; each one's log comes back in the archive.
left=$((budget - (SECONDS - start) - 10))
if [ "$left" -gt 40 ] && [ ! -f "$RES/tests.done" ]; then
  echo "=== $(date +%T) CUDA tests, ${left}s"
  timeout "$left" python3 -m pytest -q -rs --durations=10 tests/gpu/test_qlora_cuda.py tests/gpu/test_bench_cuda.py \
    tests/gpu/test_mixers_cuda.py tests/gpu/test_parallel_cuda.py tests/gpu/test_attention_chunks_cuda.py \
    tests/gpu/test_memory_cuda.py tests/gpu/test_train_cuda.py > "$RES/gpu-tests.log" 2>&1
  echo "rc=$?" >> "$RES/gpu-tests.log"; touch "$RES/tests.done"
  tail -15 "$RES/gpu-tests.log"
fi
pack
