"""The longest sequence that completes a training step: exponential, then binary search over trials.

`probe(length)` runs one trial (in a fresh process: lstune.bench.runner) and returns its record; a record
whose outcome is "ok" fits. From `start`, lengths double while they fit (or halve while they do not), then
the gap between the longest fit and the shortest failure is bisected on multiples of `step`. Fitting is
assumed monotone in the length (a longer sequence never needs less memory or time), so the answer is exact
to `step` in about log2(answer / start) + log2(answer / step) trials. A trial that fails for a reason other
than running out of memory or time (outcome "error": a bug or a refusal) ends the search: no length
would tell more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

FAILED_BY_LIMIT = ("oom", "host-oom", "timeout", "crash")


@dataclass
class SearchResult:
    longest_ok: int  # 0 when not even the shortest length tried fits
    shortest_failed: int | None  # None when every length tried fits (up to `max_len`)
    step: int
    trials: list[dict[str, Any]] = field(default_factory=list)
    stopped: str | None = None  # why the search ended early ("error: ...")
    capped: bool = False  # every length fitted up to --max-len: the longest is the cap, not the configuration's

    def to_dict(self) -> dict[str, Any]:
        return {"longest_ok": self.longest_ok, "shortest_failed": self.shortest_failed, "len_step": self.step,
                "stopped": self.stopped, "capped": self.capped, "trials": [t.get("id") for t in self.trials]}


def find_max_len(probe: Callable[[int], dict[str, Any]], *, start: int, step: int,
                 max_len: int | None = None) -> SearchResult:
    """The longest multiple of `step` (at most `max_len`) whose trial succeeds (module doc)."""
    result = SearchResult(0, None, step)
    ok, failed = 0, None  # longest length that fit, shortest that did not
    length = max(step, start // step * step)
    if max_len is not None:
        length = min(length, max(step, max_len // step * step))

    def fits(n: int) -> bool | None:
        record = probe(n)
        result.trials.append(record)
        if record["outcome"] == "ok":
            return True
        if record["outcome"] in FAILED_BY_LIMIT:
            return False
        result.stopped = f"{record['outcome']} at {n}: {record.get('error', '')}"[:300]
        return None

    # Exponential phase: up by doubling from a fit, down by halving from a failure.
    verdict = fits(length)
    while verdict is not None:
        if verdict:
            ok = length
            if max_len is not None and length * 2 > max_len:
                top = max_len // step * step
                if top <= length:
                    break
                length = top
            else:
                length *= 2
        else:
            failed = length
            if ok or length == step:
                break
            length = max(step, length // 2 // step * step)
        if failed is not None and ok:
            break
        verdict = fits(length)
    # Binary phase, on multiples of `step`, between the longest fit and the shortest failure.
    while result.stopped is None and failed is not None and ok and failed - ok > step:
        mid = (ok + failed) // 2 // step * step
        verdict = fits(mid)
        if verdict is None:
            break
        ok, failed = (mid, failed) if verdict else (ok, mid)
    result.longest_ok, result.shortest_failed = ok, failed
    result.capped = (result.stopped is None and failed is None and max_len is not None
                     and ok >= max(step, max_len // step * step))
    return result


CAP_NOTE = "reached the --max-len cap"


def longest_text(search: dict[str, Any], format_length: Callable[[int], str]) -> str:
    """A search's answer in words: '2k', 'none', or '≥ 2k (reached the --max-len cap)' when the cap, not the
    configuration, ended it."""
    if not search["longest_ok"]:
        return "none"
    found = format_length(search["longest_ok"])
    return f"≥ {found} ({CAP_NOTE})" if search.get("capped") else found
