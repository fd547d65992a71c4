#!/usr/bin/env bash
# The 25-minute plan (issue 10's leftovers, then issue 14's chunk phases as regression checks), most valuable first,
# every phase under its own limit; each phase appends its records to $RES/bench.jsonl as they come, so a run
# cut short keeps every finished one (limits: 150 + 300 + 320 + 330 + 150 + 150 + 400 = 1800 s: more than a 25-minute lease holds, the last phases are cut). Start it
# detached and poll (docs/benchmarks/README.md, "Running run_next.sh with the run tool"):
#   RESULTS_DIR=$OUT; source .whl/prelude.sh && mkdir -p /tmp/res && cp $OUT/fingerprint.txt /tmp/res/ && \
#     (RES=/tmp/res setsid nohup bash tools/gpu/run_next.sh > /tmp/run_next.log 2>&1 < /dev/null &); sleep 20
#   then every ~9 min: sleep 540; grep '=== ' /tmp/run_next.log | tail -8; cp -r /tmp/res/. $OUT/
# Expected durations come from docs/benchmarks/2026-11-23-h100 (H100 80 GB): a 2-layer step at 128K takes 3.9 s
# (0.45 s of it the loss head), a full-depth one 56 s in steady state and 75 s for the first step at a length
# (it pins the offload buffers); attention per layer at 128K is 0.25 s forward + 0.67 s backward and grows with
# length squared; model build + imports ~30-40 s per process.
set -u
. "$(dirname "$0")/phase.sh"
. "$(dirname "$0")/phases.sh"

shared_phases
full_depth_128k_recompute
qwen3_recipe_128k
deepspeed_offload
chunk_phases
echo "=== $(date +%T) all done" | tee "$RES/DONE"
