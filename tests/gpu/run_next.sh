#!/usr/bin/env bash
# The third GPU run (issues 14 and 10's leftovers), most valuable first, every phase under its own limit; the
# limits add up to 1620 s = 27 min, and each phase appends its records to $RES/bench.jsonl as they come, so a run
# cut short keeps every finished one (limits: 150 + 120 + 400 + 240 + 150 + 320 + 240 = 1620 s). Start it
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

# Issue 14 (b): the longest 32-layer sequence with chunked attention + offload + MEMO placement on a 125 GiB
#    host (this machine's RAM), through 2 layers carrying the other 30 layers' weights/adapter state AND the
#    deep placement's checkpoint bytes on the device and (pinned) on the host — tests/gpu/bench_ladder.py
#    cmd_maxlen's doc says what that emulation does and does not model. lstune.estimate's plan for it
#    (`deep_plan`, weights on the device, chunks `auto`; computed on the dev machine, 125 GiB host):
#      768K: 8 chunks, predicted device 74.8 GiB, host 119.9 GiB; placement host 0,2,...,22,25,28, 17 layers
#            recomputed, device 31 → ballast 12.0 GiB device + 78.0 GiB pinned host (+ 13.1 GB of weights);
#      832K: 16 chunks, 75.0 / 122.9 GiB (fits, the estimate's longest with weights on the device) → ballast
#            13.0 GiB device + 78.0 GiB host;
#      896K: 16 chunks, device 79.5 GiB: predicted not to fit (14.0 + 70.0 GiB ballast).
#      1M: 16 chunks, device 88.6 GiB: does not fit (24.0 + 64.0 GiB ballast; 9 layers on the host, 22 recomputed).
#    With a 128 GiB host (the docs' round number): 768K 8 chunks, 74.4 / 128.0 GiB, ballast 9.94 + 86.06 GiB
#    (host 0-1,3,...,27, split 29 α 0.34, 15 recomputed); 1M 64 chunks, device 95.0 GiB, ballast 22.38 + 73.62 GiB.
#    (1M needs the weights on the host too, ZeRO-3: the 1.08M of docs/memory.md; not emulated here: the bench
#    model keeps its weights on the device.) tests/unit/bench/test_emulation_ballast.py pins the 768K numbers.
#    Target ≥ 1.5 × lstune without them: 768K vs the 512K device limit, 675K vs the ~450K host cap.
#    One trial at 832K: 2 layers × attention (832/128)² × 1.17 s ≈ 2 × 49 s + MLP/projections/head ~10 s (+ the
#    chunked projections' re-runs) ≈ 2 min, plus pinning ~78 GiB of host (~10-30 s). Two trials from the
#    estimate's longest: 832K, then 896K if it fits (768K if not) ≈ 5 min + build. A host OOM kills the process
#    (rc 137 in the phase record): the last "search" record before it is the longest that completed.
phase maxlen-chunks-emulated 400 $B maxlen --out "$OUT" $L8 --rung mini_seq --layers 2 --as-layers 32 \
  --attn-chunks auto --emulate-host 125G --start 832k --len-step 64k --max-tries 2 --max-len 1024k

full_depth_128k
gpu_tests_rest

# Issue 10: the Qwen3-8B recipe at its 128K, 3 steps through the CLI (36 layers: ~85 s a step in steady
#    state, ~100 s for the first (it pins the offload buffers), + random init, self-check, imports ≈ 5.3 min).
phase qwen3-recipe-128k 320 bash -c "python3 -m lstune train --config recipes/qwen3-8b/128k-1xh100.yaml \
  --model qwen3-8b --data builtin:passkey --max-steps 3 --save-every 3 --output-dir /tmp/qwen3-128k \
  > $RES/qwen3-128k.log 2>&1; cp /tmp/qwen3-128k/metrics.jsonl $RES/qwen3-128k-metrics.jsonl"

deepspeed_offload
echo "=== $(date +%T) all done" | tee "$RES/DONE"
