"""Token mixers that are not attention — short convolutions, linear attention, state-space scans — exact with
packed documents and under sequence parallelism.

lstune keeps packed documents apart and shards the sequence for SP through attention (documents from
`position_ids`, all-to-alls around the attention call). A layer that mixes tokens another way — the short causal
convolutions of LFM2, the convolution and recurrent state of Gated DeltaNet (Qwen3-Next, Qwen3.5) and Mamba-2
(Bamba, Nemotron-H, Falcon-H1, GraniteMoeHybrid) — reads every earlier token directly: across a packed document
boundary (in plain transformers too: these layers ignore `position_ids`) and, under SP, beyond its rank's shard.
Such a mixer is found structurally (the module that owns a convolution inside a decoder layer) and its instance's
`forward` is replaced, undoably, by `DocumentMixer`:

* **packed documents** (one process): the module's own forward runs once per document of each row — a document
  starts where `position_ids` does not continue by +1, as for attention — so the convolution sees zero padding and
  the recurrent state starts at zero at every document start, exactly as for the document run alone. (transformers'
  torch paths take no `seq_idx`/`cu_seqlens`: their kernels ignore it; the per-document loop is lstune's own reset.)
* **sequence parallelism, head-parallel like Ulysses** (`MixerFamily`: Gated DeltaNet, KDA, Mamba-2, Mamba-1,
  ShortConv, lightning attention): the input projections run on the rank's
  sequence shard; an all-to-all gives each rank the whole timeline of its heads' channels (uneven head counts as
  in Ulysses' `HeadPlan`); there the module's own forward runs, per document, on a *view* of the module that holds
  only those heads — its convolution weights, `A_log`, `dt_bias`, `D` sliced, its projections reading the
  exchanged channels, its output projection left out; an all-to-all brings the output back to the shard, where the
  norms that mix heads and the output projection run. Memory per rank: the mixer's activations for S·(its heads)/sp
  channels; cost: two all-to-alls per mixer layer of the projected channels.
* **every SP layout the attention imposes** (`ShardOrder`): the shards need not be contiguous — chunked attention
  lays them out in FPDT's pieces, a ring (`--sp-ring`) in zigzag pieces (lstune.models.chunk_layout). After the
  all-to-all the gathered timeline (every rank's shard, in rank order) is put in global time order by a permutation
  taken from the layout object itself (`SequenceLayout.shard` of the global token indices), the conv / recurrence
  runs there, per document from the gathered positions in the same order, and the output is permuted back before the
  all-to-all home. Under a ring the head-parallel group is the whole SP group (Ulysses × ring), so the mixer's heads
  are split over all its ranks (refused, naming the fix, when it has fewer heads than the SP degree).

Each installed wrapper is checked at once by a probe (`probe_mixer`): on a few tokens holding a document boundary
and, under SP, every rank's shard boundary, its output must equal the module's own forward on each document alone.
MiniMax's lightning attention owns no convolution and is recognised by its structure (`LIGHTNING`). Mamba-1 (Jamba,
Mamba, FalconMamba) splits by channel, its `x_proj` (which reads every channel of a token) summed over the ranks; a
model with no attention heads (Mamba, FalconMamba, Mamba2) takes its SP degree from its mixers' units
(`lstune.models.introspect.mixer_units`). A convolution-owning module of no known family is refused under SP with its
name; with packing alone any such module runs per document (the probe still checks it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from lstune.errors import DataError, ModelError

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger("lstune")

_PROBE_SHARD = 6  # tokens per rank in the probe: more than a short convolution's window, so shard edges are crossed
_PROBE_RTOL = {"float32": 1e-4, "float64": 1e-8}
_PROBE_RTOL_LOW = 3e-2  # bf16 / fp16


def convolution_mixers(layers: "nn.ModuleList") -> list[str]:
    """Qualified names (`layers.<i>.<path>`) of the convolutions inside the decoder layers."""
    from torch import nn

    found = []
    for index, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if isinstance(module, (nn.Conv1d, nn.Conv2d)):
                found.append(f"layers.{index}.{name}")
    return found


def mixer_sites(layers: "nn.ModuleList") -> list[tuple[str, "nn.Module"]]:
    """(qualified name, module) of each token mixer inside the decoder layers, in layer order: each module that owns
    a convolution (its parent, when peft wrapped the convolution), and each module of a family that has none."""
    owners: dict[str, Any] = {}
    for index, layer in enumerate(layers):
        modules = dict(layer.named_modules())
        for name in convolution_mixers(layers[index : index + 1]):
            path = name.split(".", 2)[2]
            parent = path.rpartition(".")[0]
            while parent and _is_peft_wrapper(modules.get(parent)):
                parent = parent.rpartition(".")[0]
            owners.setdefault(f"layers.{index}.{parent}" if parent else f"layers.{index}", modules[parent])
        for name, module in modules.items():  # recurrent mixers with no convolution (MiniMax's lightning attention)
            if name and family_of(module) is not None:
                owners.setdefault(f"layers.{index}.{name}", module)
    return sorted(owners.items(), key=lambda item: _layer_order(item[0]))


def _layer_order(name: str) -> tuple[int, str]:
    return int(name.split(".")[1]), name


def _is_peft_wrapper(module: Any) -> bool:
    return module is not None and hasattr(module, "base_layer")


# --------------------------------------------------------------------------------------------------------------------
# positions: documents of the current forward
# --------------------------------------------------------------------------------------------------------------------


class ShardOrder:
    """Where the SP ranks' tokens sit in the sample — the layout the attention imposes (lstune.models.chunk_layout:
    contiguous shards, FPDT's pieces under chunked attention, the zigzag pieces under a ring) — and the permutation
    that puts the tokens an all-to-all gathers (every rank's shard, in rank order) in global time order. Derived from
    the layout object itself (`SequenceLayout.shard` of the global token indices, rank by rank), so any layout it
    produces is followed. `chunks` is set once the memory techniques have chosen the attention's (`follow`)."""

    def __init__(self, sp: int = 1, ring: int = 1, chunks: Any = None):
        self.sp, self.ring, self.chunks = sp, ring, chunks
        self._cache: dict = {}

    def follow(self, chunks: Any) -> None:
        """Lay shards out for the attention's `chunks` (lstune.models.chunk_layout.AttentionChunks)."""
        self.chunks, self._cache = chunks, {}

    def padded(self, length: int):
        """The layout (lstune.models.chunk_layout.SequenceLayout) of a sample of `length` tokens, padded for it."""
        from lstune.models.chunk_layout import sequence_layout

        return sequence_layout(length, self.sp, self.chunks, self.ring)

    def layout(self, local_seq: int):
        """The layout of a sample whose shards are `local_seq` tokens long."""
        layout = self.padded(local_seq * self.sp)
        if layout.length != local_seq * self.sp:
            raise DataError(f"a {local_seq}-token shard on {self.sp} ranks is not laid out for "
                            f"{self.describe()} (samples are padded to {layout.length} tokens for it); shard batches "
                            "with lstune's SP data adapter (SPDataAdapter / shard_batch) given the run's layout.")
        return layout

    def describe(self) -> str:
        if self.ring > 1:
            return f"ring attention's zigzag pieces (a ring of {self.ring})"
        chunked = self.chunks is not None and self.chunks.setting != "off"
        return f"chunked attention's pieces ({self.chunks.describe()})" if chunked else "contiguous shards"

    def gathered_index(self, local_seq: int, device) -> "tuple[torch.Tensor, torch.Tensor] | None":
        """(to_global, to_gathered): the gathered position of each global token and the global index of each
        gathered token (`x_global = x_gathered[:, to_global]`, `x_gathered = x_global[:, to_gathered]`); None when
        the gathered order is the global one (contiguous shards)."""
        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        key = (local_seq, str(device))
        if key not in self._cache:
            with unset_fake_temporarily():  # real indices also in the estimator's trace (fake tensors)
                layout = self.layout(local_seq)
                tokens = torch.arange(layout.length).unsqueeze(0)
                to_gathered = torch.cat([layout.shard(tokens, rank)[0] for rank in range(self.sp)])
                identity = bool((to_gathered == tokens[0]).all())
                both = None if identity else (torch.argsort(to_gathered), to_gathered)
            self._cache[key] = None if both is None else tuple(index.to(device) for index in both)
        return self._cache[key]

    def to_global(self, x_BS_: "torch.Tensor") -> "torch.Tensor":
        """The gathered tokens (dim 1) of `x_BS_` in global order."""
        index = self.gathered_index(x_BS_.shape[1] // self.sp, x_BS_.device)
        return x_BS_ if index is None else x_BS_.index_select(1, index[0])

    def to_gathered(self, x_BS_: "torch.Tensor") -> "torch.Tensor":
        """`to_global`'s inverse."""
        index = self.gathered_index(x_BS_.shape[1] // self.sp, x_BS_.device)
        return x_BS_ if index is None else x_BS_.index_select(1, index[1])


class DocumentPositions:
    """The `position_ids` of the forward in flight, read by a pre-hook on the decoder body (the mixers are not
    passed them), gathered across the SP group by `exchange` and put in global order by `order` (global documents),
    and cut into document spans once per forward. An activation-checkpoint recompute runs before the next forward, so
    it reads the same positions."""

    def __init__(self, exchange: Any = None, order: ShardOrder | None = None):
        self.exchange = exchange
        self.order = order if order is not None else ShardOrder(exchange.sp if exchange is not None else 1)
        self.current: Any = None
        self._cache: tuple[Any, Any] = (None, None)

    def hook(self, module, args, kwargs):
        self.current = kwargs.get("position_ids")

    def spans(self, batch: int, local_seq: int) -> list[list[tuple[int, int]]]:
        """Per row, the (start, end) of each document over the whole (gathered) sequence, in global order."""
        from lstune.models.attention import document_spans

        positions = self.current
        sp = self.exchange.sp if self.exchange is not None else 1
        if positions is None:
            if sp > 1:
                raise DataError("sequence parallelism over a linear-attention / state-space mixer needs position_ids "
                                "(they mark where each shard and document starts); batches from lstune's data "
                                "pipeline have them.")
            return [[(0, local_seq)]] * batch
        if self._cache[0] is not positions:
            full = self.order.to_global(self.exchange.full_positions(positions)) if sp > 1 else positions
            self._cache = (positions, document_spans(full))
        return self._cache[1]


# --------------------------------------------------------------------------------------------------------------------
# module views: the module's own forward on a subset of its heads
# --------------------------------------------------------------------------------------------------------------------


class _Conv:
    """A depthwise causal convolution with a subset of a real one's channels (what the mixers read: `.weight`,
    `.bias`, or a call)."""

    def __init__(self, conv: "nn.Module", channels: "torch.Tensor"):
        self.weight = conv.weight.index_select(0, channels)
        self.bias = conv.bias.index_select(0, channels) if conv.bias is not None else None
        self.padding, self.kernel_size = conv.padding, conv.kernel_size

    def __call__(self, x_BCS):
        import torch.nn.functional as F

        return F.conv1d(x_BCS, self.weight, self.bias, padding=self.padding, groups=self.weight.shape[0])


class _DeferredNorm:
    """A gated norm left to the sequence side (it mixes heads a rank does not hold): the view's forward calls it
    and gets its input back; `used` tells the wrapper to apply the real norm after the all-to-all."""

    def __init__(self):
        self.used = False

    def __call__(self, hidden_states, gate=None):
        self.used = True
        return hidden_states


def _identity(x):
    return x


def module_view(module: "nn.Module", **attributes: Any) -> "nn.Module":
    """A shallow stand-in for `module`: same class and attributes, with `attributes` (sliced parameters, local
    head counts, projections that read exchanged channels) shadowing the module's own. Nothing of the real module
    changes; `type(module).forward(view, ...)` runs the module's own code on the view."""
    view = object.__new__(type(module))
    state = dict(vars(module))
    state["_parameters"], state["_modules"], state["_buffers"] = {}, {}, {}
    state.update({**module._parameters, **module._modules, **module._buffers})
    state.pop("forward", None)
    state["_forward_hooks"], state["_forward_pre_hooks"] = {}, {}
    state["training"] = False  # skips the fused training kernels (they take the whole module's norm and projection)
    state.update(attributes)
    object.__setattr__(view, "__dict__", state)
    return view


def _index(values: list[int], device) -> "torch.Tensor":
    import torch

    return torch.tensor(values, dtype=torch.long, device=device)


# --------------------------------------------------------------------------------------------------------------------
# families with a head-parallel plan
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class MixerFamily:
    """How one family's mixer splits into `units` (heads or channel groups) for head-parallel SP.

    `units(module)`: how many; `streams(module, x_BsC)`: (per-unit channels `[B, s, U, w]` made on the sequence
    shard, what stays there); `view(module, start, count, like)`: the module restricted to units
    `[start, start + count)`, whose forward takes the exchanged channels flattened `[B, S, count·w]` and returns
    `[B, S, count·w_out]`; `finish(module, y_BsUw, kept, view)`: the sequence-side rest (output projection)."""

    name: str
    matches: Callable[[Any], bool]
    units: Callable[[Any], int]
    streams: Callable[[Any, Any], tuple[Any, Any]]
    view: Callable[[Any, int, int, Any], Any]
    finish: Callable[[Any, Any, Any, Any], Any]
    examples: tuple[str, ...] = field(default=())
    reduces: bool = False  # its view also takes the exchange (a projection summed over every rank's channels)


def _has(module: Any, *names: str) -> bool:
    return all(hasattr(module, n) for n in names)


def _plain_conv(conv: Any) -> bool:
    from torch import nn

    return type(conv) is nn.Conv1d and conv.groups == conv.in_channels == conv.out_channels


def _unflat(x, units):
    return x.reshape(*x.shape[:2], units, -1)


# Gated DeltaNet (Qwen3-Next, Qwen3.5): unit = one key head with its num_v/num_k value heads; per unit the channels
# q (dk) | k (dk) | v (r·dv) | z (r·dv) | b (r) | a (r).

def _gdn_common(module: Any) -> bool:
    return (_has(module, "conv1d", "A_log", "dt_bias", "norm", "out_proj", "num_k_heads", "num_v_heads",
                 "head_k_dim", "head_v_dim") and _plain_conv(module.conv1d)
            and module.num_v_heads % module.num_k_heads == 0
            and module.conv1d.in_channels == 2 * module.num_k_heads * module.head_k_dim
            + module.num_v_heads * module.head_v_dim)


def _gdn_sizes(module: Any) -> tuple[int, int, int]:
    return module.head_k_dim, module.head_v_dim, module.num_v_heads // module.num_k_heads


def _gdn_fused_streams(module, x):
    import torch

    qkvz = _unflat(module.in_proj_qkvz(x), module.num_k_heads)
    ba = _unflat(module.in_proj_ba(x), module.num_k_heads)
    return torch.cat([qkvz, ba], dim=-1), None


def _gdn_split_streams(module, x):
    import torch

    dk, dv, r = _gdn_sizes(module)
    hk = module.num_k_heads
    q, k, v = module.in_proj_qkv(x).split([hk * dk, hk * dk, hk * r * dv], dim=-1)
    parts = [q, k, v, module.in_proj_z(x), module.in_proj_b(x), module.in_proj_a(x)]
    return torch.cat([_unflat(p, hk) for p in parts], dim=-1), None


def _gdn_view_common(module, start: int, count: int, like) -> dict:
    dk, dv, r = _gdn_sizes(module)
    key_dim = module.num_k_heads * dk
    q = list(range(start * dk, (start + count) * dk))
    v = list(range(2 * key_dim + start * r * dv, 2 * key_dim + (start + count) * r * dv))
    channels = _index(q + [key_dim + c for c in q] + v, like.device)
    heads = slice(start * r, (start + count) * r)
    return dict(num_k_heads=count, num_v_heads=count * r, key_dim=count * dk, value_dim=count * r * dv,
                conv_dim=2 * count * dk + count * r * dv, conv1d=_Conv(module.conv1d, channels),
                A_log=module.A_log[heads], dt_bias=module.dt_bias[heads], out_proj=_identity)


def _gdn_fused_view(module, start, count, like):
    dk, dv, r = _gdn_sizes(module)
    qkvz = 2 * dk + 2 * r * dv

    def read(lo, hi):
        return lambda s: _unflat(s, count)[..., lo:hi].flatten(2)

    return module_view(module, **_gdn_view_common(module, start, count, like),
                       in_proj_qkvz=read(0, qkvz), in_proj_ba=read(qkvz, qkvz + 2 * r))


def _gdn_split_view(module, start, count, like):
    import torch

    dk, dv, r = _gdn_sizes(module)
    cuts = [0, dk, 2 * dk, 2 * dk + r * dv, 2 * dk + 2 * r * dv, 2 * dk + 2 * r * dv + r, 2 * dk + 2 * r * dv + 2 * r]

    def read(*pieces):
        return lambda s: torch.cat([_unflat(s, count)[..., cuts[p] : cuts[p + 1]].flatten(2) for p in pieces], -1)

    return module_view(module, **_gdn_view_common(module, start, count, like),
                       in_proj_qkv=read(0, 1, 2), in_proj_z=read(3), in_proj_b=read(4), in_proj_a=read(5))


def _out_proj_finish(module, y_BsUw, kept, view):
    return module.out_proj(y_BsUw.flatten(2))


GATED_DELTANET_FUSED = MixerFamily(
    "Gated DeltaNet", lambda m: _gdn_common(m) and _has(m, "in_proj_qkvz", "in_proj_ba"),
    lambda m: m.num_k_heads, _gdn_fused_streams, _gdn_fused_view, _out_proj_finish, ("qwen3_next",))
GATED_DELTANET_SPLIT = MixerFamily(
    "Gated DeltaNet", lambda m: _gdn_common(m) and _has(m, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    lambda m: m.num_k_heads, _gdn_split_streams, _gdn_split_view, _out_proj_finish, ("qwen3_5", "qwen3_5_moe"))


# Mamba-2 (Bamba, Nemotron-H, Falcon-H1, GraniteMoeHybrid, Mamba2): unit = one SSM head; per unit the channels
# gate (hd) | x (hd) | B (N) | C (N) of its group | dt (1). B and C travel once per head (a group's heads may sit on
# different ranks); the view gives each local head its own group.

def _mamba2_matches(m: Any) -> bool:
    return (_has(m, "in_proj", "conv1d", "A_log", "dt_bias", "D", "norm", "out_proj", "num_heads", "head_dim",
                 "n_groups", "ssm_state_size", "intermediate_size", "conv_dim") and _plain_conv(m.conv1d)
            and m.num_heads * m.head_dim == m.intermediate_size and m.num_heads % m.n_groups == 0
            and m.conv_dim == m.intermediate_size + 2 * m.n_groups * m.ssm_state_size == m.conv1d.in_channels
            and getattr(m.in_proj, "out_features", None) == m.intermediate_size + m.conv_dim + m.num_heads)


def _mamba2_streams(module, x):
    import torch

    h, hd, n, g = module.num_heads, module.head_dim, module.ssm_state_size, module.n_groups
    projected = module.in_proj(x)
    scale = getattr(module, "mup_vector", None)  # Falcon-H1's muP multipliers, applied right after in_proj
    if scale is not None:
        projected = projected * scale
    gate, xs, b, c, dt = projected.split([h * hd, h * hd, g * n, g * n, h], dim=-1)
    of_head = _index([i // (h // g) for i in range(h)], x.device)
    b, c = (_unflat(t, g).index_select(2, of_head) for t in (b, c))
    return torch.cat([_unflat(gate, h), _unflat(xs, h), b, c, _unflat(dt, h)], dim=-1), None


def _mamba2_view(module, start, count, like):
    import torch

    h, hd, n, g = module.num_heads, module.head_dim, module.ssm_state_size, module.n_groups
    inter = h * hd
    group = [i // (h // g) for i in range(start, start + count)]
    channels = (list(range(start * hd, (start + count) * hd))
                + [inter + j * n + e for j in group for e in range(n)]
                + [inter + g * n + j * n + e for j in group for e in range(n)])
    cuts = [0, hd, 2 * hd, 2 * hd + n, 2 * hd + 2 * n, 2 * hd + 2 * n + 1]

    def in_proj(s):
        return torch.cat([_unflat(s, count)[..., cuts[p] : cuts[p + 1]].flatten(2) for p in range(5)], -1)

    heads = slice(start, start + count)
    extra = {"mup_vector": 1.0} if getattr(module, "mup_vector", None) is not None else {}
    return module_view(module, num_heads=count, n_groups=count, intermediate_size=count * hd,
                       conv_dim=count * hd + 2 * count * n, conv1d=_Conv(module.conv1d, _index(channels, like.device)),
                       A_log=module.A_log[heads], dt_bias=module.dt_bias[heads], D=module.D[heads],
                       in_proj=in_proj, norm=_DeferredNorm(), out_proj=_identity, **extra)


def _mamba2_finish(module, y_BsUw, kept, view):
    y = y_BsUw.flatten(2)
    if view.norm.used:
        gate = kept
        y = module.norm(y, gate)
    return module.out_proj(y.to(kept.dtype))


def _mamba2_streams_keeping_gate(module, x):
    stream, _ = _mamba2_streams(module, x)
    gate = stream[..., : module.head_dim].flatten(2)
    return stream, gate


MAMBA2 = MixerFamily("Mamba-2", _mamba2_matches, lambda m: m.num_heads, _mamba2_streams_keeping_gate, _mamba2_view,
                     _mamba2_finish, ("nemotron_h", "bamba", "falcon_h1", "granitemoehybrid", "mamba2"))


# ShortConv (LFM2): unit = one channel; per unit B | C | x.

def _short_conv_matches(m: Any) -> bool:
    conv = getattr(m, "conv", None)
    return (_has(m, "conv", "in_proj", "out_proj") and conv is not None and _plain_conv(conv)
            and getattr(m.in_proj, "out_features", None) == 3 * conv.in_channels)


def _short_conv_streams(module, x):
    import torch

    return torch.stack(module.in_proj(x).chunk(3, dim=-1), dim=-1), None


def _short_conv_view(module, start, count, like):
    channels = _index(list(range(start, start + count)), like.device)
    return module_view(module, conv=_Conv(module.conv, channels), out_proj=_identity,
                       in_proj=lambda s: _unflat(s, count).transpose(2, 3).flatten(2))


SHORT_CONV = MixerFamily("ShortConv", _short_conv_matches, lambda m: m.conv.in_channels, _short_conv_streams,
                         _short_conv_view, _out_proj_finish, ("lfm2",))

# KDA (Kimi-Linear): unit = one head; per unit q | k | v (before the convolution) | g (its forget gate, per channel,
# made on the shard by the module's own forget_gate: fp32) | b (1). The stream is fp32 when g is (q, k, v, b go back to
# their dtype exactly). The gated output norm (per head, it reads a gate made from the layer's input) and o_proj run on
# the sequence shard.

def _kda_matches(m: Any) -> bool:
    gate = getattr(m, "forget_gate", None)
    return (_has(m, "q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj", "g_b_proj",
                 "o_norm", "o_proj", "num_heads", "head_dim", "qkv_dim") and _plain_conv(m.conv1d)
            and m.conv1d.in_channels == 3 * m.qkv_dim == 3 * m.num_heads * m.head_dim
            and _has(gate, "f_a_proj", "f_b_proj", "dt_bias", "A_log"))


def _kda_streams(module, x):
    import torch

    h = module.num_heads
    parts = [module.q_proj(x), module.k_proj(x), module.v_proj(x), module.forget_gate(x), module.b_proj(x)]
    dtype = torch.promote_types(parts[0].dtype, parts[3].dtype)
    return torch.cat([_unflat(p.to(dtype), h) for p in parts], dim=-1), x


def _kda_view(module, start, count, like):
    hd, qkv = module.head_dim, module.qkv_dim
    own = list(range(start * hd, (start + count) * hd))
    channels = _index(own + [qkv + c for c in own] + [2 * qkv + c for c in own], like.device)
    dtype = module.q_proj.weight.dtype if hasattr(module.q_proj, "weight") else like.dtype

    def read(p, to=None):
        def reader(s):
            piece = _unflat(s, count)[..., p * hd : (p + 1) * hd if p < 4 else 4 * hd + 1]
            return (piece.to(to) if to is not None else piece).flatten(2) if p != 3 else piece
        return reader

    return module_view(module, num_heads=count, qkv_dim=count * hd, conv_dim=3 * count * hd,
                       conv1d=_Conv(module.conv1d, channels), q_proj=read(0, dtype), k_proj=read(1, dtype),
                       v_proj=read(2, dtype), forget_gate=read(3), b_proj=read(4, dtype),
                       g_a_proj=_identity, g_b_proj=lambda s: s[..., : count * hd], o_norm=_DeferredNorm(),
                       o_proj=_identity)


def _kda_finish(module, y_BsUw, x, view):
    gate = module.g_b_proj(module.g_a_proj(x)).view(*x.shape[:2], -1, module.head_dim)
    y = module.o_norm(y_BsUw.reshape(gate.shape), gate)
    return module.o_proj(y.reshape(*x.shape[:2], -1))


KDA = MixerFamily("KDA", _kda_matches, lambda m: m.num_heads, _kda_streams, _kda_view, _kda_finish,
                  ("kimi_linear",))


# Mamba-1 (Jamba, Mamba, FalconMamba): unit = one channel; per unit x | gate. Its x_proj reads every channel of a
# token, so the view's x_proj is the rank's channels' share, summed over the SP group (an all-reduce on the rank's
# whole timeline, small: dt_rank + 2·N per token); dt_proj's rows, A_log, D and the conv are sliced per channel. The
# norms Jamba and FalconMamba apply to dt, B and C (per token, over those summed features) stay the module's own.

def _mamba1_matches(m: Any) -> bool:
    return (_has(m, "in_proj", "conv1d", "x_proj", "dt_proj", "A_log", "D", "out_proj", "intermediate_size",
                 "time_step_rank", "ssm_state_size") and _plain_conv(m.conv1d)
            and m.conv1d.in_channels == m.intermediate_size and getattr(m.x_proj, "bias", 0) is None
            and getattr(m.in_proj, "out_features", None) == 2 * m.intermediate_size)


def _mamba1_streams(module, x):
    import torch

    xs, gate = module.in_proj(x).chunk(2, dim=-1)
    return torch.stack([xs, gate], dim=-1), None


class _Rows:
    """A linear layer's weight rows (and bias entries) for some output channels: what Mamba-1 reads of dt_proj."""

    def __init__(self, linear: Any, rows: slice):
        self.weight = linear.weight[rows]
        self.bias = linear.bias[rows] if linear.bias is not None else None


def _mamba1_view(module, start, count, like, exchange):
    import torch.nn.functional as F

    channels = slice(start, start + count)
    weight = module.x_proj.weight[:, channels]

    def x_proj(xs):
        return exchange.sum_over_group(F.linear(xs, weight))

    conv = _Conv(module.conv1d, _index(list(range(start, start + count)), like.device))
    return module_view(module, intermediate_size=count, conv1d=conv,
                       in_proj=lambda s: _unflat(s, count).transpose(2, 3).flatten(2), x_proj=x_proj,
                       dt_proj=_Rows(module.dt_proj, channels), A_log=module.A_log[channels], D=module.D[channels],
                       out_proj=_identity)


MAMBA1 = MixerFamily("Mamba-1", _mamba1_matches, lambda m: m.intermediate_size, _mamba1_streams, _mamba1_view,
                     _out_proj_finish, ("jamba", "mamba", "falcon_mamba"), reduces=True)


# Lightning attention (MiniMax): unit = one head; per unit its q | k | v before the activation. The per-head decays
# (slope_rate and the decay buffers derived from it) are sliced; the norm over all heads, the output gate (it reads
# the layer's input) and out_proj run on the sequence shard. It owns no convolution: found by its structure.

def _lightning_matches(m: Any) -> bool:
    return (_has(m, "qkv_proj", "output_gate", "out_proj", "norm", "slope_rate", "query_decay", "key_decay",
                 "diagonal_decay", "block_size", "num_attention_heads", "head_dim")
            and getattr(m.qkv_proj, "out_features", None) == 3 * m.num_attention_heads * m.head_dim)


def _lightning_streams(module, x):
    return _unflat(module.qkv_proj(x), module.num_attention_heads), x


def _open_gate(hidden_states):
    """The view's output gate: sigmoid(+inf) is exactly 1, so the view's product leaves its input unchanged; the real
    gate is applied on the sequence shard."""
    return hidden_states.new_full((), float("inf"))


def _lightning_view(module, start, count, like):
    heads = slice(start, start + count)
    return module_view(module, num_attention_heads=count, qkv_proj=_identity, norm=_DeferredNorm(),
                       output_gate=_open_gate, out_proj=_identity, slope_rate=module.slope_rate[heads],
                       query_decay=module.query_decay[heads], key_decay=module.key_decay[heads],
                       diagonal_decay=module.diagonal_decay[:, heads])


def _lightning_finish(module, y_BsUw, x, view):
    import torch

    y = module.norm(y_BsUw.flatten(2))
    return module.out_proj(torch.sigmoid(module.output_gate(x)) * y)


LIGHTNING = MixerFamily("lightning attention", _lightning_matches, lambda m: m.num_attention_heads,
                        _lightning_streams, _lightning_view, _lightning_finish, ("minimax",))

FAMILIES = (GATED_DELTANET_FUSED, GATED_DELTANET_SPLIT, MAMBA2, MAMBA1, SHORT_CONV, KDA, LIGHTNING)


def family_of(module: Any) -> MixerFamily | None:
    return next((f for f in FAMILIES if f.matches(module)), None)


# --------------------------------------------------------------------------------------------------------------------
# the wrapper
# --------------------------------------------------------------------------------------------------------------------


class DocumentMixer:
    """The replacement `forward` of one mixer instance: per document, and head-parallel under SP."""

    def __init__(self, module: "nn.Module", name: str, forward: Callable, positions: DocumentPositions,
                 family: MixerFamily | None, exchange: Any = None):
        self.module, self.name, self.own_forward = module, name, forward
        self.positions, self.family, self.exchange = positions, family, exchange
        self.sp = exchange.sp if exchange is not None else 1

    def __call__(self, hidden_states=None, *args, **kwargs):
        if hidden_states is None:
            hidden_states = kwargs.pop("hidden_states")
        self._check_arguments(args, kwargs)
        spans = self.positions.spans(hidden_states.shape[0], hidden_states.shape[1])
        if spans[0][-1][1] != hidden_states.shape[1] * self.sp:
            raise ModelError(
                f"{self.name} ({type(self.module).__name__}) got {hidden_states.shape[1]} tokens of a "
                f"{spans[0][-1][1] // self.sp}-token sequence (chunked attention, or MLP tiling taking a block "
                "whose only part is this mixer for its MLP, runs it on pieces), and lstune's per-document mixer "
                "needs the whole sequence to find its documents: use --attn-chunks off, or tiled_mlp: off and "
                "mini_sequence: false."
            )
        return self.run(hidden_states, spans, kwargs)

    def run(self, x_BsC, spans, kwargs):
        """The mixer's output on `x_BsC` (this rank's shard) — as the module returns it: a tensor, or (tensor, None)
        where its forward returns a tuple (lightning attention also returns its state; nothing reads it)."""
        returned: list = []
        if self.sp == 1:
            out = _per_document(lambda piece: _first(self.own_forward(piece, **kwargs), returned), x_BsC, spans)
        else:
            out = self._head_parallel(x_BsC, spans, returned)
        return (out, None) if returned and returned[0] else out

    def _check_arguments(self, args, kwargs) -> None:
        """Per-document runs are only right when nothing but the hidden states carries the sequence."""
        cache = kwargs.get("cache", kwargs.get("cache_params", kwargs.get("past_key_values")))
        if args or cache is not None or kwargs.get("attention_mask") is not None:
            raise ModelError(f"{self.name} ({type(self.module).__name__}) was called with a cache, an attention "
                             "mask or positional arguments, which lstune's per-document mixer does not take: train "
                             "without --pack and with --sp 1.")

    def _head_parallel(self, x_BsC, spans, returned):
        family, module, ex = self.family, self.module, self.exchange
        counts = ex.unit_counts(family.units(module))
        start, count = sum(counts[: ex.sp_rank]), counts[ex.sp_rank]
        stream_BsUw, kept = family.streams(module, x_BsC)
        order = self.positions.order  # the gathered shards in global time order (FPDT's pieces, a ring's zigzag)
        local_BSuw = order.to_global(ex.seq_to_units(stream_BsUw, counts))
        view = (family.view(module, start, count, local_BSuw, ex) if family.reduces
                else family.view(module, start, count, local_BSuw))
        run, extra = type(module).forward, _required_arguments(self.own_forward)
        out_BSy = _per_document(lambda piece: _first(run(view, piece.flatten(2), **extra), returned), local_BSuw,
                                spans)
        out_BSuw = order.to_gathered(out_BSy.reshape(*out_BSy.shape[:2], count, -1))
        return family.finish(module, ex.units_to_seq(out_BSuw, counts), kept, view)


def _first(output, returned: list):
    """The hidden states of a mixer's output; `returned` records whether it came as a tuple."""
    if not returned:
        returned.append(isinstance(output, tuple))
    return output[0] if isinstance(output, tuple) else output


def _per_document(run: Callable, x_BS_: "torch.Tensor", spans) -> "torch.Tensor":
    """`run` on each document of each row alone (one call for the batch when every row is one document)."""
    import torch

    seq = x_BS_.shape[1]
    if all(row == [(0, seq)] for row in spans):
        return run(x_BS_)
    rows = [torch.cat([run(x_BS_[b : b + 1, s:e]) for s, e in row], dim=1) for b, row in enumerate(spans)]
    return torch.cat(rows, dim=0)


# --------------------------------------------------------------------------------------------------------------------
# install, probe, undo
# --------------------------------------------------------------------------------------------------------------------


def check_token_mixers(layers: "nn.ModuleList", *, pack: bool, sp: int, exchange: Any = None) -> None:
    """ModelError naming every mixer that SP cannot run head-parallel: no family of lstune's knows it, or (with the
    `exchange` it would run over) it has fewer heads than the SP group has ranks."""
    if sp <= 1:
        return
    sites = mixer_sites(layers)
    unknown = [f"{name} ({type(m).__name__})" for name, m in sites if family_of(m) is None]
    if unknown:
        where = ", ".join(unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        problem = (f"this model mixes tokens with convolutions or a recurrent state in {where}, whose structure "
                   "lstune has no head-parallel plan for (it knows Gated DeltaNet, KDA, Mamba-2, Mamba-1, "
                   "ShortConv and lightning attention), so "
                   "under sequence parallelism it would miss the other ranks' tokens; use --sp 1 (or --gpus 1).")
        raise ModelError(problem, problems=[problem])
    if exchange is not None:
        for name, module in sites:
            exchange.unit_counts(family_of(module).units(module), f"{name} ({type(module).__name__})")


def _input_width(module: Any) -> int:
    for name in ("in_proj_qkvz", "in_proj_qkv", "in_proj", "qkv_proj"):
        proj = getattr(module, name, None)
        if proj is not None and hasattr(proj, "in_features"):
            return proj.in_features
    width = getattr(module, "hidden_size", None)
    if width is None:
        raise ModelError(f"cannot tell the input width of {type(module).__name__} to probe it; train without "
                         "--pack and with --sp 1.")
    return width


def _required_arguments(forward: Callable) -> dict:
    """None for each argument after the hidden states that `forward` requires (MiniMax's position_embeddings and
    attention_mask, which its lightning layers do not read)."""
    import inspect

    parameters = list(inspect.signature(forward).parameters.values())[1:]
    return {p.name: None for p in parameters if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def probe_mixer(wrapper: DocumentMixer) -> None:
    """The wrapper against the module's own forward on each document alone: one row of about sp·6 tokens laid out
    on the ranks as the run lays samples out (`ShardOrder`: contiguous shards, FPDT's pieces with an explicit chunk
    count, a ring's zigzag), two documents cut off the shard edges, the same on every rank (each compares its
    shard). ModelError on any difference."""
    import torch

    from torch._subclasses.fake_tensor import is_fake

    module, sp = wrapper.module, wrapper.sp
    param = next(module.parameters())
    if param.device.type == "meta" or is_fake(param):  # no values to compare (the estimator's models)
        return
    layout = wrapper.positions.order.padded(sp * _PROBE_SHARD)  # the run's layout (FPDT's pieces, a ring's zigzag)
    length = layout.length
    cut = length // 2 + 1
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, length, _input_width(module), generator=gen).to(param.device, param.dtype)
    spans = [[(0, cut), (cut, length)]]
    rank = wrapper.exchange.sp_rank if sp > 1 else 0
    shard = layout.shard(torch.arange(length, device=param.device).unsqueeze(0), rank)[0]
    extra = _required_arguments(wrapper.own_forward)
    with torch.no_grad():
        pieces = [_first(wrapper.own_forward(x[:, s:e], **extra), []) for s, e in spans[0]]
        expected = torch.cat(pieces, dim=1)[:, shard]
        got = _first(wrapper.run(x[:, shard], spans, extra), [])
    tolerance = _PROBE_RTOL.get(str(param.dtype).removeprefix("torch."), _PROBE_RTOL_LOW)
    error = float((got.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-12))

    def check() -> None:
        if not error <= tolerance:
            raise ModelError(f"lstune's per-document{' head-parallel' if sp > 1 else ''} run of {wrapper.name} "
                             f"({type(module).__name__}) differs from its own forward on each document alone "
                             f"(relative error {error:.1e}{f' on SP rank {rank}' if sp > 1 else ''}); train without "
                             "--pack and with --sp 1.")

    if sp > 1:  # each rank compared its own shard: all refuse alike, before the next collective
        wrapper.exchange.agreed(check)
    else:
        check()
