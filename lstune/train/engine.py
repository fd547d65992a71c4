"""The engine owns parameters' optimisation and their state on disk.

`Engine` is the interface the loop drives; `TorchEngine` implements it on one device with plain
torch AdamW. The distributed implementation (DeepSpeed ZeRO) lives in lstune.parallel and has the
same surface, so the loop does not know which one it drives.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

from lstune.optim import OptimConfig, make_adamw, make_scheduler

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
MODEL_DIR = "model"


class Engine(Protocol):
    model: Any

    def backward(self, loss) -> None: ...

    def step(self) -> dict[str, float]: ...

    def save(self, ckpt_dir: Path) -> None: ...

    def load(self, ckpt_dir: Path) -> None: ...

    def export(self, out_dir: Path, *, merge_lora: bool = False) -> None: ...


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


class TorchEngine:
    """AdamW on one device; fp32 master weights (bf16 autocast is the loop's business)."""

    def __init__(self, model, cfg: OptimConfig):
        self.model = model
        self.cfg = cfg
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise RuntimeError("the model has no trainable parameters")
        self._params = params
        self.optimizer = make_adamw(params, cfg, fused=params[0].is_cuda or None)
        self.scheduler = make_scheduler(self.optimizer, cfg)

    def backward(self, loss) -> None:
        loss.backward()

    def step(self) -> dict[str, float]:
        import torch

        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self._params, max_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float(grad_norm), "lr": float(lr)}

    def save(self, ckpt_dir: Path) -> None:
        import torch

        save_model(self.model, ckpt_dir / MODEL_DIR)
        torch.save(self.optimizer.state_dict(), ckpt_dir / OPTIMIZER_FILE)
        torch.save(self.scheduler.state_dict(), ckpt_dir / SCHEDULER_FILE)

    def load(self, ckpt_dir: Path) -> None:
        import torch

        load_model_weights(self.model, ckpt_dir / MODEL_DIR)
        self.optimizer.load_state_dict(torch.load(ckpt_dir / OPTIMIZER_FILE, weights_only=True))
        self.scheduler.load_state_dict(torch.load(ckpt_dir / SCHEDULER_FILE, weights_only=True))

    def export(self, out_dir: Path, *, merge_lora: bool = False) -> None:
        export_model(self.model, out_dir, merge_lora=merge_lora)


def save_model(model, out_dir: Path) -> None:
    """HF format, safetensors: the full model, or for LoRA the PEFT adapter."""
    model.save_pretrained(out_dir, safe_serialization=True)


def load_model_weights(model, model_dir: Path) -> None:
    """Load weights written by `save_model` into `model` in place (full model or PEFT adapter)."""
    import torch
    from safetensors.torch import load_file

    if is_peft_model(model):
        from peft import set_peft_model_state_dict

        state = load_file(str(model_dir / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(model, state)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise RuntimeError(f"adapter checkpoint has keys the model lacks: {unexpected[:5]}")
        return
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = _tied_parameter_names(model)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _tied_parameter_names(model) -> set[str]:
    """Names that save_pretrained leaves out because they share storage with another parameter."""
    seen: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        key = id(param)
        if key in seen:
            tied.add(name)
        else:
            seen[key] = name
    return tied


def export_model(model, out_dir: Path, *, merge_lora: bool = False) -> None:
    """The model a user loads with from_pretrained: full weights, or for LoRA the adapter — or, with
    `merge_lora`, the merged full model. Merging folds the adapter into the base weights in place, so
    the loop asks for it last, after every other save."""
    if is_peft_model(model) and merge_lora:
        model = model.merge_and_unload()
    model.save_pretrained(out_dir, safe_serialization=True)
