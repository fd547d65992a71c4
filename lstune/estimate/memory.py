"""The analytic memory model: bytes on each device and on each host for one training step, per rank.

Static terms are bytes per parameter, by where the run keeps them (lstune.train.prepare, lstune.parallel.engine_ds):

- single-device AdamW (TorchEngine): on CUDA with LoRA the frozen base is bf16 (2 B) and the adapters fp32
  (4 B weight, 4 B gradient, 8 B Adam moments); a full fine-tune keeps fp32 weights under bf16 autocast
  (4 + 4 + 8 B per parameter) and so an fp32 residual stream;
- DeepSpeed ZeRO (bf16 mode on CUDA): every weight bf16 (2 B), fp32 gradient (4 B) and fp32 master + m + v
  (12 B) per trainable parameter; stage 1 shards the 12 B over the ranks, stage 2 also the gradient, stage 3
  also the weights (and gathers one layer at a time, with one more prefetched); `offload_optimizer` moves the
  gradient and the 12 B to the host, `offload_params` the weight shards too.

Activation terms are bytes per token of the rank's local sequence (seq_len / SP), in the run's dtypes: `act`
= 2 in a bf16 run (4 in fp32), `res` = the residual stream's bytes (the dtype of the weights). Under
checkpointing the device holds one layer input (res · hidden per token) per layer — two with host offload
(the kept last layer and the one prefetched during the layer above's backward) — plus the larger of two
working sets:

- the loss head's (forward + backward of the final norm and the head): Liger's chunked fused loss on CUDA, the
  ALST tiles (~1 GiB of fp32 logits per tile), MST's vocab/hidden tiles, or the full logits;
- one decoder layer's backward: attention block `act·(4h + 6q + 4kv) + 4h` (the saved q, k, v, output and
  o-projection input with their gradients, and HF's RMSNorm fp32 copy of its input); the norm feeding the MLP
  `3 · 4h` (its fp32 backward temporaries; gone when mini-sequence fuses it into the MLP tiles); further norms
  `4h` each (Gemma's post-norms); the MLP `act · 3.5 · I` untiled (gate, up, activation, product and their
  gradients), or one tile's worth when tiled.

The per-token coefficients are counted from the saved tensors of a Llama layer and checked against the
device peaks measured on an H100 (docs/estimate.md); `lstune estimate --trace` measures the same quantities
on fake tensors for any model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lstune.estimate.placement import checkpoint_terms
from lstune.estimate.shapes import ModelShape, ParamCounts, ceil_div
from lstune.models.quant import frozen_weight_bytes

GIB = 2**30
CUDA_CONTEXT_BYTES = 512 * 2**20  # the CUDA context and kernels, outside torch's allocator
ALLOCATOR_RESERVE = 0.025  # of device memory the caching allocator cannot hand out (expandable segments)
HOST_PROCESS_BYTES = 2 * GIB  # one training process's own memory (python, torch, CUDA libraries): measured 1.5-1.9 GB
LOSS_TILE_BYTES = 2**30  # lstune.memory.loss.LOSS_TILE_BYTES: ALST's ~1 GiB of fp32 logits per tile
ADAM_BYTES = 8  # two fp32 moments
DS_GRAD_BYTES, DS_OPTIM_BYTES = 4, 12  # DeepSpeed bf16 mode: fp32 gradient; fp32 master + m + v


@dataclass(frozen=True)
class Engine:
    """How the training state is kept: the single-device AdamW, or DeepSpeed ZeRO with its offloads."""

    kind: str  # "torch" | "deepspeed"
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False

    def describe(self) -> str:
        if self.kind == "torch":
            return "AdamW on one device (no ZeRO)"
        offload = [name for name, on in (("optimizer", self.offload_optimizer), ("params", self.offload_params)) if on]
        return f"DeepSpeed ZeRO-{self.zero_stage}" + (f" + {' + '.join(offload)} offload" if offload else "")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "zero_stage": self.zero_stage, "offload_optimizer": self.offload_optimizer,
                "offload_params": self.offload_params, "description": self.describe()}


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
    checkpoint_device_budget: int | None = None  # device bytes checkpoints may use (MEMO placement, issue 14)
    liger: bool = True  # Liger's fused loss where lstune uses it (CUDA, tiled_loss auto); False: the ALST tiles
    fuse_norms: bool = True  # mini-sequence fuses the MLP's norms (a probe on real weights finds them)
    load_in_4bit: bool = False  # QLoRA: the frozen base's linear weights in NF4 (lstune.models.quant)

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
    placement: Any = None  # the checkpoint placement (lstune.memory.placement), None without an offloader

    def add(self, name: str, device: int = 0, host: int = 0, detail: str = "") -> None:
        self.items.append(Item(name, int(device), int(host), detail))

    @property
    def device_peak(self) -> int:
        return sum(i.device for i in self.items)

    @property
    def host_peak(self) -> int:
        return sum(i.host for i in self.items)


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
    """Per-rank device and host bytes at the peak of one step (module doc)."""
    b = Breakdown(dtypes=dtypes(s))
    _static(b, params, s)
    _activations(b, shape, params, s)
    b.add("CUDA context and allocator reserve" if s.on_cuda else "process", *_overheads(s))
    return b


def _overheads(s: Settings) -> tuple[int, int]:
    if not s.on_cuda:
        return 0, HOST_PROCESS_BYTES
    return CUDA_CONTEXT_BYTES, HOST_PROCESS_BYTES


def reserve_bytes(device_bytes: int, on_cuda: bool) -> int:
    """What the allocator cannot hand out of a device's memory."""
    return int(device_bytes * ALLOCATOR_RESERVE) if on_cuda else 0


def _static(b: Breakdown, p: ParamCounts, s: Settings) -> None:
    d, e, world = b.dtypes, s.engine, s.world
    if e.kind == "torch":
        _frozen(b, p, s, d["frozen"])
        b.add("trainable parameters", p.trainable * d["trainable"], detail=f"{p.trainable:,} × fp32")
        b.add("gradients", p.trainable * 4, detail=f"{p.trainable:,} × fp32")
        b.add("optimizer state", p.trainable * ADAM_BYTES, detail="Adam m, v: 2 × fp32")
        return
    wb = d["trainable"]
    weights = p.total * wb
    shard = 3 if e.zero_stage == 3 else 0
    if shard:
        gathered = 2 * p.largest_layer * wb  # the layer running and the one prefetched
        on_host = e.offload_params
        b.add("parameters (ZeRO-3 shard)", (0 if on_host else weights // world) + gathered,
              weights // world if on_host else 0, f"{p.total:,} × {_dt(wb)} / {world} ranks + 2 gathered layers")
    else:
        b.add("parameters", weights, detail=f"{p.total:,} × {_dt(wb)} (frozen {p.frozen:,}, trainable {p.trainable:,})")
    grads = p.trainable * DS_GRAD_BYTES // (world if e.zero_stage >= 2 else 1)
    optim = p.trainable * DS_OPTIM_BYTES // world
    where = "host" if e.offload_optimizer else "device"
    b.add("gradients", 0 if e.offload_optimizer else grads, grads if e.offload_optimizer else 0,
          f"fp32, {'sharded' if e.zero_stage >= 2 else 'replicated'}, on the {where}")
    b.add("optimizer state", 0 if e.offload_optimizer else optim, optim if e.offload_optimizer else 0,
          f"fp32 master + m + v / {world} ranks, on the {where}")


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
    if not s.checkpointing:
        saved = t * _saved_per_token(shape, p, s, act)
        b.add("saved activations (no checkpointing)", (shape.layers - 1) * saved,
              detail=f"{shape.layers - 1} layers × {saved / t:,.0f} B/token")
        for name, nbytes in _layer_parts(shape, p, s, act):
            b.add(name, nbytes)
        b.phase = "layer backward"
        return
    # Issue 14 (MEMO placement): host / device / recomputed checkpoints from lstune.estimate.placement.
    placed = checkpoint_terms(shape, s, ckpt, res)
    offloaded, host, kept_fwd, kept_bwd = placed.offloaded, placed.host, placed.kept_fwd, placed.kept_bwd
    b.placement = placed.placement
    layer, loss = _layer_parts(shape, p, s, act), _loss_parts(shape, s, act)
    if _total(loss) + kept_fwd * ckpt >= _total(layer) + kept_bwd * ckpt:
        b.phase, on_device, working = "loss head", kept_fwd, loss
    else:
        b.phase, on_device, working = "layer backward", kept_bwd, layer
    b.add("activation checkpoints", on_device * ckpt, host,
          f"{shape.layers} layers × {h * res:,} B/token ({_dt(res)}); {offloaded} on the host"
          + (f"; {placed.placement.describe()}" if placed.placement else ""))
    for name, nbytes in working:
        b.add(name, nbytes)
    b.add("LoRA intermediates", t * act * s.lora_r * 2 * (p.adapted_linears // max(shape.layers, 1)) if s.lora_r else 0)


def pinned_copy_bytes(nbytes: int, element_size: int) -> int:
    """Host bytes one offloaded checkpoint of `nbytes` takes: the offloader's pinned blocks (memory.checkpoint), each
    rounded to a power of two by torch's caching host allocator — under one block over `nbytes`."""
    from lstune.memory.checkpoint import host_copy_bytes  # imports torch: not for `lstune estimate`'s fast path

    return host_copy_bytes(nbytes // element_size, element_size, pinned=True)


def _offloaded_layers(shape: ModelShape, s: Settings, ckpt: int) -> int:
    if not s.offload_checkpoints:
        return 0
    offloadable = shape.layers - 1
    if s.host_mem_budget is not None and ckpt:
        offloadable = min(offloadable, s.host_mem_budget // ckpt)
    return max(0, offloadable)


def _norm_upcast(act: int) -> int:
    """HF's RMSNorm computes in fp32: in a 16-bit run it keeps an fp32 copy of its input for backward."""
    return 4 if act == 2 else 0


def _total(parts: list[tuple[str, int]]) -> int:
    return sum(nbytes for _, nbytes in parts)


def _layer_parts(shape: ModelShape, p: ParamCounts, s: Settings, act: int) -> list[tuple[str, int]]:
    """One checkpointed layer's recompute + backward, by part (module doc)."""
    h, t = shape.hidden, s.local_tokens
    attention = act * (4 * h + 6 * shape.q_width + 4 * shape.kv_width) + _norm_upcast(act) * h
    fused = s.mini_sequence and s.fuse_norms and s.tiled_mlp != "off"
    mlp_norm = 0 if fused else 3 * 4 * h
    extra_norms = max(0, p.norms_per_layer - 2) - (1 if fused and p.norms_per_layer >= 4 else 0)
    parts = [
        ("layer backward: attention block (q, k, v, output, gradients, input norm)", t * attention),
        ("layer backward: norms around the MLP" + (" (fused into the tiles: none)" if fused else ""),
         t * (mlp_norm + 4 * h * max(0, extra_norms))),
    ]
    if s.tiled_mlp == "off":
        return parts + [("layer backward: MLP (untiled)", t * _mlp_per_token(shape, act))]
    return parts + [("layer backward: one MLP tile", _mlp_tile(shape, s, act))]


def _mlp_per_token(shape: ModelShape, act: int) -> int:
    width = shape.active_intermediate
    per = act * (3.5 if shape.gated else 2.5) * width
    if shape.experts:
        per += act * shape.hidden * shape.top_k + 4 * shape.experts  # routed copies, fp32 router logits
    return int(per)


def _mlp_tile(shape: ModelShape, s: Settings, act: int) -> int:
    """One MLP tile's working set (constant in the sequence length once tiled)."""
    if s.tiled_mlp == "off":
        return 0
    t = s.local_tokens
    tiles = ceil_div(t, shape.hidden) if s.tiled_mlp == "auto" else min(int(s.tiled_mlp), t)
    tile = ceil_div(t, max(tiles, 1))
    return tile * (_mlp_per_token(shape, act) + 2 * act * shape.hidden)


def _saved_per_token(shape: ModelShape, p: ParamCounts, s: Settings, act: int) -> int:
    """Bytes per token one layer keeps from forward to backward without checkpointing."""
    h = shape.hidden
    attention = act * (3 * shape.q_width + 2 * shape.kv_width + 2 * h)
    norms = _norm_upcast(act) * h * p.norms_per_layer
    mlp = act * h if s.tiled_mlp != "off" else int(act * 4 * shape.active_intermediate)
    return attention + norms + mlp + h * act


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


def _loss_parts(shape: ModelShape, s: Settings, act: int) -> list[tuple[str, int]]:
    """The final norm and the loss head, forward + backward, by part (module doc)."""
    t, h, v = s.local_tokens, shape.hidden, shape.vocab
    final_norm = t * (_norm_upcast(act) + act) * h
    backend = loss_backend(s)
    if backend == "liger":
        chunk = ceil_div(t, ceil_div(v, h))  # Liger's chunks hold about as many logits as hidden states
        return [("loss head: final norm", final_norm), ("loss head: Liger's gradient of its input", t * act * h),
                ("loss head: one Liger chunk of logits", 2 * chunk * v * 4)]
    if backend == "mst":
        tile = ceil_div(t, ceil_div(v, h))
    elif backend == "alst":
        tile = min(t, max(1, LOSS_TILE_BYTES // (4 * v)))
    elif backend == "off":
        tile = t
    else:
        tile = ceil_div(t, min(int(s.tiled_loss), t))
    # Per logit of a tile at its peak: the fp32 logits and log-softmax's fp32 output or their fp32 gradients, and
    # the 16-bit matmul output or gradient: 4 + 4 + act, plus ~1 B for what overlaps tile to tile (fitted on
    # traces of Llama-3.1-8B and Qwen3-0.6B shapes, docs/estimate.md).
    per_logit = 4 + 4 + act + 1
    return [
        ("loss head: final norm", final_norm),
        ("loss head: its input and fp32 gradient", t * (act + 4) * h),  # the head's saved input, fp32 accumulator
        (f"loss head: one tile of logits ({tile:,} tokens, {backend})", tile * v * per_logit),
        ("loss head: weight gradient buffers", _head_weight_grad(shape, s)),
    ]


def _head_weight_grad(shape: ModelShape, s: Settings) -> int:
    """A trainable head (full fine-tune) adds autocast's bf16 copy of its fp32 weight; its gradient, summed over
    the tiles, becomes `.grad` (counted with the gradients). Fitted on traces, docs/estimate.md."""
    if s.lora_r or not s.bf16:
        return 0
    return 2 * shape.vocab * shape.hidden
