"""The device's kernel rates: what a step would take at the speed of its kernels alone (the "ideal").

bf16 GEMMs of a Llama-8B layer's shapes and causal SDPA forward and backward (32 query / 8 key-value heads of
128, the same model's), each timed as the median of 5 runs after one untimed run. On CPU the same kernels on
small shapes (to test the code path; CPU rates mean little). `lstune bench --rates` records them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

CUDA_GEMMS = ((8192, 8192, 8192), (65536, 4096, 14336), (65536, 14336, 4096), (65536, 4096, 4096))
CUDA_ATTENTION_LENGTHS = (32768, 131072)
CPU_GEMMS = ((256, 256, 256),)
CPU_ATTENTION_LENGTHS = (256,)


def measure_rates(device: str | None = None) -> list[dict[str, Any]]:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    rates = [gemm_rate(m, k, n, device, dtype) for m, k, n in (CUDA_GEMMS if cuda else CPU_GEMMS)]
    rates += [attention_rate(s, device, dtype) for s in (CUDA_ATTENTION_LENGTHS if cuda else CPU_ATTENTION_LENGTHS)]
    return rates


def gemm_rate(m: int, k: int, n: int, device: str, dtype) -> dict[str, Any]:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    seconds = timed(lambda: a @ b, device)
    return {"op": "gemm", "shape": [m, k, n], "dtype": str(dtype), "seconds": seconds,
            "tflops": 2 * m * k * n / seconds / 1e12}


def attention_rate(seq: int, device: str, dtype, heads: int = 32, kv_heads: int = 8, head_dim: int = 128) -> dict:
    """Causal SDPA forward and backward; FLOPs: 2·S²·H·D forward (half of 4·S²·H·D), 2.5 × that backward
    (the FlashAttention convention lstune.estimate.flops uses)."""
    import torch.nn.functional as F

    q = torch.randn(1, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    kv = [torch.randn(1, kv_heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(2)]

    def forward():
        return F.scaled_dot_product_attention(q, *kv, is_causal=True, enable_gqa=True)

    grad = torch.randn_like(forward())
    fwd = timed(forward, device)
    fwd_bwd = timed(lambda: torch.autograd.grad(forward(), [q, *kv], grad), device)
    bwd = max(fwd_bwd - fwd, 1e-9)
    flops = 2 * seq * seq * heads * head_dim
    return {"op": "attention_causal", "seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": str(dtype), "fwd_s": fwd, "bwd_s": bwd, "fwd_tflops": flops / fwd / 1e12,
            "bwd_tflops": 2.5 * flops / bwd / 1e12}


def timed(fn: Callable[[], Any], device: str, reps: int = 5) -> float:
    """Median seconds of `fn()` over `reps` runs after one untimed run (synchronised on CUDA)."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
