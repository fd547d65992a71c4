"""Where each decoder layer's checkpoint lives: host, device, split by tokens, or not stored (MEMO Sec. 4).

A checkpoint is one layer's input hidden state (lstune.memory.checkpoint). A `CheckpointPlacement` gives each
layer a host fraction α of its tokens:

- α = 1: on the host (today's offload); α = 0: on the device; 0 < α < 1: the first α·S tokens of every sample on
  the host, the rest on the device (MEMO's token-wise α, Sec. 4.1, applied to the one tensor lstune keeps per
  layer: MEMO splits a layer's *saved activations* between offload and recompute, but under per-layer
  checkpointing the only thing kept is the layer input, and a token of it cannot be recomputed without the whole
  layer below, so the complement of the offloaded tokens stays on the device);
- `None`: not stored — backward re-runs the layers from the nearest stored checkpoint below it (its segment's
  base) once, without grad, and keeps the segment's inputs on the device until their layers' backward.

`plan_placement` chooses the placement that costs the least extra recompute (module doc of the function). It is
plain arithmetic (no torch): `lstune estimate` and `lstune train` call the same function on the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

HOST, DEVICE, SPLIT, RECOMPUTE = "host", "device", "split", "recompute"


@dataclass(frozen=True)
class CheckpointPlacement:
    """Per layer, the host fraction α of its checkpoint's tokens (None: not stored, recomputed in backward)."""

    host_fraction: tuple[float | None, ...]
    checkpoint_bytes: int = 0  # one layer's checkpoint at the planned length (0: unknown)
    host_bytes_of: Callable[[int], int] = field(default=lambda n: n, repr=False, compare=False)
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        fractions = self.host_fraction
        if not fractions or fractions[0] is None or fractions[-1] is None:
            raise ValueError("the first and last layers' checkpoints must be stored (nothing below / above them)")
        if any(a is not None and not 0.0 <= a <= 1.0 for a in fractions):
            raise ValueError(f"host fractions must lie in [0, 1], not {fractions}")

    @classmethod
    def offload_all(cls, n_layers: int, checkpoint_bytes: int = 0, **kw) -> "CheckpointPlacement":
        """Today's offload: every layer on the host but the last (its backward comes first, a copy would not hide)."""
        return cls((1.0,) * (n_layers - 1) + (0.0,), checkpoint_bytes, **kw)

    @property
    def n_layers(self) -> int:
        return len(self.host_fraction)

    def where(self, index: int) -> str:
        a = self.host_fraction[index]
        return RECOMPUTE if a is None else HOST if a == 1.0 else DEVICE if a == 0.0 else SPLIT

    @property
    def recomputed(self) -> list[int]:
        return [i for i, a in enumerate(self.host_fraction) if a is None]

    def base(self, index: int) -> int:
        """The nearest stored layer at or below `index` (where its recompute starts)."""
        while self.host_fraction[index] is None:
            index -= 1
        return index

    @property
    def longest_segment(self) -> int:
        """The most consecutive layers recomputed from one base."""
        longest = run = 0
        for a in self.host_fraction:
            run = run + 1 if a is None else 0
            longest = max(longest, run)
        return longest

    @property
    def offloads(self) -> bool:
        return any(a for a in self.host_fraction)

    def host_bytes(self) -> int:
        """Host bytes of every stored host part (with the offloader's block rounding)."""
        return sum(self.host_bytes_of(int(a * self.checkpoint_bytes)) for a in self.host_fraction if a)

    def device_bytes(self) -> int:
        """Device bytes the stored device parts hold between forward and backward."""
        return int(sum(1 - a for a in self.host_fraction if a is not None) * self.checkpoint_bytes)

    def device_peak_bytes(self) -> int:
        """`device_bytes` plus backward's transients: one host part fetched back ahead of its layer (when any
        layer has one), and the inputs of the longest recomputed segment kept until their layers' backward."""
        fetched = 1 if self.offloads else 0
        return self.device_bytes() + (fetched + self.longest_segment) * self.checkpoint_bytes

    def extra_layer_forwards(self) -> int:
        """Layer forwards beyond checkpointing's one recompute per layer: one per layer not stored."""
        return len(self.recomputed)

    def describe(self) -> str:
        """Layers grouped by where their checkpoint lives, e.g. 'host 0-12; split 13 (α 0.40); recompute 14, 16'."""
        groups: dict[str, list[str]] = {}
        for kind, first, last in _runs([self.where(i) for i in range(self.n_layers)]):
            label = str(first) if first == last else f"{first}-{last}"
            if kind == SPLIT:
                label += f" (α {self.host_fraction[first]:.2f})" if first == last else ""
            groups.setdefault(kind, []).append(label)
        return "; ".join(f"{kind} {', '.join(labels)}" for kind, labels in groups.items())

    def summary(self, step_layer_forwards: float | None = None) -> dict:
        """What train's plan summary and `lstune estimate` show. `step_layer_forwards`: a step's FLOPs in units of
        one layer's forward (for the extra recompute in % of the step)."""
        out = {
            "layers": self.describe(),
            "host_bytes": self.host_bytes(),
            "device_bytes": self.device_bytes(),
            "recomputed_layers": self.recomputed,
            "host_fraction": [None if a is None else round(a, 4) for a in self.host_fraction],
        }
        if step_layer_forwards:
            out["extra_recompute_pct"] = round(100 * self.extra_layer_forwards() / step_layer_forwards, 2)
        if self.notes:
            out["notes"] = list(self.notes)
        return out


def _runs(kinds: Sequence[str]):
    start = 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[start] or kinds[start] == SPLIT:
            yield kinds[start], start, i - 1
            start = i


def hiding_fraction(checkpoint_bytes: int, copy_bytes_per_s: float | None, layer_forward_s: float | None) -> float:
    """The largest α whose copy hides under one layer's forward (MEMO Eq. 1): α · bytes / BW <= forward time."""
    if not copy_bytes_per_s or not layer_forward_s or checkpoint_bytes <= 0:
        return 1.0
    return min(1.0, layer_forward_s * copy_bytes_per_s / checkpoint_bytes)


def plan_placement(
    n_layers: int,
    checkpoint_bytes: int,
    *,
    host_budget: int | None = None,
    device_budget: int | None = None,
    copy_bytes_per_s: float | None = None,
    layer_forward_s: float | None = None,
    host_bytes_of: Callable[[int], int] = lambda n: n,
    tokens: int | None = None,
) -> CheckpointPlacement:
    """The placement that costs the least extra recompute.

    1. Host first: each stored layer from the bottom (the longest-lived checkpoints) puts the fraction α of its
       tokens whose copy hides under one layer's forward (`hiding_fraction`) on the host, while `host_budget`
       lasts (the layer where it runs out gets the α that fills it). The last layer stays on the device.
    2. Device: the rest of every stored layer, plus backward's transients (`device_peak_bytes`).
    3. Recompute: while that exceeds `device_budget`, one more layer is not stored; the r recomputed layers are
       spread evenly between stored ones (segments differ by at most one layer), so the longest segment — the
       inputs backward keeps on the device at once — is as short as r allows. The first r that fits wins: each
       recomputed layer costs one layer forward, so fewer is cheaper. If none fits, the one needing the least
       device memory (fewest recomputed among equals) is returned with a note.

    With no budgets (or budgets that hold everything) this is `CheckpointPlacement.offload_all`. `tokens`: the
    checkpoint's length, to round fractions down to whole tokens (what the offloader splits).
    """
    if n_layers < 1:
        raise ValueError("a placement needs at least one layer")
    alpha = _whole_tokens(hiding_fraction(checkpoint_bytes, copy_bytes_per_s, layer_forward_s), tokens)
    best = None
    for recomputed in range(max(n_layers - 1, 1)):
        stored = _spread(n_layers, recomputed)
        if stored is None:
            break
        plan = _fill_host(stored, checkpoint_bytes, alpha, host_budget, host_bytes_of, tokens)
        if device_budget is None or plan.device_peak_bytes() <= device_budget:
            return plan
        if best is None or plan.device_peak_bytes() < best.device_peak_bytes():
            best = plan  # nothing fits yet: keep the smallest device need (fewest recomputed among equals)
    need = best.device_peak_bytes()
    note = (f"checkpoints need {need:,} B on the device even with {len(best.recomputed)} of {n_layers} layers "
            f"recomputed; the device budget is {device_budget:,} B")
    return CheckpointPlacement(best.host_fraction, checkpoint_bytes, host_bytes_of, (note,))


def _spread(n_layers: int, recomputed: int) -> list[bool] | None:
    """Which layers are stored when `recomputed` of them are not: the first and last stored, the recomputed ones
    in runs of near-equal length after each stored layer but the last (None when that is impossible)."""
    stored_count = n_layers - recomputed
    gaps = stored_count - 1
    if recomputed and (gaps < 1 or stored_count < 2):
        return None
    runs = [recomputed // gaps + (1 if g < recomputed % gaps else 0) for g in range(gaps)] if recomputed else [0] * gaps
    # Longer runs above: the top segments' backward comes first, before the device holds a fetched-back base.
    runs.reverse()
    stored: list[bool] = []
    for run in runs:
        stored += [True] + [False] * run
    return stored + [True]


def _fill_host(stored: list[bool], checkpoint_bytes: int, alpha: float, host_budget: int | None,
               host_bytes_of: Callable[[int], int], tokens: int | None) -> CheckpointPlacement:
    fractions: list[float | None] = []
    left = math.inf if host_budget is None else host_budget
    last = len(stored) - 1
    for index, is_stored in enumerate(stored):
        if not is_stored:
            fractions.append(None)
            continue
        if index == last:
            fractions.append(0.0)
            continue
        a = _whole_tokens(_fitting_fraction(alpha, checkpoint_bytes, left, host_bytes_of), tokens)
        left -= host_bytes_of(int(a * checkpoint_bytes)) if a else 0
        fractions.append(a)
    return CheckpointPlacement(tuple(fractions), checkpoint_bytes, host_bytes_of)


def _whole_tokens(fraction: float, tokens: int | None) -> float:
    return fraction if not tokens else math.floor(fraction * tokens + 1e-6) / tokens


def _fitting_fraction(alpha: float, checkpoint_bytes: int, left: float, host_bytes_of: Callable[[int], int]) -> float:
    """The largest fraction <= alpha whose host bytes fit in `left` (rounded down to 1/1024 of the checkpoint)."""
    if checkpoint_bytes <= 0 or left == math.inf:
        return alpha
    a = min(alpha, left / checkpoint_bytes)
    while a > 0 and host_bytes_of(int(a * checkpoint_bytes)) > left:
        a = math.floor(a * 1024 - 1) / 1024
    return max(a, 0.0)
