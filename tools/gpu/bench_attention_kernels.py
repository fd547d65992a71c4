"""Chunked attention's block kernels, timed: one attention module's forward + backward with every block on the flash
op, with every block on the pure-PyTorch kernel, and unchunked (SDPA) — time (best of 3) and peak bytes.

A script, not a test (docs/memory.md's chunked-attention section quotes its CPU numbers):

    OMP_NUM_THREADS=1 python -m tools.gpu.bench_attention_kernels --seq 4096 --chunks 8 [--kv-heads 2]
    python -m tools.gpu.bench_attention_kernels --device cuda --seq 65536 --chunks 8      # bf16 on CUDA

A one-layer tiny Llama, hidden 512 in 8 heads (64 each), one document, saved chunks on the device; fp32 on CPU,
bf16 on CUDA. On CPU the peak is `LiveBytes`' (the storages ops allocate; a kernel's internal scratch is not seen).
"""

from __future__ import annotations

import argparse
import time

import torch

from lstune.memory import attention_blocks
from lstune.memory.attention_chunks import ChunkStats, install_chunked_attention
from lstune.memory.measure import peak_bytes
from lstune.memory.patching import run_undos
from lstune.models.attention import use_lstune_attention
from tests.support.archs import tiny_model

HIDDEN, HEADS = 512, 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=HEADS)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = tiny_model("llama", hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=args.kv_heads,
                       intermediate_size=HIDDEN).to(device, dtype)
    attention = use_lstune_attention(model, backend="sdpa")
    inputs = [torch.randn(1, args.seq, HIDDEN, device=device, dtype=dtype) for _ in range(2)]
    grads = {name: _measure(model, args, inputs, name) for name in ("flash", "pytorch", "unchunked")}
    attention.undo()
    for other in ("pytorch", "unchunked"):
        error = (grads["flash"].float() - grads[other].float()).norm() / grads[other].float().norm()
        print(f"input gradient, flash blocks vs {other}: relative difference {error:.1e}")


def _measure(model, args, inputs: list[torch.Tensor], name: str) -> torch.Tensor:
    layers = model.model.layers[:1]
    module = layers[0].self_attn
    hidden, grad_out = inputs[0].clone().requires_grad_(), inputs[1]
    device = hidden.device
    positions = torch.arange(args.seq, device=device)[None]
    cos_sin = model.model.rotary_emb(hidden, positions)

    def step():
        hidden.grad = None
        model.zero_grad(set_to_none=True)
        out = module(hidden_states=hidden, position_embeddings=cos_sin, attention_mask=None,
                     position_ids=positions)[0]
        out.backward(grad_out)
        if device.type == "cuda":
            torch.cuda.synchronize()

    saved = dict(attention_blocks.FLASH_OPS)
    if name == "pytorch":
        attention_blocks.FLASH_OPS.pop(device.type, None)
    undos = install_chunked_attention(layers, args.chunks, offload=False, stats=ChunkStats()) if name != "unchunked" \
        else []
    try:
        step()  # warm-up (and the flash probe)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        peak = peak_bytes(step, device)
    finally:
        run_undos(undos)
        attention_blocks.FLASH_OPS.update(saved)
    print(f"{name:9s} {args.seq} tokens, {args.chunks} chunks, {HEADS}/{args.kv_heads} heads, {hidden.dtype}: best "
          f"{min(times):.3f} s of [{', '.join(f'{t:.3f}' for t in times)}], peak {peak / 2**20:.1f} MiB")
    return hidden.grad.clone()


if __name__ == "__main__":
    main()
