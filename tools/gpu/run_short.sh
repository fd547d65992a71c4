#!/usr/bin/env bash
# A GPU run for a 15-minute lease (start-up included, so ~10 minutes of work), most valuable first; every phase
# under its own limit and appending to $RES/bench.jsonl as it finishes, so a lease that ends mid-run keeps every
# finished phase (limits: 150 + 330 + 330 + 320 + 150 + 150 + 400 s; the lease cuts what does not fit). After the
# third H200 lease of 2026-11-26 (docs/benchmarks/2026-11-26-h200-c): the CUDA tests fixed since (43 s for the
# rest), the full-depth 128K step with attention's output kept (issue 33: against the no-recompute ideal, and the
# first step against the steady state; on any card), ZeRO-3's 8B full fine-tune with the sub-groups sized
# since (~4 min with set-up), the Qwen3-8B recipe (~320 s), then issue 14's chunk phases as regression checks.
# Start detached and poll: docs/benchmarks/README.md, "Running run_short.sh".
set -u
. "$(dirname "$0")/phase.sh"
. "$(dirname "$0")/phases.sh"

shared_phases
deepspeed_offload
qwen3_recipe_128k
chunk_phases
echo "=== $(date +%T) all done" | tee "$RES/DONE"
