"""Sequence-tiled compute: the one mechanism behind tiled MLP, mini-sequence layers and the tiled loss.

A per-token function f (MLP, norm + MLP, LM head + cross-entropy) is applied to a long sequence
tile by tile (ALST Sec. 3.1 "TiledCompute"; MST Alg. 1-4):

1. Forward: for each tile, run f under no_grad and write its output into the full output (or add
   its loss into the sum). Nothing f creates inside a tile is kept; only the input x is saved.
2. Backward: for each tile, recompute f on that tile with grad enabled (under forward's RNG and
   autocast state, so dropout masks and mixed-precision casts repeat) and call
   `torch.autograd.grad` for the tile's input slice and f's trainable weights. The input gradient
   is written into its slice; weight gradients are summed over tiles (fp32 for 16-bit weights) and
   returned once, so autograd accumulates them into `.grad` exactly once, with the upstream
   gradient applied once per tile (MST Alg. 4 scales the running sum repeatedly: see DIGEST.md).

Memory: f's intermediates go from O(seq · width) to O(tile_len · width); what remains is x, the
output and, in backward, grad_x: O(seq · hidden). Cost: f runs twice (three times under activation
checkpointing) and its weights are read once per tile. Composes with checkpointing (the tiles
recompute inside the checkpoint's recompute), LoRA (only trainable weights get gradients) and
sequence parallelism (tiles cut the local shard). Higher-order gradients are not supported.

Why not DeepSpeed's `SequenceTiledCompute` / `TiledFusedLogitsLoss` (deepspeed/runtime/
sequence_parallel/ulysses_sp.py): they push weight gradients into `.grad` themselves with
`torch.autograd.backward` once per tile (bypassing autograd's single accumulation, so
`torch.autograd.grad` and per-parameter hooks see each tile), and `TiledFusedLogitsLoss` scales
only the input gradient by the upstream gradient, not the weight gradient, which breaks
`loss_sum / tokens` normalisation.

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
) -> torch.Tensor:
    """Apply per-token `fn` to `x` in `tiles` slices along `dim`, keeping no intermediates of `fn`.

    `params`: the weights `fn` uses (only those requiring grad get gradients). `reduce="cat"`
    stitches tile outputs along `dim` (outputs must have x's extent on `dim`); `reduce="sum"` adds
    0-d tile outputs (a summed loss). `preserve_rng` replays the RNG state in backward so dropout
    inside `fn` draws the same masks. One tile runs `fn` directly: plain autograd, same numbers.
    """
    if reduce not in ("cat", "sum"):
        raise ValueError(f"reduce must be 'cat' or 'sum', not {reduce!r}")
    bounds = tile_bounds(x.shape[dim], tiles)
    if len(bounds) <= 1:
        return fn(x, 0, x.shape[dim])
    trainable = tuple(p for p in params if p.requires_grad)
    spec = _TileSpec(fn, bounds, dim, reduce, preserve_rng)
    return _SequenceTiledFunction.apply(spec, x, *trainable)


@dataclass
class _TileSpec:
    fn: TileFn
    bounds: list[tuple[int, int]]
    dim: int
    reduce: str
    preserve_rng: bool

    def tile(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return x.narrow(self.dim, start, end - start)


class _SequenceTiledFunction(torch.autograd.Function):
    """See the module docstring: forward per tile under no_grad, backward recomputes each tile."""

    @staticmethod
    def forward(ctx, spec: _TileSpec, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.spec = spec
        ctx.params = params
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
        grad_x = torch.empty_like(x) if want_x else None
        grads: list[torch.Tensor | None] = [None] * len(ctx.params)
        with _replay_rng(ctx.rng, x.device), _replay_autocast(ctx.autocast):
            for start, end in spec.bounds:
                tile_grads = _tile_backward(spec, x, start, end, grad_out, ctx.params, want_x)
                if want_x:
                    spec.tile(grad_x, start, end).copy_(tile_grads[0])
                _accumulate(grads, tile_grads[1:])
                del tile_grads  # else this tile's weight gradients live on through the next tile's backward
        param_grads = [g if g is None else g.to(p.dtype) for g, p in zip(grads, ctx.params)]
        return (None, grad_x, *param_grads)


def _tile_backward(spec, x, start, end, grad_out, params, want_x) -> list[torch.Tensor | None]:
    """Recompute one tile with grad and return [grad of its x slice, grad of each param]."""
    x_tile = spec.tile(x, start, end).detach().requires_grad_(want_x)
    with torch.enable_grad():
        y = spec.fn(x_tile, start, end)
    upstream = grad_out if spec.reduce == "sum" else spec.tile(grad_out, start, end)
    inputs = ([x_tile] if want_x else []) + list(params)
    if not y.requires_grad:
        return [torch.zeros_like(x_tile) if want_x else None] + [None] * len(params)
    found = torch.autograd.grad(y, inputs, upstream, allow_unused=True)
    if not want_x:
        return [None, *found]
    gx = found[0] if found[0] is not None else torch.zeros_like(x_tile)
    return [gx, *found[1:]]


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
