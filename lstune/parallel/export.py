"""Writing a consolidated Hugging Face model from a distributed (ZeRO-sharded) one, one parameter at a time.

Under ZeRO-3 no rank holds the whole model, and gathering it onto one GPU is exactly what long-sequence
training cannot afford. Export instead walks the parameters in order: all ranks gather one parameter
(DeepSpeed's `GatheredParameters`, a collective), rank 0 copies it to host memory and appends it to the
current safetensors shard, and the gathered copy is freed before the next one. Device memory: one full
parameter beyond each rank's shard. Host memory on rank 0: one shard (2 GiB by default). The result is
what `save_pretrained` writes — `model.safetensors` or numbered shards with
`model.safetensors.index.json`, `config.json`, `generation_config.json` — and `from_pretrained` loads it.

Written by hand because transformers' `save_pretrained` needs the whole state dict in memory and
DeepSpeed's `zero_to_fp32` works from a saved checkpoint on disk (all optimizer shards) rather than
from the live model.

Tied parameters (e.g. output embedding = input embedding) are written once, under their first name,
as `save_pretrained` does; `from_pretrained` ties them again. LoRA (peft) models export the adapter, or
with `merge_lora` the base model with each adapter folded into its layer's weight.
"""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import torch

INDEX_FILE = "model.safetensors.index.json"


# A parameter kept in pieces outside DeepSpeed (METP's MLP weights, lstune.memory.metp_mlp) carries, while it is to
# be exported, a context-manager factory under this name that makes it whole on every rank for the duration.
WHOLE_ATTR = "lstune_whole"


@contextmanager
def gathered(params: list[Any]):
    """Context in which ZeRO-3-partitioned `params` (and those with a `WHOLE_ATTR` factory) are whole on every rank
    (no-op for ordinary tensors)."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    with ExitStack() as stack:
        for param in params:
            if hasattr(param, WHOLE_ATTR):
                stack.enter_context(getattr(param, WHOLE_ATTR)())
        if partitioned:
            import deepspeed

            stack.enter_context(deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None))
        yield


class ShardWriter:
    """Appends tensors to safetensors files of at most `shard_bytes` and writes the HF index at the end."""

    def __init__(self, out_dir: Path, shard_bytes: int):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.shard_bytes = shard_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: "torch.Tensor") -> None:
        """Copy `tensor` (possibly a gathered view, valid only now) to host memory under `name`."""
        tensor = tensor.detach().to("cpu", copy=True).contiguous()
        size = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + size > self.shard_bytes:
            self._flush()
        self.current[name] = tensor
        self.current_bytes += size
        self.total += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        name = f"part-{len(self.files):05d}.safetensors"
        save_file(self.current, str(self.out_dir / name), metadata={"format": "pt"})
        self.files.append((name, list(self.current)))
        self.current, self.current_bytes = {}, 0

    def finish(self) -> None:
        """Name the shards as transformers does, and write the index when there is more than one."""
        if self.current or not self.files:
            self._flush()
        if len(self.files) == 1:
            (self.out_dir / self.files[0][0]).rename(self.out_dir / "model.safetensors")
            return
        weight_map = {}
        for i, (name, keys) in enumerate(self.files, start=1):
            final = f"model-{i:05d}-of-{len(self.files):05d}.safetensors"
            (self.out_dir / name).rename(self.out_dir / final)
            weight_map.update({key: final for key in keys})
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))


def export_hf(model: Any, out_dir: Path, *, rank: int, merge_lora: bool = False, shard_bytes: int = 2 * 1024**3) -> None:
    """Write `model` in HF format to `out_dir` from rank 0; every rank must call it (gathers are collective)."""
    from lstune.parallel.comm import Communicator

    writer = ShardWriter(out_dir, shard_bytes) if rank == 0 else None
    peft = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
    if peft and not merge_lora:
        _write_adapter(model, out_dir, writer)
    else:
        tensors = _merged_lora_tensors(model) if peft else _model_tensors(model)
        for name, tensor in tensors:
            if writer is not None:
                writer.add(name, tensor)
        if writer is not None:
            writer.finish()
            base = model.get_base_model() if peft else model
            base.config.save_pretrained(out_dir)
            if getattr(base, "generation_config", None) is not None:
                base.generation_config.save_pretrained(out_dir)
    Communicator.of().barrier()


def _model_tensors(model: Any) -> Iterator[tuple[str, "torch.Tensor"]]:
    """(name, host copy) of every parameter (tied ones once) and persistent buffer, gathered one by one."""
    for name, param in model.named_parameters():
        with gathered([param]):
            yield name, param
    yield from _persistent_buffers(model)


def _persistent_buffers(model: Any) -> Iterator[tuple[str, "torch.Tensor"]]:
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buf


def _merged_lora_tensors(model: Any) -> Iterator[tuple[str, "torch.Tensor"]]:
    """The base model's tensors under their base names, each LoRA layer's weight with its adapter folded in."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    lora_modules = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    done: set[int] = set()
    for module_name, module in lora_modules.items():
        params = list(module.parameters())
        with gathered(params):
            weight = module.get_base_layer().weight.detach().clone()
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight += module.get_delta_weight(adapter).to(weight.dtype)
            yield f"{module_name}.weight", weight
            bias = module.get_base_layer().bias
            if bias is not None:
                yield f"{module_name}.bias", bias
        done.update(id(p) for p in params)
    for name, param in base.named_parameters():
        if id(param) in done:
            continue
        with gathered([param]):
            yield name, param
    yield from _persistent_buffers(base)


def _write_adapter(model: Any, out_dir: Path, writer: ShardWriter | None) -> None:
    """The PEFT adapter (adapter_model.safetensors + adapter_config.json), gathered parameter by parameter."""
    state = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            with gathered([param]):
                state[name] = param.detach().to("cpu", copy=True).contiguous()
    if writer is not None:
        # peft picks the adapter's entries out of `state` and writes them with adapter_config.json.
        model.save_pretrained(str(out_dir), state_dict=state, safe_serialization=True)
