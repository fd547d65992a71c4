"""Tiled MLP (ALST Sec. 3.1.1) and mini-sequence layers (MST Sec. 3.1): per-token blocks run in tiles.

Steps, for every decoder layer of any HF causal LM:
1. Find the layer's per-token block structurally (`introspect.layer_mlp`: a dense MLP or an MoE
   block whose routing is per token) and check on a probe that it is per-token (the first tokens'
   output does not depend on the later tokens), else refuse with a ModelError.
2. Replace that module instance's `forward` by one that runs it through `tiling.sequence_tiled`
   along the sequence (`tiles = ceil(seq / hidden)` by default, ALST; MST's MLP chunk = hidden size
   is the same rule).
3. Mini-sequence mode (`fused=`, found by `find_fusable_norms`) also pulls the norm that feeds the
   block (Llama's post-attention norm, Gemma-2's pre-feed-forward norm) and the norm applied to its output
   (Gemma-2's post-feed-forward norm) into the tiled function, when a probe shows their outputs
   feed only the block; those norms become identities in place. The fused layer is then checked
   against the original on the probe and falls back to the plain tiled block if they differ.

Memory (per layer, during the layer's backward, which is where the peak sits under checkpointing):
plain `O(seq · (k · intermediate))` for the k intermediates the MLP saves (Llama: gate, up, act,
product = 4 · intermediate) becomes `O(seq · hidden)` (x, output, grad) + `O(tile_len · k · intermediate)`.
Fusing the norms also removes what the norm saves for backward (RMSNorm: its input product and
output, the rsqrt: 2 · seq · hidden measured on Llama). The residual add saves nothing, so there is nothing to
gain by pulling it in. Cost: one extra MLP forward per step (the tile recompute), the MLP weights
read once per tile. Composes with checkpointing + offload, LoRA, MoE, sequence parallelism and
ZeRO-3 (whose partitioned weights take tiling.py's `.grad` route).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch

from lstune.errors import ModelError
from lstune.memory.patching import FusedNorm, Undo, patch_forward
from lstune.memory.probe import eval_mode
from lstune.memory.tiling import TilePolicy, sequence_tiled
from lstune.models.introspect import is_norm, mlp_names

if TYPE_CHECKING:
    from torch import nn


@dataclass
class TiledBlock:
    """What was installed on one layer: the block, the norms fused around it, and the undo."""

    layer_index: int
    block: "nn.Module"
    pre_norm: "nn.Module | None" = None
    post_norm: "nn.Module | None" = None
    undos: list[Undo] = field(default_factory=list)


class TiledForward:
    """Installed as a block's `forward`: runs (pre-norm →) block (→ post-norm) in sequence tiles."""

    def __init__(self, block: "nn.Module", policy: TilePolicy, pre_norm=None, post_norm=None):
        self.block = block
        self.policy = policy
        self.block_forward = block.forward
        self.pre_norm, self.post_norm = pre_norm, post_norm
        self.modules = [m for m in (pre_norm, block, post_norm) if m is not None]
        self.width = widest_row(block)

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        dim = 1 if hidden_states.dim() >= 3 else 0
        self._refuse_sequence_arguments(hidden_states.shape[: dim + 1], args, kwargs)
        rows = hidden_states.shape[0] if dim == 1 else 1
        tiles = self.policy.tiles(hidden_states.shape[dim], width=self.width, rows=rows)
        params = [p for m in self.modules for p in m.parameters()]
        extras = _Extras([])
        run = partial(self._run_tile, args=args, kwargs=kwargs, extras=extras)
        out = sequence_tiled(
            run, hidden_states, tiles=tiles, dim=dim, params=params, preserve_rng=self.block.training
        )
        recorded, extras.tiles = extras.tiles, None  # the backward's recomputes record nothing
        if extras.flat:  # the block returns its output flat, [B·S, D] (Llama-4's MoE): so does the tiled one
            out = out.reshape(-1, out.shape[-1])
        if not recorded:
            return out
        if len(recorded) == 1:  # one tile: plain autograd, the block's own outputs
            return (out, *recorded[0][1])
        return (out, *stitch_extras(recorded, hidden_states.shape[:dim + 1], type(self.block).__name__, out))

    def _refuse_sequence_arguments(self, leading: torch.Size, args, kwargs) -> None:
        """A tensor argument shaped like the hidden states' tokens would reach every tile whole: refuse."""
        for value in (*args, *kwargs.values()):
            if torch.is_tensor(value) and value.dim() >= len(leading) and value.shape[: len(leading)] == leading:
                names = "a per-token tensor argument"
                raise ModelError(_EXTRA_ARGUMENT_MESSAGE.format(block=type(self.block).__name__, names=names))

    def _run_tile(self, x: torch.Tensor, start: int, end: int, *, args, kwargs, extras: "_Extras") -> torch.Tensor:
        # MoE blocks `.view` their input flat, which a sequence slice of a batch > 1 does not allow.
        x = x.contiguous()
        if self.pre_norm is not None:
            x = FusedNorm.call(self.pre_norm, x)
        y = self.block_forward(x, *args, **kwargs)
        if isinstance(y, tuple):  # an MoE returning its router logits / scores beside the output
            if extras.tiles is not None:
                extras.tiles.append((x.shape[-2] if x.dim() >= 3 else x.shape[0], y[1:]))
            y = y[0]
        if _flat_output(x, y):  # tiles are stitched along the sequence: back to [B, t, D]
            y = y.view(*x.shape[:-1], y.shape[-1])
            extras.flat = True
        if self.post_norm is not None:
            y = FusedNorm.call(self.post_norm, y)
        return y


def _flat_output(x: torch.Tensor, y: torch.Tensor) -> bool:
    """The block took [B, t, D] and returned [B·t, D] (MoE blocks that flatten the batch)."""
    return x.dim() == 3 and y.dim() == 2 and y.shape[0] == x.shape[0] * x.shape[1]


@dataclass
class _Extras:
    """The extra outputs (router logits) of each tile in forward; None once forward is done."""

    tiles: list | None
    flat: bool = False  # the block returns its output flattened to [B·t, D]


def stitch_extras(tiles: list[tuple[int, tuple]], leading: torch.Size, block: str, anchor: torch.Tensor) -> list:
    """A tiled MoE's extra outputs (router logits / scores) over the whole sequence, from each tile's (tokens, extra
    outputs): per-token tensors shaped [B, t, ...] or flat [B·t, ...] (transformers' MoE blocks flatten the batch)
    are joined along their tokens in the sequence's order; None stays None. They carry no gradient: the decoder
    layers of the families that return them (gpt-oss, Llama-4) drop them, and HF's auxiliary router loss reads
    them through other hooks. If a gradient ever reaches one, backward refuses (`_NoGradient`) rather than drop it."""
    batch = leading[0] if len(leading) == 2 else 1
    counts = [tokens for tokens, _ in tiles]
    stitched = []
    for parts in zip(*(extra for _, extra in tiles)):
        if all(p is None for p in parts):
            stitched.append(None)
        elif all(torch.is_tensor(p) and p.dim() >= 2 and p.shape[:2] == (batch, n) for p, n in zip(parts, counts)):
            stitched.append(_NoGradient.apply(torch.cat(parts, dim=1), anchor))
        elif all(torch.is_tensor(p) and p.shape[0] == batch * n for p, n in zip(parts, counts)):
            per_row = [p.reshape(batch, n, *p.shape[1:]) for p, n in zip(parts, counts)]
            joined = torch.cat(per_row, dim=1).reshape(-1, *parts[0].shape[1:])
            stitched.append(_NoGradient.apply(joined, anchor))
        else:
            raise ModelError(_EXTRA_OUTPUT_MESSAGE.format(block=block))
    return stitched


class _NoGradient(torch.autograd.Function):
    """`value` in the graph behind `anchor`; a gradient reaching it is refused (tiling cannot carry it)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is not None:
            raise ModelError(
                "a gradient reached the router logits of a sequence-tiled MoE block (an auxiliary router loss?), "
                "which tiling does not carry; set tiled_mlp: off and mini_sequence: false, or train without the "
                "router loss."
            )
        return None, None


_EXTRA_OUTPUT_MESSAGE = (
    "{block} returns more than its output, and lstune cannot tell the extra outputs' token dimension (it stitches "
    "per-token tensors shaped [batch, tokens, ...] or [batch·tokens, ...]); set tiled_mlp: off and mini_sequence: "
    "false for this model."
)


def widest_row(module: "nn.Module") -> int:
    """The widest per-token dimension the module can materialise: the largest matrix dimension it holds."""
    dims = [max(p.shape[-2:]) for p in module.parameters() if p.dim() >= 2]
    return max(dims, default=1)


def install_tiled_blocks(
    layers: "nn.ModuleList",
    policy: TilePolicy,
    fused: dict[int, tuple[str | None, str | None]] | None = None,
    names: tuple[str, ...] | None = None,
) -> list[TiledBlock]:
    """Tile the per-token block of every layer; `fused[i] = (pre_norm_name, post_norm_name)` fuses norms.
    `names`: each layer's block attribute (`ModelParts.mlp_names`), looked up here when not given."""
    installed = []
    for index, (layer, name) in enumerate(zip(layers, names or mlp_names(layers))):
        if name is None:  # a hybrid's block with no MLP (only a token mixer): nothing to tile
            continue
        pre_name, post_name = (fused or {}).get(index, (None, None))
        installed.append(_install_one(index, layer, getattr(layer, name), policy, pre_name, post_name))
    return installed


def _install_one(index, layer, block, policy, pre_name, post_name) -> TiledBlock:
    pre = getattr(layer, pre_name) if pre_name else None
    post = getattr(layer, post_name) if post_name else None
    tiled = TiledBlock(index, block, pre, post)
    forward = TiledForward(block, policy, pre, post)
    tiled.undos.append(patch_forward(block, forward, what=f"layer {index}: sequence-tiled"))
    for norm, norm_name in ((pre, pre_name), (post, post_name)):
        if norm is not None:
            what = f"layer {index}: {norm_name} fused into the tiled block"
            tiled.undos.append(FusedNorm.install(norm, what=what))
    return tiled


def undo_tiled_blocks(installed: list[TiledBlock]) -> None:
    for tiled in installed:
        while tiled.undos:
            tiled.undos.pop()()


def check_call_signature(layers: "nn.ModuleList", names: tuple[str, ...] | None = None) -> None:
    """Refuse blocks called with more than the hidden states (BLOOM's MLP takes the residual too): the tiled forward
    slices only its first argument, so another per-token argument would reach each tile whole."""
    import inspect

    for layer, name in zip(layers, names or mlp_names(layers)):
        if name is None:
            continue
        block = getattr(layer, name)
        params = list(inspect.signature(block.forward).parameters.values())[1:]
        required = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                                                   p.POSITIONAL_OR_KEYWORD)]
        if required:
            raise ModelError(_EXTRA_ARGUMENT_MESSAGE.format(block=type(block).__name__, names=", ".join(required)))


_EXTRA_ARGUMENT_MESSAGE = (
    "{block} is called with more than the hidden states ({names}), and lstune's sequence tiling splits only the hidden "
    "states; set tiled_mlp: off and mini_sequence: false for this model (lstune's limitation: tiling every "
    "per-token argument alongside would lift it)."
)


def check_per_token(layers: "nn.ModuleList", hidden_size: int, names: tuple[str, ...] | None = None) -> None:
    """Refuse blocks whose output for a token depends on other tokens (tiling would change the result).

    Runs each distinct block class once on 6 random tokens, on the first 3 of them and on the last 3: a block that
    reads later tokens changes the first, a causal one (a convolution, a state-space scan) the last.
    """
    checked = set()
    for layer, name in zip(layers, names or mlp_names(layers)):
        if name is None:
            continue
        block = getattr(layer, name)
        if type(block) in checked:
            continue
        checked.add(type(block))
        if not torch.is_tensor(_probe_block(block, hidden_size, tokens=2)):
            raise ModelError(
                f"{type(block).__name__} does not return a tensor (or a tensor and its router outputs), which "
                "sequence tiling cannot stitch; set tiled_mlp: off and mini_sequence: false for this model."
            )
        if not _is_per_token(block, hidden_size):
            raise ModelError(
                f"{type(block).__name__} mixes tokens (its output for a token changes with the other tokens), "
                "so it cannot be sequence-tiled; set tiled_mlp: off and mini_sequence: false for this model."
            )


def _is_per_token(block: "nn.Module", hidden: int) -> bool:
    full = _probe_block(block, hidden, tokens=6)
    head = _probe_block(block, hidden, tokens=3)
    tail = _probe_block(block, hidden, tokens=3, start=3)
    tol = 1e-4 if full.dtype == torch.float32 else 2e-2
    return bool(torch.allclose(full[:, :3], head, rtol=tol, atol=tol)
                and torch.allclose(full[:, 3:], tail, rtol=tol, atol=tol))


@torch.no_grad()
def _probe_block(block: "nn.Module", hidden: int, *, tokens: int, start: int = 0):
    """The block's output (eval mode) on `tokens` tokens from `start` of a fixed random 6-token sequence."""
    # A floating weight gives the input's dtype (a 4-bit block's packed weights are uint8; its LoRA is not).
    param = next((p for p in block.parameters() if p.is_floating_point()), next(block.parameters()))
    dtype = param.dtype if param.is_floating_point() else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, 6, hidden, generator=gen)[:, start:start + tokens].to(device=param.device, dtype=dtype)
    with eval_mode(block):
        y = block(x.contiguous())
    y = y[0] if isinstance(y, tuple) and y and torch.is_tensor(y[0]) else y  # an MoE's router outputs beside
    return y.view(*x.shape[:-1], y.shape[-1]) if torch.is_tensor(y) and _flat_output(x, y) else y


def find_fusable_norms(calls: list["LayerCall"], block_name: str) -> tuple[str | None, str | None]:
    """From one layer's recorded child calls: the norm feeding only the block, and the norm fed only by it."""
    by_name = {c.name: c for c in calls}
    block = by_name.get(block_name)
    if block is None:
        return None, None
    pre = next((c for c in calls if c.output is block.input and is_norm(c.module)), None)
    post = next((c for c in calls if c.input is block.output and is_norm(c.module)), None)
    if pre is not None and _consumers(calls, pre.output) != [block_name]:
        pre = None
    if post is not None and _consumers(calls, block.output) != [post.name]:
        post = None
    return (pre.name if pre else None), (post.name if post else None)


def _consumers(calls: list["LayerCall"], tensor: torch.Tensor) -> list[str]:
    return [c.name for c in calls if c.input is tensor]


@dataclass
class LayerCall:
    """One call of a decoder layer's direct child during a probe forward."""

    name: str
    module: "nn.Module"
    input: torch.Tensor | None
    output: torch.Tensor | None


def record_child_calls(layers: "nn.ModuleList", run: Callable[[], object]) -> list[list[LayerCall]]:
    """Run `run()` with hooks recording, per layer, which child consumed and produced which tensor."""
    records: list[list[LayerCall]] = [[] for _ in layers]
    handles = []
    for index, layer in enumerate(layers):
        for name, child in layer.named_children():
            hook = partial(_record_call, records[index], name)
            handles.append(child.register_forward_hook(hook, with_kwargs=True))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return records


def _record_call(record: list[LayerCall], name: str, module, args, kwargs, output) -> None:
    first = args[0] if args else next((v for v in kwargs.values() if torch.is_tensor(v)), None)
    out = output if torch.is_tensor(output) else (output[0] if isinstance(output, tuple) and output else None)
    record.append(LayerCall(name, module, first if torch.is_tensor(first) else None, out))
