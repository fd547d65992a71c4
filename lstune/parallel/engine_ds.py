"""`DeepSpeedEngine`: the distributed (and memory-offloading) implementation of the training Engine.

Same surface as the loop's single-device `TorchEngine` (lstune/train/engine.py): call forward on
`engine.model` (the HF model itself — ZeRO-3 gathers each layer's parameters through hooks on its
modules), `backward(loss)` per micro-batch, `step()` once per accumulation window, `save`/`load` for
resume and `export` for the final HF-format model. Every method is a collective: call it on every rank.

Gradient accumulation is the loop's: DeepSpeed runs with `gradient_accumulation_steps=1` and
`managed_gradient_accumulation=false`, so `backward` only accumulates and `step()` is the boundary that
reduces, clips, updates and zeroes — however many micro-batches the loop fed it.

Loss scaling contract (see loss.py): the loop backpropagates, per micro-batch, this rank's
`loss_sum / N_global`; the step's gradient must be the SUM of those over all ranks and micro-batches.
DeepSpeed divides the summed gradients by a factor that depends on the path (deepspeed 0.19): ZeRO
1–2 divide by the DP degree (world / sp, the SP group given as its `mpu`); ZeRO-3's reduce-scatter
path divides by the whole world size, ignoring SP (its contiguous-bucket path would divide by DP, so
the config pins reduce_scatter on). `backward` multiplies by that factor; the equivalence tests for
each stage guard it against DeepSpeed changing.

ZeRO and offload (why each exists — memory per parameter with bf16 + Adam is 18 bytes, ALST 3.4):
stage 1 shards the 12 B of fp32 master weights and Adam moments over ranks, stage 2 also the 4 B of
gradients, stage 3 also the 2 B of weights (gathered layer by layer in forward and backward);
offload_optimizer keeps master weights, moments and the update on the host (DeepSpeedCPUAdam), and
offload_params keeps the stage-3 weight shards on the host too, and offload_ratio below 1 keeps that fraction of
the optimizer sub-groups on the host and the rest on the GPU (DeepSpeed's partial offload; two of its defects are
worked around here: `_gpu_optimizer_states`, `_sync_gpu_optimizer_settings`). `--zero-stage auto` takes the first
that the memory estimate says fits (lstune.estimate.choose_engine).
"""

from __future__ import annotations

import json
import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lstune.config.schema import zero_problems
from lstune.errors import CheckpointError, ConfigError
from lstune.optim import OptimConfig, advance_schedule, apply_optim_settings, make_adamw, make_scheduler

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.local_params import LocalParams

log = logging.getLogger(__name__)

DS_TAG = "deepspeed"
EXPORT_SHARD_BYTES = 2 * 1024**3


# Under partial optimizer offload (--offload-ratio below 1) each rank's parameters are cut into this many optimizer
# sub-groups; DeepSpeed keeps the first int((1 - ratio) * n) on the GPU, so the ratio is honoured to 1/n.
PARTIAL_SUB_GROUPS = 32
GPU_OPTIMIZER_FILE = "gpu_optimizer_rank{rank}.pt"
# Each rank's rank-local parameters (lstune.parallel.local_params: METP's MLP shards) and their Adam state.
LOCAL_PARAMS_FILE = "local_params_rank{rank}.pt"
# The ZeRO stage that wrote a checkpoint ({"stage": N}); DeepSpeed's files of one stage do not load under another.
ZERO_STAGE_FILE = "lstune-zero-stage.json"


@dataclass(frozen=True)
class ZeroPlan:
    stage: int
    offload_optimizer: bool
    offload_params: bool
    bytes_per_device: int  # weights + gradients + optimizer state resident on each device
    reason: str
    offload_ratio: float = 1.0  # of the offloaded optimizer state, the fraction on the host (the rest on the GPU)


def partial_sub_group_size(shards: Sequence[int]) -> int:
    """DeepSpeed's sub_group_size under partial optimizer offload, from one rank's trainable shards in the optimizer's
    order (each ceil(numel / ranks)): about 1/PARTIAL_SUB_GROUPS of them per sub-group.

    DeepSpeed closes a sub-group at the tensor that brings it to the size (stage3.py), so one runs past the size by
    up to a tensor, and its fp32 gradient's pinned host buffer is rounded up to a power of two (torch's caching host
    allocator). A size of exactly 1/32 let most of Llama-3.1-8B's run past 2^30 B, each taking 2 GiB of host for
    1.1 GB (the H200 of 2026-11-26); the size is set one tensor below the power of two at or above the share, so
    every sub-group of tensors smaller than that power fits in it (a larger tensor, an embedding, is one of its own).
    Where that would halve the sub-groups, the share itself."""
    numel = sum(shards)
    share = max(1, -(-numel // PARTIAL_SUB_GROUPS))
    power = 1 << (share - 1).bit_length()
    overshoot = max((n for n in shards if n < power), default=0)
    return power - overshoot if power - overshoot >= power // 2 else share


def deepspeed_config(
    *,
    zero_stage: int,
    offload_optimizer: bool,
    offload_params: bool,
    bf16: bool,
    max_grad_norm: float,
    pin_memory: bool,
    offload_ratio: float = 1.0,
    sub_group_size: int | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config dict lstune runs with (the loop owns the batch and the accumulation window).
    `offload_ratio` below 1: that fraction of the optimizer sub-groups (`sub_group_size` elements each) on the host."""
    problems = zero_problems(zero_stage, processes=1, offload_optimizer=offload_optimizer, offload_params=offload_params,
                             offload_ratio=offload_ratio)
    if zero_stage not in (1, 2, 3):
        problems.append(
            f"--zero-stage {zero_stage} is not supported with DeepSpeed; use 1, 2 or 3 (ZeRO-1 communicates "
            "like plain data parallelism and only shards the optimizer state)."
        )
    if problems:
        raise ConfigError(problems)
    zero: dict[str, Any] = {"stage": zero_stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
        if offload_ratio < 1:
            zero["offload_optimizer"]["ratio"] = offload_ratio
            zero["sub_group_size"] = sub_group_size or 10**9
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    if zero_stage == 3:
        # Export and checkpoints gather parameters themselves; never gather the whole model on save.
        zero["stage3_gather_16bit_weights_on_model_save"] = False
        # One gradient-averaging rule for every parameter (see `gradient_divisor`).
        zero["reduce_scatter"] = True
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": max_grad_norm if max_grad_norm > 0 else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _gpu_optimizer_states(optimizer) -> dict | None:
    """Under partial offload, the Adam state of the sub-groups kept on the GPU, by sub-group index, with the ratio
    and sub-group count they belong to; None otherwise.

    Why by hand: DeepSpeed (0.19) steps those sub-groups with a separate torch AdamW (`backup_optimizer`) whose
    state its checkpoint leaves out — a resume would restart their moments and step count, silently."""
    backup = getattr(optimizer, "backup_optimizer", None)
    if backup is None:
        return None
    groups = optimizer.fp32_partitioned_groups_flat
    return {"ratio": float(optimizer.partial_offload), "sub_groups": len(groups),
            "states": {i: dict(backup.state[group]) for i, group in enumerate(groups) if group in backup.state}}


def _sync_gpu_optimizer_settings(optimizer) -> None:
    """Under partial offload, the schedule's learning rate (and every other setting) of each parameter group into
    DeepSpeed's `backup_optimizer` too: it copies group 0's settings once, when it is built, so without this the
    sub-groups on the GPU would train at the first step's learning rate throughout (deepspeed 0.19)."""
    backup = getattr(optimizer, "backup_optimizer", None)
    if backup is None:
        return
    for main, gpu in zip(optimizer.optimizer.param_groups, backup.param_groups):
        gpu.update({k: v for k, v in main.items() if k != "params"})


def _check_offload_ratio(optimizer, path: Path) -> None:
    """CheckpointError unless the checkpoint's GPU part of the optimizer state (`path`, this rank's) is there exactly
    when this run keeps one: across --offload-ratio settings DeepSpeed either fails to load or restarts moments."""
    partial = getattr(optimizer, "backup_optimizer", None) is not None
    if partial != path.is_file():
        written = "below 1 (part of the optimizer state on the GPU)" if path.is_file() else "1 (or none)"
        raise CheckpointError(f"{path.parent.parent} was written with --offload-ratio {written}: resume with the "
                              "--offload-ratio that wrote it.")


def _load_gpu_optimizer_states(optimizer, path: Path) -> None:
    """The GPU sub-groups' Adam state `_gpu_optimizer_states` saved, into this engine's; CheckpointError where the
    checkpoint's --offload-ratio or sub-groups differ (DeepSpeed would restart those moments)."""
    _check_offload_ratio(optimizer, path)
    if not path.is_file():
        return
    from lstune.untrusted import torch_load

    saved = torch_load(path, error=CheckpointError, map_location="cpu")
    groups = optimizer.fp32_partitioned_groups_flat
    if saved["ratio"] != float(optimizer.partial_offload) or saved["sub_groups"] != len(groups) or any(
            state["exp_avg"].numel() != groups[i].numel() for i, state in saved["states"].items()):
        raise CheckpointError(f"{path} (--offload-ratio {saved['ratio']:g}, {saved['sub_groups']} sub-groups) does "
                              f"not match this run's optimizer (--offload-ratio {optimizer.partial_offload:g}, "
                              f"{len(groups)} sub-groups): resume with the model, processes and --offload-ratio "
                              "that wrote it (and an lstune of before 2026-11-26 for a checkpoint it wrote: the "
                              "sub-groups' size changed then).")
    backup = optimizer.backup_optimizer
    for i, state in saved["states"].items():
        backup.state[groups[i]] = {k: v if k == "step" else v.to(groups[i].device) for k, v in state.items()}


def gradient_divisor(zero_stage: int, dims: "ParallelDims") -> int:
    """What DeepSpeed divides the all-reduced gradient sum by (see the module docstring)."""
    return dims.world_size if zero_stage == 3 else dims.dp


class DeepSpeedSPGroups:
    """The `mpu` object DeepSpeed reads sequence-parallel groups from, backed by `ParallelDims`.

    It mirrors deepspeed.runtime.sequence_parallel.parallel_state_sp (which keeps the groups in module
    globals): DeepSpeed then reduces gradients over the SP × DP group, summing over SP and averaging
    over DP, and shards ZeRO state over all ranks. `initialize_sequence_parallel` must exist — DeepSpeed
    tells an SP mpu from a Megatron one by it.
    """

    def __init__(self, dims: "ParallelDims"):
        import torch.distributed as dist

        self.dims = dims
        self._world = dist.group.WORLD

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        if sequence_parallel_size != self.dims.sp:
            raise RuntimeError(f"SP groups are built for sp={self.dims.sp}, not {sequence_parallel_size}")

    def get_sequence_parallel_group(self):
        return self.dims.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.dims.sp

    def get_sequence_parallel_rank(self) -> int:
        return self.dims.sp_rank

    def get_sequence_data_parallel_group(self):
        return self._world

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.dims.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.dims.rank

    # DeepSpeed's SP state module aliases "model parallel" to SP; kept identical.
    get_model_parallel_group = get_sequence_parallel_group
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_rank = get_sequence_parallel_rank


class DeepSpeedEngine:
    """Engine over DeepSpeed ZeRO 1–3 with optional host offload and bf16, SP-aware through `dims`."""

    def __init__(
        self, model, *, dims: "ParallelDims", optim: OptimConfig, zero: ZeroPlan, bf16: bool,
        trust_checkpoint: bool = False, local: "LocalParams | None" = None,
    ):
        """`local`: rank-local parameters the model does not register (METP's MLP shards): reduced, counted in the
        clipping norm, stepped, saved and exported beside DeepSpeed's (lstune.parallel.local_params)."""
        import deepspeed
        import torch

        from lstune.parallel.comm import init_process_group
        from lstune.parallel.launch import detect_launch_env

        on_cuda = torch.cuda.is_available()
        init_process_group(detect_launch_env())
        # Wraps the process group already initialised (by the launch, or the one-process group).
        with without_inference_shm_op():
            deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
        zero_stage = zero.stage
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise RuntimeError("the model has no trainable parameters")
        config = deepspeed_config(
            zero_stage=zero_stage, offload_optimizer=zero.offload_optimizer, offload_params=zero.offload_params,
            bf16=bf16, max_grad_norm=optim.max_grad_norm, pin_memory=on_cuda, offload_ratio=zero.offload_ratio,
            sub_group_size=partial_sub_group_size([-(-p.numel() // dims.world_size) for p in params]),
        )
        optimizer = _adamw(params, optim, on_host=zero.offload_optimizer)
        scheduler = make_scheduler(optimizer, optim)
        if zero_stage == 3:
            _register_mixer_children(model)
        self.dims = dims
        self.zero_stage = zero_stage
        self._ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=config,
            mpu=DeepSpeedSPGroups(dims) if dims.sp > 1 else None,
            dist_init_required=False,
        )
        self.model = self._ds.module
        self._divisor = gradient_divisor(zero_stage, dims)
        self.local = local
        if local is not None and local.params:
            _count_local_norm(self._ds.optimizer, local)
        self._optim = optim  # applied again after a checkpoint's settings are loaded (lstune.optim)
        if not trust_checkpoint:
            from lstune.parallel.safe_load import use_restricted_loader

            use_restricted_loader(self._ds)

    def backward(self, loss: "torch.Tensor") -> None:
        """Accumulate gradients of this rank's share of the global mean loss (see loss.py)."""
        # DeepSpeed's own forward() starts each micro-batch by closing the previous backward's
        # bookkeeping (ZeRO's micro-step counter: copy vs accumulate gradient partitions). The loop calls
        # the model's parts directly (hidden states, then a tiled loss head), never that forward, so the
        # same call happens here, between one backward and the next.
        if hasattr(self._ds.optimizer, "clear_backward_seen_flag"):
            self._ds.optimizer.clear_backward_seen_flag()
        self._ds.backward(loss * self._divisor)

    def step(self) -> dict[str, float]:
        """Reduce, clip, update, advance the schedule and zero gradients; {"grad_norm", "lr", "update_skipped"}.

        DeepSpeed (0.19: every ZeRO stage, offloaded or not, fp32 or bf16) checks the gradients before it updates
        and, when they are not finite, drops them and leaves the weights and the schedule as they were, counting
        the step in `skipped_steps`. The step is then reported skipped and the schedule advanced as the
        single-device engine's `skip_step` advances it, so a skipped step leaves both engines on one schedule."""
        lr = float(self.scheduler.get_last_lr()[0])
        _sync_gpu_optimizer_settings(self._ds.optimizer)
        if self.local is not None:
            self.local.reduce(self._divisor)  # its norm joins DeepSpeed's (`_count_local_norm`)
        skipped_before = self._ds.skipped_steps
        self._ds.step()
        skipped = self._ds.skipped_steps > skipped_before
        if skipped:
            advance_schedule(self.scheduler)
        norm = self._ds.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        if self.local is not None:
            if skipped or not math.isfinite(norm):
                self.local.zero_grad()
                skipped = True
            else:
                self.local.step(lr, norm)
        return {"grad_norm": norm, "lr": lr, "update_skipped": skipped}

    def skip_step(self) -> dict[str, float]:
        """A step whose loss is not finite: DeepSpeed's own check drops its gradients when they are not finite
        (`step`); when they are, the update is applied and `update_skipped` is False (the run then stops,
        lstune.train.guard)."""
        return self.step()

    def save(self, ckpt_dir: Path) -> None:
        """Model, optimizer and scheduler state, sharded as DeepSpeed keeps it (every rank writes its part).

        Resume needs the same world size and ZeRO stage; multi-node runs need `ckpt_dir` on a shared
        filesystem.
        """
        self._ds.save_checkpoint(str(ckpt_dir), tag=DS_TAG, save_latest=False)
        if self.dims.rank == 0:
            (Path(ckpt_dir) / DS_TAG / ZERO_STAGE_FILE).write_text(json.dumps({"stage": self.zero_stage}))
        states = _gpu_optimizer_states(self._ds.optimizer)
        if states is not None:
            import torch

            torch.save(states, Path(ckpt_dir) / DS_TAG / GPU_OPTIMIZER_FILE.format(rank=self.dims.rank))
        if self.local is not None:
            import torch

            torch.save(self.local.state_dict(), Path(ckpt_dir) / DS_TAG / LOCAL_PARAMS_FILE.format(rank=self.dims.rank))

    def load(self, ckpt_dir: Path) -> None:
        if not (Path(ckpt_dir) / DS_TAG).is_dir():
            raise CheckpointError(
                f"{ckpt_dir} has no DeepSpeed state ({DS_TAG}/); it was written by a single-device run or is "
                "incomplete. Resume with the same launcher and number of processes that wrote it."
            )
        refuse_other_zero_stage(Path(ckpt_dir), self.zero_stage)
        gpu_part = Path(ckpt_dir) / DS_TAG / GPU_OPTIMIZER_FILE.format(rank=self.dims.rank)
        _check_offload_ratio(self._ds.optimizer, gpu_part)
        path, _ = self._ds.load_checkpoint(
            str(ckpt_dir), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load the checkpoint in {ckpt_dir}")
        _load_gpu_optimizer_states(self._ds.optimizer, gpu_part)
        apply_optim_settings(self.optimizer, self.scheduler, self._optim)
        self._load_local(Path(ckpt_dir) / DS_TAG / LOCAL_PARAMS_FILE.format(rank=self.dims.rank))

    def _load_local(self, path: Path) -> None:
        """This rank's rank-local parameters and their Adam state; CheckpointError where the checkpoint has none
        and this run has some, or the other way round, or they do not fit."""
        if (self.local is not None) != path.is_file():
            has = "rank-local parameters (--metp-mlp)" if path.is_file() else "no rank-local parameters"
            raise CheckpointError(f"{path.parent.parent} holds {has}, unlike this run: resume with the --metp-mlp "
                                  "setting (and layout) that wrote it.")
        if self.local is None:
            return
        from lstune.untrusted import torch_load

        try:
            self.local.load_state_dict(torch_load(path, error=CheckpointError, map_location="cpu"), str(path))
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise CheckpointError(f"{path} does not fit this run's METP shards ({exc}); resume with the model and "
                                  "layout that wrote it.") from exc

    def export(self, out_dir: Path, *, merge_lora: bool = False) -> None:
        """The HF-format model (from_pretrained loads it), gathered one parameter at a time.

        Rank 0 streams parameters to safetensors shards of at most 2 GiB on the host; no device ever
        holds more than one full parameter beyond its own shard. A PEFT model exports its adapter, or
        with `merge_lora` the merged full model.
        """
        from contextlib import nullcontext

        from lstune.parallel.export import export_hf

        with self.local.full_weights() if self.local is not None else nullcontext():
            export_hf(self.model, Path(out_dir), rank=self.dims.rank, merge_lora=merge_lora,
                      shard_bytes=EXPORT_SHARD_BYTES)


def saved_zero_stage(ckpt_dir: Path) -> int | None:
    """The ZeRO stage that wrote the DeepSpeed checkpoint in `ckpt_dir`: its record, else (a checkpoint of before
    the record) 3 when DeepSpeed's ZeRO-3 per-rank model files are there; None when that cannot tell (1 or 2)."""
    from lstune.untrusted import read_json, require

    record = Path(ckpt_dir) / DS_TAG / ZERO_STAGE_FILE
    if record.is_file():
        return require(read_json(record, error=CheckpointError).get("stage"), int, f"{record}: stage", CheckpointError)
    return 3 if any((Path(ckpt_dir) / DS_TAG).glob("zero_pp_rank_*_model_states.pt")) else None


def refuse_other_zero_stage(ckpt_dir: Path, stage: int) -> None:
    """CheckpointError when the DeepSpeed checkpoint in `ckpt_dir` was written under another ZeRO stage than
    `stage` (0: the single-device engine): its shards hold another partitioning, and DeepSpeed fails on them."""
    saved = saved_zero_stage(ckpt_dir)
    if saved is None or saved == stage or (saved in (1, 2) and stage in (1, 2) and not (
            Path(ckpt_dir) / DS_TAG / ZERO_STAGE_FILE).is_file()):
        return
    raise CheckpointError(
        f"{ckpt_dir} is a DeepSpeed ZeRO-{saved} checkpoint and this run uses ZeRO-{stage}: DeepSpeed's shards of "
        f"one stage do not load under another. Resume with --zero-stage {saved}, or start a new run without --resume."
    )


@contextmanager
def without_inference_shm_op():
    """DeepSpeed's comm backend without its shared-memory all-reduce op. On its CPU accelerator it compiles that C++
    op when the backend starts (~3 minutes on two cores, on every fresh machine and CI run) but uses it only in
    `inference_all_reduce`, which training never calls: lstune's collectives go through torch.distributed. Patched
    around the one call that builds it (`deepspeed.comm.torch.build_shm_op`, looked up when the backend starts),
    then restored."""
    import importlib

    # `deepspeed.comm.torch` by attribute is the torch package (deepspeed.comm imports it): fetch the module.
    ds_torch = importlib.import_module("deepspeed.comm.torch")

    build = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch.build_shm_op = build


def _count_local_norm(optimizer, local: "LocalParams") -> None:
    """DeepSpeed's global gradient norm made to count the rank-local parameters too (`local.norm`, set before each
    step), so its clipping (and the norm it reports) is the one-process norm over every parameter. An instance-level
    patch of the method each ZeRO optimizer computes its norm in (deepspeed 0.19: ZeRO 1-2 `scaled_global_norm`,
    ZeRO-3 `_get_norm_groups`); the equivalence tests with clipping active fail if either moves."""
    from deepspeed.runtime.utils import combine_grad_norm_groups

    def scaled(norm):  # ZeRO's norms are of loss-scaled gradients (the scale is 1 without fp16)
        return local.norm.to(norm.device) * getattr(optimizer, "loss_scale", 1.0)

    if callable(getattr(type(optimizer), "scaled_global_norm", None)):
        own = optimizer.scaled_global_norm

        def scaled_global_norm(*args, **kwargs):
            norm = own(*args, **kwargs)
            return combine_grad_norm_groups([norm, scaled(norm)])

        optimizer.scaled_global_norm = scaled_global_norm
    elif callable(getattr(type(optimizer), "_get_norm_groups", None)):
        groups = optimizer._get_norm_groups

        def get_norm_groups():
            norms = groups()
            return [*norms, scaled(norms[0])]

        optimizer._get_norm_groups = get_norm_groups
    else:
        raise ConfigError([f"--metp-mlp: this DeepSpeed's {type(optimizer).__name__} computes its gradient norm where "
                           "lstune does not count the METP shards in it; use deepspeed 0.19, or drop --metp-mlp."])


def _register_mixer_children(model) -> None:
    """ZeRO-3 gathers a module's own parameters when that module is called. The token mixers (lstune.models.mixers)
    read some of their children's weights directly, never calling them — the convolution, Mamba-1's x_proj and
    dt_proj: transformers' code does, and so do lstune's head-parallel views — so their children's parameters are
    registered as the mixer's external parameters (DeepSpeed then gathers them whenever the mixer runs)."""
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    from lstune.models.introspect import decoder_layers
    from lstune.models.mixers import mixer_sites

    try:
        layers = decoder_layers(model)
    except Exception:  # noqa: BLE001 - a model without decoder layers has no mixers to register
        return
    for _, mixer in mixer_sites(layers):
        for child in mixer.children():
            for parameter in child.parameters():
                register_external_parameter(mixer, parameter)


def _adamw(params, cfg: OptimConfig, *, on_host: bool):
    """torch AdamW (the same update as TorchEngine), or DeepSpeed's host Adam for an offloaded optimizer."""
    if on_host:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(
            params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, adamw_mode=True
        )
    return make_adamw(params, cfg)

