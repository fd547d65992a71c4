"""Find the parts of any Hugging Face causal LM by structure, not by class name.

The memory techniques need four things from a model: its decoder layers, the per-token MLP (or MoE
block) inside each layer, the final norm and the output embedding. Looking them up by class name
would break on every new architecture, so each is found from the module tree and the config
(so a new architecture needs no code change). Wrappers are looked through: peft (`get_peft_model`), DeepSpeed / DDP engines
(`.module`).

A small table of attribute names (`_MLP_NAMES`) is kept only to break ties in layers that hold more
than one per-token block (e.g. Gemma-3n's extra side blocks); the usual case never reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from lstune.errors import ModelError

if TYPE_CHECKING:
    from torch import nn

# Tie-breakers when a layer holds several per-token blocks; the first name found wins.
_MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward", "ffn")


@dataclass(frozen=True)
class ModelParts:
    """The parts every technique needs, found once per model (`find_parts`) and passed around, so applying
    the techniques and each training step do not walk the module tree again."""

    lm: Any  # the transformers *ForCausalLM inside any wrapper
    body: Any  # the decoder body returning last_hidden_state
    layers: Any  # nn.ModuleList of decoder layers
    input_embedding: Any  # None when the model has none to report
    output_embedding: Any  # the LM head
    text_config: Any

    @cached_property
    def mlp_names(self) -> tuple[str, ...]:
        """Per layer, the attribute naming its per-token block (`layer_mlp_name`; None for a hybrid's block without
        one), looked up on first use only: a model whose MLP cannot be told apart is refused only when a technique
        needs its MLP."""
        return mlp_names(self.layers)

    @cached_property
    def final_norm(self):
        """The body's final norm (`final_norm`), or None when the body has not exactly one norm child."""
        try:
            return _final_norm_of(self.body)
        except ModelError:
            return None

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    def tied_to_input(self, params: list) -> list:
        """Those of `params` that the input embedding also uses (tied embeddings)."""
        used = {id(p) for p in self.input_embedding.parameters()} if self.input_embedding is not None else set()
        return [p for p in params if id(p) in used]


def find_parts(model: "nn.Module") -> ModelParts:
    """Walk `model` once for the parts of `ModelParts` (ModelError naming what is missing)."""
    lm = unwrap_model(model)
    return ModelParts(
        lm=lm,
        body=decoder_body(lm),
        layers=decoder_layers(lm),
        input_embedding=lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None,
        output_embedding=output_embedding(lm),
        text_config=_text_config(lm),
    )


def unwrap_model(model: "nn.Module") -> "nn.Module":
    """The transformers model inside peft / DeepSpeed / DDP wrappers (the model itself if unwrapped)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model"):  # peft PeftModel
            model = model.get_base_model()
        elif hasattr(model, "config") and hasattr(model, "get_output_embeddings"):
            return model
        elif _is_module(getattr(model, "module", None)):  # DeepSpeedEngine, DDP
            model = model.module
    return model


def decoder_body(model: "nn.Module") -> "nn.Module":
    """The module that returns `last_hidden_state` (e.g. `LlamaForCausalLM.model`)."""
    lm = unwrap_model(model)
    body = lm.get_decoder() if hasattr(lm, "get_decoder") else getattr(lm, "base_model", lm)
    if body is lm:
        # get_decoder() answers the model itself when base_model_prefix names no child (Llama-4 text: the prefix is
        # "language_model", the child "model"): take the child model that owns the input embeddings.
        body = _child_owning_embeddings(lm) or lm
    if body is lm:
        raise ModelError(
            f"lstune cannot find the decoder body of {type(lm).__name__} (the submodule that returns the final hidden "
            "states: neither get_decoder() nor a child model holding the input embeddings), so it cannot run the "
            "loss head on hidden states; this is lstune's limitation for this class layout."
        )
    return body


def _child_owning_embeddings(lm: "nn.Module") -> "nn.Module | None":
    embeddings = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
    for child in lm.children():
        if hasattr(child, "config") and embeddings is not None and any(m is embeddings for m in child.modules()):
            return child
    return None


def decoder_layers(model: "nn.Module") -> "nn.ModuleList":
    """The decoder layers: the body's ModuleList with `num_hidden_layers` entries (the longest one if unsure)."""
    from torch import nn

    lm = unwrap_model(model)
    body = decoder_body(lm)
    n_layers = getattr(_text_config(lm), "num_hidden_layers", None)
    lists = [m for _, m in body.named_children() if isinstance(m, nn.ModuleList) and len(m) > 0]
    exact = [m for m in lists if len(m) == n_layers]
    found = exact or sorted(lists, key=len, reverse=True)[:1]
    if not found:
        raise ModelError(
            f"found no list of decoder layers in {type(body).__name__}; lstune supports decoder-only "
            "transformers whose body keeps its layers in a torch.nn.ModuleList."
        )
    return found[0]


def layer_mlp(layer: "nn.Module") -> tuple["nn.Module", str]:
    """`(parent, attribute)` of the layer's per-token block (dense MLP or MoE), so it can be read or replaced.

    A child is a per-token block when it holds matrices (parameters of 2+ dims), is not the attention
    (no `head_dim` / `num_key_value_groups`, class name without "Attention"), is not a token mixer (`_mixer_children`:
    a Mamba mixer holds matrices and no head_dim) and is not a norm.
    """
    mixers = _mixer_children(layer)
    candidates = [
        (name, child)
        for name, child in layer.named_children()
        if _has_matrices(child) and not _is_attention(child) and name not in mixers
    ]
    if len(candidates) > 1:
        preferred = [c for c in candidates if c[0] in _MLP_NAMES]
        candidates = preferred[:1] or candidates
    if len(candidates) != 1:
        names = ", ".join(n for n, _ in candidates) or "none"
        raise ModelError(
            f"cannot tell which part of {type(layer).__name__} is its MLP (candidates: {names}); "
            "turn MLP tiling off (tiled_mlp: off, mini_sequence: false) for this architecture."
        )
    return layer, candidates[0][0]


def layer_mlp_name(layer: "nn.Module") -> str | None:
    """`layer_mlp`'s attribute name, or None for a layer with no per-token block at all — a block that holds only a
    token mixer (Nemotron-H's Mamba or attention blocks, every block of Mamba / FalconMamba / Mamba2) — so that tiling
    skips it. A layer with matrices of its own outside any child is not such a layer: it is refused as `layer_mlp`
    refuses."""
    mixers = _mixer_children(layer)
    has_candidates = any(_has_matrices(child) and not _is_attention(child) and name not in mixers
                         for name, child in layer.named_children())
    own_matrices = any(p.dim() >= 2 for p in layer.parameters(recurse=False))
    if not has_candidates and not own_matrices:
        return None
    return layer_mlp(layer)[1]


def layer_attention(layer: "nn.Module") -> str:
    """The attribute name of the layer's attention module: its one child with matrices that looks like attention
    (`head_dim` / `num_key_value_groups`, or "Attention" in the class name)."""
    names = [name for name, child in layer.named_children() if _has_matrices(child) and _is_attention(child)]
    if len(names) != 1:
        raise ModelError(
            f"cannot tell which part of {type(layer).__name__} is its attention (candidates: "
            f"{', '.join(names) or 'none'}); chunked attention cannot apply: use --attn-chunks off."
        )
    return names[0]


def attention_names(layers: "nn.ModuleList", calling: list | None = None) -> tuple[str | None, ...]:
    """Per layer, the attribute of its softmax-attention child, or None for a layer without one (a hybrid's
    linear-attention / state-space layer). `calling`: the modules seen calling lstune's attention function on a
    probe (`models.attention.recording_attention_modules`) — the child holding one is the attention, whatever its
    class looks like (Kimi's "DeltaAttention" and MiniMax's "LightningAttention" are linear mixers, Mamba mixers have
    a head_dim). Without a probe (meta / fake weights) the structural guess of `layer_attention`, None where a layer
    has no candidate. ModelError when a layer has several."""
    names = []
    for layer in layers:
        if calling is None:
            candidates = [n for n, child in layer.named_children() if _has_matrices(child) and _is_attention(child)]
        else:
            candidates = [n for n, child in layer.named_children()
                          if any(m is child or any(m is sub for sub in child.modules()) for m in calling)]
        if len(candidates) > 1:
            raise ModelError(
                f"cannot tell which part of {type(layer).__name__} is its attention (candidates: "
                f"{', '.join(candidates)}); chunked attention cannot apply: use --attn-chunks off."
            )
        names.append(candidates[0] if candidates else None)
    return tuple(names)


def mlp_names(layers: "nn.ModuleList") -> tuple[str | None, ...]:
    """`layer_mlp_name` for each layer (None: the layer has no per-token block). ModelError when no layer has one,
    unless the layers hold token mixers (an attention-free model such as Mamba: blocks of a mixer alone, nothing to
    tile); a model whose MLP is merely not recognised is still refused."""
    names = tuple(layer_mlp_name(layer) for layer in layers)
    if all(name is None for name in names) and not any(_mixer_children(layer) for layer in layers):
        layer_mlp(layers[0])  # raises, naming the candidates (none)
    return names


def _mixer_children(layer: "nn.Module") -> set[str]:
    """Names of the layer's children that hold a token mixer — a convolution, as `lstune.models.mixers.mixer_sites`
    finds them (the one family it knows without a convolution, MiniMax's lightning attention, is named attention):
    they mix tokens, so they are never the layer's per-token block. (Not `mixer_sites` itself: mixers imports the
    attention module, which imports this one.)"""
    from torch import nn

    return {name for name, child in layer.named_children()
            if any(isinstance(m, (nn.Conv1d, nn.Conv2d)) for m in child.modules())}


def final_norm(model: "nn.Module") -> "nn.Module":
    """The norm the body applies after its last layer: its one direct child that only has vector parameters."""
    return _final_norm_of(decoder_body(model))


def _final_norm_of(body: "nn.Module") -> "nn.Module":
    norms = [m for _, m in body.named_children() if is_norm(m)]
    if len(norms) != 1:
        raise ModelError(
            f"cannot find the final norm of {type(body).__name__} ({len(norms)} candidates); "
            "lstune expects exactly one norm module directly in the decoder body."
        )
    return norms[0]


def output_embedding(model: "nn.Module") -> "nn.Module":
    """The LM head (`get_output_embeddings()`); with tied embeddings its weight is the input embedding's."""
    lm = unwrap_model(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if head is None:
        raise ModelError(
            f"{type(lm).__name__} has no output embedding (get_output_embeddings() is None); "
            "lstune trains causal LMs: load the model with AutoModelForCausalLM."
        )
    return head


def is_norm(module: "nn.Module") -> bool:
    """A norm has parameters and all of them are vectors (RMSNorm: weight; LayerNorm: weight + bias)."""
    params = list(module.parameters())
    return bool(params) and all(p.dim() == 1 for p in params)


def text_config(model: "nn.Module"):
    """The config describing the language model (`text_config` of multimodal configs, else the config)."""
    return _text_config(unwrap_model(model))


def attention_heads(config: Any) -> tuple[int, int, int] | None:
    """(query heads, key/value heads, head dim) of a transformers config (its text config for multimodal ones);
    None for a model without attention heads (Mamba, RWKV). Where they vary per layer (transformers then refuses
    the global attribute and lists the layers in `per_layer_config`), the widest layer's."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        return _uniform_attention_heads(config)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        shapes = [shape for layer in config.per_layer_config if (shape := _uniform_attention_heads(layer))]
        return max(shapes, key=lambda shape: shape[0] * shape[2], default=None)


def mixer_units(config: Any) -> int | None:
    """For a model without attention heads, how many units its token mixers split into under head-parallel SP
    (lstune.models.mixers), from its config: a Mamba-1 mixer's channels (Mamba, FalconMamba: `intermediate_size`,
    beside `time_step_rank` and `state_size`), a Mamba-2 mixer's SSM heads (Mamba2: `num_heads`, beside `head_dim`
    and `n_groups`); None for any other. Only the plan's cap: the mixers found in the model decide at install."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "num_heads", None) and getattr(config, "head_dim", None) and getattr(config, "n_groups", None):
        return config.num_heads
    if getattr(config, "time_step_rank", None) and getattr(config, "state_size", None):
        return getattr(config, "intermediate_size", None) or None
    return None


def _uniform_attention_heads(config: Any) -> tuple[int, int, int] | None:
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, head_dim


def _text_config(lm: "nn.Module"):
    config = lm.config
    return getattr(config, "text_config", None) or config


def _has_matrices(module: "nn.Module") -> bool:
    return any(p.dim() >= 2 for p in module.parameters())


def _is_attention(module: "nn.Module") -> bool:
    return (
        hasattr(module, "head_dim")
        or hasattr(module, "num_key_value_groups")
        or "attention" in type(module).__name__.lower()
    )


def _is_module(obj) -> bool:
    from torch import nn

    return isinstance(obj, nn.Module)
