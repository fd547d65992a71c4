"""Loss head: summed token cross-entropy from final hidden states, tile by tile.

Hugging Face's `*ForCausalLM.forward` projects every position to the vocabulary before the loss: at
Llama-3.1-8B / 16K tokens that is a 7.65 GiB fp32 logits tensor, and the loss needs about two of
them (ALST Sec. 3.1). lstune never calls it: the decoder body runs to its final hidden states and
this head computes the loss.

Steps (generic path, `tiling.sequence_tiled` with `reduce="sum"`):
1. Flatten hidden states to tokens `[B·S, D]` and pre-shifted labels to `[B·S]` (labels were shifted
   on the full sequence, so no tile loses a target at its edge: ALST Sec. 4.3).
2. Per tile: logits = output embedding(h) (its LoRA adapter included), cast to fp32, the model's
   logit transform (see `LogitTransform`), cross-entropy summed over labels != -100.
3. Backward recomputes each tile's logits; the LM head weight gradient (the input embedding's with
   tied embeddings) is accumulated over tiles and scaled by the upstream gradient once per tile.
   Under ZeRO-3 a tied weight is marked shared, so ZeRO reduces its gradient once, after the input
   embedding's gradient is added (see tiling.py).
4. Fused final norm (`fuse_final_norm`, installed by `apply_memory_techniques` on the tiled and Liger paths when
   a probe shows it exact): the body calls its final norm as an identity (`patching.FusedNorm`, the mechanism
   mini-sequence uses) and each tile norms its slice before the head, so forward and recompute keep only the
   un-normed hidden states. HF's RMSNorm otherwise keeps a full-sequence fp32 copy of its input and its output for
   backward (with a trainable weight also the normalised input): 6 B per hidden value in a bf16 LoRA run, of which
   the tiles leave the 2 B head input plus one tile's worth.
The head returns (sum, count); the caller divides by the token count of the whole accumulation
window (MST Alg. 2's per-chunk mean is only right when chunks have equal label counts).

Tile sizes: `auto` keeps one tile's fp32 logits at about 1 GiB (ALST: tile_len = 2^28 / vocab
tokens); mini-sequence mode uses MST's M = vocab / hidden tiles; an int is a tile count; every
choice is raised until a tile's logits have < 2^31 elements. Memory: O(seq · vocab) → O(tile_len ·
vocab) + O(seq · hidden) (saved hidden states and their gradient; fused, the final norm's copies become
O(tile_len · hidden)). Cost: the logits matmul runs twice (forward, recompute), plus once for the weight
gradient, as without tiling; a fused final norm runs twice too.

On CUDA with liger-kernel installed, `auto` uses Liger's fused linear cross-entropy instead
(reduction "sum", its softcap, scaling folded into the hidden states) when the head is a plain
Linear not partitioned by ZeRO-3; it never materialises full logits either and is faster (ALST
recommends it where it applies). Liger takes the whole normed sequence, so a fused final norm (step 4) runs
before it through the same mechanism, `sequence_tiled` in the loss head's tiles (`normed_in_tiles`): forward keeps
no norm internals, backward recomputes the norm one tile at a time. Memory: the un-normed input (kept by the
tiling), the normed output (one hidden vector per token in the input's dtype, read by Liger and then dropped; in
backward the input's gradient takes its place) and one tile's norm internals, instead of the 6 B per hidden value
HF's norm keeps (bf16 LoRA: 24 GiB at 1M tokens x hidden 4096) and the fp32 temporaries of its backward. Cost: the
norm runs twice. The Liger path needs CUDA; the CPU tests run it with a pure-torch stand-in for Liger's function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Union

import torch
import torch.nn.functional as F

from lstune.data.batch import IGNORE_INDEX
from lstune.memory.patching import FusedNorm, Undo
from lstune.memory.tiling import TilePolicy, int32_safe_tiles, is_zero3_partitioned, sequence_tiled, tile_bounds
from lstune.models.introspect import ModelParts, decoder_body, find_parts, text_config

if TYPE_CHECKING:
    from torch import nn

    from lstune.models.chunk_layout import AttentionChunks

LOSS_TILE_BYTES = 2**30  # fp32 logits per tile (ALST's ~1 GiB shards)

# "auto" | "off" | a tile count | a TilePolicy (what apply_memory_techniques stores in its plan)
LossTiles = Union[str, int, TilePolicy]

# Config attributes that scale logits after the LM head. Multipliers: Cohere (`logit_scale`),
# Falcon-H1 (`lm_head_multiplier`). Divisor: Granite family and MiniCPM3 (`logits_scaling`), except
# the model types listed in _LOGITS_SCALING_MULTIPLIES, which multiply by it.
_MULTIPLIER_ATTRS = ("logit_scale", "lm_head_multiplier")
_DIVISOR_ATTR = "logits_scaling"
_LOGITS_SCALING_MULTIPLIES = frozenset({"hyperclovax"})


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to its LM head output before the loss: scale, then tanh softcap (Gemma-2/3)."""

    multiplier: float | None = None
    divisor: float | None = None
    softcap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.multiplier is not None:
            logits = logits * self.multiplier
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @property
    def scale(self) -> float:
        """The combined linear factor, foldable into the hidden states (h·s)·Wᵀ = s·(h·Wᵀ) without a bias."""
        return (self.multiplier or 1.0) / (self.divisor or 1.0)


def logit_transform(config) -> LogitTransform:
    """Read the logit scaling and final softcapping of a (text) config."""
    multiplier = None
    for attr in _MULTIPLIER_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, (int, float)) and value != 1:
            multiplier = (multiplier or 1.0) * float(value)
    divisor = getattr(config, _DIVISOR_ATTR, None)
    divisor = float(divisor) if isinstance(divisor, (int, float)) and divisor != 1 else None
    if divisor is not None and getattr(config, "model_type", None) in _LOGITS_SCALING_MULTIPLIES:
        multiplier, divisor = (multiplier or 1.0) * divisor, None
    softcap = getattr(config, "final_logit_softcapping", None)
    return LogitTransform(multiplier, divisor, float(softcap) if softcap else None)


def alst_loss_policy(vocab: int) -> TilePolicy:
    """ALST: tiles whose fp32 logits hold about `LOSS_TILE_BYTES` (1 GiB)."""
    return TilePolicy(tile_len=max(1, LOSS_TILE_BYTES // (4 * vocab)))


def mst_loss_policy(vocab: int, hidden: int) -> TilePolicy:
    """MST: M = vocab / hidden tiles, so one tile's logits are as large as the hidden states."""
    return TilePolicy(count=math.ceil(vocab / hidden))


def causal_lm_loss_sum(
    model: "nn.Module", batch: dict[str, torch.Tensor], *, tiles: LossTiles = "auto", parts: ModelParts | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed token CE loss: fp32 0-d, differentiable; count of labels != -100: int64 0-d).

    Runs the decoder body to its final hidden states (HF never computes logits), then the loss head.
    `tiles`: "auto" (~1 GiB fp32 logits per tile, or Liger on CUDA), "off" (one tile: plain logits, same
    numbers), an int tile count, or a TilePolicy; a model prepared by `apply_memory_techniques` uses its
    plan's setting through `MemoryPlan.loss_sum`. `parts`: the model's parts when already found.
    """
    parts = parts or find_parts(model)
    hidden_BSD = final_hidden_states(model, batch, parts=parts)
    return loss_sum_from_hidden(model, hidden_BSD, batch["shift_labels"], tiles=tiles, parts=parts)


def causal_lm_eval_sums(
    model: "nn.Module", batch: dict[str, torch.Tensor], *, tiles: LossTiles = "auto", parts: ModelParts | None = None,
    misses: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`causal_lm_loss_sum`'s (sum, count), plus with `misses` the `argmax_misses` of the same forward (else None)."""
    parts = parts or find_parts(model)
    hidden_BSD = final_hidden_states(model, batch, parts=parts)
    loss, count = loss_sum_from_hidden(model, hidden_BSD, batch["shift_labels"], tiles=tiles, parts=parts)
    wrong = argmax_misses(model, hidden_BSD, batch["shift_labels"], parts=parts) if misses else None
    return loss, count, wrong


@torch.no_grad()
def argmax_misses(
    model: "nn.Module", hidden_BSD: torch.Tensor, shift_labels_BS: torch.Tensor, *, parts: ModelParts | None = None
) -> torch.Tensor:
    """How many labels (!= -100) are not the argmax of their logits (int64 0-d): teacher-forced greedy decoding.

    Only labelled rows go through the LM head, one ALST loss tile (~1 GiB of fp32 logits) at a time, so no full
    `[seq, vocab]` logits exist. The head runs once per tile of the local length, labelled rows or none: every
    rank of an SP group (equal shard lengths) then calls it equally often, as ZeRO-3's gathers inside it need.
    """
    parts = parts or find_parts(model)
    head, norm = parts.output_embedding, fused_final_norm(parts)
    transform = logit_transform(parts.text_config)
    hidden_TD = hidden_BSD.reshape(-1, hidden_BSD.shape[-1])
    labels_T = shift_labels_BS.reshape(-1).to(hidden_TD.device)
    vocab = vocab_rows(head)
    misses = torch.zeros((), dtype=torch.int64, device=hidden_TD.device)
    for start, end in tile_bounds(len(labels_T), alst_loss_policy(vocab).tiles(len(labels_T), width=vocab)):
        rows_R = (labels_T[start:end] != IGNORE_INDEX).nonzero().squeeze(1) + start
        logits_RV = transform(head(_normed(norm, hidden_TD[rows_R])).float())
        misses += (logits_RV.argmax(-1) != labels_T[rows_R]).sum()
    return misses


def final_hidden_states(
    model: "nn.Module", batch: dict[str, torch.Tensor], *, parts: ModelParts | None = None
) -> torch.Tensor:
    """The decoder body's `last_hidden_state` for the batch (no attention mask: position_ids carry packing); before the
    final norm when `fuse_final_norm` moved it into the loss head."""
    body = parts.body if parts is not None else decoder_body(model)
    out = body(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def loss_sum_from_hidden(
    model: "nn.Module", hidden_BSD: torch.Tensor, shift_labels_BS: torch.Tensor, *, tiles: LossTiles = "auto",
    parts: ModelParts | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss head alone: (summed CE, label count) from final hidden states and pre-shifted labels."""
    _check_tiles(tiles)
    parts = parts or find_parts(model)
    head = parts.output_embedding
    transform = logit_transform(parts.text_config)
    norm = fused_final_norm(parts)
    hidden_TD = hidden_BSD.reshape(-1, hidden_BSD.shape[-1])
    labels_T = shift_labels_BS.reshape(-1).to(hidden_TD.device)
    count = (labels_T != IGNORE_INDEX).sum()
    if tiles == "auto" and liger_applies(head, hidden_TD):
        normed_TD = normed_in_tiles(norm, hidden_TD, vocab=vocab_rows(head))
        return _liger_loss_sum(head, transform, normed_TD, labels_T), count
    n_tiles = loss_tile_count(tiles, hidden_TD.shape[0], vocab_rows(head), hidden_TD.shape[-1])
    fn = partial(_tile_loss_sum, head, transform, labels_T, norm)
    params = list(head.parameters()) + (list(norm.parameters()) if norm is not None else [])
    loss = sequence_tiled(
        fn, hidden_TD, tiles=n_tiles, dim=0, params=params, reduce="sum", shared_params=parts.tied_to_input(params)
    )
    return loss, count


def loss_tile_count(setting: LossTiles, n_tokens: int, vocab: int, hidden: int) -> int:
    """How many tiles `setting` cuts `n_tokens` into (int32-safe except for "off", which is one tile)."""
    if setting == "off":
        return 1
    if isinstance(setting, TilePolicy):
        return setting.tiles(n_tokens, width=vocab)
    if isinstance(setting, int):
        return int32_safe_tiles(n_tokens, vocab, max(1, min(setting, n_tokens)))
    return alst_loss_policy(vocab).tiles(n_tokens, width=vocab)


def vocab_rows(head: "nn.Module") -> int:
    """Rows of the LM head (the logits width), LoRA-wrapped or not."""
    out_features = getattr(head, "out_features", None)
    return out_features if isinstance(out_features, int) else head.weight.shape[0]


def _tile_loss_sum(head, transform: LogitTransform, labels_T, norm, hidden_tile, start: int, end: int) -> torch.Tensor:
    logits = transform(head(_normed(norm, hidden_tile)).float())
    return F.cross_entropy(logits, labels_T[start:end], ignore_index=IGNORE_INDEX, reduction="sum")


def fused_final_norm(parts: ModelParts) -> "nn.Module | None":
    """The body's final norm when `fuse_final_norm` runs it inside the loss head, else None."""
    norm = parts.final_norm
    return norm if norm is not None and FusedNorm.installed(norm) else None


def _normed(norm: "nn.Module | None", hidden: torch.Tensor) -> torch.Tensor:
    return hidden if norm is None else FusedNorm.call(norm, hidden)


def normed_in_tiles(norm: "nn.Module | None", hidden_TD: torch.Tensor, *, vocab: int) -> torch.Tensor:
    """The fused final norm (`fused_final_norm`; None: `hidden_TD` as it is) applied to `[T, D]` hidden states tile by
    tile through `sequence_tiled`, for Liger, which takes the whole normed sequence (module doc, the Liger paragraph).

    Memory: the normed output (one hidden vector per token in the input's dtype) and one tile's norm internals, instead
    of HF's full-sequence fp32 copies and fp32 backward temporaries. Cost: the norm runs twice (forward, recompute)."""
    if norm is None:
        return hidden_TD
    n_tokens, hidden = hidden_TD.shape
    # The loss head's own tiles (ALST, ~1 GiB of fp32 logits: ~2K tokens at a 128K vocabulary): the tiled path norms
    # in exactly these, so both paths keep the same norm memory (one estimate formula), and a tile of ~8M values is
    # still large enough for the norm's elementwise kernels. int32-safe for the norm's own width as well.
    tiles = int32_safe_tiles(n_tokens, hidden, loss_tile_count("auto", n_tokens, vocab, hidden))
    return sequence_tiled(partial(_tile_normed, norm), hidden_TD, tiles=tiles, dim=0, params=list(norm.parameters()))


def _tile_normed(norm: "nn.Module", hidden_tile: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return FusedNorm.call(norm, hidden_tile)


def fuse_final_norm(parts: ModelParts, chunks: AttentionChunks | None = None) -> Undo | None:
    """Make the body's final norm an identity and run it in each loss tile instead (module doc), when a probe shows
    that is exact: the probe's normed hidden states equal the norm applied to the un-normed ones, whole and in two
    uneven slices (so nothing follows the norm in the body and it is per token). Returns the undo, or None (left
    alone) when the body has no single final norm or the probe differs. Needs real weights (`probe`); `chunks`: the
    chunked attention installed (the probe's layout must suit it, `probe.probe_inputs`)."""
    from lstune.memory.probe import eval_mode, probe_hidden_states, probe_inputs

    norm = parts.final_norm
    if norm is None:
        return None
    inputs = probe_inputs(parts, chunks=chunks)
    reference = probe_hidden_states(parts, inputs)
    undo = FusedNorm.install(norm, what="final norm fused into the loss tiles")
    try:
        raw = probe_hidden_states(parts, inputs)
        with torch.no_grad(), eval_mode(norm):
            whole = FusedNorm.call(norm, raw)
            sliced = torch.cat([FusedNorm.call(norm, raw[:, :3]), FusedNorm.call(norm, raw[:, 3:])], dim=1)
    except BaseException:
        undo()
        raise
    tol = 1e-5 if reference.dtype == torch.float32 else 1e-2
    if all(torch.allclose(out, reference, rtol=tol, atol=tol) for out in (whole, sliced)):
        return undo
    undo()
    return None


def _check_tiles(tiles: LossTiles) -> None:
    if isinstance(tiles, bool) or not (tiles in ("auto", "off") or isinstance(tiles, (int, TilePolicy))):
        raise ValueError(f"tiles must be 'auto', 'off', an int or a TilePolicy, not {tiles!r}")
    if isinstance(tiles, int) and tiles < 1:
        raise ValueError(f"tiles must be >= 1, not {tiles}")


def liger_applies(head: "nn.Module", hidden: torch.Tensor) -> bool:
    """Liger's fused linear CE fits: CUDA, liger-kernel installed, and a plain bias-free Linear head (no
    adapter; a logit scale is folded into the hidden states, which a bias would not survive).

    Not under ZeRO-3: Liger reads `head.weight` directly, outside the module call that gathers it.
    """
    if hidden.device.type != "cuda" or type(head) is not torch.nn.Linear or head.bias is not None:
        return False
    if is_zero3_partitioned(head.weight):
        return False
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except ImportError:
        return False
    return True


def _liger_loss_sum(head, transform: LogitTransform, hidden_TD, labels_T) -> torch.Tensor:
    """Liger's fused linear cross-entropy, summed; a linear logit scale is folded into the hidden states."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    if transform.scale != 1.0:
        hidden_TD = hidden_TD * transform.scale
    weight, bias = head.weight, head.bias
    if torch.is_autocast_enabled("cuda"):
        # Liger's autograd.Function does not autocast; cast as autocast would for the LM head's matmul.
        dtype = torch.get_autocast_dtype("cuda")
        hidden_TD, weight = hidden_TD.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    loss = liger_fused_linear_cross_entropy(
        hidden_TD,
        weight,
        labels_T,
        bias=bias,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        softcap=transform.softcap,
    )
    return loss.float()


@torch.no_grad()
def check_loss_head(parts: ModelParts) -> None:
    """Raise ModelError unless head + transform reproduce the model's own logits, and token cross-entropy its own
    loss, on a few-token probe.

    Catches architectures that post-process logits in a way `logit_transform` does not know, and models whose own
    loss adds a term to the cross-entropy (MoE routers' load-balancing loss, a remote model's z-loss): lstune's
    head computes token cross-entropy only, so such a model would train on a different objective.
    """
    from lstune.errors import ModelError
    from lstune.memory.probe import eval_mode, probe_hidden_states, probe_inputs

    check_loss_config(parts.text_config)
    inputs = probe_inputs(parts)
    with eval_mode(parts.lm):
        out = parts.lm(**inputs, labels=inputs["input_ids"], use_cache=False)
    reference = out.logits.float()
    ours = logit_transform(parts.text_config)(parts.output_embedding(probe_hidden_states(parts, inputs)).float())
    tol = 1e-4 if parts.output_embedding.weight.dtype == torch.float32 else 3e-2
    if not torch.allclose(ours, reference, rtol=tol, atol=tol * reference.abs().max().item()):
        raise ModelError(
            f"lstune's loss head does not reproduce {type(parts.lm).__name__}'s logits "
            "(it post-processes logits in a way lstune does not know); this architecture is not supported yet."
        )
    check_own_loss(parts.lm, getattr(out, "loss", None), own_loss_candidates(reference, inputs["input_ids"]), rtol=tol)


def own_loss_candidates(logits: "torch.Tensor", labels: "torch.Tensor") -> tuple[float, float]:
    """The token cross-entropy a model's own loss may be, given `labels`: shifted by one (Hugging Face's causal-LM
    convention) or as given (BartForCausalLM and the other encoder-decoder families' decoders, which expect labels
    already shifted). Either is plain token cross-entropy; lstune computes its own from pre-shifted labels."""
    logits = logits.float()
    shifted = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX)
    as_given = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    return shifted.item(), as_given.item()


def check_own_loss(lm: "nn.Module", own: "torch.Tensor | None", token_ce: tuple[float, ...], *, rtol: float) -> None:
    """ModelError when the model's own loss (`own`, its forward's `.loss` given labels) is none of the token
    cross-entropies `token_ce` of the same logits (`own_loss_candidates`): the forward adds a term lstune's head
    does not compute. In a 16-bit probe a small term (a router loss of ~1e-3) hides under the tolerance; the fp32
    self-check (lstune.train.self_check) and `check_loss_config` catch those."""
    from lstune.errors import ModelError

    if own is None or any(math.isclose(own.item(), ce, rel_tol=rtol, abs_tol=rtol) for ce in token_ce):
        return
    check_loss_config(text_config(lm))  # the known cause, with its fix
    raise ModelError(
        f"{type(lm).__name__}'s own loss is not token cross-entropy ({own.item():.7g} against {token_ce[0]:.7g} on a "
        "probe): its forward adds a term that lstune's loss head does not compute, so training would silently "
        "differ from Hugging Face's; this model is not supported yet."
    )


def check_loss_config(text_config) -> None:
    """ModelError when the config asks the model's own loss to add the routers' load-balancing loss
    (`output_router_logits` with a non-zero `router_aux_loss_coef`): lstune's loss is token cross-entropy only.
    Checked on the config so it holds where no probe can run (meta or fake weights)."""
    from lstune.errors import ModelError

    coef = getattr(text_config, "router_aux_loss_coef", None)
    if not getattr(text_config, "output_router_logits", False) or not coef:
        return  # no coefficient: whether the model adds a term at all is the probe's to find (check_loss_head)
    raise ModelError(
        f"this model's config asks for the routers' load-balancing loss (output_router_logits: true, "
        f"router_aux_loss_coef: {coef}), which Hugging Face adds to the loss and lstune's loss head does not "
        "compute, so training would silently differ. Set \"output_router_logits\": false in the config.json of a "
        "local copy of the model (Hugging Face's default for every MoE model; the loss is then token "
        "cross-entropy, as lstune computes it) and pass that folder to --model."
    )
