"""Memory meters: bytes saved for backward, and peak live tensor bytes — for tests, `estimate --trace`
and `bench`.

- `SavedBytes`: an outermost `saved_tensors_hooks` that adds up the unique storages autograd keeps
  for backward (hooks set deeper, e.g. inside a checkpoint, take precedence and hide what they save).
- `LiveBytes`: a `TorchDispatchMode` that follows every storage an op allocates until it is freed
  (weakref finalizer on the storage), giving current and peak live bytes on CPU, for real and fake
  tensors. On CUDA use `torch.cuda.max_memory_allocated` (`peak_bytes` picks the right one).

Written by hand: torch's `MemTracker` needs modules to attribute bytes to and counts only what it sees
inside them; these count every storage an op creates, which is what a peak is made of.
"""

from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class SavedBytes:
    """Context manager: `bytes` = size of the distinct storages autograd saved for backward inside it."""

    def __init__(self):
        self.bytes = 0
        self._seen: set[int] = set()

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if _key(tensor) not in self._seen and storage.nbytes() > 0:
            self._seen.add(_key(tensor))
            self.bytes += storage.nbytes()
        return tensor


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of the storages allocated by ops run inside (views and in-place ops add nothing).

    Works on real and fake tensors (storages are told apart by identity, not address).
    `exclude()`, if given, is subtracted when the peak is taken (e.g. the bytes of offloaded host copies,
    which on a CPU run are CPU storages like everything else).
    """

    def __init__(self, exclude: Callable[[], int] | None = None):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._exclude = exclude
        self._live: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and _key(tensor) not in inputs:
                self._track(tensor.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key = id(storage)
        if key in self._live or storage.nbytes() == 0:
            return
        self._live[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current - (self._exclude() if self._exclude else 0))
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)


def _key(tensor: torch.Tensor) -> int:
    # Storage Python objects are preserved for as long as the storage lives, so identity is stable.
    return id(tensor.untyped_storage())


def peak_bytes(fn: Callable[[], object], device: torch.device | str = "cpu", exclude=None) -> int:
    """Peak bytes allocated while `fn()` runs, above what was allocated before it (`exclude`: see LiveBytes)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with LiveBytes(exclude) as live:
        fn()
    return live.peak


@contextmanager
def no_leftover_grads(model: torch.nn.Module):
    """Zero gradients before and drop them after, so one measurement does not carry into the next."""
    model.zero_grad(set_to_none=True)
    try:
        yield
    finally:
        model.zero_grad(set_to_none=True)
