#!/usr/bin/env bash
# The third GPU run (issues 14 and 10's leftovers), most valuable first, every phase under its own limit; the
# limits add up to 1710 s = 28.5 min, and each phase appends its records to $RES/bench.jsonl as they come, so a run
# cut short keeps every finished one (limits: 150 + 150 + 400 + 300 + 150 + 320 + 240 = 1710 s). Start it
# detached and poll (docs/benchmarks/README.md, "Running run_next.sh with the run tool"):
#   RESULTS_DIR=$OUT; source .whl/prelude.sh && mkdir -p /tmp/res && cp $OUT/fingerprint.txt /tmp/res/ && \
#     (RES=/tmp/res setsid nohup bash tests/gpu/run_next.sh > /tmp/run_next.log 2>&1 < /dev/null &); sleep 20
#   then every ~9 min: sleep 540; grep '=== ' /tmp/run_next.log | tail -8; cp -r /tmp/res/. $OUT/
# Expected durations come from docs/benchmarks/2026-11-23-h100 (H100 80 GB): a 2-layer step at 128K takes 3.9 s
# (0.45 s of it the loss head), a full-depth one 56 s in steady state and 75 s for the first step at a length
# (it pins the offload buffers); attention per layer at 128K is 0.25 s forward + 0.67 s backward and grows with
# length squared; model build + imports ~30-40 s per process.
set -u
. "$(dirname "$0")/phase.sh"
. "$(dirname "$0")/phases.sh"

gpu_tests_chunks
chunks_128k

maxlen_chunks_emulated
full_depth_128k
gpu_tests_rest

# Issue 10: the Qwen3-8B recipe at its 128K, 3 steps through the CLI (36 layers: ~85 s a step in steady
#    state, ~100 s for the first (it pins the offload buffers), + random init, self-check, imports ≈ 5.3 min).
phase qwen3-recipe-128k 320 bash -c "python3 -m lstune train --config recipes/qwen3-8b/128k-1xh100.yaml \
  --model qwen3-8b --data builtin:passkey --max-steps 3 --save-every 3 --output-dir /tmp/qwen3-128k \
  > $RES/qwen3-128k.log 2>&1; cp /tmp/qwen3-128k/metrics.jsonl $RES/qwen3-128k-metrics.jsonl"

deepspeed_offload
echo "=== $(date +%T) all done" | tee "$RES/DONE"
