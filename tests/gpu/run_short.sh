#!/usr/bin/env bash
# A GPU run for a 15-minute lease (start-up included, so ~10 minutes of work), most valuable first; every phase
# under its own limit and appending to $RES/bench.jsonl as it finishes, so a lease that ends mid-run keeps every
# finished phase (limits: 150 + 120 + 240 + 150 + 240 = 900 s; the lease cuts what does not fit; on 2026-11-26 an
# H200 ran the first four in 445 s). Start detached and poll: docs/benchmarks/README.md, "Running run_short.sh".
# What it leaves out of run_next.sh (too long for 15 minutes): the emulated 32-layer longest length with chunked
# attention and MEMO placement (~400 s) and the Qwen3-8B recipe at 128K (~320 s).
set -u
. "$(dirname "$0")/phase.sh"
. "$(dirname "$0")/phases.sh"

gpu_tests_chunks
chunks_128k
full_depth_128k
gpu_tests_rest
deepspeed_offload
echo "=== $(date +%T) all done" | tee "$RES/DONE"
