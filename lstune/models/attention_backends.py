"""lstune attention's backends and the refusals made before anything is loaded — with no torch at import, so that
the run plan (lstune.train.plan) can check a model's attention for `lstune estimate` without importing torch
(torch is imported here only to compare a known dtype or ask for CUDA). lstune.models.attention re-exports these.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import TYPE_CHECKING

from lstune.errors import ConfigError, ModelError, UserError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

logger = logging.getLogger("lstune")

BACKENDS = ("sdpa", "flex", "flash_attention_2")
_BIDIRECTIONAL_MESSAGE = (
    "{name} attends bidirectionally (is_causal=False / use_bidirectional_attention); lstune attention is causal only. "
    "Use a causal LM, or set use_bidirectional_attention=False in the model config."
)


@functools.cache
def _flash_attn_importable() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@functools.cache
def _flex_importable() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def available_backends() -> list[str]:
    """Backends that can run here: sdpa always, flex with torch's flex_attention (training needs CUDA), and
    flash_attention_2 when flash-attn is importable and CUDA is present."""
    backends = ["sdpa"]
    if _flex_importable():
        backends.append("flex")
    if _flash_attn_importable() and _cuda_available():
        backends.append("flash_attention_2")
    return backends


def resolve_backend(
    backend: str, *, device_type: str, dtype: torch.dtype | None, softcap: float | None, dropout: float = 0.0,
    needs_grad: bool = True,
) -> str:
    """The concrete backend for `backend` ("auto" or a name from BACKENDS), or a UserError saying why it cannot run.

    `dtype` None means "not known yet" (config time): only flash-attn's fp16/bf16 requirement depends on it.
    """
    _check_backend_name(backend)
    if backend == "auto":
        backend = _auto_backend(device_type, dtype, softcap)
    refusal = _why_backend_cannot_run(backend, device_type, dtype, softcap, dropout, needs_grad)
    if refusal:
        error_class, message = refusal
        raise error_class(message)
    return backend


def _check_backend_name(backend: str) -> None:
    if backend not in ("auto", *BACKENDS):
        raise ConfigError([f"attention backend {backend!r} is unknown; use one of: auto, {', '.join(BACKENDS)}."])


def _auto_backend(device_type: str, dtype: torch.dtype | None, softcap: float | None) -> str:
    half = dtype is None or _half(dtype)
    if device_type == "cuda" and half and _flash_attn_importable():
        return "flash_attention_2"
    # Softcapping: flex's compiled kernel on CUDA; elsewhere sdpa, whose softcapped calls run lstune's block kernel.
    return "flex" if softcap is not None and device_type == "cuda" else "sdpa"


def _why_backend_cannot_run(
    backend: str, device_type: str, dtype: torch.dtype | None, softcap: float | None, dropout: float, needs_grad: bool
) -> tuple[type[UserError], str] | None:
    """(error class, message) when `backend` cannot compute this model's attention here, else None."""
    if backend == "flash_attention_2":
        if not (_flash_attn_importable() and device_type == "cuda"):
            installed = "installed" if _flash_attn_importable() else "not installed"
            return UserError, (
                f"attention backend 'flash_attention_2' needs flash-attn and a CUDA device (here: {device_type}, "
                f"flash-attn {installed}); install lstune[gpu] on a GPU machine or pick one of {available_backends()}."
            )
        if dtype is not None and not _half(dtype):
            return UserError, f"flash-attn runs in fp16/bf16 only, not {dtype}; train in bf16 or use backend 'sdpa'."
    if backend == "flex":
        if not _flex_importable():
            return UserError, "this torch has no flex_attention; install torch>=2.7.1 or use attention backend 'sdpa'."
        if device_type != "cuda" and needs_grad:
            if softcap is not None:
                return ModelError, (
                    f"the model softcaps attention logits (attn_logit_softcapping={softcap}) and PyTorch has no flex "
                    f"backward on {device_type}; use attention backend 'auto' or 'sdpa' (lstune's block kernel "
                    "softcaps there) or train on a CUDA GPU."
                )
            return UserError, (
                f"PyTorch has no flex_attention backward on {device_type}; train on a CUDA GPU or use attention "
                "backend 'sdpa'."
            )
        if dropout:
            return ModelError, (
                f"flex attention has no dropout (attention_dropout={dropout}); set attention_dropout=0 in the model "
                "config or use backend 'sdpa'."
            )
    return None


def _bidirectional_problem(config: PretrainedConfig) -> str | None:
    if not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention", None):
        return _BIDIRECTIONAL_MESSAGE.format(name=getattr(config, "model_type", "the model"))
    return None


def check_attention_support(
    model_config: PretrainedConfig, *, pack: bool, seq_len: int, backend: str = "auto", device: str | None = None,
) -> None:
    """Refuse, before anything heavy is loaded, model/backend combinations lstune attention would get wrong.

    Raises ConfigError for an unknown backend and ModelError/UserError (every problem listed) for: bidirectional
    attention, softcapped logits on flex where it cannot train (CPU; sdpa softcaps through lstune's block kernel),
    attention dropout under flex, and a backend that cannot run here. Learned attention sinks need lstune's block
    kernel, which `use_lstune_attention` is given (or refuses the model without). Sliding windows need no refusal
    (every backend honours them exactly); they and the packed-on-sdpa cost are logged. `device` defaults to cuda
    when available.
    """
    device = device or ("cuda" if _cuda_available() else "cpu")
    softcap = getattr(model_config, "attn_logit_softcapping", None)
    dropout = float(getattr(model_config, "attention_dropout", 0.0) or 0.0)
    _check_backend_name(backend)
    problems = [p for p in (_bidirectional_problem(model_config),) if p]
    chosen = None
    try:
        chosen = resolve_backend(backend, device_type=device, dtype=None, softcap=softcap, dropout=dropout)
    except UserError as error:
        problems.append(str(error))
    if problems:
        raise ModelError("\n".join(problems), problems=problems)
    _log_attention_plan(model_config, chosen, device, pack=pack, seq_len=seq_len)


def _log_attention_plan(config: PretrainedConfig, backend: str, device: str, *, pack: bool, seq_len: int) -> None:
    window = getattr(config, "sliding_window", None)
    if window is not None and window < seq_len:
        logger.info(
            "lstune attention: layers with a %d-token sliding window (< seq_len %d) keep it exactly on the %s backend",
            window, seq_len, backend,
        )
    if pack and backend == "sdpa" and device == "cuda":
        logger.warning(
            "lstune attention: packed batches on the sdpa backend run one kernel per document; with many short "
            "documents install flash-attn (lstune[gpu]) or use attention backend 'flex'."
        )


def _half(dtype) -> bool:
    import torch

    return dtype in (torch.float16, torch.bfloat16)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
