"""Sequence-tiled compute: the one mechanism behind tiled MLP, mini-sequence layers and the tiled loss.

A per-token function f (MLP, norm + MLP, LM head + cross-entropy) is applied to a long sequence
tile by tile (ALST Sec. 3.1 "TiledCompute"; MST Alg. 1-4):

1. Forward: for each tile, run f under no_grad and write its output into the full output (or add
   its loss into the sum). Nothing f creates inside a tile is kept; only the input x is saved.
2. Backward: for each tile, recompute f on that tile with grad enabled (under forward's RNG and
   autocast state, so dropout masks and mixed-precision casts repeat) and backpropagate the tile's
   slice of the upstream gradient (the whole upstream gradient for a summed loss) through it. The
   input gradient is written into its slice. Weight gradients take one of two routes:
   - Returned (ordinary weights): `torch.autograd.grad` gives each tile's weight gradients; they are
     summed over tiles (fp32 for 16-bit weights) and returned once from the Function, so autograd
     accumulates them into `.grad` exactly once, together with any other use of the weight (tied
     embeddings), and `torch.autograd.grad` callers and per-parameter hooks see one gradient.
   - Into `.grad` (DeepSpeed ZeRO-3, when any weight is partitioned, i.e. has `ds_id`): outside its
     module's forward a partitioned weight's data has shape [0], so it cannot be an input of the
     Function (autograd would record that shape and reject the full-shape gradient). Instead, as
     DeepSpeed's `TiledMLP` does, each tile runs `torch.autograd.backward` into the weights' `.grad`,
     so the gradients pass through ZeRO's own gather and accumulate-grad hooks; `ds_grad_is_ready`
     is False for all tiles but the last, so ZeRO keeps accumulating into `.grad` and reduces the
     full sum once. Weights that also get a gradient from outside f later in the same backward
     (`shared_params`: an LM head tied to the input embedding) stay not-ready on every tile and are
     reduced with that later gradient, once.
   Either way each tile's contribution is scaled by the upstream gradient exactly once (MST Alg. 4
   scales the running sum repeatedly, over-weighting early tiles), so `loss_sum / tokens` stays exact.

Why two routes: the `.grad` route is the only one ZeRO-3 allows, and the returned route is better
everywhere else at the same compute (the same matmuls per tile): it sums 16-bit weights' tiles in
fp32 (the `.grad` route sums in the weight dtype, as DeepSpeed does), works with `torch.autograd.grad`
and fires gradient hooks once instead of once per tile. Its extra cost is one weight-sized sum buffer.

Memory: f's intermediates go from O(seq · width) to O(tile_len · width); what remains is x, the
output and, in backward, grad_x: O(seq · hidden). Cost: f runs twice (three times under activation
checkpointing) and its weights are read once per tile (under ZeRO-3 also gathered once per tile, by
ZeRO's module hooks). Composes with checkpointing (the tiles recompute inside the checkpoint's
recompute), LoRA (only trainable weights get gradients), sequence parallelism (tiles cut the local
shard) and ZeRO-1/2/3. Higher-order gradients are not supported. The `.grad` route needs every
trainable weight f touches to be used by the last tile (true for per-token blocks: dense MLPs,
transformers' MoE blocks with their fused expert tensors, the LM head).

Not DeepSpeed's `TiledFusedLogitsLoss` (deepspeed/runtime/sequence_parallel/ulysses_sp.py): it runs
the backward inside forward with a unit upstream gradient and scales only the input gradient by the
real one afterwards, so `loss_sum / N` would leave the LM head's gradient N times too large.

Int32 safety: many kernels index with 32-bit offsets and fail once one tensor reaches 2^31
elements (ALST's 555K single-GPU run died so). `TilePolicy.tiles` raises the tile count until
`rows · tile_len · width < 2^31` for the widest tensor a tile creates.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.autograd.function import once_differentiable

INT32_LIMIT = 2**31
_ABSENT = object()  # an attribute that was not set (restored by deleting it)

# One tile's output: the function takes (x_tile, start, end) so it can slice per-token side inputs
# (labels) that are not differentiated.
TileFn = Callable[[torch.Tensor, int, int], torch.Tensor]


@dataclass(frozen=True)
class TilePolicy:
    """How to cut `n` tokens: a fixed tile length (ALST) or a fixed tile count (MST), then int32-safe.

    `width` is the widest per-token dimension a tile materialises (intermediate size, vocab) and
    `rows` the number of rows processed side by side (batch size when tiling along the sequence).
    """

    tile_len: int | None = None
    count: int | None = None

    def __post_init__(self):
        if (self.tile_len is None) == (self.count is None):
            raise ValueError("TilePolicy needs exactly one of tile_len or count")
        if (self.tile_len or self.count) < 1:
            raise ValueError("TilePolicy tile_len/count must be >= 1")

    def tiles(self, n: int, *, width: int, rows: int = 1) -> int:
        wanted = math.ceil(n / self.tile_len) if self.tile_len else self.count
        return int32_safe_tiles(n, rows * width, max(1, min(wanted, n)))

    def describe(self) -> str:
        return f"{self.tile_len} tokens per tile" if self.tile_len else f"{self.count} tiles"


def int32_safe_tiles(n: int, row_elements: int, tiles: int) -> int:
    """The smallest tile count >= `tiles` whose tiles hold fewer than 2^31 elements of `row_elements` each."""
    max_len = (INT32_LIMIT - 1) // row_elements
    if max_len < 1:
        raise ValueError(f"one token row has {row_elements} elements, more than int32 kernels allow")
    return max(tiles, math.ceil(n / max_len))


def tile_bounds(n: int, tiles: int) -> list[tuple[int, int]]:
    """`[(start, end), ...]` cutting `n` into `tiles` slices of ceil(n / tiles) (the last may be shorter)."""
    step = math.ceil(n / max(1, tiles))
    return [(start, min(start + step, n)) for start in range(0, n, step)]


def sequence_tiled(
    fn: TileFn,
    x: torch.Tensor,
    *,
    tiles: int,
    dim: int,
    params: Sequence[torch.Tensor] = (),
    reduce: str = "cat",
    preserve_rng: bool = False,
    shared_params: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """Apply per-token `fn` to `x` in `tiles` slices along `dim`, keeping no intermediates of `fn`.

    `params`: the weights `fn` uses (only those requiring grad get gradients). `reduce="cat"`
    stitches tile outputs along `dim` (outputs must have x's extent on `dim`); `reduce="sum"` adds
    0-d tile outputs (a summed loss). `preserve_rng` replays the RNG state in backward so dropout
    inside `fn` draws the same masks. `shared_params`: those of `params` that also get a gradient
    from outside `fn`, later in the same backward (an LM head tied to the input embedding); only
    ZeRO-3 needs to know. One tile runs `fn` directly: plain autograd, same numbers.
    """
    if reduce not in ("cat", "sum"):
        raise ValueError(f"reduce must be 'cat' or 'sum', not {reduce!r}")
    bounds = tile_bounds(x.shape[dim], tiles)
    if len(bounds) <= 1:
        return fn(x, 0, x.shape[dim])
    trainable = tuple(p for p in params if p.requires_grad)
    into_grad = any(is_zero3_partitioned(p) for p in trainable)
    shared = frozenset(id(p) for p in shared_params)
    spec = _TileSpec(fn, bounds, dim, reduce, preserve_rng, trainable if into_grad else (), shared)
    if into_grad:
        # The weights are not Function inputs on this route; an empty leaf that requires grad keeps
        # the output in the graph (so backward runs) even when x does not require grad.
        return _SequenceTiledFunction.apply(spec, x, x.new_empty(0).requires_grad_())
    return _SequenceTiledFunction.apply(spec, x, *trainable)


def is_zero3_partitioned(param: torch.Tensor) -> bool:
    """A weight managed by DeepSpeed ZeRO-3 (its data is gathered only inside its module's forward/backward)."""
    return hasattr(param, "ds_id")


@dataclass
class _TileSpec:
    fn: TileFn
    bounds: list[tuple[int, int]]
    dim: int
    reduce: str
    preserve_rng: bool
    into_grad: tuple[torch.Tensor, ...]  # the weights whose gradients go into .grad per tile (ZeRO-3)
    shared: frozenset[int]  # ids of weights that get more gradient outside fn later in backward

    def tile(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return x.narrow(self.dim, start, end - start)

    def upstream(self, grad_out: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return grad_out if self.reduce == "sum" else self.tile(grad_out, start, end)


class _SequenceTiledFunction(torch.autograd.Function):
    """See the module docstring: forward per tile under no_grad, backward recomputes each tile.

    Inputs after x: the trainable weights (returned route) or one empty anchor (`.grad` route).
    """

    @staticmethod
    def forward(ctx, spec: _TileSpec, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.spec = spec
        ctx.params = () if spec.into_grad else params
        ctx.rng = _RngState.capture(x.device) if spec.preserve_rng else None
        ctx.autocast = _autocast_state(x.device.type)
        ctx.save_for_backward(x)
        out = None
        for start, end in spec.bounds:
            y = spec.fn(spec.tile(x, start, end), start, end)
            if spec.reduce == "sum":
                out = y if out is None else out + y
                continue
            if out is None:
                shape = list(y.shape)
                shape[spec.dim] = x.shape[spec.dim]
                out = y.new_empty(shape)
            spec.tile(out, start, end).copy_(y)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        spec: _TileSpec = ctx.spec
        (x,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[1]
        with _replay_rng(ctx.rng, x.device), _replay_autocast(ctx.autocast):
            if spec.into_grad:
                return (None, _backward_into_grad(spec, x, grad_out, want_x), None)
            grad_x, param_grads = _backward_returning_grads(spec, x, grad_out, ctx.params, want_x)
        return (None, grad_x, *param_grads)


def _backward_returning_grads(spec, x, grad_out, params, want_x):
    """Returned route: (grad_x, each weight's gradient summed over tiles, in the weight's dtype)."""
    grad_x = torch.empty_like(x) if want_x else None
    grads: list[torch.Tensor | None] = [None] * len(params)
    for start, end in spec.bounds:
        tile_grads = _tile_grads(spec, x, start, end, grad_out, params, want_x)
        if want_x:
            spec.tile(grad_x, start, end).copy_(tile_grads[0])
        _accumulate(grads, tile_grads[1:])
        del tile_grads  # else this tile's weight gradients live on through the next tile's backward
    return grad_x, [g if g is None else g.to(p.dtype) for g, p in zip(grads, params)]


def _tile_grads(spec, x, start, end, grad_out, params, want_x) -> list[torch.Tensor | None]:
    """Recompute one tile with grad and return [grad of its x slice, grad of each param]."""
    x_tile = spec.tile(x, start, end).detach().requires_grad_(want_x)
    with torch.enable_grad():
        y = spec.fn(x_tile, start, end)
    inputs = ([x_tile] if want_x else []) + list(params)
    if not y.requires_grad:
        return [torch.zeros_like(x_tile) if want_x else None] + [None] * len(params)
    found = torch.autograd.grad(y, inputs, spec.upstream(grad_out, start, end), allow_unused=True)
    if not want_x:
        return [None, *found]
    gx = found[0] if found[0] is not None else torch.zeros_like(x_tile)
    return [gx, *found[1:]]


def _backward_into_grad(spec, x, grad_out, want_x) -> torch.Tensor | None:
    """`.grad` route: each tile's weight gradients go into `.grad` through autograd; returns grad_x."""
    grad_x = torch.empty_like(x) if want_x else None
    last = len(spec.bounds) - 1
    with _Zero3Readiness(spec.into_grad, spec.shared) as readiness:
        for i, (start, end) in enumerate(spec.bounds):
            readiness.set(last_tile=i == last)
            x_tile = spec.tile(x, start, end).detach().requires_grad_(want_x)
            with torch.enable_grad():
                y = spec.fn(x_tile, start, end)
            # `inputs` confines the backward to this tile's graph: x_tile and the weights, never a
            # side input of fn that happens to require grad (its graph belongs to the outer backward).
            if y.requires_grad:
                inputs = ([x_tile] if want_x else []) + list(spec.into_grad)
                torch.autograd.backward(y, spec.upstream(grad_out, start, end), inputs=inputs)
            if want_x and x_tile.grad is not None:
                spec.tile(grad_x, start, end).copy_(x_tile.grad)
            elif want_x:
                spec.tile(grad_x, start, end).zero_()
    return grad_x


class _Zero3Readiness:
    """Sets ZeRO-3's `ds_grad_is_ready` per tile and restores what was there afterwards.

    ZeRO-3 reduces a weight's `.grad` when its accumulate-grad hook fires and `ds_grad_is_ready` is
    True (the default when absent); when False it leaves `.grad` to accumulate (deepspeed/runtime/
    zero/stage3.py, `reduce_independent_p_g_buckets_and_remove_grads`). Reducing a weight twice in
    one backward is wrong (the second reduction overwrites or duplicates the first), so only the
    last tile lets it reduce, and never for shared weights, whose later gradient reduces the sum.
    """

    def __init__(self, params: Sequence[torch.Tensor], shared: frozenset[int]):
        self.params = [p for p in params if is_zero3_partitioned(p)]
        self.shared = shared
        self.saved = [p.__dict__.get("ds_grad_is_ready", _ABSENT) for p in self.params]

    def __enter__(self) -> "_Zero3Readiness":
        return self

    def set(self, *, last_tile: bool) -> None:
        for p, saved in zip(self.params, self.saved):
            p.ds_grad_is_ready = last_tile and id(p) not in self.shared and saved is not False

    def __exit__(self, *exc) -> None:
        for p, saved in zip(self.params, self.saved):
            if saved is _ABSENT:
                del p.ds_grad_is_ready
            else:
                p.ds_grad_is_ready = saved


def _accumulate(total: list[torch.Tensor | None], tile: Sequence[torch.Tensor | None]) -> None:
    """Sum tile weight gradients; 16-bit weights are summed in fp32 so many tiles lose no precision."""
    for i, g in enumerate(tile):
        if g is None:
            continue
        if total[i] is None:
            total[i] = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
        else:
            total[i].add_(g)


@dataclass
class _RngState:
    """CPU (and CUDA device) RNG state, so backward's recompute draws what forward drew (dropout)."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> "_RngState":
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda)


@contextlib.contextmanager
def _replay_rng(state: _RngState | None, device: torch.device):
    if state is None:
        yield
        return
    devices = [device] if state.cuda is not None else []
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.set_rng_state(state.cpu)
        if state.cuda is not None:
            torch.cuda.set_rng_state(state.cuda, device)
        yield


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype, bool] | None:
    """Forward's autocast (mixed precision) setting: backward runs without one unless we restore it."""
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return device_type, True, torch.get_autocast_dtype(device_type), torch.is_autocast_cache_enabled()


def _replay_autocast(state: tuple[str, bool, torch.dtype, bool] | None):
    if state is None:
        return contextlib.nullcontext()
    device_type, enabled, dtype, cache = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache)
