"""The margin a "fits" keeps: what the measured runs needed beyond the byte model's peak.

The byte model predicts what torch allocates (within ~1 % of `max_memory_allocated` at full depth); a run fails on
what the allocator reserves and on what the host really pins. The records in docs/benchmarks set the margins:

- Device, every run: **8 % of the device**. The full-depth Llama-3.1-8B LoRA step at 128K on an H200
  (2026-11-26-h200): predicted 79.55 GiB, allocated 79.10, reserved 85.81 — the reserved peak 6.26 GiB (7.3 % of
  it, 7.9 % of the prediction) above the estimate; the 2-layer 128K steps reserved 2.1-3.1 GiB over allocated.
  Checked against the full-depth 384K step on an H100 (2026-11-28-h100): predicted 61.29 GiB, allocated 60.51,
  reserved 70.10 — 8.81 GiB (11.4 % of the usable device) above, but with 18 GiB free, where the cache keeps freed
  blocks; under pressure it gives them back (the 832K emulation below ended with its reserved peak at the cap, 4.6
  GiB above the estimate). Not raised on that evidence; a full-depth step at the margin's edge is still unmeasured.
- Device, chunked attention (FPDT): **13 % of the device**. Its blocks' many tensor sizes fragment the cache: at
  128K on two layers the reserved peak rose 8.5 GiB (21.05 → 29.55 GiB) while the allocated one fell 4.5
  (17.97 → 13.44; 2026-11-26-h200-c): 16.1 GiB reserved over allocated, against 3.1 unchunked. Under an 80 GB cap at
  768K (emulated full depth) the reserved peak was 7.4 GiB over allocated and 3.4 GiB over the prediction, and at
  832K it met the cap. 5 % more of the device (3.9 GiB of an H100) covers that excess with the 8 % kept for the rest.
- Host: **4 % of the usable host** (the RAM less the OS's reserve, lstune.estimate.memory.host_reserve_bytes: the
  kernel, page tables, other processes — the OOM killer ended a process at 123.0 of 125.9 GiB, 2026-11-26-h200-b).
  Pinned host memory grew beyond the model by +2.1 % at 768K and +4.3 % at 832K (2026-11-26-h200-c: 116.3 and 121.4
  GiB measured, 113.9 and 116.4 predicted).

On a CPU the device is the host's RAM: the host's margin applies to both. `--force` (lstune train) runs past the
margin and the verdict. The estimate states the margin; `fits`, the longest length, train's refusal and every
`auto` choice (engine, offloads, chunks, tiles' target, the placement's budgets) apply it.
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICE_MARGIN = 0.08
CHUNKED_DEVICE_MARGIN = 0.13
HOST_MARGIN = 0.04


@dataclass(frozen=True)
class Margin:
    """Bytes a fitting run leaves free: of one device, and of one node's usable host."""

    device: int
    host: int
    device_share: float
    host_share: float

    def describe(self) -> str:
        return (f"a fit leaves {self.device_share:.0%} of the device and {self.host_share:.0%} of the usable host "
                "free (what measured runs reserved and pinned beyond the model's peak; docs/estimate.md)")

    def to_dict(self) -> dict:
        return {"device_bytes": self.device, "host_bytes": self.host, "device_share": self.device_share,
                "host_share": self.host_share}


def margin(device_capacity: int, host_capacity: int, *, on_cuda: bool, chunked: bool) -> Margin:
    """The margin of a run on a device of `device_capacity` usable bytes and a node of `host_capacity` (module doc)."""
    device_share = (CHUNKED_DEVICE_MARGIN if chunked else DEVICE_MARGIN) if on_cuda else HOST_MARGIN
    return Margin(int(device_capacity * device_share), int(host_capacity * HOST_MARGIN), device_share, HOST_MARGIN)
