"""Llama-4's attention, exact with packed documents, under Ulysses SP and under chunked attention (FPDT).

Why: two things in transformers' Llama-4 text attention (`Llama4TextAttention`, `Llama4TextDecoderLayer`) tie it to
one whole sequence per row:

* the decoder layer does not pass `position_ids` on to its attention, so lstune's attention function sees none: it
  cannot tell packed documents apart, Ulysses cannot gather the shards' positions, and FPDT cannot cut them;
* the NoPE layers' attention temperature (`attn_temperature_tuning`, arXiv 2501.19399) scales each query by
  `1 + attn_scale · log1p(floor((p + 1) / floor_scale))` with p the token's index in the module's input
  (`arange(seq)`), not its position: the index runs on across packed documents (each document alone starts again at
  0), restarts at every SP shard and every FPDT chunk (the whole sequence runs on).

What (instance-level, undone by `Llama4Handle.undo`), for every `Llama4TextAttention` (found by class and checked by
its structure; the multimodal model's text layers are the same class):

1. a pre-hook on its decoder layer records the layer's `position_ids`; a pre-hook on the attention module hands them
   on as the `position_ids` keyword (`models.position_hooks`, as for GraniteMoeHybrid's layers), so
   they reach the attention function as in every other HF model (documents, Ulysses' gathered positions, FPDT's
   per-chunk cut — chunked attention narrows per-token keywords);
2. its forward is replaced by `Llama4Attention`: the module's own parts in transformers' order (q/k/v projections,
   its modeling module's `apply_rotary_emb` on the rotary layers, the L2 qk-norm, the config's attention function,
   `o_proj`) with the temperature computed from `position_ids` — each packed document's own positions, global
   positions on an SP shard or an FPDT chunk. For one document from position 0 these are the numbers of the
   module's own forward. The chunked-attention layers' "same chunk" rule (position // attention_chunk_size) is the
   attention function's (`models.attention.chunk_positions`), from the same positions.

Checked by a probe on install (`probe_llama4_attention`): per distinct kind of layer (rotary or NoPE, qk-norm,
temperature), the replacement on 24 tokens at positions [p0, p0 + 24) across a `floor_scale` step, against the
module's own forward given a cache stand-in that reports p0 tokens seen before — transformers' own code then computes
the temperature of exactly those positions. A difference raises ModelError naming the module. With a real cache
(generation) the replacement hands the call to the module's own forward.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from lstune.errors import ModelError
from lstune.models import hf_internals

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

logger = logging.getLogger("lstune")

_CLASS = "Llama4TextAttention"
_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "use_rope", "attn_temperature_tuning",
          "floor_scale", "attn_scale", "attention_dropout", "config", "layer_idx")
_PROBE_TOKENS = 24
_PROBE_RTOL = {"float32": 1e-5, "float64": 1e-9}
_PROBE_RTOL_LOW = 2e-2  # bf16 / fp16: both paths run the same kernels, so they agree far closer than this


@dataclass
class Llama4Handle:
    """What `install_llama4_attention` changed; `undo()` restores every forward and removes the hooks."""

    names: list[str] = field(default_factory=list)
    undos: list[Callable[[], None]] = field(default_factory=list)

    def undo(self) -> None:
        while self.undos:
            self.undos.pop()()


def llama4_attention_sites(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(name, decoder layer, attention module) of every Llama-4 text attention in `model`; ModelError for a module
    of that class whose structure this adapter does not know (another transformers version)."""
    sites = []
    for name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if type(child).__name__ != _CLASS:
                continue
            missing = [part for part in _PARTS if not hasattr(child, part)]
            code = sys.modules.get(type(child).__module__)
            if missing or not hasattr(code, "apply_rotary_emb"):
                raise ModelError(
                    f"{_CLASS} {name}.{child_name} is not laid out as lstune's Llama-4 adapter expects (missing "
                    f"{', '.join(missing) or 'apply_rotary_emb in its module'}): this transformers version changed "
                    "it; lstune cannot pass it positions and temperature exactly (update lstune.models.llama4)."
                )
            sites.append((f"{name}.{child_name}" if name else child_name, parent, child))
    return sites


class Llama4Attention:
    """The replaced forward of one `Llama4TextAttention`: its own parts, the temperature from `position_ids`."""

    def __init__(self, module: nn.Module, own_forward: Callable):
        self.module, self.own_forward = module, own_forward
        code = sys.modules[type(module).__module__]
        self.apply_rotary = code.apply_rotary_emb
        self.eager = getattr(code, "eager_attention_forward", None)

    def __call__(self, hidden_states: Tensor, position_embeddings: Any = None, attention_mask: Any = None,
                 cache: Any = None, **kwargs: Any) -> tuple[Tensor, Any]:
        if cache is not None or kwargs.get("past_key_values") is not None:  # generation: the model's own code
            return self.own_forward(hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        m = self.module
        shape = hidden_states.shape[:-1]
        query = m.q_proj(hidden_states).view(*shape, -1, m.head_dim)
        key = m.k_proj(hidden_states).view(*shape, -1, m.head_dim)
        value = m.v_proj(hidden_states).view(*shape, -1, m.head_dim).transpose(1, 2)
        if m.use_rope:
            query, key = self.apply_rotary(query, key, position_embeddings.to(query.device))
        if hasattr(m, "qk_norm"):
            query, key = m.qk_norm(query), m.qk_norm(key)
        if m.attn_temperature_tuning and not m.use_rope:
            scales_BS = temperature(kwargs.get("position_ids"), shape, m.floor_scale, m.attn_scale, query.device)
            query = (query * scales_BS[..., None, None]).to(query.dtype)
        attention = hf_internals.attention_interface(m.config, self.eager)
        out, weights = attention(m, query.transpose(1, 2), key.transpose(1, 2), value, attention_mask,
                                 dropout=0.0 if not m.training else m.attention_dropout, scaling=m.scaling, **kwargs)
        return m.o_proj(out.reshape(*shape, -1).contiguous()), weights


def temperature(position_ids: Tensor | None, shape: torch.Size, floor_scale: float, attn_scale: float,
                device: Any) -> Tensor:
    """Llama-4's query scale per token, fp32 [B, S]: 1 + attn_scale · log1p(floor((p + 1) / floor_scale)) of each
    token's position p (the token index when there are no position_ids, as transformers computes it)."""
    import torch

    batch, seq = shape
    if position_ids is None:
        positions = torch.arange(seq, device=device)[None]
    else:
        positions = position_ids.to(device)
    positions = positions.expand(batch, seq)
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def install_llama4_attention(model: nn.Module, *, probe: bool = True) -> Llama4Handle | None:
    """Install the position hooks and the replaced forward on every Llama-4 text attention of `model` (module doc);
    None when it has none. Each distinct kind of layer is probed against its own forward (ModelError on a
    difference, after undoing everything)."""
    from lstune.models import position_hooks

    sites = llama4_attention_sites(model)
    if not sites:
        return None
    handle = Llama4Handle()
    probed: set[tuple] = set()
    try:
        for name, layer, module in sites:
            handle.undos.extend(position_hooks.hand_on_positions(layer, [module]))
            wrapper = Llama4Attention(module, module.forward)
            handle.undos.append(_patch_forward(module, wrapper))
            handle.names.append(name)
            kind = (bool(module.use_rope), hasattr(module, "qk_norm"), bool(module.attn_temperature_tuning))
            if probe and kind not in probed:
                probed.add(kind)
                probe_llama4_attention(wrapper, _rotary(model), name)
    except BaseException:
        handle.undo()
        raise
    logger.info("Llama-4 attention: position_ids handed on and temperature from positions in %d layers",
                len(handle.names))
    return handle


def _patch_forward(module: nn.Module, forward: Callable) -> Callable[[], None]:
    """Set `module.forward` on the instance; the undo restores what was there (the class's, or an instance's own).
    (memory.patching does the same for the memory techniques; models may not import it.)"""
    had_own, previous = "forward" in vars(module), vars(module).get("forward")
    module.forward = forward

    def undo() -> None:
        if had_own:
            module.forward = previous
        else:
            vars(module).pop("forward", None)

    return undo


def _rotary(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if type(module).__name__ == "Llama4TextRotaryEmbedding":
            return module
    raise ModelError("Llama-4: no Llama4TextRotaryEmbedding found next to its attention layers; lstune cannot probe "
                     "its attention adapter (update lstune.models.llama4).")


class _SeenTokens:
    """Stands in for a cache in the probe: the module's own forward reads how many tokens came before from it (its
    temperature then covers positions seen..seen+n) and hands the new keys/values back unchanged."""

    def __init__(self, seen: int):
        self.seen = seen

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        return key, value


def probe_llama4_attention(wrapper: Llama4Attention, rotary: nn.Module, name: str) -> None:
    """The replacement against the module's own forward on positions [p0, p0 + 24) that cross a `floor_scale` step
    (module doc); ModelError on any difference. Skipped for models without values (meta, fake, ZeRO-3 partitions)."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    module = wrapper.module
    param = next(module.parameters())
    if param.device.type == "meta" or is_fake(param) or param.numel() == 0:
        return
    # From p0 > 0 (an index-based temperature would start at 0) across the floor_scale step at p + 1 = k·floor_scale.
    half = _PROBE_TOKENS // 2
    start = int(math.ceil((half + 1) / module.floor_scale) * module.floor_scale) - half
    positions = torch.arange(start, start + _PROBE_TOKENS, device=param.device)[None]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, _PROBE_TOKENS, module.config.hidden_size, generator=gen).to(param.device, param.dtype)
    was_training = module.training
    module.eval()  # no attention dropout in either
    try:
        with torch.no_grad():
            embeddings = rotary(hidden, positions)
            seen = _SeenTokens(start)
            expected = wrapper.own_forward(hidden, embeddings, None, cache=seen, position_ids=positions)[0]
            got = wrapper(hidden, embeddings, None, position_ids=positions)[0]
    finally:
        module.train(was_training)
    tolerance = _PROBE_RTOL.get(str(param.dtype).removeprefix("torch."), _PROBE_RTOL_LOW)
    error = float((got.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-12))
    if not error <= tolerance:
        raise ModelError(
            f"lstune's Llama-4 attention adapter differs from {name}'s own forward (relative error {error:.1e}): this "
            "transformers version computes Llama-4's attention otherwise; lstune cannot train it exactly (update "
            "lstune.models.llama4)."
        )
