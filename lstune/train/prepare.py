"""Prepare a loaded model for training: adapt it, then apply lstune's techniques in one fixed order.

Order (each step sees the result of the previous one):
1. move to the device (on CUDA with LoRA, frozen base weights in bf16; adapters stay fp32);
2. LoRA adapters (peft) — before anything wraps modules, so peft finds the plain linear layers;
3. attention backend: lstune's attention function (no 4D mask, packed documents from position_ids);
4. sequence parallelism: Ulysses all-to-alls around that attention when SP > 1 — around ring attention
   (lstune.memory.attention_ring) when the SP group has a ring part (--sp-ring) — and LongRoPE's factors chosen
   from the whole sample, not each shard (lstune.parallel.rope_sp); token mixers that are not
   attention (short convolutions, linear attention, state-space scans) run per packed document and head-parallel
   under SP over the whole SP group, ring part included (lstune.models.mixers, installed by lstune.train.mixers), or
   are refused naming the fix;
5. memory techniques (lstune.memory): tiled MLP / mini-sequence, tiled loss, checkpointing + offload,
   sized for the per-rank sequence length (the token mixers then follow the chunked attention's shard layout, FPDT's
   pieces under SP); then, with --metp-mlp, METP's MLP (lstune.memory.metp_mlp: the MLP
   weights sharded over the SP group and rotated; it replaces the tiled MLP and mini-sequence, which stay off).
The engine (optimizer, ZeRO) is built last, over the parameters that remain trainable.

Steps 1-2 (`adapt_model`) change the model for good; steps 3-5 (`apply_techniques`) are reversible:
the returned `PreparedModel` holds what they installed and `undo()` removes it, so a benchmark can
apply, measure, undo and apply other settings to the same adapted model.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any

from lstune.config.schema import ModelSection, TrainConfig
from lstune.errors import ConfigError
from lstune.estimate.memory import lora_base_in_bf16
from lstune.models.loading import apply_lora

log = logging.getLogger("lstune")


@dataclass
class PreparedModel:
    """A model with lstune's techniques applied: its parts (found once), the attention and Ulysses handles,
    and the memory plan. The loss head reads its plan from here."""

    model: Any
    parts: Any  # lstune.models.introspect.ModelParts
    attention: Any  # lstune.models.attention.AttentionHandle
    ulysses: Any  # lstune.parallel.ulysses.UlyssesHandle, None without sequence parallelism
    memory: Any  # lstune.memory.apply.MemoryPlan
    mixers: Any = None  # lstune.train.mixers.MixersHandle, None when no mixer needed lstune's per-document run
    # LongRoPE's factors: of the whole sample under SP (lstune.parallel.rope_sp), of each document with --pack in
    # one process (lstune.models.rope_documents)
    rope: Any = None
    metp: Any = None  # lstune.memory.metp_mlp.MetpHandle with --metp-mlp (its shards: the engine's local params)

    def loss_sum(self, batch: dict, model: Any = None):
        """(summed token loss, label count) of `batch` with the planned loss head; `model` may be the engine's
        view of the same model (DeepSpeed keeps the module itself)."""
        return self.memory.loss_sum(model if model is not None else self.model, batch)

    def eval_sums(self, batch: dict, model: Any = None, *, misses: bool = False):
        """(summed token loss, label count, labels whose argmax is wrong, or None without `misses`) of `batch`
        from one forward, with the planned loss tiles (lstune.memory.loss.causal_lm_eval_sums)."""
        from lstune.memory.loss import causal_lm_eval_sums

        model = model if model is not None else self.model
        return causal_lm_eval_sums(model, batch, tiles=self.memory.loss_tiles, parts=self.parts, misses=misses)

    def undo(self) -> None:
        """Remove the techniques in reverse order of application; the adapted model (device, LoRA) remains."""
        if self.metp is not None:
            self.metp.undo()
        self.memory.undo()
        if self.mixers is not None:
            self.mixers.undo()
        if self.rope is not None:
            self.rope.undo()
        if self.ulysses is not None:
            self.ulysses.undo()
        self.attention.undo()


def apply_sequence_parallelism(model, dims):
    """Ulysses over the SP group's Ulysses part, its kernel the ring (composed here: parallel and memory are
    siblings) when the group has a ring part; returns the Ulysses handle."""
    from lstune.parallel.ulysses import apply_ulysses

    if dims.ring > 1:
        from lstune.memory.attention_ring import RingAttention

        return apply_ulysses(model, dims, core=RingAttention.of(dims), core_name=f"ring of {dims.ring}")
    return apply_ulysses(model, dims)


def prepare_model(model, config: TrainConfig, runtime) -> PreparedModel:
    """`adapt_model`, then `apply_techniques`."""
    return apply_techniques(adapt_model(model, config.model, runtime), config, runtime)


def adapt_model(model, spec: ModelSection, runtime):
    """Steps 1-2: device and dtype, then LoRA; returns the model to train (peft-wrapped with LoRA)."""
    import torch

    # A 4-bit base (--load-in-4bit) was quantized onto its device, in its dtypes, as it loaded: transformers
    # refuses to cast it.
    if not getattr(model, "is_loaded_in_4bit", False):
        if lora_base_in_bf16(spec.lora_r, spec.dtype, runtime.device.type == "cuda"):
            model = model.to(dtype=torch.bfloat16)
        model = model.to(runtime.device)
    return add_lora(model, spec)


def add_lora(model, spec: ModelSection):
    """Step 2: LoRA adapters when `spec` asks for them (the model as it is otherwise)."""
    if spec.lora_r:
        model = apply_lora(model, r=spec.lora_r, alpha=spec.lora_alpha, dropout=spec.lora_dropout,
                           targets=spec.lora_targets, dora=spec.lora_dora, rslora=spec.lora_rslora)
        log.info("LoRA r=%d applied%s%s", spec.lora_r, " (DoRA)" if spec.lora_dora else "",
                 " (rsLoRA)" if spec.lora_rslora else "")
    return model


def apply_techniques(model, config: TrainConfig, runtime) -> PreparedModel:
    """Steps 3-5 on an adapted model, reversibly (`PreparedModel.undo`)."""
    from lstune.memory.apply import apply_memory_techniques
    from lstune.memory.block_attention import block_attention
    from lstune.models.attention import use_lstune_attention
    from lstune.models.introspect import find_parts

    parts = find_parts(model)
    # The block kernel (memory) runs what the backends cannot: attention sinks, softcapping on sdpa.
    attention = use_lstune_attention(model, backend=config.model.attn, block_kernel=block_attention)
    ulysses = mixers = rope = metp = None
    try:
        if runtime.sp > 1:
            from lstune.parallel.rope_sp import whole_sample_longrope

            ulysses = apply_sequence_parallelism(model, runtime.dims)
            rope = whole_sample_longrope(model, runtime.dims.sp_group)
        elif config.data.pack:
            from lstune.models.rope_documents import per_document_longrope

            rope = per_document_longrope(model)
        mixers = _install_mixers(parts, config, runtime)
        seq_len = math.ceil(config.data.seq_len / runtime.sp)
        memory_section = config.memory
        if config.parallel.metp_mlp:  # explicit tiles / mini-sequence are refused with it (TrainConfig.problems)
            memory_section = replace(memory_section, tiled_mlp="off", mini_sequence=False)
        ring = runtime.dims.ring if ulysses is not None else 1
        memory = apply_memory_techniques(model, memory_section, seq_len=seq_len, parts=parts, ring=ring)
        if mixers is not None:
            _follow_attention_layout(mixers, memory)
        if config.parallel.metp_mlp:
            metp = _install_metp(parts, runtime, memory)
    except BaseException:
        for handle in (mixers, rope, ulysses, attention):
            if handle is not None:
                handle.undo()
        raise
    model.train()
    return PreparedModel(model, parts, attention, ulysses, memory, mixers, rope, metp)


def _install_metp(parts, runtime, memory):
    """Step 5's METP MLP over the SP group (in SP order); ConfigError without SP (nothing to shard over)."""
    from lstune.memory.metp_mlp import install_metp_mlp
    from lstune.memory.rotation import Ring

    dims = runtime.dims
    if runtime.sp < 2:
        memory.undo()
        raise ConfigError(["--metp-mlp shards the MLP over the SP group, and this run has none (SP 1): use --gpus N "
                           "with --sp N (N > 1), or drop --metp-mlp."])
    try:
        return install_metp_mlp(parts.layers, Ring(dims.sp, dims.sp_rank, tuple(dims.sp_group_ranks(dims.dp_rank)),
                                                   dims.sp_group))
    except BaseException:
        memory.undo()
        raise


def _install_mixers(parts, config: TrainConfig, runtime):
    """Step 4's token mixers: per packed document, and head-parallel over the whole SP group (its ring part
    included: a ring's zigzag pieces are put in order on each head's whole timeline) (lstune.train.mixers)."""
    from lstune.train.mixers import install_mixers

    exchange = None
    if runtime.sp > 1:
        from lstune.parallel.ulysses import SequenceExchange

        exchange = SequenceExchange(runtime.dims)
    return install_mixers(parts.body, parts.layers, pack=config.data.pack, exchange=exchange, lm=parts.lm)


def _follow_attention_layout(mixers, memory) -> None:
    """The head-parallel mixers take the shards as chunked attention lays them out (FPDT's pieces under SP), probed
    again on that layout; the memory techniques are undone if the probe refuses."""
    try:
        mixers.follow(memory.attn_chunking)
    except BaseException:
        memory.undo()
        raise
