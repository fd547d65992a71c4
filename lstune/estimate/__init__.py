"""`estimate(config, hardware)`: will this run fit, where do its bytes go, how long is a step — before anything
is loaded or rented.

One model for `lstune estimate` and for the run plan every command starts from (lstune.train.plan): the engine
(single-device AdamW or DeepSpeed ZeRO 1-3, with optimizer / parameter offload) is the first of
`engine_candidates` whose predicted peak fits the device, so a choice never disagrees with the estimate shown for
it. The modules, each named for what it does:

- planner.py: `estimate` → `Estimate`, the prediction and, when it does not fit, the suggestions;
- prediction.py: `predict` → `Estimate` (the engine, `choose_engine`; peaks, verdict, step time, longest sequence);
- settings.py: a configuration's byte-model settings, the SP degree, the device's and host's room;
- choice.py: the `auto` memory settings (`choose_memory` → `MemoryChoice`) and the engines `auto` may take;
- longest.py: the longest sequence that fits; suggestions.py: the cheapest changes that would fit;
- memory.py (the analytic byte model, per rank), flops.py, copies.py, placement.py, shapes.py, hardware.py;
- sequence_parallel.py (Ulysses × ring and METP's per-rank terms), metp_table.py (METP vs ZeRO-3 + tiled MLP).

`lstune estimate --trace` measures the same step on fake tensors (lstune.train.trace). docs/estimate.md explains
each term and how close it comes to measurements.
"""

from __future__ import annotations

from lstune.estimate.choice import (AUTO_OFFLOAD_RATIOS, MemoryChoice, choose_memory, engine_candidates,
                                    partial_offload_ratios, placed_settings, placement_budgets)
from lstune.estimate.flops import StepFlops, step_flops
from lstune.estimate.hardware import Cluster
from lstune.estimate.longest import longest_reach, longest_seq_len
from lstune.estimate.planner import estimate
from lstune.estimate.prediction import (Estimate, choose_engine, micro_batches_per_step, predict, step_seconds,
                                        traced_settings_estimate)
from lstune.estimate.settings import AUTO_HEADROOM, MIN_SEQ, device_capacity, host_capacity, resolve_sp, settings
from lstune.estimate.suggestions import _CHANGES, _MINI_OFFLOAD, Suggestion, change_flags, cheapest_changes

__all__ = ["AUTO_HEADROOM", "AUTO_OFFLOAD_RATIOS", "MIN_SEQ", "Cluster", "Estimate", "MemoryChoice", "StepFlops",
           "Suggestion", "change_flags", "cheapest_changes", "choose_engine", "choose_memory", "device_capacity",
           "engine_candidates", "estimate", "host_capacity", "longest_reach", "longest_seq_len",
           "micro_batches_per_step", "partial_offload_ratios", "predict", "placed_settings", "placement_budgets", "resolve_sp",
           "settings", "step_flops", "step_seconds", "traced_settings_estimate", "_CHANGES", "_MINI_OFFLOAD"]
