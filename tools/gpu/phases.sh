# The phases run_short.sh and run_next.sh share, one function each (sourced after phase.sh, with $RES, $OUT, $B).
L8="--preset llama-3.1-8b --lora-r 16"

# Issue 14 (c): the chunked-attention and memory CUDA tests (23 tests: 77 s on the H200 of 2026-11-26; 3 more since,
# each a second or two: Liger's peak against the estimate, frozen and trainable head, and the prefetch buffers' pool).
gpu_tests_chunks() {
  phase gpu-tests-chunks 150 bash -c "python3 -m pytest -q -rs tests/gpu/test_attention_chunks_cuda.py \
    tests/gpu/test_memory_cuda.py > $RES/gpu-tests-chunks.log 2>&1"
}

# Issue 14 (a): chunked vs unchunked step time at 128K in steady state, on 2 layers (the per-layer cost is what
# chunking changes; the head is the same). Each setting: a warm-up step at 128K (pins the host buffers), then 2 timed
# steps; 76 s for the three on the H200. Target ≤ 1.10 × `off` (the record's `vs_off`); 1.54 × on 2026-11-26 with
# PyTorch's flash op in the blocks; 1.14 × (4) and 1.18 × (8) on the second H200 run with cuDNN blocks. `--profile`
# adds one profiled step per setting (the record's "profile": compute busy, idle, copies, attention kernels) to say
# whether the rest is slower kernels or waits.
chunks_128k() {
  phase chunks-128k-2layers 150 $B chunks --out "$OUT" $L8 --layers 2 --rung mini_seq --seq 128k \
    --chunks off,4,8 --steps 2 --profile
}

# Issue 14 (b): the longest 32-layer sequence with chunked attention + offload + MEMO placement on a 125 GiB
#   host (this machine's RAM), through 2 layers carrying the other 30 layers' weights/adapter state AND the
#   deep placement's checkpoint bytes on the device and (pinned) on the host — tools/gpu/bench_ladder.py
#   cmd_maxlen's doc says what that emulation does and does not model. lstune.estimate's plan for it
#   (`deep_plan`, weights on the device, chunks `auto`; computed on the dev machine, 125 GiB host of which 119.75 GiB
#   usable: the OS keeps 4 GiB + 1 %, lstune.estimate.memory.host_reserve_bytes):
#     704K: 8 chunks, predicted device 67.3 GiB, host 119.8 GiB; 15 layers recomputed → ballast 6.9 + 81.1 GiB;
#     768K: 8 chunks, predicted device 75.2 GiB, host 113.9 GiB (33.9 GiB of it the live layer's chunks, pinned in
#           power-of-two pieces, lstune.memory.host_copies; 45 GiB and one more layer recomputed when each copy was
#           one allocation, rounded up whole); 18 layers recomputed, device 31 → ballast 12.0 GiB device + 72.0 GiB
#           pinned host (+ 13.1 GB of weights);
#     832K: 16 chunks, 75.0 / 116.4 GiB (fits, the estimate's longest with weights on the device) → ballast
#           13.0 GiB device + 71.5 GiB host;
#     896K: 16 chunks, device 79.5 GiB: predicted not to fit.
#   (1M needs the weights on the host too, ZeRO-3: docs/memory.md; not emulated here: the bench model keeps its
#   weights on the device.) tests/unit/bench/test_emulation_ballast.py pins the 768K numbers.
#   Target ≥ 1.5 × lstune without them: 768K vs the 512K device limit, 675K vs the ~450K host cap.
#   On 2026-11-26 (H200 capped to an H100's 80 GB) the first try, 832K before the OS reserve (host ballast 78 GiB,
#   predicted host 122.9 of 125 GiB), was killed by the host's OOM killer at 123.0 GiB (121.4 GiB pinned): the
#   reserve comes from it. Two trials now: 768K, then 832K if it fits (704K if not) ≈ 4-5 min + build; one 832K
#   trial: 2 layers × attention (832/128)² × ~0.5 s (cuDNN, H200) + MLP/projections/head ≈ 1 min, plus pinning
#   ~72 GiB of host (~10-30 s). A host OOM kills the process (rc 137 in the phase record): the last "search"
#   record before it is the longest that completed.
#   On a card bigger than an H100 80 GB (an H200) bench_ladder caps the allocator to what an H100 leaves it
#   (`cap_device`: the "device_cap" record, with a check that the cap holds; it held on 2026-11-26).
maxlen_chunks_emulated() {
  phase maxlen-chunks-emulated 400 $B maxlen --out "$OUT" $L8 --rung mini_seq --layers 2 --as-layers 32 \
    --attn-chunks auto --emulate-host 125G --start 768k --len-step 64k --max-tries 2 --max-len 1024k
}

# Issues 10 and 33: the device's kernel rates (the ideal) and a full-depth step at 128K with lstune's defaults on
# this machine. Since issue 33 the defaults keep attention's output beside each checkpoint (`--recompute-attention
# auto`: at 128K the estimate keeps it — on the device of an H200, on the host with offloaded checkpoints on an H100),
# so backward no longer re-runs attention's forward (~8 s of the H200's 45.0 s ideal), and the host blocks are pinned
# before the first step. One untimed warm-up step (its time is the record's `warmup_times_s`: issue 33's first step,
# target within 10 % of the steady state), then two timed steps. Targets: ≤ 1.2 × the no-recompute ideal (bench.md's
# "× ideal"; before: 50.7 s = 1.48 × the H200's 34.2 s, with attention recomputed). ~4.5 min with set-up; the
# trial's own record is in trials/ as soon as it ends. The recompute baseline on the same card is
# `full_depth_128k_recompute` (run_next.sh).
full_depth_128k() {
  phase full-depth-128k 330 python3 -m lstune bench --model llama-3.1-8b --lora-r 16 --rungs lstune \
    --seq-len 128k --lengths 128k --warmup 1 --steps 2 --rates --trial-timeout 280 \
    --output-dir "$RES/full-depth-128k"
}

# Issue 33's baseline: the same step with attention re-run in backward (today's 50.7 / 51.2 s on the H200), one
# warm-up and one timed step (~4 min): run_next.sh only.
full_depth_128k_recompute() {
  phase full-depth-128k-recompute 300 python3 -m lstune bench --model llama-3.1-8b --lora-r 16 --rungs lstune \
    --recompute-attention on --seq-len 128k --lengths 128k --steps 1 --trial-timeout 220 \
    --output-dir "$RES/full-depth-128k-recompute"
}

# Issue 10: the rest of tests/gpu (8 tests with bitsandbytes, 43 s on the third H200 lease: two failed there, fixed
# since — the bench's forkserver with bitsandbytes installed, the QLoRA run's self-check).
gpu_tests_rest() {
  phase gpu-tests-rest 150 bash -c "python3 -m pytest -q -rs tests/gpu \
    --ignore=tests/gpu/test_attention_chunks_cuda.py --ignore=tests/gpu/test_memory_cuda.py \
    > $RES/gpu-tests-rest.log 2>&1"
}

# Issue 10: DeepSpeed ZeRO-3 with parameter and optimizer offload, Llama-3.1-8B full fine-tune at 16K through
# `lstune bench` (the engine `lstune train` makes, with no checkpoint to save: the ~112 GB save cannot fit this
# machine's 64 GiB disk, and it used the rest of the phase's time on the third H200 lease). One warm-up step (it
# makes the device half's Adam moments), one timed step (the steady state); the record carries the device peak,
# the host RSS and the estimate's numbers for both. Everything on the host is refused for host memory (171.9 GiB >
# 125 GiB); with --offload-ratio 0.5 (half of the optimizer sub-groups on the GPU: docs/parallel.md) it ran on the
# third H200 lease through `lstune train`: 16.8 s for its first step, host RSS 122.1 GiB where the estimate said
# 111.9 (27 sub-groups of whole tensors, most pinned in 2 GiB blocks). lstune sizes the sub-groups within their
# power of two since: predicted host 112.9 GiB, device 93.2 GiB (H200) — this run measures that. Set-up to the
# first step was 2 min 53 s (init + self-check 79 s, DeepSpeed's engine 84 s). The trial's own record is in
# trials/ as soon as it ends, should the closing estimates trial be cut.
deepspeed_offload() {
  phase deepspeed-offload 330 python3 -m lstune bench --model llama-3.1-8b --lora-r 0 --zero-stage 3 \
    --offload-optimizer --offload-params --offload-ratio 0.5 --rungs lstune --seq-len 16k --lengths 16k \
    --warmup 1 --steps 1 --trial-timeout 280 --output-dir "$RES/deepspeed-8b"
}

# Issue 10: the Qwen3-8B recipe at its 128K, 3 steps through the CLI (36 layers: ~85 s a step in steady state,
# ~100 s for the first (it pins the offload buffers), + random init, self-check, imports ≈ 5.3 min): run_next.sh only.
qwen3_recipe_128k() {
  phase qwen3-recipe-128k 320 bash -c "python3 -m lstune train --config recipes/qwen3-8b/128k-1xh100.yaml \
    --model qwen3-8b --data builtin:passkey --max-steps 3 --save-every 3 --output-dir /tmp/qwen3-128k \
    > $RES/qwen3-128k.log 2>&1; cp /tmp/qwen3-128k/metrics.jsonl $RES/qwen3-128k-metrics.jsonl"
}

# The phases both run scripts take, most valuable first (run_short.sh adds DeepSpeed, then Qwen3; run_next.sh
# Qwen3, then DeepSpeed, then the chunk phases). Issue 14's chunk phases met their targets on the third H200 lease of
# 2026-11-26 (docs/benchmarks/2026-11-26-h200-c): they run last now, as regression checks.
shared_phases() {
  gpu_tests_rest
  full_depth_128k
}

chunk_phases() {
  gpu_tests_chunks
  chunks_128k
  maxlen_chunks_emulated
}
