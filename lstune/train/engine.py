"""The engine owns parameters' optimisation and their state on disk.

`Engine` is the interface the loop drives; `TorchEngine` implements it on one device with plain
torch AdamW. The distributed implementation (DeepSpeed ZeRO) lives in lstune.parallel and has the
same surface, so the loop does not know which one it drives.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

from lstune.errors import CheckpointError
from lstune.optim import OptimConfig, advance_schedule, apply_optim_settings, make_adamw, make_scheduler

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
MODEL_DIR = "model"


class Engine(Protocol):
    model: Any
    scheduler: Any  # the learning-rate schedule the engine steps (a step without an update advances it too)

    def backward(self, loss) -> None: ...

    def step(self) -> dict[str, float]: ...

    def skip_step(self) -> dict[str, float]: ...

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
        """Clip and update; an update from a non-finite gradient norm is never applied (the step is
        skipped, `update_skipped` says so, and the loop decides whether the run may go on)."""
        import torch

        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._params, max_norm))
        if not math.isfinite(grad_norm):
            return {**self.skip_step(), "grad_norm": grad_norm}
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": float(lr), "update_skipped": False}

    def skip_step(self) -> dict[str, float]:
        """Drop this step's gradients, keep the weights; the schedule advances as if the step ran."""
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float("nan"), "lr": advance_schedule(self.scheduler), "update_skipped": True}

    def weights_finite(self) -> bool:
        import torch

        return all(bool(torch.isfinite(p).all()) for p in self._params)

    def save(self, ckpt_dir: Path) -> None:
        import torch

        save_model(self.model, ckpt_dir / MODEL_DIR)
        torch.save(self.optimizer.state_dict(), ckpt_dir / OPTIMIZER_FILE)
        torch.save(self.scheduler.state_dict(), ckpt_dir / SCHEDULER_FILE)

    def load(self, ckpt_dir: Path) -> None:
        """Weights, optimizer and schedule position; then this run's optimiser settings take effect
        (a changed --lr, betas, schedule on resume is applied, not silently replaced by the saved ones)."""
        from lstune.untrusted import describe, torch_load

        try:
            load_model_weights(self.model, ckpt_dir / MODEL_DIR)
            self.optimizer.load_state_dict(torch_load(ckpt_dir / OPTIMIZER_FILE, error=CheckpointError))
            self.scheduler.load_state_dict(torch_load(ckpt_dir / SCHEDULER_FILE, error=CheckpointError))
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError, OSError) as exc:
            raise CheckpointError(
                f"checkpoint {ckpt_dir} does not fit this model and optimizer ({describe(exc)[:300]}). Resume with the "
                "--model, LoRA settings and engine it was trained with (a DeepSpeed checkpoint needs the same "
                "--gpus and --zero-stage)."
            ) from exc
        apply_optim_settings(self.optimizer, self.scheduler, self.cfg)

    def export(self, out_dir: Path, *, merge_lora: bool = False) -> None:
        export_model(self.model, out_dir, merge_lora=merge_lora)


def save_model(model, out_dir: Path) -> None:
    """HF format, safetensors: the full model, or for LoRA the PEFT adapter."""
    model.save_pretrained(out_dir, safe_serialization=True)


def load_model_weights(model, model_dir: Path) -> None:
    """Load weights written by `save_model` into `model` in place (full model or PEFT adapter)."""
    import torch
    from safetensors.torch import load_file

    from lstune.untrusted import check_safetensors

    for shard in sorted(model_dir.glob("*.safetensors")):
        check_safetensors(shard, error=CheckpointError)
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
