# The phases run_short.sh and run_next.sh share, one function each (sourced after phase.sh, with $RES, $OUT, $B).
L8="--preset llama-3.1-8b --lora-r 16"

# Issue 14 (c): the chunked-attention and memory CUDA tests (23 tests: 77 s on the H200 of 2026-11-26).
gpu_tests_chunks() {
  phase gpu-tests-chunks 150 bash -c "python3 -m pytest -q -rs tests/gpu/test_attention_chunks_cuda.py \
    tests/gpu/test_memory_cuda.py > $RES/gpu-tests-chunks.log 2>&1"
}

# Issue 14 (a): chunked vs unchunked step time at 128K in steady state, on 2 layers (the per-layer cost is what
# chunking changes; the head is the same). Each setting: a warm-up step at 128K (pins the host buffers), then 2 timed
# steps; 76 s for the three on the H200. Target ≤ 1.10 × `off` (the record's `vs_off`); 1.54 × on 2026-11-26 with
# PyTorch's flash op in the blocks, before they took cuDNN's.
chunks_128k() {
  phase chunks-128k-2layers 120 $B chunks --out "$OUT" $L8 --layers 2 --rung mini_seq --seq 128k \
    --chunks off,4,8 --steps 2
}

# Issue 14 (b): the longest 32-layer sequence with chunked attention + offload + MEMO placement on a 125 GiB
#   host (this machine's RAM), through 2 layers carrying the other 30 layers' weights/adapter state AND the
#   deep placement's checkpoint bytes on the device and (pinned) on the host — tests/gpu/bench_ladder.py
#   cmd_maxlen's doc says what that emulation does and does not model. lstune.estimate's plan for it
#   (`deep_plan`, weights on the device, chunks `auto`; computed on the dev machine, 125 GiB host):
#     768K: 8 chunks, predicted device 74.8 GiB, host 119.9 GiB; placement host 0,2,...,22,25,28, 17 layers
#           recomputed, device 31 → ballast 12.0 GiB device + 78.0 GiB pinned host (+ 13.1 GB of weights);
#     832K: 16 chunks, 75.0 / 122.9 GiB (fits, the estimate's longest with weights on the device) → ballast
#           13.0 GiB device + 78.0 GiB host;
#     896K: 16 chunks, device 79.5 GiB: predicted not to fit (14.0 + 70.0 GiB ballast).
#     1M: 16 chunks, device 88.6 GiB: does not fit (24.0 + 64.0 GiB ballast; 9 layers on the host, 22 recomputed).
#   With a 128 GiB host (the docs' round number): 768K 8 chunks, 74.4 / 128.0 GiB, ballast 9.94 + 86.06 GiB
#   (host 0-1,3,...,27, split 29 α 0.34, 15 recomputed); 1M 64 chunks, device 95.0 GiB, ballast 22.38 + 73.62 GiB.
#   (1M needs the weights on the host too, ZeRO-3: the 1.08M of docs/memory.md; not emulated here: the bench
#   model keeps its weights on the device.) tests/unit/bench/test_emulation_ballast.py pins the 768K numbers.
#   Target ≥ 1.5 × lstune without them: 768K vs the 512K device limit, 675K vs the ~450K host cap.
#   One trial at 832K: 2 layers × attention (832/128)² × 1.17 s ≈ 2 × 49 s + MLP/projections/head ~10 s (+ the
#   chunked projections' re-runs) ≈ 2 min, plus pinning ~78 GiB of host (~10-30 s). Two trials from the
#   estimate's longest: 832K, then 896K if it fits (768K if not) ≈ 5 min + build. A host OOM kills the process
#   (rc 137 in the phase record): the last "search" record before it is the longest that completed.
#   On a card bigger than an H100 80 GB (an H200) bench_ladder caps the allocator to what an H100 leaves it
#   (`cap_device`: the "device_cap" record, with a check that the cap holds).
maxlen_chunks_emulated() {
  phase maxlen-chunks-emulated 400 $B maxlen --out "$OUT" $L8 --rung mini_seq --layers 2 --as-layers 32 \
    --attn-chunks auto --emulate-host 125G --start 832k --len-step 64k --max-tries 2 --max-len 1024k
}

# Issue 10: the device's kernel rates (the ideal) and a steady-state full-depth step at 128K with lstune's defaults
# on this machine (one untimed warm-up step, then one timed step; 231 s in all on the H200, whose step took 50.7 s =
# 1.13 × its ideal). Target ≤ 1.2 × the ideal (bench.md's "× ideal"); the record also carries the estimate's peak.
full_depth_128k() {
  phase full-depth-128k 240 python3 -m lstune bench --model llama-3.1-8b --lora-r 16 --rungs lstune \
    --seq-len 128k --lengths 128k --steps 1 --rates --trial-timeout 220 --output-dir "$RES/full-depth-128k"
}

# Issue 10: the rest of tests/gpu (7 tests, 61 s on the H200).
gpu_tests_rest() {
  phase gpu-tests-rest 150 bash -c "python3 -m pytest -q -rs tests/gpu \
    --ignore=tests/gpu/test_attention_chunks_cuda.py --ignore=tests/gpu/test_memory_cuda.py \
    > $RES/gpu-tests-rest.log 2>&1"
}

# Issue 10: DeepSpeed ZeRO-3 with parameter and optimizer offload, one full fine-tune step at 16K. Llama-3.1-8B is
# refused in seconds for host memory (predicted 171.9 GiB > 125 GiB: fp32 master + Adam 89.7 GiB, the gradient
# twice); Llama-3.2-3B then gives the engine's step time (6.33 s on 2026-11-26, after DeepSpeed's JIT build of its
# CPU Adam, ~60 s; 150 s cut the final save of ~6 GB then: the log's time stamps say how long it takes).
deepspeed_offload() {
  phase deepspeed-offload 240 bash -c "for m in llama-3.1-8b llama-3.2-3b; do python3 -m lstune train --model \$m \
    --lora-r 0 --zero-stage 3 --offload-optimizer --offload-params --data builtin:passkey --seq-len 16k \
    --max-steps 1 --output-dir /tmp/ds-\$m 2>&1 | while IFS= read -r line; do echo \"\$(date +%T) \$line\"; done \
    > $RES/deepspeed-\$m.log; cp /tmp/ds-\$m/metrics.jsonl $RES/deepspeed-\$m-metrics.jsonl 2>/dev/null && break; done"
}
