#!/usr/bin/env bash
# A GPU run for a 15-minute lease (start-up included, so ~10 minutes of work), most valuable first; every phase
# under its own limit and appending to $RES/bench.jsonl as it finishes, so a lease that ends mid-run keeps every
# finished phase (limits: 150 + 150 + 400 + 150 + 300 + 240 s; the lease cuts what does not fit). On 2026-11-26
# an H200 ran the chunk tests in 77 s, the chunk timings in 76 s, the rest of the tests in 61 s and the full-depth
# step in 231 s. Start detached and poll: docs/benchmarks/README.md, "Running run_short.sh".
# What it leaves to run_next.sh (too long for 15 minutes): the Qwen3-8B recipe at 128K (~320 s).
set -u
. "$(dirname "$0")/phase.sh"
. "$(dirname "$0")/phases.sh"

shared_phases
deepspeed_offload
echo "=== $(date +%T) all done" | tee "$RES/DONE"
