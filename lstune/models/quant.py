"""QLoRA's 4-bit base: bitsandbytes NF4 with double quantization and bf16 compute, loaded by transformers.

Optional (`pip install 'lstune[qlora]'`): bitsandbytes is imported only when `--load-in-4bit` is asked for.
Only the frozen base is quantized; LoRA adapters, norms, embeddings and the output head stay in their dtype.
Quantization happens while `from_pretrained` loads the weights, so it needs pretrained weights (a random
initialisation would be quantized noise; save the model first, then load it).

Bytes of a quantized frozen weight (`frozen_weight_bytes`): NF4 stores 4 bits a value, plus one absmax
per block of 64 values, which double quantization stores as 8 bits with one fp32 scale per 256 blocks:
0.5 + 1/64 + 4/(64·256) ≈ 0.516 bytes a parameter (a quarter of bf16's 2 and a bit).
"""

from __future__ import annotations

from typing import Any

from lstune.errors import ModelError, UserError

NF4_BLOCK = 64  # values per absmax (bitsandbytes' 4-bit blocksize)
DOUBLE_QUANT_BLOCK = 256  # absmax values per fp32 scale of the second quantization


def quiet_cpu_kernel_warning() -> None:
    """bitsandbytes, when installed, is imported by peft and warns on CPUs with AVX-512 BF16 that an optional
    4-bit CPU kernel package is missing: lstune quantizes only on CUDA, so that kernel is never used. Its logger
    is set to errors before bitsandbytes is imported (by the CLI and by a bench trial's forkserver)."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def frozen_weight_bytes(numel: int, load_in_4bit: bool, dtype_bytes: int = 2) -> float:
    """Bytes that `numel` frozen base parameters take: NF4 + double-quantized absmax, or `dtype_bytes` each."""
    if not load_in_4bit:
        return float(numel * dtype_bytes)
    blocks = numel / NF4_BLOCK
    return numel / 2 + blocks + 4 * blocks / DOUBLE_QUANT_BLOCK


def require_bitsandbytes(device_type: str) -> None:
    """UserError naming the fix when bitsandbytes (or its backend for `device_type`) is missing."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise UserError(
            f"--load-in-4bit needs bitsandbytes, which could not be imported ({exc}). Install it with "
            "`pip install 'lstune[qlora]'`, or drop --load-in-4bit."
        ) from None
    if device_type not in ("cuda", "cpu"):
        raise UserError(f"--load-in-4bit: bitsandbytes has no 4-bit backend lstune supports on {device_type}; "
                        "run on CUDA, or drop --load-in-4bit.")


def quantization_config() -> Any:
    """transformers' config for NF4, double quantization, bf16 compute (QLoRA's settings)."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def refuse_random_4bit(model_name: str) -> None:
    raise ModelError(
        f"--load-in-4bit quantizes pretrained weights while they load, and --model {model_name!r} is initialised at "
        "random here (a preset, or --init random). Give a model folder or hub id with weights (--init pretrained), "
        "or drop --load-in-4bit."
    )


def disable_cpu_packing(model: Any) -> None:
    """Keep bitsandbytes' 4-bit layers on their one dequantize-and-matmul path on CPU.

    On CPUs with AVX512-BF16, `Linear4bit.forward` without gradients repacks its weight in place into another
    layout (bitsandbytes 0.50), which fails on double-quantized weights and would make no-grad forwards (the
    self-check's reference, evaluation) run another kernel than training's. The switch is the layer's own
    attribute."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
