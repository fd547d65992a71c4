"""LoRA adapters read the layer input as it is under autocast: no per-adapter copy of it is saved.

peft keeps the adapters of a bf16 base in fp32 and casts each adapted layer's input to fp32 before the
adapter (`_cast_input_dtype`). Under bf16 autocast the adapter's matmul casts it straight back to bf16, so
every adapter saves its own bf16 copy of the input for backward, and its backward makes fp32 gradient
copies. Measured on an H100 (Llama-3.1-8B, LoRA r=16 on every linear layer; docs/benchmarks/2026-11-23-h100):
these copies are part of the attention block's working set in backward, the term that sets the longest
sequence once checkpoints are offloaded.

Skipping the cast when autocast is on for the input's device, with the input already in autocast's dtype,
gives bit-identical numbers (bf16 -> fp32 -> bf16 is exact, and autocast casts the fp32 adapter weights
either way) and lets each adapter use the very tensor the base layer saves. Only vanilla LoRA layers
without dropout are touched: dropout on an fp32 input could round differently from dropout on bf16.
Outside autocast (fp32 runs, CPU tests, probes) the patch does nothing. Instance-level, undoable.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

from lstune.memory.patching import Undo

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger("lstune")


def share_lora_inputs(model: "nn.Module") -> list[Undo]:
    """Patch every eligible peft LoRA layer of `model` (see module doc); one undo per patched layer."""
    undos = [_patch(module) for module in model.modules() if _eligible(module)]
    if undos:
        logger.info("LoRA: %d adapted layers read their input in autocast's dtype (no fp32 copy)", len(undos))
    return undos


def _eligible(module: "nn.Module") -> bool:
    lora_A = getattr(module, "lora_A", None)
    dropouts = getattr(module, "lora_dropout", None)
    return (
        isinstance(lora_A, torch.nn.ModuleDict)
        and len(lora_A) > 0
        and callable(getattr(module, "_cast_input_dtype", None))
        and not getattr(module, "lora_variant", None)
        and isinstance(dropouts, torch.nn.ModuleDict)
        and all(isinstance(d, torch.nn.Identity) for d in dropouts.values())
    )


def _patch(module: "nn.Module") -> Undo:
    had_own = "_cast_input_dtype" in vars(module)
    previous = vars(module).get("_cast_input_dtype")
    module._cast_input_dtype = functools.partial(_cast_unless_autocast, module._cast_input_dtype)

    def undo() -> None:
        if had_own:
            module._cast_input_dtype = previous
        else:
            vars(module).pop("_cast_input_dtype", None)

    return undo


def _cast_unless_autocast(cast: Callable[[Any, torch.dtype], Any], x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and _autocast_would_undo(x, dtype):
        return x
    return cast(x, dtype)


def _autocast_would_undo(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """The adapter's matmul would cast `x.to(dtype)` back to x.dtype: the cast changes nothing but memory."""
    device = x.device.type
    return (
        dtype == torch.float32
        and x.dtype in (torch.bfloat16, torch.float16)
        and torch.is_autocast_enabled(device)
        and torch.get_autocast_dtype(device) == x.dtype
    )
