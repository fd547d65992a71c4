"""Apply the single-device memory techniques to a loaded model, in a fixed order, reversibly.

Order (docs/memory.md): LoRA (peft, before this) → attention backend → **chunked attention → tiled MLP / mini-sequence →
loss head (the final norm run in its tiles) → checkpointing + offload** → engine. Tiling goes first so the
checkpointed layer recomputes the tiled block; checkpointing wraps last so its hooks see the layer input only.

Each step patches module *instances* (never classes, never at import), logs on the "lstune" logger
and registers an undo; `MemoryPlan.undo()` restores the model exactly. The model's parts are found
once (`introspect.find_parts`) and kept in the plan; `plan.loss_sum(model, batch)` runs the loss head
with the planned tiles (nothing is attached to the model).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from lstune.config.schema import MemorySection
from lstune.errors import ConfigError, UserError
from lstune.memory import attention_chunks as chunked_attn
from lstune.memory import checkpoint as ckpt
from lstune.memory import mlp as tiled_mlp_mod
from lstune.memory.host_copies import reserve_pinned
from lstune.memory.lora_inputs import share_lora_inputs
from lstune.memory.loss import (
    LossTiles,
    causal_lm_loss_sum,
    check_loss_config,
    check_loss_head,
    fuse_final_norm,
    liger_applies,
    loss_tile_count,
    mst_loss_policy,
    vocab_rows,
)
from lstune.memory.patching import Undo, run_undos
from lstune.memory.placement import CheckpointPlacement
from lstune.memory.probe import probe_hidden_states, probe_inputs
from lstune.memory.tiling import INT32_LIMIT, TilePolicy
from lstune.models.chunk_layout import AttentionChunks
from lstune.models.introspect import ModelParts, find_parts

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger("lstune")


@dataclass
class MemoryPlan:
    """What `apply_memory_techniques` applied, with tile counts at `seq_len`; `summary()` is what the CLI prints.

    `parts`: the model's parts, found once. `mlp_tiles` / `loss_tiles_at_seq_len`: tile counts for one
    sample of `seq_len` tokens (the installed code sizes tiles from each actual batch). `loss_tiles`: the
    setting `loss_sum` runs the loss head with ("auto", "off", a count or MST's TilePolicy). `fused_norms`: per layer, the norms mini-sequence
    pulled into the tiled MLP. `offloader`: the checkpoint offloader (its `stats`), None without offload.
    `notes`: warnings worth showing the user (int32 limits, skipped fusion).
    """

    seq_len: int
    parts: ModelParts | None = field(default=None, repr=False)
    tiled_mlp: str | int = "off"
    mini_sequence: bool = False
    mlp_tiles: int = 1
    fused_norms: dict[int, tuple[str | None, str | None]] = field(default_factory=dict)
    loss_tiles: LossTiles = "auto"
    loss_tiles_at_seq_len: int = 1
    loss_backend: str = "tiled"  # "liger" | "tiled" | "plain"
    final_norm_fused: bool = False  # the body's final norm runs in the loss tiles (loss.fuse_final_norm)
    checkpointing: bool = False
    save_attention: bool = False  # attention's output and lse kept beside each checkpoint (memory.attention_saved)
    offload: bool = False
    offload_note: str = ""
    offloader: ckpt.CheckpointOffloader | None = None
    attn_chunks: str | int = "off"
    attn_chunking: AttentionChunks = field(default_factory=AttentionChunks)  # what SPDataAdapter lays samples out for
    attn_chunks_at_seq_len: int = 1
    attn_chunk_stats: chunked_attn.ChunkStats | None = None
    attn_fused_norms: dict[int, tuple[str | None, str | None]] = field(default_factory=dict)
    placement: CheckpointPlacement | None = None
    notes: list[str] = field(default_factory=list)
    _undos: list[Undo] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        loss_policy = self.loss_tiles.describe() if isinstance(self.loss_tiles, TilePolicy) else self.loss_tiles
        return {
            "seq_len": self.seq_len,
            "tiled_mlp": {"setting": self.tiled_mlp, "tiles": self.mlp_tiles, "mini_sequence": self.mini_sequence,
                          "fused_norms": {i: [n for n in pair if n] for i, pair in self.fused_norms.items()}},
            "tiled_loss": {"setting": loss_policy, "tiles": self.loss_tiles_at_seq_len, "backend": self.loss_backend,
                           "final_norm_fused": self.final_norm_fused},
            "checkpointing": self.checkpointing,
            "recompute_attention": "off" if self.save_attention else ("on" if self.checkpointing else None),
            "offload_checkpoints": {"enabled": self.offload, "note": self.offload_note},
            "attn_chunks": {"setting": self.attn_chunks, "chunks": self.attn_chunks_at_seq_len},
            "checkpoint_placement": self._placement_summary(),
            "notes": list(self.notes),
        }

    def _placement_summary(self) -> dict | None:
        if self.placement is None:
            return None
        # A checkpointed step runs each layer forward, again in backward, and backward (~2 forwards): 4 per layer.
        return self.placement.summary(step_layer_forwards=4 * self.placement.n_layers)

    def host_copies(self, micro_batch: int = 1) -> list[tuple[int, torch.dtype]]:
        """(numel, dtype) of every host copy one step of `micro_batch` samples of `seq_len` tokens makes at once:
        each offloaded checkpoint's host part and, with attention saved, its layer's output and lse; with chunked
        attention offloaded, the saved chunks (k, v, output, lse) of every layer when attention is saved, else of
        the live layer, and the live layer's backward chunks (q, dO, dq; not the PyTorch kernel's rowsums, a
        hundredth of them). What `reserve_host` pins before the first step; under Ulysses sizes assume the heads
        divide evenly (copies of other sizes are pinned when first made, as before)."""
        if self.parts is None or not self.checkpointing:
            return []
        config, tokens = self.parts.text_config, micro_batch * self.seq_len
        param = next(p for p in self.parts.layers[0].parameters() if p.is_floating_point())
        dtype, heads, q_width, kv_width = param.dtype, *_attention_sizes(config)
        fractions = self.placement.host_fraction if self.placement is not None else ()
        copies: list[tuple[int, torch.dtype]] = []
        for fraction in fractions:
            if fraction:
                copies.append((micro_batch * math.floor(fraction * self.seq_len + 1e-6) * config.hidden_size, dtype))
                if self.save_attention and self.attn_chunks_at_seq_len <= 1 and heads:
                    copies += [(tokens * q_width, dtype), (tokens * heads, torch.float32)]
        if self.offload and self.attn_chunks_at_seq_len > 1 and heads:
            layers = sum(a is not None for a in fractions) if self.save_attention else 1
            c, chunks = tokens // self.attn_chunks_at_seq_len, self.attn_chunks_at_seq_len
            saved = [(c * kv_width, dtype), (c * kv_width, dtype), (c * q_width, dtype), (c * heads, torch.float32)]
            # The live layer's backward: q, dO and the fp32 dq accumulator of each chunk (the 8-chunk profile of
            # docs/benchmarks/2026-11-26-h200-c still pinned 8 blocks in a steady step: 0.35 s of cudaHostAlloc).
            stored = [(c * q_width, dtype), (c * q_width, dtype), (c * q_width, torch.float32)]
            copies += saved * (chunks * layers) + stored * chunks
        return copies

    def reserve_host(self, micro_batch: int = 1) -> int:
        """Pin the blocks of `host_copies` before the first step (host_copies.reserve_pinned), on CUDA; the bytes."""
        param = next(self.parts.lm.parameters(), None) if self.parts is not None else None
        if param is None or param.device.type != "cuda":
            return 0
        nbytes = reserve_pinned(self.host_copies(micro_batch))
        if nbytes:
            logger.info("host copies: %.1f GiB pinned before the first step", nbytes / 2**30)
        return nbytes

    def loss_sum(self, model: "nn.Module", batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """`causal_lm_loss_sum` with this plan's loss tiles and parts (`model` may be an engine's view of it)."""
        return causal_lm_loss_sum(model, batch, tiles=self.loss_tiles, parts=self.parts)

    def undo(self) -> None:
        """Restore every patched module."""
        run_undos(self._undos)
        logger.info("memory techniques undone")


def _patched_here(module: "nn.Module") -> bool:
    """A forward patched by a memory technique (the token mixers' per-document forward and Llama-4's attention
    adapter are not: they come first)."""
    from lstune.models.llama4 import Llama4Attention
    from lstune.models.mixers import DocumentMixer

    return "forward" in vars(module) and not isinstance(vars(module)["forward"], (DocumentMixer, Llama4Attention))


def apply_memory_techniques(
    model: "nn.Module", memory: MemorySection | None = None, *, seq_len: int, parts: ModelParts | None = None,
    ring: int = 1,
) -> MemoryPlan:
    """Apply tiled MLP / mini-sequence, the loss-head tiling, checkpointing and offload to `model`.

    `memory` is the config's memory section (defaults when None): `tiled_mlp` and `tiled_loss` "auto"
    (ALST policies), "off" or a tile count; `mini_sequence` (MST policies: loss in vocab/hidden tiles,
    norms fused into the tiled MLP); `checkpointing`, `offload_checkpoints` and `host_mem_budget` (bytes
    of host memory offloaded checkpoints may use). `seq_len` is the local (per-rank) sequence length a
    micro-batch will have; tile counts in the plan are for it, while the installed code sizes tiles from
    each actual batch. `parts`: the model's parts when the caller found them already. `ring`: the ring part of
    the run's sequence parallelism (its attention chunks then hold the zigzag inside each chunk, and the setup
    probes are laid out for it: `probe.probe_inputs`). Works on peft-wrapped models (LoRA applied first).
    """
    memory = memory if memory is not None else MemorySection()
    _validate(memory, seq_len)
    parts = parts or find_parts(model)
    patched = [*parts.layers.modules(), *([parts.final_norm] if parts.final_norm is not None else [])]
    if any(_patched_here(module) for module in patched):
        raise UserError("memory techniques are already applied to this model; call plan.undo() first.")
    # 'auto' mini-sequence, like 'auto' offload, is the estimate's to resolve; unresolved it stays off.
    plan = MemoryPlan(seq_len=seq_len, parts=parts, tiled_mlp=memory.tiled_mlp,
                      mini_sequence=memory.mini_sequence is True)
    probing = _can_probe(parts.lm)
    if probing:
        check_loss_head(parts)
    else:
        check_loss_config(parts.text_config)
    try:
        plan._undos.extend(share_lora_inputs(model))
        _apply_attention_chunks(plan, memory, probing, ring)
        _apply_mlp(plan, probing)
        _apply_loss(model, plan, memory.tiled_loss, probing)
        # 'auto' offload is the estimate's to resolve (lstune.estimate.choose_memory); unresolved it stays off.
        _apply_checkpointing(model, plan, memory)
    except BaseException:
        run_undos(plan._undos)
        raise
    _warn_untiled_overflow(plan)
    logger.info("memory plan: %s", plan.summary())
    return plan


def _validate(memory: MemorySection, seq_len) -> None:
    """The section's own rules (the same the CLI reports), and a usable sequence length."""
    problems = []
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        problems.append(f"seq_len must be a positive number of tokens, not {seq_len!r}")
    problems += memory.problems()
    if problems:
        raise ConfigError(problems)


def _can_probe(lm: "nn.Module") -> bool:
    """Probes need real weights: skip them for meta-device or fake-tensor models (the estimator's)."""
    from torch._subclasses.fake_tensor import is_fake

    param = next(lm.parameters(), None)
    return param is not None and param.device.type != "meta" and not is_fake(param)


def _apply_attention_chunks(plan: MemoryPlan, memory: MemorySection, probing: bool, ring: int = 1) -> None:
    """Chunked attention (FPDT), with the norms around each attention run per chunk when a probe confirms that is
    exact; its saved chunks go to host memory with --offload-checkpoints."""
    chunking = replace(chunked_attn.attention_chunking(memory.attn_chunks, plan.parts.lm.config), ring=ring)
    setting = chunking.setting  # "off" for a model without attention
    auto_tokens = chunking.auto_tokens
    if setting == "auto" and chunked_attn.chunk_count(setting, plan.seq_len, auto_tokens) <= 1:
        setting = "off"  # unresolved `auto` (no estimate chose) that cuts nothing at this length: nothing to patch
        chunking = replace(chunking, setting=setting)
    plan.attn_chunks, plan.attn_chunking = setting, chunking
    plan.attn_chunks_at_seq_len = chunked_attn.chunk_count(setting, plan.seq_len, auto_tokens)
    if setting == "off":
        return
    plan.attn_chunk_stats = chunked_attn.ChunkStats()
    names, calls = _probe_attention(plan.parts, probing)
    install = partial(chunked_attn.install_chunked_attention, plan.parts.layers, setting,
                      auto_tokens=auto_tokens, names=names,
                      offload=memory.offload_checkpoints is True, stats=plan.attn_chunk_stats)
    fused = _attention_norms(calls, names) if calls is not None else {}
    if fused:
        inputs = probe_inputs(plan.parts, chunks=plan.attn_chunking)
        reference = probe_hidden_states(plan.parts, inputs)
        undos = install(fused=fused)
        try:
            out = probe_hidden_states(plan.parts, inputs)
        except BaseException:
            run_undos(undos)
            raise
        tol = 1e-5 if reference.dtype == torch.float32 else 1e-2
        if torch.allclose(out, reference, rtol=tol, atol=tol):
            plan._undos.extend(undos)
            plan.attn_fused_norms = fused
            return
        run_undos(undos)
        logger.warning("chunked attention: running the attention norms per chunk changed the output; not fused")
    plan._undos.extend(install())


def _probe_attention(parts: ModelParts, probing: bool) -> tuple[tuple[str | None, ...], list | None]:
    """From one probe forward: each layer's softmax attention child (None: none, a hybrid's linear or state-space
    layer) — the child that calls lstune's attention function — and every layer's recorded child calls (for the
    norms around it). Without real weights (meta / fake), or on HF's own attention (refused per chunk: it builds a
    mask), the structural guess and no calls."""
    from lstune.models import hf_internals
    from lstune.models.attention import recording_attention_modules
    from lstune.models.introspect import attention_names

    on_lstune = str(hf_internals.attention_implementation(parts.lm.config)).startswith("lstune_")
    if not probing:
        return attention_names(parts.layers), None
    inputs = probe_inputs(parts)
    with recording_attention_modules() as calling:
        calls = tiled_mlp_mod.record_child_calls(parts.layers, lambda: probe_hidden_states(parts, inputs))
    return attention_names(parts.layers, calling if on_lstune else None), calls


def _attention_norms(calls: list, names: tuple[str | None, ...]) -> dict[int, tuple[str | None, str | None]]:
    """Per layer, the norms feeding only / fed only by the attention, from the recorded probe forward."""
    fused = {}
    for index, name in enumerate(names):
        if name is None:
            continue
        pair = tiled_mlp_mod.find_fusable_norms(calls[index], name)
        if any(pair):
            fused[index] = pair
    return fused


def _apply_mlp(plan: MemoryPlan, probing: bool) -> None:
    if plan.tiled_mlp == "off":
        return
    layers, hidden = plan.parts.layers, plan.parts.hidden_size
    policy = TilePolicy(tile_len=hidden) if plan.tiled_mlp == "auto" else TilePolicy(count=plan.tiled_mlp)
    names = plan.parts.mlp_names
    tiled_mlp_mod.check_call_signature(layers, names)
    if probing:
        tiled_mlp_mod.check_per_token(layers, hidden, names)
    fused = _discover_fusion(plan.parts, plan.attn_chunking) if plan.mini_sequence and probing else {}
    if plan.mini_sequence and not probing:
        _note(plan, "mini-sequence: norm fusion needs a probe forward on real weights (meta/fake model); "
                    "the MLP is tiled alone")
    installed = _install_verified(plan.parts, policy, fused, plan.attn_chunking)
    plan.fused_norms = {t.layer_index: _names(t, layers) for t in installed if t.pre_norm or t.post_norm}
    plan._undos.append(lambda: tiled_mlp_mod.undo_tiled_blocks(installed))
    if not installed:  # every block holds a token mixer alone (Mamba): nothing to tile
        logger.info("tiled MLP: no layer has an MLP (its blocks hold a token mixer alone); nothing to tile")
        return
    block = installed[0].block
    plan.mlp_tiles = policy.tiles(plan.seq_len, width=tiled_mlp_mod.widest_row(block))
    logger.info("tiled MLP: %s on %d layers (%d tiles at %d tokens)",
                type(block).__name__, len(installed), plan.mlp_tiles, plan.seq_len)


def _discover_fusion(parts: ModelParts, chunks: AttentionChunks) -> dict[int, tuple[str | None, str | None]]:
    """Which norms feed / follow each layer's block, from one recorded probe forward (`chunks`: the attention's)."""
    inputs = probe_inputs(parts, chunks=chunks)
    calls = tiled_mlp_mod.record_child_calls(parts.layers, lambda: probe_hidden_states(parts, inputs))
    fused = {}
    for index, name in enumerate(parts.mlp_names):
        if name is None:
            continue
        pre, post = tiled_mlp_mod.find_fusable_norms(calls[index], name)
        if pre or post:
            fused[index] = (pre, post)
    return fused


def _install_verified(parts: ModelParts, policy, fused, chunks: AttentionChunks | None = None) -> list:
    """Install tiled blocks; if fused norms change the probe's output, fall back to unfused blocks."""
    install = partial(tiled_mlp_mod.install_tiled_blocks, parts.layers, policy, names=parts.mlp_names)
    if not fused:
        return install()
    inputs = probe_inputs(parts, chunks=chunks)
    reference = probe_hidden_states(parts, inputs)
    installed = install(fused=fused)
    fused_out = probe_hidden_states(parts, inputs)
    tol = 1e-5 if reference.dtype == torch.float32 else 1e-2
    if torch.allclose(fused_out, reference, rtol=tol, atol=tol):
        return installed
    tiled_mlp_mod.undo_tiled_blocks(installed)
    logger.warning("mini-sequence: fusing norms into the MLP changed the output; tiling the MLP alone")
    return install()


def _names(tiled, layers) -> tuple[str | None, str | None]:
    layer = layers[tiled.layer_index]
    named = {id(m): n for n, m in layer.named_children()}
    return (named.get(id(tiled.pre_norm)), named.get(id(tiled.post_norm)))


def _apply_loss(model, plan: MemoryPlan, tiled_loss, probing: bool) -> None:
    head = plan.parts.output_embedding
    vocab, hidden = vocab_rows(head), plan.parts.hidden_size
    if tiled_loss == "auto" and plan.mini_sequence:
        plan.loss_tiles = mst_loss_policy(vocab, hidden)
    else:
        plan.loss_tiles = tiled_loss
    plan.loss_tiles_at_seq_len = loss_tile_count(plan.loss_tiles, plan.seq_len, vocab, hidden)
    if plan.loss_tiles == "off" and plan.seq_len * vocab >= INT32_LIMIT:
        _note(plan, f"tiled_loss off: {plan.seq_len} x {vocab} logits reach 2^31 elements; int32 kernels may fail")
    probe = torch.empty(0, device=head.weight.device)
    if plan.loss_tiles == "auto" and liger_applies(head, probe):
        plan.loss_backend = "liger"
    else:
        plan.loss_backend = "tiled" if plan.loss_tiles_at_seq_len > 1 else "plain"
    if plan.loss_backend in ("tiled", "liger") and probing:
        _fuse_final_norm(plan)
    logger.info("loss head: %s (%d tiles at %d tokens)%s", plan.loss_backend, plan.loss_tiles_at_seq_len,
                plan.seq_len, _fused_norm_note(plan))


def _fused_norm_note(plan: MemoryPlan) -> str:
    if not plan.final_norm_fused:
        return ""
    if plan.loss_backend == "liger":
        return ", final norm in the tiles before Liger's fused loss"
    return ", final norm in the tiles"


def _fuse_final_norm(plan: MemoryPlan) -> None:
    """The final norm's full-sequence fp32 copy and output go: each loss tile norms its slice (loss.fuse_final_norm),
    where a probe shows that is exact. For Liger, whose fused loss takes the whole normed sequence, the head norms it
    in those tiles first (loss.normed_in_tiles)."""
    undo = fuse_final_norm(plan.parts, chunks=plan.attn_chunking)
    if undo is None:
        logger.info("loss head: the final norm stays in the body (no single final norm, or running it per tile "
                    "changed the probe's output)")
        return
    plan._undos.append(undo)
    plan.final_norm_fused = True


def _apply_checkpointing(model, plan: MemoryPlan, memory: MemorySection) -> None:
    if not memory.checkpointing:
        return
    layers = plan.parts.layers
    plan.checkpointing = True
    if memory.offload_checkpoints is True:
        plan.offload, plan.offload_note = _offload_decision(plan.parts, plan.seq_len, memory.host_mem_budget)
    if plan.offload or memory.checkpoint_device_budget is not None:
        plan.placement = checkpoint_placement(plan.parts, plan.seq_len, memory, offload=plan.offload)
        for note in plan.placement.notes:
            _note(plan, note)
        budget = memory.host_mem_budget if plan.offload else 0
        plan.offloader = ckpt.CheckpointOffloader(len(layers), host_mem_budget=budget, placement=plan.placement)
    # 'auto' is the estimate's to resolve (lstune.estimate.choose_memory); unresolved, attention is recomputed.
    plan.save_attention = memory.recompute_attention == "off"
    plan._undos.extend(ckpt.install_checkpointing(layers, plan.offloader, save_attention=plan.save_attention))
    placed = f"; placement: {plan.placement.describe()}" if plan.placement else ""
    logger.info("checkpointing: %d layers%s%s%s", len(layers),
                f"; {plan.offload_note}" if memory.offload_checkpoints is True else "", placed,
                "; attention's output saved, not recomputed" if plan.save_attention else "")


def checkpoint_placement(parts: ModelParts, seq_len: int, memory: MemorySection, *, offload: bool) -> CheckpointPlacement:
    """The planner's placement for this model at `seq_len` (lstune.memory.checkpoint.place_checkpoints): host budget
    (none without offload), device budget, and on CUDA the fraction whose copy hides under one layer's forward."""
    layers, config = parts.layers, parts.text_config
    param = next(p for p in layers[0].parameters() if p.is_floating_point())
    return ckpt.place_checkpoints(
        len(layers), seq_len * config.hidden_size * param.element_size(), tokens=seq_len,
        layer_matmul_params=layer_flop_params(layers[0], config), attention_width=_attention_width(config),
        element_size=param.element_size(), on_cuda=param.device.type == "cuda",
        host_budget=memory.host_mem_budget if offload else 0, device_budget=memory.checkpoint_device_budget,
    )


def _offload_decision(parts: ModelParts, seq_len: int, budget: int | None) -> tuple[bool, str]:
    """Offload only when the copy hides under a layer's forward (MEMO Eq. 1) — on CUDA; always on CPU (tests)."""
    layers, config = parts.layers, parts.text_config
    # The hidden state's dtype: a floating weight's (a 4-bit base also holds uint8 packed weights).
    param = next(p for p in layers[0].parameters() if p.is_floating_point())
    per_layer = seq_len * config.hidden_size * param.element_size()
    host = per_layer * (len(layers) - 1)
    fits = min(len(layers) - 1, budget // per_layer) if budget is not None else None
    budget_note = "" if budget is None else f", host budget {budget} B → {fits} layers"
    if param.device.type != "cuda":
        return True, f"offload on ({param.device.type}: plain copies into separate buffers{budget_note})"
    min_tokens = ckpt.offload_min_tokens(
        layer_flop_params(layers[0], config), config.hidden_size, _attention_width(config), param.element_size()
    )
    if seq_len < min_tokens:
        return False, f"offload off: {seq_len} tokens < {min_tokens}, below which copies would not hide under compute"
    return True, f"offload on: ~{host / 2**30:.1f} GiB host per sample{budget_note}"


def layer_flop_params(layer: "nn.Module", config) -> int:
    """Parameters one token multiplies in a layer: stacked expert weights count top_k / n_experts."""
    top_k = getattr(config, "num_experts_per_tok", None) or 1
    total = 0
    for p in layer.parameters():
        total += p.numel() * top_k // p.shape[0] if p.dim() == 3 else p.numel()
    return total


def _attention_width(config) -> int:
    from lstune.models.introspect import attention_heads

    heads = attention_heads(config)
    return 0 if heads is None else heads[0] * heads[2]


def _attention_sizes(config) -> tuple[int, int, int]:
    """(query heads, q width, kv width) of a text config; zeros without attention."""
    from lstune.models.introspect import attention_heads

    heads = attention_heads(config)
    if heads is None:
        return 0, 0, 0
    q_heads, kv_heads, head_dim = heads
    return q_heads, q_heads * head_dim, kv_heads * head_dim


def _warn_untiled_overflow(plan: MemoryPlan) -> None:
    """Tiles are int32-safe; the untiled hidden state itself is not, past 2^31 / hidden tokens."""
    hidden = plan.parts.hidden_size
    if plan.seq_len * hidden >= INT32_LIMIT:
        _note(plan, f"{plan.seq_len} x {hidden} hidden states reach 2^31 elements: kernels outside the tiles "
                    f"(norms, attention projections) may overflow int32; keep the local sequence below "
                    f"{math.ceil(INT32_LIMIT / hidden)} tokens (more sequence-parallel ranks)")


def _note(plan: MemoryPlan, note: str) -> None:
    plan.notes.append(note)
    logger.warning(note)
