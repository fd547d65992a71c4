#!/usr/bin/env bash
# A GPU run for a 15-minute lease (start-up included, so ~10 minutes of work), most valuable first; every phase
# under its own limit and appending to $RES/bench.jsonl as it finishes, so a lease that ends mid-run keeps every
# finished phase (limits: 150 + 120 + 240 + 150 + 240 = 900 s; the lease cuts what does not fit; on 2026-11-26 an
# H200 ran the first four in 445 s). Start detached and poll: docs/benchmarks/README.md, "Running run_short.sh".
# What it leaves out of run_next.sh (too long for 15 minutes): the emulated 32-layer longest length with chunked
# attention and MEMO placement (~400 s) and the Qwen3-8B recipe at 128K (~320 s).
set -u
. "$(dirname "$0")/phase.sh"
L8="--preset llama-3.1-8b --lora-r 16"

# 1. Issue 14 (c): the chunked-attention and memory CUDA tests (13 tests).
phase gpu-tests-chunks 150 bash -c "python3 -m pytest -q -rs tests/gpu/test_attention_chunks_cuda.py \
  tests/gpu/test_memory_cuda.py > $RES/gpu-tests-chunks.log 2>&1"

# 2. Issue 14 (a): chunked vs unchunked attention at 128K in steady state, 2 layers (target ≤ 1.10 × `off`; 1.54 ×
#    on 2026-11-26 with PyTorch's flash op in the blocks, before they took cuDNN's).
phase chunks-128k-2layers 120 $B chunks --out "$OUT" $L8 --layers 2 --rung mini_seq --seq 128k \
  --chunks off,4,8 --steps 2

# 3. Issue 10: the device's kernel rates (the ideal) and a steady-state full-depth step at 128K with lstune's
#    defaults on this machine (one untimed warm-up step, then one timed step; 231 s in all on the H200). Target
#    ≤ 1.2 × the ideal (bench.md's "× ideal").
phase full-depth-128k 240 python3 -m lstune bench --model llama-3.1-8b --lora-r 16 --rungs lstune --seq-len 128k \
  --lengths 128k --steps 1 --rates --trial-timeout 220 --output-dir "$RES/full-depth-128k"

# 4. Issue 10: the rest of tests/gpu (7 tests).
phase gpu-tests-rest 150 bash -c "python3 -m pytest -q -rs tests/gpu --ignore=tests/gpu/test_attention_chunks_cuda.py \
  --ignore=tests/gpu/test_memory_cuda.py > $RES/gpu-tests-rest.log 2>&1"

# 5. Issue 10: DeepSpeed ZeRO-3 with parameter and optimizer offload, one full fine-tune step at 16K: 8B is refused
#    for host memory (predicted 171.9 GiB > 125 GiB; 136.6 GiB before the 2026-11-26 model of ZeRO-3's host
#    buffers) in seconds, then Llama-3.2-3B gives the step time (6.33 s on
#    2026-11-26, when 150 s cut the final save: the time stamps in the log say how long it takes).
phase deepspeed-offload 240 bash -c "for m in llama-3.1-8b llama-3.2-3b; do python3 -m lstune train --model \$m \
  --lora-r 0 --zero-stage 3 --offload-optimizer --offload-params --data builtin:passkey --seq-len 16k \
  --max-steps 1 --output-dir /tmp/ds-\$m 2>&1 | while IFS= read -r line; do echo \"\$(date +%T) \$line\"; done \
  > $RES/deepspeed-\$m.log; cp /tmp/ds-\$m/metrics.jsonl $RES/deepspeed-\$m-metrics.jsonl 2>/dev/null && break; done"
echo "=== $(date +%T) all done" | tee "$RES/DONE"
