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

Vanilla LoRA layers WITH dropout (p > 0) instead run each adapter's `lora_A(dropout(cast(x)))` as one recomputed
region (`_recompute_dropout`): forward saves only the shared input x (which the base layer saves anyway) and the
RNG state, not the cast copy, the dropout output and its mask — per adapted layer, per adapter, one to three
sequence-sized tensors (measured on CPU, tiny-llama r=8, 2048 tokens, fp32: peak of forward+backward 136.2 MB with
dropout 0.1 against 90.1 MB without; patched, the same as without). Backward pays one extra cast + dropout + rank-r
matmul per adapter and holds the region's tensors transiently, one adapter at a time. Numbers are peft's to the
bit: the same ops run in the same order, and the replay restores the RNG state, so it draws the same mask.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

from lstune.memory.patching import Undo, patch_attribute, patch_forward, run_undos

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger("lstune")


def share_lora_inputs(model: "nn.Module") -> list[Undo]:
    """Patch every eligible peft LoRA layer of `model` (see module doc); one undo per patched layer."""
    vanilla = [module for module in model.modules() if _vanilla_lora(module)]
    undos = [_patch(module) for module in vanilla if not _has_dropout(module)]
    if undos:
        logger.info("LoRA: %d adapted layers read their input in autocast's dtype (no fp32 copy)", len(undos))
    recomputed = [_recompute_dropout(module) for module in vanilla if _has_dropout(module)]
    if recomputed:
        logger.info("LoRA: %d adapted layers recompute cast + dropout in backward (only the input is saved)",
                    len(recomputed))
    return undos + recomputed


def _vanilla_lora(module: "nn.Module") -> bool:
    lora_A = getattr(module, "lora_A", None)
    return (
        isinstance(lora_A, torch.nn.ModuleDict)
        and len(lora_A) > 0
        and callable(getattr(module, "_cast_input_dtype", None))
        and not getattr(module, "lora_variant", None)
        and isinstance(getattr(module, "lora_dropout", None), torch.nn.ModuleDict)
        and set(module.lora_dropout.keys()) >= set(lora_A.keys())
    )


def _has_dropout(module: "nn.Module") -> bool:
    return not all(isinstance(d, torch.nn.Identity) for d in module.lora_dropout.values())


def _recompute_dropout(module: "nn.Module") -> Undo:
    """peft computes `lora_A(dropout(_cast_input_dtype(x)))` for each adapter, and that chain only (forward and
    `_mixed_batch_forward`): the cast and every dropout become identities and each lora_A runs the whole chain as
    one region under `torch.utils.checkpoint` (non-reentrant, preserve_rng_state). That is the library's mechanism
    for exactly this: it saves the region's inputs and the RNG state, and in backward restores that state (in a
    forked RNG, so the live stream is not advanced) before recomputing, so the dropout draws the same mask. Nested
    inside lstune's own recompute (layer checkpointing, tiled MLP, attention chunks — all of which replay the RNG
    state first), the region's forward sees the same state as the first time and records the same one, so every
    replay draws the mask of the original forward. The cast sits inside the region, so its copy is not saved."""
    cast = module._cast_input_dtype
    what = "LoRA cast + dropout recomputed in backward"
    undos = [patch_attribute(module, "_cast_input_dtype", _no_cast, what=what)]
    for name, lora_A in module.lora_A.items():
        dropout = module.lora_dropout[name]
        chain = functools.partial(_cast_dropout_project, cast, dropout.forward, lora_A.forward, lora_A.weight.dtype)
        undos.append(patch_forward(dropout, _identity, what=what))
        undos.append(patch_forward(lora_A, functools.partial(_recomputed, chain, dropout), what=what))
    return functools.partial(run_undos, undos)


def _no_cast(x: Any, dtype: torch.dtype) -> Any:
    return x


def _identity(x: Any) -> Any:
    return x


def _cast_dropout_project(cast: Callable, dropout: Callable, project: Callable, dtype: torch.dtype,
                          x: torch.Tensor) -> torch.Tensor:
    return project(dropout(cast(x, dtype)))


def _recomputed(chain: Callable[[torch.Tensor], torch.Tensor], dropout: "nn.Module", x: torch.Tensor) -> torch.Tensor:
    """The chain, recomputed in backward when it would save anything (training with gradients on)."""
    if not (torch.is_grad_enabled() and dropout.training):
        return chain(x)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(chain, x, use_reentrant=False, preserve_rng_state=True)


def _patch(module: "nn.Module") -> Undo:
    return patch_attribute(module, "_cast_input_dtype",
                           functools.partial(_cast_unless_autocast, module._cast_input_dtype),
                           what="LoRA input read in autocast's dtype")


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
