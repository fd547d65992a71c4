"""Activation checkpointing of every decoder layer, with optional host offload of the checkpoints.

Checkpointing (MST Sec. 3.2; ALST Sec. 3.3): each decoder layer runs under
`torch.utils.checkpoint.checkpoint(use_reentrant=False)`; backward recomputes the layer from its
input. What stays in memory between forward and backward is one `[B, S, D]` hidden state per layer:
`L · S · D` elements instead of every intermediate of every layer.

Offload (ALST Sec. 3.3; MEMO Sec. 4 with alpha = 0, i.e. only the layer input is swapped): those
`L · S · D` checkpoints still grow with depth (Llama-8B at 125K: 30.5 GiB). With offload each
layer's checkpoint goes to (pinned, on CUDA) host memory:

1. Forward: the checkpoint's input is saved through `torch.autograd.graph.saved_tensors_hooks`
   placed around the checkpoint call, so the hook sees exactly the tensors checkpoint keeps (its
   positional input; everything saved inside the layer is handled by checkpoint's own inner hooks).
   The pack hook copies it to host blocks on a side stream (`non_blocking`), and `record_stream`
   keeps the device block from being reused until the copy is done; the device tensor is then free
   as soon as the forward no longer needs it.
2. Backward: unpacking layer i (when autograd reaches it and checkpoint recomputes it) returns the
   tensor prefetched during layer i+1's backward, then starts the copy of layer i-1 on another side
   stream, into a block of the compute stream's pool (`HostBlocks.to_device`, as the chunk store's
   reads). The last layer stays on the device: its backward comes first, a copy would not hide.
3. `host_mem_budget` caps the host bytes: once the next checkpoint would exceed it, it stays on the
   device (so the earliest layers, whose checkpoints live longest, are the ones offloaded).
4. Placement (MEMO Sec. 4; lstune.memory.placement): a `CheckpointPlacement` gives each layer a host
   fraction α of its tokens (the rest stays on the device) or marks it not stored; backward then re-runs
   the layers from the segment's stored base once, without grad, under each layer's forward RNG and
   autocast state, and keeps the segment's inputs until their layers' backward. The default placement
   is 1-3 above (all but the last layer on the host).
5. Saved attention (`save_attention`, lstune.memory.attention_saved): each stored layer's call gets a `LayerSaves`
   that keeps its attention output and lse, placed like the layer's checkpoint (`keep_saved`: host when it has a host
   part and the budget holds them, else device) and prefetched with the checkpoint of the layer below, one layer
   ahead; the recompute then runs no attention forward.

Memory: device checkpoints O(L · S · D) → O(1 · S · D) (the kept last layer, one in flight out, one
prefetched in); host gets L-1 of them (Llama-8B: 2 · L · D = 256 KiB per token in bf16). Cost: two
PCIe copies of S · D per layer, hidden under compute when `offload_min_tokens` says so. On CPU
the same code runs with plain copies into separate buffers, so the logic is tested without a GPU.
Composes with tiled MLP / mini-sequence (they run inside the checkpointed layer), LoRA, SP.

Why not `torch.autograd.graph.save_on_cpu`: it copies synchronously on the compute stream and
copies back on demand, with no prefetch and no budget. ALST patched reentrant `CheckpointFunction`
with blocking copies; this keeps torch's non-reentrant checkpoint and only adds hooks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch.utils.checkpoint import checkpoint

from lstune.memory.attention_saved import LayerSaves
from lstune.memory.host_copies import HostBlocks, host_copy_bytes
from lstune.memory.offload_math import (  # noqa: F401  (re-exported: the offload's threshold lives with its math)
    MIN_COPY_BYTES, PCIE_BYTES_PER_S, SUSTAINED_FLOPS, offload_min_tokens, place_checkpoints)
from lstune.memory.patching import Undo, patch_forward
from lstune.memory.placement import CheckpointPlacement

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger("lstune")





@dataclass
class OffloadStats:
    """Counters of one offloader, cumulative except the host byte counts."""

    offloaded: int = 0  # checkpoints copied to host
    kept: int = 0  # checkpoints left on the device (placed there, or over the host budget)
    split: int = 0  # checkpoints with their first tokens on the host and the rest on the device (0 < alpha < 1)
    recomputed: int = 0  # checkpoints not stored (their layers re-run from the segment's base in backward)
    recomputed_in_backward: int = 0  # layer forwards backward re-ran without grad for them
    prefetched: int = 0  # fetched back one layer ahead of their backward
    fetched_on_demand: int = 0  # fetched back when their backward needed them (no prefetch)
    saved_on_host: int = 0  # saved attention tensors (lstune.memory.attention_saved) copied to host
    saved_on_device: int = 0  # saved attention tensors kept on the device
    saved_prefetched: int = 0  # saved attention tensors fetched back one layer ahead of their recompute
    host_bytes: int = 0  # host bytes held by live checkpoints (and saved attention) now
    peak_host_bytes: int = 0


class _OnDevice:
    """A checkpoint kept on the device (pack returns this so unpack still knows the layer index)."""

    def __init__(self, index: int, tensor: torch.Tensor):
        self.index = index
        self.tensor = tensor


class _HostCopy:
    """A checkpoint living in host memory (`host`, in blocks), plus its in-flight device copy when prefetched."""

    def __init__(self, index: int, source: torch.Tensor, *, pinned: bool):
        self.index = index
        self.device = source.device
        self.host = HostBlocks(source.shape, source.dtype, pinned=pinned)
        self.nbytes = self.host.nbytes
        self.ready = None  # CUDA event: the device→host copy finished (None on CPU)
        self.incoming: tuple[torch.Tensor, object] | None = None  # (device tensor, CUDA event or None)


class _Saved:
    """One layer's checkpoint as the placement put it: a host part (the first tokens), a device part (the rest),
    or neither (not stored: backward re-runs the layers from its segment's base). `run` re-runs the layer on a
    hidden state (its other arguments bound), `replay` the RNG and autocast state its forward ran under."""

    def __init__(self, index: int, run: Callable, replay: "_Replay | None"):
        self.index = index
        self.run = run
        self.replay = replay
        self.host: _HostCopy | None = None
        self.device: torch.Tensor | None = None
        self.below: weakref.ref | None = None  # layer index-1's checkpoint of the same forward
        self.rerun: torch.Tensor | None = None  # not stored: its input, once backward re-ran its segment

    @property
    def stored(self) -> bool:
        return self.host is not None or self.device is not None


class _Replay:
    """The RNG and autocast state a layer's forward ran under, restored when backward re-runs it without grad
    (what torch's checkpoint does for its own recompute), so dropout masks and casts come out identical."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.autocast = {kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                         for kind in {"cpu", device.type}}

    @contextlib.contextmanager
    def restored(self):
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"), contextlib.ExitStack() as stack:
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng, self.device)
            for kind, (enabled, dtype) in self.autocast.items():
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            yield


class CheckpointOffloader:
    """Places decoder-layer checkpoints as `placement` says: host parts copied out in forward and fetched back one
    layer ahead in backward, device parts kept, layers not stored re-run from their segment's base."""

    def __init__(self, n_layers: int, *, host_mem_budget: int | None = None, keep_last: int = 1,
                 placement: CheckpointPlacement | None = None):
        self.n_layers = n_layers
        self.host_mem_budget = host_mem_budget
        if placement is None:
            placement = CheckpointPlacement((1.0,) * max(n_layers - keep_last, 0) + (0.0,) * min(keep_last, n_layers))
        if placement.n_layers != n_layers:
            raise ValueError(f"placement covers {placement.n_layers} layers, the model has {n_layers}")
        self.placement = placement
        self._replaying = bool(placement.recomputed)
        self.stats = OffloadStats()
        self._latest: dict[int, weakref.ref] = {}
        self._streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}
        self._saving: tuple[int, weakref.ref, Callable] | None = None
        self._saves: dict[int, weakref.ref] = {}  # layer index -> its latest forward's saved attention

    @contextlib.contextmanager
    def saving(self, index: int, hidden: torch.Tensor, run: Callable | None = None):
        """Scope of layer `index`'s checkpoint call: the tensor checkpoint saves goes through our hooks."""
        # The pack hook must not close over `hidden`: autograd keeps the hooks with the saved variable.
        self._saving = (index, weakref.ref(hidden), run)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._saving = None

    def _pack(self, tensor: torch.Tensor):
        index, expected, run = self._saving if self._saving else (-1, lambda: None, None)
        if tensor is not expected():  # not a layer input: nothing of ours (index -2 prefetches nothing)
            return _OnDevice(-2, tensor)
        saved = _Saved(index, run, _Replay(tensor.device) if self._replaying else None)
        saved.below = self._latest.get(index - 1)
        self._latest[index] = weakref.ref(saved)
        fraction = self.placement.host_fraction[index]
        if fraction is None:
            self.stats.recomputed += 1
            return saved
        tokens = self._host_tokens(fraction, tensor)
        if tokens:
            saved.host = self._copy_out(index, tensor[..., :tokens, :])
            self._track_host(saved.host, saved.host.nbytes)
        if tokens < tensor.shape[-2]:
            # A slice would keep the whole tensor's storage alive: the device part gets its own.
            saved.device = tensor if not tokens else tensor[..., tokens:, :].clone()
        self._count(tokens, tensor.shape[-2])
        return saved

    def _host_tokens(self, fraction: float, tensor: torch.Tensor) -> int:
        """Tokens of each sample that go to the host: the placement's fraction, or none past the host budget."""
        tokens = math.floor(fraction * tensor.shape[-2] + 1e-6)  # the planner's fractions are whole tokens
        if tokens and self.host_mem_budget is not None:
            numel = tensor[..., :tokens, :].numel()
            nbytes = host_copy_bytes(numel, tensor.element_size(), pinned=tensor.device.type == "cuda")
            if self.stats.host_bytes + nbytes > self.host_mem_budget:
                return 0
        return tokens

    def _fits_host(self, tensor: torch.Tensor) -> bool:
        if self.host_mem_budget is None:
            return True
        nbytes = host_copy_bytes(tensor.numel(), tensor.element_size(), pinned=tensor.device.type == "cuda")
        return self.stats.host_bytes + nbytes <= self.host_mem_budget

    def _count(self, tokens: int, length: int) -> None:
        if tokens == length:
            self.stats.offloaded += 1
        elif tokens:
            self.stats.split += 1
        else:
            self.stats.kept += 1

    def _unpack(self, handle) -> torch.Tensor:
        if isinstance(handle, _OnDevice):
            return handle.tensor
        if handle.stored:
            tensor = self._take(handle)
        else:
            tensor, handle.rerun = handle.rerun, None
            if tensor is None:
                tensor = self._recompute_segment(handle)
        self._prefetch(self._fetch_next(handle.index))
        self._prefetch_saves(handle.index - 1)
        return tensor

    def stores(self, index: int) -> bool:
        """Whether layer `index`'s checkpoint is stored (not re-run from its segment's base)."""
        return self.placement.host_fraction[index] is not None

    def register_saves(self, saves: LayerSaves) -> None:
        self._saves[saves.index] = weakref.ref(saves)

    def keep_saved(self, index: int, tensor: torch.Tensor):
        """A tensor layer `index` keeps beside its checkpoint (saved attention): on the host when its checkpoint has
        a host part and the host budget holds it, else on the device."""
        if self.placement.host_fraction[index] and self._fits_host(tensor):
            handle = self._copy_out(index, tensor)
            self._track_host(handle, handle.nbytes)
            self.stats.saved_on_host += 1
            return handle
        self.stats.saved_on_device += 1
        return _OnDevice(index, tensor)

    def fetch_saved(self, handle) -> torch.Tensor:
        return handle.tensor if isinstance(handle, _OnDevice) else self._arrived(handle)

    def prefetch_saved(self, handle) -> None:
        if isinstance(handle, _HostCopy) and handle.incoming is None:
            handle.incoming = self._copy_in(handle)
            self.stats.saved_prefetched += 1

    def _prefetch_saves(self, index: int) -> None:
        ref = self._saves.get(index)
        saves = ref() if ref is not None else None
        if saves is not None:
            saves.prefetch()

    def _fetch_next(self, index: int) -> int:
        """Whose host part backward needs next below `index`: the layer below, or its segment's base."""
        return self.placement.base(index - 1) if index > 0 else -1

    def _recompute_segment(self, top: _Saved) -> torch.Tensor:
        """Re-run layers base..top-1 without grad from the stored base; keep every input of the segment for its
        layer's backward (on its handle, dropped when its layer unpacks), return layer `top`'s."""
        saved = []
        layer = top.below()
        while True:  # down the same forward's chain (another micro-batch's forward may have run since)
            saved.insert(0, layer)
            if layer.stored:
                break
            layer = layer.below()
        base, top = saved[0].index, top.index
        hidden = self._take(saved[0])
        with torch.no_grad():
            for layer, above in zip(saved, saved[1:] + [None]):
                with layer.replay.restored():
                    hidden = _hidden_of(layer.run(hidden))
                if above is not None:
                    above.rerun = hidden
        self.stats.recomputed_in_backward += top - base
        return hidden

    def _take(self, saved: _Saved) -> torch.Tensor:
        """The stored checkpoint on the device: its fetched host part before its device part."""
        if saved.host is None:
            return saved.device
        host = self._arrived(saved.host)
        return host if saved.device is None else torch.cat([host, saved.device], dim=-2)

    def _prefetch(self, index: int) -> None:
        ref = self._latest.get(index)
        saved = ref() if ref is not None else None
        if saved is None or saved.host is None or saved.host.incoming is not None:
            return
        saved.host.incoming = self._copy_in(saved.host)
        self.stats.prefetched += 1

    def _arrived(self, handle: _HostCopy) -> torch.Tensor:
        if handle.incoming is None:
            handle.incoming = self._copy_in(handle)
            self.stats.fetched_on_demand += 1
        tensor, arrived = handle.incoming
        handle.incoming = None
        if arrived is not None:  # the tensor is the compute stream's (HostBlocks.to_device)
            torch.cuda.current_stream(handle.device).wait_event(arrived)
        return tensor

    def _copy_out(self, index: int, tensor: torch.Tensor) -> _HostCopy:
        source = tensor.detach().contiguous()
        if tensor.device.type != "cuda":
            handle = _HostCopy(index, tensor, pinned=False)
            handle.host.write(source)
            return handle
        handle = _HostCopy(index, tensor, pinned=True)
        handle.ready = handle.host.from_device(source, self._stream("d2h", tensor.device))
        return handle

    def _copy_in(self, handle: _HostCopy) -> tuple[torch.Tensor, object]:
        host = handle.host
        if handle.device.type != "cuda":
            tensor = torch.empty(host.shape, dtype=host.dtype, device=handle.device)
            host.read_into(tensor)
            return tensor, None
        return host.to_device(handle.device, self._stream("h2d", handle.device), after=handle.ready)

    def _stream(self, kind: str, device: torch.device) -> "torch.cuda.Stream":
        key = (kind, device)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=device)
        return self._streams[key]

    def _track_host(self, handle: _HostCopy, nbytes: int) -> None:
        self.stats.host_bytes += nbytes
        self.stats.peak_host_bytes = max(self.stats.peak_host_bytes, self.stats.host_bytes)
        weakref.finalize(handle, self._release, nbytes)

    def _release(self, nbytes: int) -> None:
        self.stats.host_bytes -= nbytes


class CheckpointedForward:
    """Installed as a decoder layer's `forward`: the original forward under non-reentrant checkpoint."""

    def __init__(self, layer: "nn.Module", index: int, offloader: CheckpointOffloader | None,
                 save_attention: bool = False):
        self.forward = layer.forward
        self.index = index
        self.offloader = offloader
        self.save_attention = save_attention

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        hidden, run = self._bind(args, _without_cache(kwargs))
        if self.save_attention and (self.offloader is None or self.offloader.stores(self.index)):
            # Attention's output and lse are kept beside the checkpoint (lstune.memory.attention_saved); layers the
            # placement re-runs from a segment base keep nothing.
            saves = LayerSaves(self.index, self.offloader)
            run = saves.wrap(run)
            if self.offloader is not None:
                self.offloader.register_saves(saves)
        scope = self.offloader.saving(self.index, hidden, run) if self.offloader else contextlib.nullcontext()
        with scope:
            return checkpoint(run, hidden, use_reentrant=False)

    def _bind(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, Callable]:
        """Split off the hidden state (checkpoint's only positional input) and close over the rest."""
        if args:
            rest = args[1:]
            return args[0], lambda hidden: self.forward(hidden, *rest, **kwargs)
        kwargs = dict(kwargs)
        hidden = kwargs.pop("hidden_states")
        return hidden, lambda h: self.forward(hidden_states=h, **kwargs)


def _hidden_of(output) -> torch.Tensor:
    """A decoder layer's output hidden state (HF layers return it alone or first in a tuple)."""
    return output if isinstance(output, torch.Tensor) else output[0]


def _without_cache(kwargs: dict) -> dict:
    """A KV cache would be written twice (forward and recompute): training runs without one, as HF does."""
    if kwargs.get("use_cache") or kwargs.get("past_key_values") is not None:
        kwargs = {**kwargs, "use_cache": False, "past_key_values": None}
    return kwargs


def install_checkpointing(layers: "nn.ModuleList", offloader: CheckpointOffloader | None, *,
                          save_attention: bool = False) -> list[Undo]:
    """Checkpoint every layer (HF's own per-layer checkpointing is switched off meanwhile, not doubled);
    `save_attention`: keep attention's output and lse beside each checkpoint (lstune.memory.attention_saved)."""
    undos: list[Undo] = []
    for index, layer in enumerate(layers):
        if getattr(layer, "gradient_checkpointing", False):
            layer.gradient_checkpointing = False
            undos.append(partial_setattr(layer, "gradient_checkpointing", True))
            logger.info("layer %d: Hugging Face gradient checkpointing off (lstune checkpoints it)", index)
        what = (f"layer {index}: checkpointed" + (", checkpoint offloaded" if offloader else "")
                + (", attention saved" if save_attention else ""))
        forward = CheckpointedForward(layer, index, offloader, save_attention)
        undos.append(patch_forward(layer, forward, what=what))
    return undos


def partial_setattr(obj, name: str, value) -> Undo:
    return lambda: setattr(obj, name, value)
