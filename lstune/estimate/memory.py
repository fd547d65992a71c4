"""The analytic memory model: bytes on each device and on each host for one training step, per rank.

Static terms are bytes per parameter, by where the run keeps them (lstune.train.prepare, lstune.parallel.engine_ds):

- single-device AdamW (TorchEngine): on CUDA with LoRA the frozen base is bf16 (2 B) and the adapters fp32
  (4 B weight, 4 B gradient, 8 B Adam moments); a full fine-tune keeps fp32 weights under bf16 autocast
  (4 + 4 + 8 B per parameter) and so an fp32 residual stream;
- DeepSpeed ZeRO (bf16 mode on CUDA): every weight bf16 (2 B), fp32 gradient (4 B) and fp32 master + m + v
  (12 B) per trainable parameter; stage 1 shards the 12 B over the ranks, stage 2 also the gradient, stage 3
  also the weights (and gathers one layer at a time, with one more prefetched); `offload_optimizer` moves the
  gradient and the 12 B to the host, `offload_params` the weight shards too. ZeRO-3's host buffers as DeepSpeed
  0.19 makes them (stage3.py): the fp32 gradient twice — the flat buffer partitions accumulate into and one per
  optimizer sub-group that CPU Adam reads (`zero3_host_gradient_bytes`) — and the weights in one flat buffer per
  parameter group; on CUDA all three are pinned, each rounded up to a power of two by torch's caching host
  allocator. Measured on an H200 (docs/benchmarks/2026-11-26-h200): Llama-3.2-3B full fine-tune, host RSS
  74.6 GiB at the step; this model says 74.9 GiB (the 18 B per parameter of before said 55.9 GiB);
- under --metp-mlp (lstune.memory.metp_mlp) the engine holds the model less the MLP weights, and each rank 1/SP of
  every MLP beside it (`_metp_static`: fp32 masters, gradients and AdamW's moments; lstune.estimate.sequence_parallel).

Activation terms are bytes per token of the rank's local sequence (seq_len / SP), in the run's dtypes: `act`
= 2 in a bf16 run (4 in fp32), `res` = the residual stream's bytes (the dtype of the weights). Under
checkpointing the device holds one layer input (res · hidden per token) per layer — two with host offload
(the kept last layer and the one prefetched during the layer above's backward). The peak is the largest of
four moments of the step (`Phase`), each with what is alive then:

- the loss head: every checkpoint, the final norm (one tile's when it runs in the loss tiles, before Liger too, with
  the whole normed output Liger reads), the gradient of the head's input and the larger of one tile's log-softmax
  backward (12 B per logit) and a trainable head's weight gradient for one tile — or Liger's buffers on CUDA
  (`_liger_parts`); the head's gradient;
- the last layer's backward: what the recomputed attention block saves, plus the largest of the MLP's (METP's
  rotation step under --metp-mlp, `_metp_moment`), the MLP norm's (HF's RMSNorm backward in fp32) and attention's
  moments (`_layer_parts`); one layer's gradients;
  LoRA dropout saves nothing more (its cast + dropout are recomputed), only its replay joins the MLP's and
  attention's moments (`_lora_dropout_replay`);
- the first layer's backward: the same with one checkpoint and every layer's gradients;
- the optimizer step: every gradient (fused AdamW).

Gradients count by moment only for the single-device engine with one micro-batch a step, which frees them
after each step; DeepSpeed's buffers and accumulated gradients are static. Every coefficient is counted from
the tensors HF's modules and lstune's tiling keep alive (checked against the fake-tensor trace's live tensors at
its peak, lstune.train.trace) and against the device peaks measured on an H100 (docs/estimate.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from lstune.estimate.placement import cache_clear as placement_cache_clear
from lstune.estimate.placement import checkpoint_terms
from lstune.estimate.shapes import ModelShape, ParamCounts, ceil_div
from lstune.memory.host_copies import host_copy_bytes, pinned_bytes
from lstune.models.quant import frozen_weight_bytes

GIB = 2**30
CUDA_CONTEXT_BYTES = 512 * 2**20  # the CUDA context and kernels, outside torch's allocator
ALLOCATOR_RESERVE = 0.025  # of device memory the caching allocator cannot hand out (expandable segments)
# Host RAM a run cannot have: the kernel and other processes, the page tables of pinned memory (8 B per 4 KiB
# page, 0.2 %) and the free-page watermarks. Measured on the GPU machine of 2026-11-26 (125.9 GiB): the OOM killer
# ended a process holding 123.0 GiB (121.4 GiB of it pinned), 2.9 GiB short of the total. 4 GiB + 1 % leaves
# 120.6 GiB there; a 2 TiB host keeps 24.5 GiB back.
HOST_RESERVE_BYTES = 4 * GIB
HOST_RESERVE_FRACTION = 0.01
HOST_PROCESS_BYTES = 2 * GIB  # one training process's own memory (python, torch, CUDA libraries): measured 1.5-1.9 GB
LOSS_TILE_BYTES = 2**30  # lstune.memory.loss.LOSS_TILE_BYTES: ALST's ~1 GiB of fp32 logits per tile
ADAM_BYTES = 8  # two fp32 moments
DS_GRAD_BYTES, DS_OPTIM_BYTES = 4, 12  # DeepSpeed bf16 mode: fp32 gradient; fp32 master + m + v
DS_SUB_GROUP_ELEMENTS = 10**9  # DeepSpeed's default zero_optimization.sub_group_size, which lstune keeps


@dataclass(frozen=True)
class Engine:
    """How the training state is kept: the single-device AdamW, or DeepSpeed ZeRO with its offloads."""

    kind: str  # "torch" | "deepspeed"
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_ratio: float = 1.0  # of the offloaded optimizer state, the fraction on the host (ZeRO-3)

    def describe(self) -> str:
        if self.kind == "torch":
            return "AdamW on one device (no ZeRO)"
        optimizer = "optimizer" if self.offload_ratio >= 1 else f"optimizer ({self.offload_ratio:.0%} of it)"
        offload = [name for name, on in ((optimizer, self.offload_optimizer), ("params", self.offload_params)) if on]
        return f"DeepSpeed ZeRO-{self.zero_stage}" + (f" + {' + '.join(offload)} offload" if offload else "")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "zero_stage": self.zero_stage, "offload_optimizer": self.offload_optimizer,
                "offload_params": self.offload_params, "offload_ratio": self.offload_ratio,
                "description": self.describe()}


@dataclass(frozen=True)
class Settings:
    """Everything the byte count depends on, resolved (no 'auto' left but the tile policies)."""

    seq_len: int  # global tokens per sample
    micro_batch: int
    sp: int
    world: int
    engine: Engine
    lora_r: int
    on_cuda: bool
    dtype: str  # "auto" | "bf16" | "fp32" (ModelSection.dtype)
    tiled_mlp: str | int
    tiled_loss: str | int
    mini_sequence: bool
    checkpointing: bool
    offload_checkpoints: bool
    host_mem_budget: int | None
    grad_accum: int = 1  # micro-batches per optimizer step
    checkpoint_device_budget: int | None = None  # device bytes checkpoints may use (MEMO placement, issue 14)
    liger: bool = True  # Liger's fused loss where lstune uses it (CUDA, tiled_loss auto); False: the ALST tiles
    fuse_norms: bool = True  # mini-sequence fuses the MLP's norms, tiled loss the final norm (a probe on real weights)
    load_in_4bit: bool = False  # QLoRA: the frozen base's linear weights in NF4 (lstune.models.quant)
    attn_chunks: str | int = "off"  # --attn-chunks as configured
    attn_chunk_count: int = 1  # FPDT chunks of the local sequence, resolved by `breakdown`; 1: not chunked
    chunks_fetched: bool = True  # offloaded chunks come back as device copies (CUDA); the CPU trace reads them in place
    lora_dropout: float = 0.0  # > 0: each adapter's cast + dropout replays in backward (`_lora_dropout_replay`)
    ring: int = 1  # the ring-attention part of sp (lstune.memory.attention_ring); sp // ring Ulysses ranks
    cuda_context: bool = True  # the CUDA context and allocator reserve counted (on CUDA); the trace sees tensors only
    save_attention: bool = False  # --recompute-attention off, resolved: attention's output kept per layer
    fla_kernels: bool = False  # flash-linear-attention runs Gated DeltaNet and KDA (CUDA, installed); False: torch kernels
    mamba_kernels: bool = False  # mamba-ssm runs Mamba's selective scan (CUDA, installed); False: the torch scan
    metp_mlp: bool = False  # --metp-mlp under SP: every MLP sharded over the SP group and rotated (`_metp`)

    @property
    def local_tokens(self) -> int:
        return self.micro_batch * ceil_div(self.seq_len, self.sp)

    @property
    def bf16(self) -> bool:
        return (self.on_cuda and self.dtype != "fp32") or self.dtype == "bf16"


@dataclass
class Item:
    """One line of the breakdown: bytes on the device and on the host, per rank."""

    name: str
    device: int = 0
    host: int = 0
    detail: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "device_bytes": self.device, "host_bytes": self.host, "detail": self.detail}


@dataclass
class Breakdown:
    items: list[Item] = field(default_factory=list)
    phase: str = ""  # where the activation peak sits: "loss head" or "layer backward"
    dtypes: dict = field(default_factory=dict)
    checkpoint_bytes_per_token_layer: int = 0
    attention_saved_bytes_per_token_layer: int = 0  # --recompute-attention off: what each layer keeps besides
    attention_saved_layers: int = 0  # layers whose attention output is kept (their recompute runs no attention)
    placement: Any = None  # the checkpoint placement (lstune.memory.placement), None without an offloader
    # Device bytes the peak would shed with no checkpoint on the device (the phase peaking without them may differ).
    checkpoint_share: int = 0
    attn_chunks: int = 1  # FPDT chunks of the local sequence (1: unchunked): the margin a fit keeps depends on it

    def add(self, name: str, device: int = 0, host: int = 0, detail: str = "") -> None:
        self.items.append(Item(name, int(device), int(host), detail))

    @property
    def device_peak(self) -> int:
        return sum(i.device for i in self.items)

    @property
    def host_peak(self) -> int:
        return sum(i.host for i in self.items)

    @property
    def device_besides_checkpoints(self) -> int:
        """The device peak of everything but the checkpoints, at whichever phase it is highest."""
        return self.device_peak - self.checkpoint_share


def saved_checkpoint_min_bytes(params: ParamCounts) -> int:
    """The least one saved checkpoint of the run (its training state on disk, lstune.train.checkpoint) takes: every
    engine saves each trainable parameter's fp32 weight and AdamW's two fp32 moments — TorchEngine as the model's
    trainable weights and the optimizer's state, DeepSpeed as its optimizer shards' fp32 master and moments, over
    all ranks. Frozen weights a full save includes, DeepSpeed's module state and the files' headers come on top
    (tiny Llama on the CPU: 0.6 % more with AdamW on one device, 0.9 % with ZeRO-3; 9.6 % for a LoRA adapter's
    small files)."""
    return DS_OPTIM_BYTES * params.trainable


def final_model_min_bytes(params: ParamCounts, *, merge_lora: bool) -> int:
    """The least the run's final model takes on disk (lstune.train.run's export): the whole model, or with LoRA the
    adapter (and with --merge-lora the merged model too), at 2 bytes a parameter at least (16-bit; fp32 weights
    take twice that)."""
    if not params.adapters:
        return 2 * params.total
    return 2 * params.adapters + (2 * (params.total - params.adapters) if merge_lora else 0)


def size_text(nbytes: float) -> str:
    """Bytes as a person reads them: GiB from one GiB up, MiB below (a tiny model's peak is not "0.0 GiB")."""
    return f"{nbytes / GIB:,.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:,.1f} MiB"


def attn_chunk_count(setting: str | int, shape: ModelShape, local_seq: int) -> int:
    """`--attn-chunks` resolved as lstune.memory.apply resolves it (the same functions) for `local_seq` tokens."""
    if setting == "off":
        return 1
    from lstune.memory import offload_math as chunked

    return chunked.chunk_count(setting, local_seq, chunked.auto_chunk_tokens(shape.q_width, shape.kv_width))


def dtypes(s: Settings) -> dict:
    """Bytes per element: frozen weights, trainable weights, the residual stream, other activations."""
    act = 2 if s.bf16 else 4
    if s.engine.kind == "deepspeed":
        weights = 2 if s.bf16 else 4
        return {"frozen": weights, "trainable": weights, "residual": weights, "act": act}
    frozen = 2 if lora_base_in_bf16(s.lora_r, s.dtype, s.on_cuda) else 4
    return {"frozen": frozen, "trainable": 4, "residual": frozen, "act": act}


def lora_base_in_bf16(lora_r: int, dtype: str, on_cuda: bool) -> bool:
    """The single-device rule of lstune.train.prepare.adapt_model: on CUDA a LoRA run keeps its frozen base in
    bf16 (the adapters stay fp32), so the residual stream and the checkpoints are bf16 too."""
    return bool(on_cuda and lora_r and dtype != "fp32")


def breakdown(shape: ModelShape, params: ParamCounts, s: Settings) -> Breakdown:
    """Per-rank device and host bytes at the peak of one step (module doc). A search asks for the same settings
    many times (an estimate makes ~3,400 byte models, ~900 of them different): each is made once (`_breakdown`)
    and handed out as a copy, which the caller may change."""
    b = _breakdown(shape, params, s)
    return replace(b, items=[replace(i) for i in b.items], dtypes=dict(b.dtypes))


def forget_byte_models() -> None:
    """Drop the byte models made so far (`breakdown`'s cache and the placement's): each estimate starts afresh, so
    a constant changed between two (a test's monkeypatch, a recalibration) is never answered from before it."""
    _breakdown.cache_clear()
    placement_cache_clear()


@lru_cache(maxsize=8192)
def _breakdown(shape: ModelShape, params: ParamCounts, s: Settings) -> Breakdown:
    chunks = attn_chunk_count(s.attn_chunks, shape, ceil_div(s.seq_len, s.sp))
    s = replace(s, attn_chunk_count=chunks)
    b = Breakdown(dtypes=dtypes(s), attn_chunks=s.attn_chunk_count)
    _static(b, shape, params, s)
    _activations(b, shape, params, s)
    b.add("CUDA context and allocator reserve" if s.on_cuda and s.cuda_context else "process", *_overheads(s))
    return b


def _overheads(s: Settings) -> tuple[int, int]:
    if not (s.on_cuda and s.cuda_context):
        return 0, HOST_PROCESS_BYTES
    return CUDA_CONTEXT_BYTES, HOST_PROCESS_BYTES


def reserve_bytes(device_bytes: int, on_cuda: bool) -> int:
    """What the allocator cannot hand out of a device's memory."""
    return int(device_bytes * ALLOCATOR_RESERVE) if on_cuda else 0


def host_reserve_bytes(host_bytes: int) -> int:
    """What a run cannot have of a host's RAM (HOST_RESERVE_BYTES + HOST_RESERVE_FRACTION, at most half of it)."""
    return min(HOST_RESERVE_BYTES + int(host_bytes * HOST_RESERVE_FRACTION), host_bytes // 2)


def _static(b: Breakdown, shape: ModelShape, p: ParamCounts, s: Settings) -> None:
    """The engine's training state per rank; under --metp-mlp the engine holds everything but the MLP weights, and
    METP's shards are counted on their own (`_metp_static`)."""
    if not _metp(shape, s):
        _engine_static(b, p, s)
        return
    _engine_static(b, without_metp_mlp(p, shape, trainable=not s.lora_r), s)
    _metp_static(b, shape, s)


def _metp(shape: ModelShape, s: Settings) -> bool:
    """METP's MLP runs (lstune.memory.metp_mlp: a dense gated MLP under SP; other MLPs are refused by the run)."""
    from lstune.estimate.sequence_parallel import metp_applies

    return s.metp_mlp and s.sp > 1 and metp_applies(shape)


def without_metp_mlp(p: ParamCounts, shape: ModelShape, *, trainable: bool) -> ParamCounts:
    """The parameters the engine sees under METP: the model less every layer's MLP weights, which METP keeps as
    shards the model does not register (lstune.memory.metp_mlp) — out of ZeRO's shares and ZeRO-3's gathered layer.
    `trainable`: the MLP trains (a full fine-tune; LoRA leaves it frozen: METP refuses adapters on it)."""
    one = shape.hidden * shape.intermediate
    per_layer = shape.mlp_matrices * one
    mlp = per_layer * shape.layers
    tensors = list(p.trainable_tensors)
    if trainable:  # the MLP's tensors out of DeepSpeed's sub-groups (`ds_sub_groups`), as many as it has
        for _ in range(shape.mlp_matrices * shape.layers):
            if one in tensors:
                tensors.remove(one)
    return replace(p, total=p.total - mlp, trainable=p.trainable - (mlp if trainable else 0),
                   largest_layer=max(0, p.largest_layer - per_layer), trainable_tensors=tuple(tensors))


def _metp_static(b: Breakdown, shape: ModelShape, s: Settings) -> None:
    """METP's shards on every rank (lstune.estimate.sequence_parallel.metp_state_bytes): 1/SP of each layer's MLP,
    trained beside the engine (lstune.parallel.local_params) — fp32 masters, fp32 gradients and their own AdamW —
    on the device whatever the engine offloads; frozen under LoRA, in the base weights' dtype."""
    from lstune.estimate.sequence_parallel import metp_shard_elements, metp_state_bytes

    trainable = not s.lora_r
    frozen = b.dtypes["trainable" if s.engine.kind == "deepspeed" else "frozen"]
    weights, grads, adam = (shape.layers * n for n in metp_state_bytes(shape, s.sp, trainable=trainable,
                                                                       frozen_bytes=frozen))
    elements = shape.layers * metp_shard_elements(shape, s.sp)
    kind = "fp32 masters" if trainable else f"frozen, {_dt(frozen)}"
    b.add("parameters: METP's MLP shards", weights,
          detail=f"{elements:,} × {kind}: 1/{s.sp} of every layer's MLP, beside the engine (not ZeRO-partitioned)")
    if trainable:
        b.add("gradients: METP's MLP shards", grads, detail="fp32, reduced over data parallelism only, on the device")
        b.add("optimizer state: METP's MLP shards", adam, detail="their own AdamW: m, v in fp32, on the device")


def _engine_static(b: Breakdown, p: ParamCounts, s: Settings) -> None:
    d, e, world = b.dtypes, s.engine, s.world
    if e.kind == "torch":
        _frozen(b, p, s, d["frozen"])
        b.add("trainable parameters", p.trainable * d["trainable"], detail=f"{p.trainable:,} × fp32")
        if not _gradients_build_up(s):
            b.add("gradients", p.trainable * 4, detail=f"{p.trainable:,} × fp32, kept between micro-batches")
        b.add("optimizer state", p.trainable * ADAM_BYTES, detail="Adam m, v: 2 × fp32")
        return
    wb = d["trainable"]
    weights = p.total * wb
    shard = 3 if e.zero_stage == 3 else 0
    pinned = s.on_cuda  # lstune.parallel.engine_ds pins DeepSpeed's host buffers on CUDA only
    if shard:
        gathered = 2 * p.largest_layer * wb  # the layer running and the one prefetched
        on_host = e.offload_params
        # The trainable shards in one flat buffer (pinned: rounded up); the frozen ones stay per tensor (not rounded
        # here: their sizes are not known to the estimate).
        host = _pinned(p.trainable * wb // world, pinned) + p.frozen * wb // world if on_host else 0
        b.add("parameters (ZeRO-3 shard)", (0 if on_host else weights // world) + gathered, host,
              f"{p.total:,} × {_dt(wb)} / {world} ranks + 2 gathered layers"
              + ("; on the host in a pinned flat buffer (a power of two)" if on_host and pinned else ""))
    else:
        b.add("parameters", weights, detail=f"{p.total:,} × {_dt(wb)} (frozen {p.frozen:,}, trainable {p.trainable:,})")
    grads = p.trainable * DS_GRAD_BYTES // (world if e.zero_stage >= 2 else 1)
    optim = p.trainable * DS_OPTIM_BYTES // world
    where = "host" if e.offload_optimizer else "device"
    if e.offload_optimizer and shard and e.offload_ratio < 1:
        _partial_offload(b, p, world, e.offload_ratio, pinned)
        return
    if e.offload_optimizer and shard:
        b.add("gradients", 0, zero3_host_gradient_bytes(p, world, pinned),
              "fp32, sharded, on the host twice: the flat buffer and one per optimizer sub-group"
              + (" (pinned: each a power of two)" if pinned else ""))
    else:
        b.add("gradients", 0 if e.offload_optimizer else grads, grads if e.offload_optimizer else 0,
              f"fp32, {'sharded' if e.zero_stage >= 2 else 'replicated'}, on the {where}")
    b.add("optimizer state", 0 if e.offload_optimizer else optim, optim if e.offload_optimizer else 0,
          f"fp32 master + m + v / {world} ranks, on the {where}")


def _partial_offload(b: Breakdown, p: ParamCounts, world: int, ratio: float, pinned: bool) -> None:
    """ZeRO-3 with part of the optimizer on the device (--offload-ratio, deepspeed 0.19 stage3.py): one rank's
    parameters in optimizer sub-groups of about 1/PARTIAL_SUB_GROUPS of them each (lstune.parallel.engine_ds sets the
    size; `ds_sub_groups` cuts them as DeepSpeed does), the first int((1 - ratio) · n) on the device — their fp32
    master, m, v and gradient, and the temporaries of the torch AdamW that steps them one at a time (two fp32 copies
    of the largest) — the rest on the host with CPU Adam. The flat gradient buffer stays on the host whole; each
    device sub-group's gradient passes through a pinned host buffer first, which torch keeps cached unless a host
    sub-group's buffer of its power of two reuses it (`_cached_device_group_buffers`).

    Counted as equal sub-groups until the H200 of 2026-11-26 ran Llama-3.1-8B with --offload-ratio 0.5: host RSS
    122.1 GiB against 111.9 predicted. DeepSpeed made 27 sub-groups, not 32 (the 525M-element embedding is one of
    its own, the last holds the 525M head), 14 of them on the host (52.7 % of the parameters), and most of them
    run past 2^30 B of fp32 gradient, so each pinned buffer was 2 GiB, not 1: this model says 123.3 GiB for that cut.
    lstune sizes the sub-groups to stay within their power of two since (`partial_sub_group_size`)."""
    from lstune.parallel.engine_ds import PARTIAL_SUB_GROUPS

    numel = p.trainable // world
    groups = _partial_sub_groups(p, world)
    on_device = min(len(groups), int((1 - ratio) * len(groups)))
    device, host = groups[:on_device], groups[on_device:]
    host_grads = _pinned(DS_GRAD_BYTES * numel, pinned) + sum(_pinned(DS_GRAD_BYTES * n, pinned) for n in host)
    host_grads += _cached_device_group_buffers(device, host, pinned)
    b.add("gradients", DS_GRAD_BYTES * sum(device), host_grads,
          f"fp32, sharded: {on_device} of {len(groups)} sub-groups on the device; on the host the flat buffer and one "
          "per host sub-group" + (" (pinned: each a power of two)" if pinned else ""))
    b.add("optimizer state", DS_OPTIM_BYTES * sum(device) + (2 * 4 * max(device) if device else 0),
          DS_OPTIM_BYTES * sum(host),
          f"fp32 master + m + v: {on_device} of {len(groups)} sub-groups on the device (+ AdamW's step temporaries), "
          f"the rest on the host (--offload-ratio {ratio:g}; sub-groups of ~1/{PARTIAL_SUB_GROUPS} of the parameters)")


def _cached_device_group_buffers(device: list[int], host: list[int], pinned: bool) -> int:
    """Pinned host bytes left cached by the device sub-groups' gradient buffers (stage3.py makes each on the host,
    pinned, then moves it to the device): torch's caching host allocator keeps one freed block per power of two, and
    the host sub-groups, allocated after every device one, take back those of their sizes."""
    if not pinned:
        return 0
    taken = {_pinned(DS_GRAD_BYTES * n, True) for n in host}
    return sum({_pinned(DS_GRAD_BYTES * n, True) for n in device} - taken)


def _partial_sub_groups(p: ParamCounts, world: int) -> tuple[int, ...]:
    """`ds_sub_groups` at lstune's partial-offload sub-group size."""
    from lstune.parallel.engine_ds import partial_sub_group_size

    return _sub_groups(p, world, partial_sub_group_size(_shards(p, world)))


@lru_cache(maxsize=64)
def _sub_groups(p: ParamCounts, world: int, size: int) -> tuple[int, ...]:
    """`ds_sub_groups`, once per counts, world and size: the length searches ask for them thousands of times."""
    return tuple(ds_sub_groups(p, world, size))


@lru_cache(maxsize=64)
def _shards(p: ParamCounts, world: int) -> tuple[int, ...]:
    """One rank's trainable shards, or without the tensors' sizes the whole as one (made once per counts and world:
    the length searches ask for them thousands of times)."""
    return tuple(ceil_div(n, world) for n in p.trainable_tensors) or (p.trainable // world,)


def ds_sub_groups(p: ParamCounts, world: int, size: int) -> list[int]:
    """One rank's optimizer sub-groups, in elements, as DeepSpeed 0.19 cuts them (stage3.py,
    `_create_fp16_sub_groups`): the trainable tensors' shards (each ceil(n / world) elements) in order, a sub-group
    ending at the tensor that brings it to `size` or more. Without the tensors' sizes (ParamCounts from elsewhere
    than `count_parameters`), equal sub-groups of `size`."""
    if not p.trainable_tensors:
        full, rest = divmod(p.trainable // world, size)
        return [size] * full + ([rest] if rest else [])
    groups, current = [], 0
    for n in _shards(p, world):
        current += n
        if current >= size:
            groups.append(current)
            current = 0
    return groups + ([current] if current else [])


def zero3_host_gradient_bytes(p: ParamCounts, world: int, pinned: bool) -> int:
    """ZeRO-3's fp32 gradients of one rank's shard under optimizer offload (DeepSpeed 0.19, stage3.py): the flat
    buffer the partitions accumulate into, and one buffer per optimizer sub-group (`ds_sub_groups` of
    sub_group_size elements) that CPU Adam reads — 8 B per parameter, each buffer rounded up to a power of two when
    pinned."""
    groups = ds_sub_groups(p, world, DS_SUB_GROUP_ELEMENTS)
    return _pinned(DS_GRAD_BYTES * (p.trainable // world), pinned) + sum(
        _pinned(DS_GRAD_BYTES * n, pinned) for n in groups)


def _pinned(nbytes: int, pinned: bool) -> int:
    """One allocation's host bytes, rounded up to a power of two when pinned (lstune.memory.host_copies)."""
    return pinned_bytes(nbytes, pinned)


def _frozen(b: Breakdown, p: ParamCounts, s: Settings, nbytes: int) -> None:
    """The frozen base: in `nbytes` per parameter, or with --load-in-4bit its linear weights in NF4 (about 0.52
    B each) and the embeddings in bf16; the few norm weights are counted as quantized (under 0.01% of a model)."""
    if not s.load_in_4bit:
        b.add("frozen parameters", p.frozen * nbytes, detail=f"{p.frozen:,} × {_dt(nbytes)}")
        return
    quantized = max(p.frozen - p.embeddings, 0)
    b.add("frozen parameters", frozen_weight_bytes(quantized, True) + (p.frozen - quantized) * 2,
          detail=f"{quantized:,} × NF4 (double-quantized) + {p.frozen - quantized:,} embedding × bf16")


def _dt(nbytes: int) -> str:
    return {2: "bf16", 4: "fp32"}[nbytes]


def _activations(b: Breakdown, shape: ModelShape, p: ParamCounts, s: Settings) -> None:
    d, t, h = b.dtypes, s.local_tokens, shape.hidden
    act, res = d["act"], d["residual"]
    ckpt = t * h * res
    b.checkpoint_bytes_per_token_layer = h * res
    b.add("inputs, positions, labels, rotary tables", t * (3 * 8 + 2 * shape.head_dim * act))
    head_grad, layer_grad, all_grad = _gradient_split(shape, p, s)
    layer = _layer_parts(shape, p, s, act, res)
    if not s.checkpointing:
        saved = t * _saved_per_token(shape, p, s, act) + (_autocast_layer_copies(p, t * h, act) if res > act else 0)

        # With frozen embeddings (LoRA) nothing before the first layer's input norm needs a gradient: it saves nothing.
        first = t * 4 * h if s.lora_r else 0

        def kept(n: int) -> tuple[str, int]:
            return (f"saved activations (no checkpointing): {n} layers × {saved / t:,.0f} B/token",
                    n * saved - (first if n == shape.layers else 0))

        phases = [Phase("loss head", [kept(shape.layers), *_loss_parts(shape, s, act, res)], head_grad),
                  Phase("layer backward", [kept(shape.layers - 1), *layer], head_grad + layer_grad),
                  *_embedding_backward(shape, s, res, all_grad, []),
                  Phase("optimizer step", [], all_grad)]
        _add_peak_phase(b, s, phases, all_grad)
        return
    # Issue 14 (MEMO placement): host / device / recomputed checkpoints from lstune.estimate.placement.
    placed = checkpoint_terms(shape, s, ckpt, res)
    b.placement = placed.placement
    where = (f"{shape.layers} layers × {h * res:,} B/token ({_dt(res)}); {placed.offloaded} on the host"
             + (f"; {placed.placement.describe()}" if placed.placement else ""))

    def checkpoints(n: float) -> tuple[str, int]:
        # A split layer's device part or a segment's held input makes `n` fractional: say so, two decimals.
        held = f"{n:g}" if n == int(n) else f"{n:.2f} checkpoints' worth"
        return (f"activation checkpoints: {held} on the device; {where}", round(n * ckpt))

    kept = _saved_attention(b, shape, s, placed.placement, act, res)
    phases = [
        Phase("loss head", [checkpoints(placed.kept_fwd), *_loss_parts(shape, s, act, res), kept("fwd")], head_grad),
        Phase("layer backward", [checkpoints(placed.kept_bwd), *layer, kept("bwd")], head_grad + layer_grad),
        # The first layer's backward: one checkpoint left, every layer's gradients (they matter in a full fine-tune).
        Phase("first layer's backward", [checkpoints(1), *layer, kept("first")],
              head_grad + shape.layers * layer_grad),
        *_embedding_backward(shape, s, res, all_grad, [checkpoints(0)]),  # every layer's kept output freed by then
        Phase("optimizer step", [checkpoints(0)], all_grad),
    ]
    _add_peak_phase(b, s, phases, all_grad, placed.host)
    if chunk_host_bytes(shape, s):
        c = _sample_chunk(s)
        detail = f"{s.attn_chunk_count} chunks of {c:,} tokens" + (
            "; pinned in power-of-two pieces (only a last piece under 1 MiB rounded up)" if s.on_cuda else "")
        b.add("attention chunks on the host (FPDT, the live layer's)", 0, chunk_host_bytes(shape, s), detail)
    b.add("LoRA intermediates", t * act * s.lora_r * 2 * (p.adapted_linears // max(shape.layers, 1)) if s.lora_r else 0)


def _saved_attention(b: Breakdown, shape: ModelShape, s: Settings, placement, act: int, res: int):
    """--recompute-attention off (lstune.memory.attention_saved): per layer whose checkpoint is stored, attention's
    output in the activation dtype and its fp32 lse (chunked attention: its chunk store — k, v, output, lse — and the
    token ids), kept from its forward to its backward beside the checkpoint (softmax-attention layers only; none with
    sinks, which are recomputed): on the host where the checkpoint has a host part (chunked: where the chunks go),
    else on the device. Adds the host bytes to `b`; returns the device part
    at a phase ("fwd": every device layer's; "bwd": also the last layer's fetched back; "first": layer 0's alone)."""
    if not s.save_attention or shape.sinks:  # sinks (gpt-oss): lstune.memory.attention_saved recomputes those layers
        return lambda phase: ("saved attention (none: recomputed)", 0)
    t = s.local_tokens
    if s.attn_chunk_count > 1:
        per_token_host = _chunks_saved_per_token(shape, act, res, s.ring) if s.offload_checkpoints else 0
        per_token_device = _chunk_ids_per_token(s) + (
            0 if s.offload_checkpoints else _chunks_saved_per_token(shape, act, res, s.ring))
    else:
        per_token_host = per_token_device = shape.q_width * act + 4 * shape.heads
    fractions = placement.host_fraction if placement is not None else (0.0,) * shape.layers
    # Only softmax attention keeps an output: a hybrid's linear / MLP-only layers have none to keep (issue 34b).
    mixers = shape.mixers or ("attention",) * shape.layers
    stored = [a for a, mixer in zip(fractions, mixers) if a is not None and mixer in ("attention", "hybrid")]
    host_layers = sum(1 for a in stored if a) if s.attn_chunk_count <= 1 else (len(stored) if per_token_host else 0)
    device_layers = len(stored) - host_layers if s.attn_chunk_count <= 1 else len(stored)
    b.attention_saved_layers = len(stored)
    b.attention_saved_bytes_per_token_layer = max(per_token_host, per_token_device)
    if host_layers and per_token_host:
        one = host_copy_bytes(t * per_token_host // act, act, pinned=s.on_cuda) if s.attn_chunk_count <= 1 else (
            t * per_token_host)
        b.add("saved attention on the host (output, lse)", 0, host_layers * one,
              f"{host_layers} layers × {per_token_host:,} B/token, beside their offloaded checkpoints")
    layer = t * per_token_device if device_layers else 0
    fetched = t * per_token_host if host_layers and s.attn_chunk_count <= 1 else 0
    counts = {"fwd": device_layers * layer, "bwd": device_layers * layer + fetched, "first": max(layer, fetched)}
    where = f"{device_layers} layers × {per_token_device:,} B/token on the device"

    def kept(phase: str) -> tuple[str, int]:
        return (f"saved attention (output, lse; --recompute-attention off): {where}", counts[phase])

    return kept


@dataclass
class Phase:
    """One moment of a step that may hold the peak: its activation parts and the gradients alive then."""

    name: str
    parts: list[tuple[str, int]]
    gradients: int

    @property
    def total(self) -> int:
        return _total(self.parts) + self.gradients


def _embedding_backward(shape: ModelShape, s: Settings, res: int, all_grad: int,
                        held: list[tuple[str, int]]) -> list[Phase]:
    """The input embedding's backward, after the first layer's, in a full fine-tune (a LoRA run's embedding is frozen:
    no backward reaches it): every gradient is alive, the embedding's own (vocab × hidden fp32) the last made, beside
    the gradient of the first layer's input it is made from. Above the optimizer step by that input gradient; the
    peak where the layers' working sets are smaller than the embedding's gradient (a short sequence, many layers:
    the trace peaks in aten.embedding_dense_backward). With static gradients (`_gradients_build_up`) they are counted
    with the engine's state, and this moment is the optimizer step's plus the input gradient."""
    if s.lora_r:
        return []
    return [Phase("input embedding's backward", [*held, ("the gradient of the first layer's input",
                                                          s.local_tokens * shape.hidden * res)], all_grad)]


def _add_peak_phase(b: Breakdown, s: Settings, phases: list[Phase], all_grad: int, host: int = 0) -> None:
    """The phase with the most bytes is the peak: its parts (and, when gradients build up during backward, the
    gradients alive at that moment) go into the breakdown."""
    peak = max(phases, key=lambda phase: phase.total)
    b.phase = peak.name
    b.checkpoint_share = peak.total - max(phase.total - _checkpoint_part(phase) for phase in phases)
    if _gradients_build_up(s):
        b.add("gradients", peak.gradients, detail=f"fp32, those alive at the peak ({peak.name}) of {all_grad:,} B "
                                                  "after backward (set to None after each step)")
    for name, nbytes in peak.parts:
        if name.startswith("activation checkpoints: "):
            b.add("activation checkpoints", nbytes, host, name.removeprefix("activation checkpoints: "))
        else:
            b.add(name, nbytes)


def _checkpoint_part(phase: Phase) -> int:
    return sum(nbytes for name, nbytes in phase.parts if name.startswith("activation checkpoints: "))


def _gradients_build_up(s: Settings) -> bool:
    """The single-device engine frees gradients after each step (`zero_grad(set_to_none=True)`): with one
    micro-batch per step they exist only for the layers backward has reached. DeepSpeed keeps its gradient buffers
    and gradient accumulation keeps them between micro-batches: all of them, all the time."""
    return s.engine.kind == "torch" and s.grad_accum == 1


def _gradient_split(shape: ModelShape, p: ParamCounts, s: Settings) -> tuple[int, int, int]:
    """fp32 gradient bytes of the single-device engine: (the output head's, one decoder layer's, all). A full
    fine-tune trains the head (with tied embeddings the shared weight, whose gradient the head starts) and the
    input embedding (its gradient comes last); LoRA's adapters sit in the layers. (0, 0, 0) when the gradients
    are static (counted with the engine's state)."""
    if not _gradients_build_up(s):
        return 0, 0, 0
    total = p.trainable * 4
    head = 0 if s.lora_r else 4 * shape.vocab * shape.hidden
    embedding = head if head and not shape.tied else 0
    return head, max(0, total - head - embedding) // max(shape.layers, 1), total


def pinned_copy_bytes(nbytes: int, element_size: int) -> int:
    """Host bytes one offloaded checkpoint of `nbytes` takes: the offloader's pinned blocks (memory.host_copies), each
    rounded to a power of two by torch's caching host allocator — under one block over `nbytes`."""
    return host_copy_bytes(nbytes // element_size, element_size, pinned=True)


def _norm_upcast(act: int) -> int:
    """HF's RMSNorm computes in fp32: in a 16-bit run it keeps an fp32 copy of its input for backward."""
    return 4 if act == 2 else 0


def _total(parts: list[tuple[str, int]]) -> int:
    return sum(nbytes for _, nbytes in parts)


def _layer_parts(shape: ModelShape, p: ParamCounts, s: Settings, act: int, res: int) -> list[tuple[str, int]]:
    """One checkpointed layer's recompute + backward, by part (module doc): what the recomputed attention block
    saves, then the largest of the three moments of the layer's backward (each holds the residual stream's
    gradient, `res · h` per token):

    - the MLP's: its norm's fp32 input and output (unless mini-sequence fused the norm into the tiles) and the
      MLP's working set (untiled: saved gate, activation and up outputs and the input gradients of the down
      projection; tiled: one tile's);
    - the MLP norm's: HF's RMSNorm backward in fp32 holds its input as fp32 and five fp32 temporaries (pow, mean
      and mul backward): 24 B per hidden value (none when fused: it runs inside the tiles);
    - attention's: the gradients of q, k, v, the output and the input norm's output.
    """
    h, t, q, kv = shape.hidden, s.local_tokens, shape.q_width, shape.kv_width
    upcast = _norm_upcast(act) * h
    fused = s.mini_sequence and s.fuse_norms and s.tiled_mlp != "off"
    further = _further_norm_width(shape, p, fused)
    grad = res * h
    if _metp(shape, s):
        mlp_name, mlp_work = _metp_moment(shape, s, act)
    elif s.tiled_mlp == "off":
        mlp_name, mlp_work = "the MLP (untiled)", t * _mlp_per_token(shape, act, lora=_lora_on_tokens(s, p))
    else:
        mlp_name, mlp_work = "one MLP tile", _mlp_tile(shape, s, act, p)
    if shape.attention_free:  # a pure state-space model's mixer in place of attention (ModelShape.mixer_saved)
        saved = ("layer backward: the state-space mixer's block saved (input norm, projections, gate, scan output)",
                 t * (upcast + act * (h + shape.mixer_saved)))
        attention = ("the state-space mixer's (its projections' gradients, input norm)",
                     t * act * (3 * h + shape.mixer_saved))
    elif s.attn_chunk_count > 1:
        saved, attention = _chunked_attention(shape, p, s, act, res)
    else:
        saved = ("layer backward: attention block saved (input norm, rotated q and k, v, output)",
                 t * (upcast + act * (h + 3 * q + 2 * kv)))
        attention = ("attention's (gradients of q, k, v, output, input norm)", t * act * (3 * h + 3 * q + 2 * kv))
        if s.ring > 1:
            from lstune.estimate.sequence_parallel import ring_buffer_bytes

            ring = ring_buffer_bytes(shape, seq_len=s.seq_len, micro_batch=s.micro_batch, sp=s.sp, ring=s.ring,
                                     act_bytes=act)
            attention = (f"attention's (gradients of q, k, v, output, input norm; ring of {s.ring}: two K/V blocks, "
                         "fp32 dK/dV, dQ)", attention[1] + ring)
    casts, mlp_casts = _autocast_casts(shape, p, s, act, res)
    replay = _lora_dropout_replay(shape, s, act)
    moments = [
        (f"the MLP's: {mlp_name}" + (", its norms fused" if fused else ", its norm's input and output"),
         t * ((0 if fused else upcast + act * h) + grad) + mlp_work + mlp_casts + replay),
        ("the MLP norm's (fp32 temporaries)", 0 if fused else t * (24 * h + grad)),
        (attention[0], attention[1] + replay),
        *_delta_rule_moment(shape, s, act, res),
        *_kda_moment(shape, s, res),
    ]
    name, working = max(moments, key=lambda moment: moment[1])
    parts = [
        saved,
        (f"layer backward: peak moment, {name}", working),
        ("layer backward: further norms (fp32 inputs)", t * 4 * further),
    ]
    if res > act:
        parts.append(("layer backward: autocast's 16-bit copies of the fp32 weights and inputs", casts))
    if s.lora_r and p.lora_wrapped:
        parts.append(("layer backward: LoRA's merged expert weights and their gradient", _merged_experts(shape, p, act)))
    # Under head-parallel SP a rank runs S tokens of 1/sp of the heads: the same bytes as its t tokens of all.
    if shape.linear_layers and shape.state_elements:
        parts.append(_state_row(shape, t, act))
    if shape.linear_layers and shape.lightning_block:
        parts.append((f"layer backward: lightning attention's intra-block scores ({shape.lightning_block}-token "
                      "blocks)", shape.lightning_scores_bytes(t, act)))
    if shape.linear_layers and shape.conv_channels:
        parts.append(("layer backward: a linear mixer's short convolution (its input and output, "
                      f"{shape.conv_channels:,} channels)", shape.linear_conv_bytes(t, act)))
    return (parts + _delta_rule_parts(shape, s, act) + _kda_parts(shape, s) + _mamba1_scan_parts(shape, s)
            + _mamba2_scan_parts(shape, s))


def _mamba2_scan_parts(shape: ModelShape, s: Settings) -> list[tuple[str, int]]:
    """An attention-free Mamba-2 on the torch chunked scan (no mamba-ssm, or a CPU run): its per-chunk matrices
    (ModelShape.mamba2_chunk_bytes); with mamba-ssm's kernel (`Settings.mamba_kernels`) none, predicted."""
    if not shape.mamba2_chunk or s.mamba_kernels:
        return []
    return [("layer backward: Mamba-2's torch chunked scan (no mamba-ssm): its per-chunk matrices (fp32)",
             shape.mamba2_chunk_bytes(s.local_tokens, dtypes(s)["act"]))]


def _mamba1_scan_parts(shape: ModelShape, s: Settings) -> list[tuple[str, int]]:
    """Mamba-1 (Jamba) on transformers' torch selective scan (no mamba-ssm where the run happens, or a CPU run): it
    keeps the fp32 state after every token, not one per chunk, and the discretised A and B·u over the whole sequence
    (ModelShape.mamba1_scan_bytes), beyond the chunk-edge states of the state row. mamba-ssm's kernel
    (`Settings.mamba_kernels`) recomputes them in backward: the state row alone, predicted."""
    if not shape.mamba1_scan_elements or s.mamba_kernels:
        return []
    t = s.local_tokens
    return [("layer backward: Mamba-1's torch scan (no mamba-ssm): its state at every token, the discretised A and "
             "B·u (fp32)", shape.mamba1_scan_bytes(t, dtypes(s)["act"]) - shape.linear_state_bytes(t))]


def _state_row(shape: ModelShape, t: int, act: int) -> tuple[str, int]:
    """A linear layer's saved recurrent states (ModelShape.saved_state_bytes): fp32, one per 64-token chunk; lightning
    attention's once per block, in the activation dtype."""
    if shape.lightning_block:
        return (f"layer backward: lightning attention's K·V states (one per {shape.lightning_block}-token block)",
                shape.saved_state_bytes(t, act))
    return ("layer backward: a linear-attention / state-space mixer's recurrent states (fp32, one per 64-token chunk)",
            shape.saved_state_bytes(t, act))


def _delta_rule_parts(shape: ModelShape, s: Settings, act: int) -> list[tuple[str, int]]:
    """Gated DeltaNet on transformers' torch kernel (no flash-linear-attention where the run happens, or a CPU run):
    what the kernel saves beyond the chunk-edge states, its intra-chunk matrices foremost (ModelShape.
    delta_rule_saved_bytes) — alive through the layer's whole backward once its recompute has run. With
    flash-linear-attention's kernel (`Settings.fla_kernels`) the model is the state and conv rows alone: its backward
    recomputes the intra-chunk matrices per chunk from the saved q, k, v and chunk states (predicted from the
    tensors that kernel saves, not traced: the trace runs on CPU, where only the torch kernel runs)."""
    if not shape.delta_heads or s.fla_kernels:
        return []
    return [("layer backward: Gated DeltaNet's torch kernel (no flash-linear-attention): its intra-chunk matrices and "
             "per-chunk tensors (fp32)", shape.delta_rule_saved_bytes(s.local_tokens, act))]


def _delta_rule_moment(shape: ModelShape, s: Settings, act: int, res: int) -> list[tuple[str, int]]:
    """The torch Gated DeltaNet kernel's backward, a moment of its layer's backward beside the MLP's and attention's:
    the kernel's gradients at their peak (ModelShape.delta_rule_backward_bytes) and the residual stream's gradient."""
    if not shape.delta_heads or s.fla_kernels:
        return []
    t = s.local_tokens
    return [("Gated DeltaNet's torch kernel's (its fp32 gradients)",
             shape.delta_rule_backward_bytes(t, act) + t * res * shape.hidden)]


def _kda_parts(shape: ModelShape, s: Settings) -> list[tuple[str, int]]:
    """KDA (Kimi-Linear) on transformers' torch kernel (no flash-linear-attention where the run happens, or a CPU
    run): what the kernel saves beyond the chunk-edge states (ModelShape.kda_saved_bytes), alive through the layer's
    backward once its recompute has run — far above the states: its decays are per key channel. With
    flash-linear-attention's kernel (`Settings.fla_kernels`) the state and conv rows alone, as for Gated DeltaNet."""
    if not shape.kda_heads or s.fla_kernels:
        return []
    return [("layer backward: KDA's torch kernel (no flash-linear-attention): its per-channel intra-chunk decays "
             "and products (fp32)", shape.kda_saved_bytes(s.local_tokens))]


def _kda_moment(shape: ModelShape, s: Settings, res: int) -> list[tuple[str, int]]:
    """The torch KDA kernel's backward, a moment of its layer's backward: its gradients at their peak
    (ModelShape.kda_backward_bytes) and the residual stream's gradient."""
    if not shape.kda_heads or s.fla_kernels:
        return []
    t = s.local_tokens
    return [("KDA's torch kernel's (its fp32 gradients)", shape.kda_backward_bytes(t) + t * res * shape.hidden)]


def _further_norm_width(shape: ModelShape, p: ParamCounts, fused: bool) -> int:
    """Per token, the input width of a layer's norms beyond the two counted in its moments (the input and the
    post-attention norm, both hidden-wide): a sandwich model's third and fourth (Gemma's; mini-sequence fuses the
    pre-MLP one into its tiles), a per-head q_norm over the query width and k_norm over the key width only (Qwen3:
    not the hidden width, ParamCounts.norm_widths)."""
    widths = list(p.layer_norm_widths(shape.hidden))
    hidden_wide = 2 + (1 if fused and widths.count(shape.hidden) >= 4 else 0)
    for _ in range(min(hidden_wide, widths.count(shape.hidden))):
        widths.remove(shape.hidden)
    return sum(widths)


def _lora_dropout_replay(shape: ModelShape, s: Settings, act: int) -> int:
    """LoRA dropout saves nothing from forward to backward (lstune.memory.lora_inputs recomputes each adapter's
    cast + dropout + lora_A from the input the base layer saves), so it adds no saved bytes to any moment. What it
    adds is the replay in backward, one adapter at a time, at the start of the MLP's and attention's backward: the
    dropout mask (4 B: the fake-tensor trace runs CPU dropout, an fp32 mask; CUDA's fused kernel keeps a 1 B bool,
    so this over-counts by 3 B there), lora_A's input in `act` and the fp32 gradient of the dropout output, per
    value of the widest adapted input (the hidden size over the sequence, or the MLP width over one MLP tile)."""
    if not (s.lora_r and s.lora_dropout):
        return 0
    t = s.local_tokens
    mlp = 0 if _metp(shape, s) else _mlp_tile_tokens(shape, s) * shape.intermediate  # METP: no adapters on the MLP
    return (4 + act + 4) * max(t * max(shape.hidden, shape.q_width), mlp)


def _chunks_saved_per_token(shape: ModelShape, act: int, res: int, ring: int = 1) -> int:
    """What FPDT saves per token of a layer (lstune.memory.attention_chunks): k, v and the attention output, and the
    output's log-sum-exp in fp32 (one per head). k and the output are in the rotated q/k's dtype (`_rotated`), v in
    the activation dtype (a fused qkv projection's v is saved as its own copy, not as a view of the whole output).
    Under a ring of R each chunk's k and v are the whole chunk's, gathered over the ring: R times a rank's tokens."""
    return sum(_chunk_items(shape, act, res, ring)[0])


def _chunk_ids_per_token(s: Settings) -> int:
    """The token ids FPDT keeps per token (int64 global index and document key, on the device); under a ring of R
    the keys' for the gathered chunk (R times a rank's tokens) beside the queries' own."""
    return 16 * (s.ring + 1) if s.ring > 1 else 16


def _chunks_backward_per_token(shape: ModelShape, act: int, res: int) -> int:
    """What FPDT's backward adds per token of the live layer: q and the output gradient dO (the rotated dtype),
    rowsum(dO ∘ o) and the dq accumulators (fp32): all of them after the first key chunk's iteration."""
    return sum(_chunk_items(shape, act, res)[1])


def _chunk_items(shape: ModelShape, act: int, res: int, ring: int = 1) -> tuple[list[int], list[int]]:
    """Bytes per token of each tensor the chunk store keeps per chunk: (saved in forward: k, v, output, lse;
    stored in backward: q, dO, rowsums, dq) — `_chunks_saved_per_token` and `_chunks_backward_per_token`. Under a
    ring of R, k and v per token of the rank: the gathered chunk's, R times its own."""
    rotated = _rotated(act, res)
    saved = [rotated * shape.kv_width * ring, act * shape.kv_width * ring, rotated * shape.q_width, 4 * shape.heads]
    return saved, [rotated * shape.q_width, rotated * shape.q_width, 4 * shape.heads, 4 * shape.q_width]


def _rotated(act: int, res: int) -> int:
    """Bytes of rotated q and k: fp32 weights under 16-bit autocast (a single-device full fine-tune) keep fp32 rotary
    tables, which promote the 16-bit projections' outputs; the chunks' outputs follow q's dtype."""
    return max(act, res)


def _chunk_tokens(s: Settings) -> int:
    return s.micro_batch * _sample_chunk(s)


def _sample_chunk(s: Settings) -> int:
    return ceil_div(ceil_div(s.seq_len, s.sp), s.attn_chunk_count)


def chunk_host_bytes(shape: ModelShape, s: Settings) -> int:
    """Host bytes of the offloaded chunks at the peak (the live layer's attention backward): what its forward saved
    and what its backward stores (`_chunk_items`, one copy of each per chunk), plus one chunk's fp32 dk and dv. On
    CUDA each copy is pinned in blocks (`host_copy_bytes`), only the last of each rounded up to a power of two by
    torch's caching host allocator. (Rounded whole, as the store once allocated them, copies of 96K-token chunks took
    a third more — the first emulated try at 768K was killed by the OOM killer, 2026-11-26 — and 16,400-token keys
    twice their size.)"""
    if s.attn_chunk_count <= 1 or not s.offload_checkpoints:
        return 0
    act, res = dtypes(s)["act"], dtypes(s)["residual"]
    saved, stored = _chunk_items(shape, act, res, s.ring)
    chunks, c = s.attn_chunk_count, _chunk_tokens(s)
    copies = sum(host_copy_bytes(c * item, 1, pinned=s.on_cuda) for item in saved + stored)
    return chunks * copies + c * 8 * shape.kv_width * s.ring


def _score_tiles(shape: ModelShape, s: Settings) -> int:
    """The PyTorch block kernel's score tiles at their peak (attention_blocks._torch_backward): query rows are cut so
    one fp32 tile [batch, heads, rows, chunk] holds at most 2²⁶ elements (`_row_tiles`). Within a row tile the scores,
    probabilities, dP, dP − rowsum and dS are alive together: five tiles. With more than one row tile, the next
    tile's scores are made (the scaled logits, then the masked copy) while the last tile's four are still bound:
    six. Plus the bool mask of the block [batch, chunk, chunk]. Under Ulysses a block is every rank's chunk m (SP
    times the tokens) and the rank's heads / SP. Blocks inside one document take the flash kernel where its probe
    passes (attention_blocks.block_kind), which holds no score tiles: counted as the PyTorch kernel's, an upper
    bound (a block across packed documents runs that kernel; so does every block of the fake-tensor trace). Under
    Ulysses U × ring R a block's queries are the U ranks' chunk m (U times the tokens, the rank's heads / U) and its
    keys the whole gathered chunk (SP times): the diagonal block, their zigzag pieces against it, runs this kernel."""
    ulysses = s.sp // s.ring
    b, c, heads = s.micro_batch, _sample_chunk(s), max(1, shape.heads // ulysses)
    n_q, n_k = ulysses * c, s.sp * c
    rows = max(1, (1 << 26) // max(1, b * heads * n_k))
    row_tiles = ceil_div(n_q, rows)
    tile = b * heads * ceil_div(n_q, row_tiles) * n_k * 4
    return (6 if row_tiles > 1 else 5) * tile + b * n_q * n_k


def _chunked_attention(shape: ModelShape, p: ParamCounts, s: Settings, act: int,
                       res: int) -> tuple[tuple[str, int], tuple[str, int]]:
    """FPDT's attention block (lstune.memory.attention_chunks) in one layer's backward: (saved part, peak moment).

    Saved: the input norm's fp32 input and output (the Function's input; none when the norm runs inside the
    chunks, fused), the token ids (int64 index and document, on the device), and k, v, output and lse — on the host
    with offload. The moment (inside the block kernel of key chunk 0 and the last query chunk): the incoming
    gradient and the input's gradient (whole sequence), the backward's q, dO, rowsum and fp32 dq accumulators (on
    the host with offload), then one chunk's share:

    - fp32 dk and dv three times: the key chunk's accumulators, the running sums of the block being computed, and
      the last block's sums (still bound in `_kv_chunk_backward` until the next block returns);
    - with offload: the last block's fp32 dq sum (bound likewise; its host copy is made) and the dq of the row tiles
      done; on CUDA the fetched copies — k and v of the key chunk, q, dO, lse, rowsum and dq of the query chunk,
      and under the key chunk's last block those of the next key chunk's first block, prefetched across the
      projections' backward between them (the store's schedule, `attention_chunks._ChunkStore`; under the other
      blocks the next query chunk's alone) (`Settings.chunks_fetched`: the CPU trace reads them in place);
    - the larger of the score tiles (`_score_tiles`) and the chunk's projections re-run with their gradients."""
    h, t, q, kv, heads = shape.hidden, s.local_tokens, shape.q_width, shape.kv_width, shape.heads
    c, offload = _chunk_tokens(s), s.offload_checkpoints
    fused = s.fuse_norms
    # The input norm's output (the Function's input, in the residual's dtype), its fp32 copy of a 16-bit input, and
    # for a trainable weight the normalised input its gradient needs.
    norm = 0 if fused else t * (_norm_upcast(res) + res + (0 if s.lora_r else res)) * h
    chunks_saved = 0 if offload else t * _chunks_saved_per_token(shape, act, res, s.ring)
    where = "on the host" if offload else "on the device"
    saved = (f"layer backward: chunked attention saved ({s.attn_chunk_count} chunks; k, v, output, lse {where}"
             + (")" if fused else "; input norm's input and output)"),
             norm + t * _chunk_ids_per_token(s) + chunks_saved)
    # The incoming gradient (and its cast to the block output's 16-bit dtype under autocast), the input's gradient.
    whole = t * h * (2 * res + (act if res > act else 0))
    backward_store = 0 if offload else t * _chunks_backward_per_token(shape, act, res)
    dq_on_device = 2 * c * 4 * q if offload else 0  # the last block's dq sum, this block's row tiles of dq
    fetched = 0
    if offload and s.chunks_fetched:
        rotated = _rotated(act, res)
        query_chunk = rotated * 2 * q + 8 * heads + 4 * q  # q, dO, lse, rowsum, dq
        fetched = 2 * c * (rotated + act) * kv * s.ring + 2 * c * query_chunk
    projections = c * act * (3 * h + 3 * q + 2 * kv)
    # Under a ring the key chunk is gathered (R times the tokens): its fp32 dk/dv too; the reduce-scatter sending them
    # home (its shares and what arrives, 2 × one of them) stays below the three pairs counted here.
    one_chunk = c * 24 * kv * s.ring + dq_on_device + fetched + max(_score_tiles(shape, s), projections)
    return saved, (f"attention's, chunked ({c:,}-token chunks: score tiles, dq/dk/dv)",
                   whole + backward_store + one_chunk)


def _autocast_casts(shape: ModelShape, p: ParamCounts, s: Settings, act: int, res: int) -> tuple[int, int]:
    """Autocast's 16-bit copies in a layer's backward (fp32 weights under 16-bit autocast): (alive at every moment,
    alive at the MLP's only). Unchunked, the layer's weights and q/k/v's input casts throughout. Chunked, q, k and v
    cast one chunk's input at a time (none alive in the block kernel), and the MLP's weight copies are freed by its
    backward, before the MLP norm's and attention's moments: those hold the attention projections' copies only."""
    if res <= act:
        return 0, 0
    if s.attn_chunk_count <= 1:
        return _autocast_layer_copies(p, s.local_tokens * shape.hidden, act), 0
    attention = act * 2 * shape.hidden * (shape.q_width + shape.kv_width)  # q, k, v and o projections
    return attention, max(0, _autocast_layer_copies(p, 0, act) - attention)


def _autocast_layer_copies(p: ParamCounts, token_values: int, act: int) -> int:
    """fp32 weights under 16-bit autocast (a single-device full fine-tune): a layer's forward casts every linear's
    weight, and q, k and v each cast the (fp32) normalised input; the matmuls keep the copies for backward."""
    return p.largest_layer * act + 3 * token_values * act


def _merged_experts(shape: ModelShape, p: ParamCounts, act: int) -> int:
    """peft's ParamWrapper adds B·A to each adapted expert weight in every forward (the recompute's included): the
    merged weights take the weights' size, and backward computes a gradient for each merged weight — the down
    projection's while all are merged, then the gate/up projection's once the down projection's is freed."""
    total = p.lora_wrapped // max(shape.layers, 1)
    largest = min(p.lora_wrapped_largest, total)
    return act * max(total + (total - largest), 2 * largest)


def _mlp_per_token(shape: ModelShape, act: int, lora: bool = False) -> int:
    """Bytes per token of an MLP's backward at its peak (the down projection's): a gated MLP's saved gate,
    activation and up outputs with the product, the product's gradient, and with LoRA the second part of that
    gradient before the two are summed; an ungated MLP's up and activation outputs and their gradients. MoE adds
    the routed copies of the tokens and the fp32 router logits."""
    width = shape.active_intermediate
    per = act * ((5 if shape.gated else 4) + (1 if lora else 0)) * width
    if shape.experts:
        per += act * shape.hidden * shape.top_k + 4 * shape.experts  # routed copies, fp32 router logits
    return int(per)


def _lora_on_tokens(s: Settings, p: ParamCounts) -> bool:
    """LoRA adds its own path through the MLP's linears (not so for expert weights: peft merges B·A into them)."""
    return bool(s.lora_r) and not p.lora_wrapped


def _metp_moment(shape: ModelShape, s: Settings, act: int) -> tuple[str, int]:
    """METP's MLP in a layer's backward (lstune.estimate.sequence_parallel.metp_moment_bytes), its parts named."""
    from lstune.estimate.sequence_parallel import metp_moment_bytes

    parts = metp_moment_bytes(shape, tokens=s.local_tokens, sp=s.sp, act_bytes=act)
    width = shape.intermediate // s.sp
    name = (f"METP's MLP at a rotation step ({s.local_tokens:,} × {width:,} intermediates "
            f"{size_text(parts['intermediates'])}; output, input gradient {size_text(parts['tokens'])}; "
            f"shards and gradient sums in flight {size_text(parts['rotating'])})")
    return name, sum(parts.values())


def mlp_tile_working_bytes(shape: ModelShape, *, tokens: int, act_bytes: int, lora: bool = False) -> int:
    """One MLP tile's working set over `tokens` tokens (`lora`: adapters on its projections)."""
    return tokens * (_mlp_per_token(shape, act_bytes, lora=lora) + 2 * act_bytes * shape.hidden)


def _mlp_tile(shape: ModelShape, s: Settings, act: int, p: ParamCounts) -> int:
    """One MLP tile's working set (constant in the sequence length once tiled)."""
    if s.tiled_mlp == "off":
        return 0
    return mlp_tile_working_bytes(shape, tokens=_mlp_tile_tokens(shape, s), act_bytes=act, lora=_lora_on_tokens(s, p))


def _mlp_tile_tokens(shape: ModelShape, s: Settings) -> int:
    """Tokens in one MLP tile (ALST's ceil(seq / hidden) tiles under 'auto'); the whole local sequence untiled."""
    t = s.local_tokens
    if s.tiled_mlp == "off":
        return t
    tiles = ceil_div(t, shape.hidden) if s.tiled_mlp == "auto" else min(int(s.tiled_mlp), t)
    return ceil_div(t, max(tiles, 1))


def _saved_per_token(shape: ModelShape, p: ParamCounts, s: Settings, act: int) -> int:
    """Bytes per token one layer keeps from forward to backward without checkpointing: each RMSNorm's input as fp32
    (a copy in a 16-bit run, the residual itself in fp32) and its output; rotated q and k, v and the attention output;
    the MLP's saved gate, up, activation and product when it is not tiled (tiled, it keeps only its input)."""
    h, res = shape.hidden, _residual_bytes(s)
    norms = _norm_saved(s, res) * sum(p.layer_norm_widths(h))
    if res > act:  # fp32 weights under autocast: q, k and v keep 16-bit casts of the input norm's output, not it
        norms -= res * h
    attention = act * (3 * shape.q_width + 2 * shape.kv_width + shape.mixer_saved)
    if s.attn_chunk_count > 1:  # FPDT keeps k, v, the output, its lse and the token ids (on the device: no offload here)
        attention = _chunks_saved_per_token(shape, act, res, s.ring) + _chunk_ids_per_token(s)
    # METP saves only the MLP's input (the norm's output): its steps are recomputed in backward
    mlp = 0 if s.tiled_mlp != "off" or _metp(shape, s) else act * 4 * shape.active_intermediate
    return norms + attention + mlp


def _norm_saved(s: Settings, res: int) -> int:
    """Bytes per hidden value an RMSNorm keeps for backward (HF computes it in fp32): its input as fp32 (a copy in a
    16-bit run, the residual itself in an fp32 one), its output, and with a trainable weight (full fine-tune) the
    normalised input the weight's gradient needs."""
    return 4 + res + (0 if s.lora_r else res)


def _residual_bytes(s: Settings) -> int:
    return dtypes(s)["residual"]


def loss_backend(s: Settings) -> str:
    """Which loss head runs (lstune.memory.apply._apply_loss, lstune.memory.loss.liger_applies): Liger on CUDA with
    'auto' (not under ZeRO-3, whose partitioned head weight Liger cannot read; liger-kernel assumed installed on a
    GPU, the `gpu` extra), MST tiles with mini-sequence, ALST tiles, or one tile ('off')."""
    if s.tiled_loss == "auto" and s.mini_sequence:
        return "mst"
    if s.tiled_loss == "auto":
        zero3 = s.engine.kind == "deepspeed" and s.engine.zero_stage == 3
        return "liger" if s.on_cuda and s.liger and not zero3 else "alst"
    return "off" if s.tiled_loss == "off" else "count"


def _loss_parts(shape: ModelShape, s: Settings, act: int, res: int) -> list[tuple[str, int]]:
    """The final norm and the loss head, forward + backward, by part (module doc)."""
    t, h, v = s.local_tokens, shape.hidden, shape.vocab
    final_norm = t * h * _norm_saved(s, res)
    backend = loss_backend(s)
    alst_tiles = ceil_div(t, max(1, LOSS_TILE_BYTES // (4 * v)))
    if backend == "liger":
        return [*_liger_norm_parts(s, t, h, res, alst_tiles), *_liger_parts(s, t, h, v, act, res)]
    if backend == "mst":
        tiles = ceil_div(v, h)
    elif backend == "alst":
        tiles = alst_tiles
    elif backend == "off":
        tiles = 1
    else:
        tiles = min(int(s.tiled_loss), t)
    tile = ceil_div(t, tiles)
    norm_name = "loss head: final norm"
    if s.fuse_norms and tiles > 1:  # lstune.memory.loss.fuse_final_norm: the head keeps the norm's input, tiles norm it
        norm_name += " in the tiles (its input, one tile's)"
        final_norm = t * h * res + tile * h * _norm_saved(s, res)
    # Two moments of a tile's backward. Log-softmax's: its saved fp32 output, the fp32 gradient nll_loss hands it
    # and the fp32 gradient it returns, 12 B per logit. A trainable head's weight gradient for the tile (the
    # logits gone by then): in the weight's dtype, and first in the 16-bit autocast dtype when that differs;
    # the sum over tiles is the head's gradient, counted with the gradients.
    logits = tile * v * 12
    weight_grad = 0 if s.lora_r else v * h * (res + (act if res > act else 0))
    moment = (f"one tile of logits ({tile:,} tokens, {backend})" if logits >= weight_grad
              else "the head's weight gradient for one tile")
    return [
        (norm_name, final_norm),
        ("loss head: gradient of its input", t * h * res),  # sequence_tiled's accumulator, in the input's dtype
        (f"loss head: peak moment, {moment}", max(logits, weight_grad)),
        ("loss head: autocast copies", _autocast_copies(shape, tile, act, res)),
    ]


def _liger_norm_parts(s: Settings, t: int, h: int, res: int, tiles: int) -> list[tuple[str, int]]:
    """The final norm before Liger's loss. Fused (lstune.memory.loss.normed_in_tiles, in the ALST loss tiles): its
    input, kept by the tiling, and one tile's norm, as on the tiled path; and the whole normed output, which Liger
    reads (Liger's gradient of it is counted with Liger) and whose place the norm's input gradient takes in backward.
    Unfused: what HF's norm keeps of the whole sequence."""
    if not (s.fuse_norms and tiles > 1):
        return [("loss head: final norm", t * h * _norm_saved(s, res))]
    one_tile = ceil_div(t, tiles) * h * _norm_saved(s, res)
    return [("loss head: final norm in the tiles (its input, one tile's)", t * h * res + one_tile),
            ("loss head: the normed states Liger reads (in backward, the norm's input gradient)", t * h * res)]


def _liger_parts(s: Settings, t: int, h: int, v: int, act: int, res: int) -> list[tuple[str, int]]:
    """Liger's fused linear cross-entropy as liger-kernel 0.8.5 runs it (ops/fused_linear_cross_entropy.py): its
    forward computes every gradient, chunk by chunk, so they are alive from the loss's forward to its backward —
    the gradient of its input (t · h, in the input's dtype) and, for a trainable head, of the head's weight (in the
    weight's dtype, no fp32 accumulator unless asked). One logits buffer serves every chunk, in the input's dtype,
    the cross-entropy kernel writing the logits' gradient over it: ⌈t / ⌈V/h⌉⌉ tokens rounded up to a power of
    two (never more than t). Under autocast (fp32 weights) lstune.memory.loss._liger_loss_sum hands Liger 16-bit
    copies of the normed states and of the head's weight."""
    chunk = min(1 << (ceil_div(t, ceil_div(v, h)) - 1).bit_length(), t)
    parts = [("loss head: Liger's gradient of its input", t * h * act),
             (f"loss head: Liger's logits buffer ({chunk:,} tokens; the gradient overwrites it)", chunk * v * act)]
    if res > act:
        parts.append(("loss head: the normed states cast for Liger (autocast)", t * h * act))
    if not s.lora_r:
        parts.append(("loss head: Liger's gradient of the head's weight (made in forward)", v * h * act))
        if res > act:
            parts.append(("loss head: the head's weight cast for Liger (autocast)", v * h * act))
    return parts


def _autocast_copies(shape: ModelShape, tile: int, act: int, res: int) -> int:
    """fp32 weights under 16-bit autocast (a single-device full fine-tune): the head's weight cast for the matmul,
    and a tile's hidden states cast, in forward and in the recompute."""
    if res <= act:
        return 0
    return act * shape.vocab * shape.hidden + 2 * act * tile * shape.hidden
