"""METP's MLP (paper 002 Sec. 3.1, Algs. 1-2): the MLP's weights sharded over the SP group and rotated, never gathered.

For O = f(X·B)·C — a gated MLP: out = down(act(gate(x)) ∘ up(x)) — rank i of a group of p holds the column shard i of
gate and up (rows [i·I/p, (i+1)·I/p) of their weights, I the intermediate size) and the matching row shard of down
(its columns), as parameters of 1/p the size; its tokens X_i are its SP shard. Forward, step j = 0..p−1: with the
shard of rank i − j, O_i += f(X_i·B_j)·C_j, while that shard is already on its way to rank i + 1 and the next one
arriving (lstune.memory.rotation: double-buffered point-to-point). Each rank's tokens meet every shard; the
intermediate is (s/p)×(I/p) per step. Backward recomputes each step's intermediate and passes (B_j, C_j) around again
with their gradients: a rank adds its tokens' dB_j, dC_j to the sums the ranks before it made and passes them on;
after the last step every sum is sent home, to the shard's owner (`Ring.send_home`). dX_i stays local.

Memory per rank and layer: weights 3·H·I/p (instead of 3·H·I) plus one arriving shard (another 3·H·I/p) while it
rotates, and in backward two gradient sums of the same size; activations (s/p)·I/p per step, recomputed in backward
(only X_i is saved). Communication per layer and step: forward (p−1)·3·H·I/p weight elements per rank, backward twice
that (weights and their gradient sums) plus one send home — METP's 3·(p−1)/p·(k1·k2 + k2·n) (Table 1).
Composes with: ring attention and Ulysses (it rotates over the whole SP group), activation checkpointing (the
recompute rotates again, in the same order on every rank), LoRA on attention only (frozen MLP shards: no gradient
sums travel). Refused: LoRA on the MLP's projections, biases, MLPs other than gate/up/down with `act_fn`, an
intermediate size the group does not divide.

The shards are rank-local parameters the model does not register: `model.parameters()` leaves them out (the linear
layers' `weight` is None while METP is installed), so an engine built over the model (DeepSpeed ZeRO: its broadcast
from rank 0, its all-reduce over every rank, ZeRO-3's partitioning) never treats them as one replicated tensor; the
training engine takes them from `shard_parameters()` (lstune.parallel.local_params) and sums their gradients over
their true replicas only. The full weights' storage is released while sharded (each rank keeps 1/p of the MLP).
Trained shards are fp32 masters; each step computes in the dtype of the tokens (the rotating copies cast to it, so
under bf16 half the bytes travel), the gradient sums in fp32.

`install_metp_mlp` shards every decoder layer's MLP in place; under `full_weights()` an export gathers each full weight
from the shards in turn; `undo` gathers them back for good, so the single-device model sees ordinary linear
layers again.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from lstune.errors import ModelError
from lstune.memory.patching import Undo, patch_forward
from lstune.memory.rotation import Ring, wait
from lstune.models.introspect import layer_mlp

if TYPE_CHECKING:
    from torch import Tensor, nn

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def check_metp_mlp(mlp: "nn.Module", p: int) -> None:
    """ModelError unless `mlp` is a bias-free gated MLP (gate_proj, up_proj, down_proj, act_fn) whose intermediate
    size divides by `p`, with plain (not LoRA-wrapped) linear projections."""
    name = type(mlp).__name__
    linears = [getattr(mlp, n, None) for n in _PROJECTIONS]
    if any(not isinstance(m, torch.nn.Linear) for m in linears) or not callable(getattr(mlp, "act_fn", None)):
        wrapped = any(hasattr(m, "base_layer") for m in linears if m is not None)
        why = ("LoRA adapts its projections: METP shards the base weights, adapters on them are not sharded; give "
               "--lora-targets without the MLP's projections" if wrapped else
               "it is not a gated MLP with gate_proj, up_proj, down_proj and act_fn")
        raise ModelError(f"--metp-mlp cannot shard {name}: {why}, or drop --metp-mlp.")
    if any(m.bias is not None for m in linears):
        raise ModelError(f"--metp-mlp cannot shard {name}: its projections have biases; drop --metp-mlp.")
    intermediate = linears[0].out_features
    if intermediate % p:
        raise ModelError(f"--metp-mlp: the intermediate size {intermediate} of {name} does not divide by the SP "
                         f"degree {p}; use an SP degree that divides it, or drop --metp-mlp.")


def _rows(p: int, i: int, size: int) -> slice:
    step = size // p
    return slice(i * step, (i + 1) * step)


@dataclass
class MetpHandle:
    """What `install_metp_mlp` did; `undo()` gathers the shards back into full weights and restores the MLPs."""

    ring: Ring
    # per MLP: the MLP, its shards by projection name, the full weights (storage released while sharded) by name
    shards: list[tuple["nn.Module", dict[str, torch.nn.Parameter], dict[str, torch.nn.Parameter]]] = field(
        default_factory=list)
    undos: list[Undo] = field(default_factory=list)

    def released_bytes(self) -> int:
        """Bytes of the full weights whose storage METP released (each rank keeps its shards instead)."""
        return sum(shard[name].numel() * self.ring.size * full[name].element_size()
                   for _, shard, full in self.shards for name in _PROJECTIONS)

    def shard_parameters(self) -> list[torch.nn.Parameter]:
        """The sharded parameters (gradients per owner: reduce them over data parallelism only, never SP)."""
        return [shard[name] for _, shard, _ in self.shards for name in _PROJECTIONS]

    @contextmanager
    def full_weights(self):
        """The linear layers hold their full weights again, as placeholders an export makes whole one at a time
        (`lstune_whole`: a context that gathers that one weight from the shards on every rank of the group, then
        releases it — lstune.parallel.export.gathered enters it), so no rank ever holds more than one full weight."""
        for mlp, shard, full in self.shards:
            for name in _PROJECTIONS:
                full[name].lstune_whole = partial(self._whole, full[name], shard[name], name)
                getattr(mlp, name).weight = full[name]
        try:
            yield
        finally:
            for mlp, _, full in self.shards:
                for name in _PROJECTIONS:
                    _unset_weight(getattr(mlp, name))
                    del full[name].lstune_whole

    @contextmanager
    def _whole(self, full: torch.nn.Parameter, shard: torch.nn.Parameter, name: str):
        _fill(full, self.ring, shard.detach(), name)
        try:
            yield
        finally:
            _release(full)

    def undo(self) -> None:
        """Every rank of the group together: the shards (and their gradients, if any) gathered into the full
        weights, which replace them."""
        for undo in reversed(self.undos):
            undo()
        for mlp, shard, full in self.shards:
            for name in _PROJECTIONS:
                piece, original = shard[name], full[name]
                _fill(original, self.ring, piece.detach(), name)
                original.grad = None if piece.grad is None else _gather(self.ring, piece.grad, _dim(name)).to(
                    original.dtype)
                getattr(mlp, name).weight = original
        self.undos, self.shards = [], []


def _dim(name: str) -> int:
    return 1 if name == "down_proj" else 0


def _fill(full: torch.nn.Parameter, ring: Ring, shard: Tensor, name: str) -> None:
    full.data = _gather(ring, shard, _dim(name)).to(full.dtype)


def _release(full: torch.nn.Parameter) -> None:
    full.data = torch.empty(0, dtype=full.dtype, device=full.device)


def _unset_weight(linear: "nn.Module") -> None:
    """The linear layer without a registered weight (METP's forward reads the shards, never the layer)."""
    linear._parameters["weight"] = None


def _gather(ring: Ring, shard: Tensor, dim: int) -> Tensor:
    import torch.distributed as dist

    if ring.size == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(ring.size)]
    dist.all_gather(parts, shard.contiguous(), group=ring.group)
    return torch.cat(parts, dim=dim)


def install_metp_mlp(layers: "nn.ModuleList", ring: Ring) -> MetpHandle:
    """Shard every layer's MLP over `ring` (the SP group in SP order) and run it as METP's rotation (module doc)."""
    handle = MetpHandle(ring)
    mlps = [getattr(*layer_mlp(layer)) for layer in layers]
    for mlp in mlps:
        check_metp_mlp(mlp, ring.size)
        if "forward" in vars(mlp):
            raise ModelError(f"--metp-mlp: {type(mlp).__name__} is already patched (tiled MLP / mini-sequence); METP's "
                             "MLP bounds its intermediate to (s/p)×(I/p) itself: use --tiled-mlp off and no "
                             "--mini-sequence with --metp-mlp.")
    for index, mlp in enumerate(mlps):
        shard, full = {}, {}
        for name in _PROJECTIONS:
            linear = getattr(mlp, name)
            original = linear.weight
            piece = _rows(ring.size, ring.rank, original.shape[_dim(name)])
            data = original.detach()[:, piece] if _dim(name) else original.detach()[piece]
            # trained shards keep fp32 masters (as DeepSpeed keeps the replicated weights' under bf16)
            data = data.float() if original.requires_grad else data
            shard[name] = torch.nn.Parameter(data.clone(), requires_grad=original.requires_grad)
            full[name] = original
            _unset_weight(linear)
            _release(original)
        handle.shards.append((mlp, shard, full))
        handle.undos.append(patch_forward(mlp, _MetpForward(mlp, ring, [shard[n] for n in _PROJECTIONS]),
                                          what=f"METP MLP, layer {index}"))
    return handle


class _MetpForward:
    def __init__(self, mlp: "nn.Module", ring: Ring, weights: list[torch.nn.Parameter]):
        self.mlp, self.ring, self.weights = mlp, ring, weights

    def __call__(self, hidden_BSD: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return _MetpFunction.apply(self.ring, self.mlp.act_fn, hidden_BSD, *self.weights)


def _step(act, x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """One shard's term: down_j(act(gate_j(x)) ∘ up_j(x))."""
    return torch.nn.functional.linear(act(torch.nn.functional.linear(x, gate)) * torch.nn.functional.linear(x, up),
                                      down)


class _MetpFunction(torch.autograd.Function):
    """Algs. 1-2 of METP over `ring` (module doc): x [.., H] local tokens; gate/up [I/p, H], down [H, I/p] own shard."""

    @staticmethod
    def forward(ctx, ring: Ring, act, x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
        shard = [w.detach().to(x.dtype).contiguous() for w in (gate, up, down)]
        out = None
        for step in range(ring.size):
            incoming, requests = None, []
            if step + 1 < ring.size:
                incoming = [torch.empty_like(w) for w in shard]
                requests = ring.exchange(shard, incoming)
            term = _step(act, x, *shard)
            out = term if out is None else out + term
            wait(requests)
            if incoming is not None:
                shard = incoming
        ctx.ring, ctx.act = ring, act
        ctx.save_for_backward(x, gate, up, down)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        ring, act = ctx.ring, ctx.act
        x, gate, up, down = ctx.saved_tensors
        want_w = any(ctx.needs_input_grad[3:6])
        shard = [w.detach().to(x.dtype).contiguous() for w in (gate, up, down)]
        dx, carry = None, None
        x_leaf = x.detach().requires_grad_(ctx.needs_input_grad[2])
        for step in range(ring.size):
            incoming, send, recv = None, [], []
            if step + 1 < ring.size:
                incoming = [torch.empty_like(w) for w in shard]
                send, recv = list(shard), list(incoming)
            arriving = None
            if carry is not None:
                arriving = [torch.empty_like(g) for g in carry]
                send, recv = send + carry, recv + arriving
            requests = ring.exchange(send, recv)
            weights = [w.requires_grad_(want_w) for w in (t.detach() for t in shard)]
            with torch.enable_grad():
                term = _step(act, x_leaf, *weights)
                inputs = ([x_leaf] if x_leaf.requires_grad else []) + (weights if want_w else [])
                grads = list(torch.autograd.grad(term, inputs, dout)) if inputs else []
            if x_leaf.requires_grad:
                gx = grads.pop(0)
                dx = gx if dx is None else dx + gx
            wait(requests)
            if want_w:
                carry = [g.float() if arriving is None else g.float() + a for g, a in zip(grads, arriving or grads)]
            if incoming is not None:
                shard = incoming
        grads_w = [None, None, None]
        if want_w:
            home = ring.send_home(carry, ring.size)
            grads_w = [g.to(w.dtype) if need else None
                       for g, w, need in zip(home, (gate, up, down), ctx.needs_input_grad[3:6])]
        return None, None, dx, *grads_w
