"""The estimate's inputs: a configuration's byte-model settings (`settings`), the SP degree, the room a device and a
host give a run (`device_capacity`, `host_capacity`, `fits`) — shared by the choices (lstune.estimate.choice), the
longest-length search (lstune.estimate.longest), the suggestions and the estimate itself."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from lstune.config.schema import TrainConfig
from lstune.estimate.hardware import Cluster
from lstune.estimate.margin import Margin, margin
from lstune.estimate.memory import Breakdown, Engine, Settings, host_reserve_bytes, reserve_bytes


MIN_SEQ = 1024


# `auto` tiling stops cutting once the predicted peak is at most this share of the device: tiles cost time, and
# the few percent the estimate may be off (docs/estimate.md) plus the allocator's fragmentation need room.
AUTO_HEADROOM = 0.9


def model_config_of(config: TrainConfig):
    """The model's config: a preset's resolved attributes kept with lstune (no torch, lstune.estimate.preset_facts),
    else transformers' config."""
    from lstune.estimate.preset_facts import preset_config_facts
    from lstune.models.loading import resolve_model

    facts = preset_config_facts(config.model.name)
    if facts is not None:
        return facts
    return resolve_model(config.model.name, trust_remote_code=config.model.trust_remote_code).config


def resolve_sp(config: TrainConfig, hardware: Cluster, model_config) -> int:
    """The SP degree the run would use (ConfigError naming the valid ones when it cannot)."""
    from lstune.parallel.dims import ParallelDims

    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return ParallelDims.for_model(hardware.world_size, config.parallel.sp, text, ring=config.parallel.sp_ring,
                                  node_size=hardware.gpus).sp


def resolve_ring(config: TrainConfig, hardware: Cluster, sp: int) -> int:
    """The ring part of `sp` the run would use (`--sp-ring`; auto: Ulysses as wide as the heads and a node allow,
    lstune.parallel.dims.auto_ring_degree)."""
    ring = config.parallel.sp_ring
    if ring == "auto":
        from lstune.parallel.dims import auto_ring_degree

        heads = _q_heads(config.model.name, config.model.trust_remote_code)
        return auto_ring_degree(sp, heads, hardware.gpus) if heads else 1
    return int(ring) if sp % int(ring) == 0 else 1


@lru_cache(maxsize=8)
def _q_heads(name: str, trust_remote_code: bool) -> int | None:
    """The model's query heads (read once per model: the length searches build settings many times)."""
    from lstune.models.introspect import attention_heads
    from lstune.models.loading import resolve_model

    model_config = resolve_model(name, trust_remote_code=trust_remote_code).config
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = attention_heads(text)
    return heads[0] if heads else None


# What the trace's step does differently (Cluster.traced): no Liger, no fused norms (a probe needs real weights),
# offloaded chunks read in place, no CUDA context (the trace counts tensors only).
# The trace runs on CPU, where transformers takes its torch Gated DeltaNet and Mamba kernels whatever is installed.
TRACED = {"liger": False, "fuse_norms": False, "chunks_fetched": False, "cuda_context": False, "fla_kernels": False,
          "mamba_kernels": False}


def installed(package: str) -> bool:
    """Whether `package` is importable here (found without importing it): transformers then runs its kernels on CUDA
    — flash-linear-attention (`fla`, `lstune[fla]`) for Gated DeltaNet, `mamba_ssm` for Mamba's selective scan
    (transformers.integrations.hub_kernels: the installed package before its torch fallback). The estimate assumes
    the run's machine has the packages of the one estimating it."""
    return _found(package)


@lru_cache(maxsize=None)
def _found(package: str) -> bool:
    """`installed`'s lookup, once per package and process: the length searches build settings thousands of times
    (a fresh lookup each time had been a sixth of an estimate's time)."""
    import importlib.util

    return importlib.util.find_spec(package) is not None


def settings(config: TrainConfig, hardware: Cluster, sp: int, engine: Engine, offload: bool | None = None) -> Settings:
    """The byte model's settings of `config`; `offload`: checkpoint offload as resolved (default: on only when the
    config says so outright, 'auto' being the estimate's choice, `choose_memory`)."""
    m = config.memory
    offload = m.offload_checkpoints is True if offload is None else offload
    ring = resolve_ring(config, hardware, sp) if sp > 1 else 1
    metp = bool(config.parallel.metp_mlp) and sp > 1  # METP runs each MLP itself: no MLP tiles, no mini-sequence
    return Settings(
        seq_len=config.data.seq_len, micro_batch=config.optim.micro_batch_size, sp=sp, world=hardware.world_size,
        engine=engine, lora_r=config.model.lora_r, lora_dropout=config.model.lora_dropout, on_cuda=hardware.on_cuda,
        dtype=config.model.dtype, tiled_mlp="off" if metp else m.tiled_mlp, tiled_loss=m.tiled_loss,
        mini_sequence=m.mini_sequence is True and not metp, metp_mlp=metp,
        checkpointing=m.checkpointing, offload_checkpoints=offload, host_mem_budget=m.host_mem_budget,
        grad_accum=config.optim.grad_accum, load_in_4bit=config.model.load_in_4bit,
        checkpoint_device_budget=m.checkpoint_device_budget, attn_chunks=m.attn_chunks,
        ring=ring,
        # ring attention (Ulysses' core under --sp-ring) never reaches the saver: its layers recompute
        save_attention=m.checkpointing and m.recompute_attention == "off" and ring == 1,
        **({"fla_kernels": hardware.on_cuda and installed("fla"),
            "mamba_kernels": hardware.on_cuda and installed("mamba_ssm")} | (TRACED if hardware.traced else {})),
    )


def fits(b: Breakdown, hardware: Cluster) -> bool:
    """Whether the peaks of `b` leave the margin free (lstune.estimate.margin): what "fits" means everywhere."""
    m = run_margin(hardware, b)
    return (b.device_peak <= device_capacity(hardware) - m.device
            and b.host_peak * hardware.gpus <= host_capacity(hardware) - m.host)


def run_margin(hardware: Cluster, b: Breakdown) -> Margin:
    """The margin of a run with breakdown `b` on `hardware` (chunked attention keeps more of the device)."""
    return margin(device_capacity(hardware), host_capacity(hardware), on_cuda=hardware.on_cuda,
                  chunked=b.attn_chunks > 1)


def host_limit(hardware: Cluster) -> int:
    """A node's usable host less the margin: what its ranks may plan to use together."""
    return host_capacity(hardware) - run_margin(hardware, Breakdown()).host


def device_target(hardware: Cluster, b: Breakdown) -> int:
    """The device peak `auto` plans for (tiles, the placement's device budget): AUTO_HEADROOM of the device, or
    less where the margin asks more (chunked attention)."""
    capacity = device_capacity(hardware)
    return int(min(AUTO_HEADROOM * capacity, capacity - run_margin(hardware, b).device))


def device_capacity(hardware: Cluster) -> int:
    return hardware.device.device_bytes - reserve_bytes(hardware.device.device_bytes, hardware.on_cuda)


def host_capacity(hardware: Cluster) -> int:
    """A node's RAM less what the OS keeps (memory.host_reserve_bytes): what its ranks can have together."""
    return hardware.host_bytes - host_reserve_bytes(hardware.host_bytes)


def ladder(top: int) -> list[int]:
    """1, 2, 4, ... below `top`, then `top`."""
    return [1 << i for i in range(max(top - 1, 0).bit_length()) if 1 << i < top] + [top]


def with_flat(config: TrainConfig, **flat: Any) -> TrainConfig:
    """A copy of `config` with some flat keys changed (`seq_len`, `offload_checkpoints`, ...)."""
    values = config.to_dict()
    values.update(flat)
    return TrainConfig.from_flat(values)
