"""`estimate(config, hardware)` → `Estimate`: the prediction (lstune.estimate.prediction: engine, `auto` memory
settings, peaks, verdict, step time, longest sequence) and, when it does not fit, the cheapest changes that would
(lstune.estimate.suggestions) — the planner's modules composed, the one call `lstune estimate` and the run plan
(lstune.train.plan) make."""

from __future__ import annotations

from typing import Any

from lstune.config.schema import TrainConfig
from lstune.estimate.hardware import Cluster
from lstune.estimate.prediction import Estimate, predict
from lstune.estimate.settings import model_config_of
from lstune.estimate.memory import forget_byte_models
from lstune.estimate.preset_facts import counts_for
from lstune.estimate.shapes import ParamCounts
from lstune.estimate.suggestions import cheapest_changes


def estimate(config: TrainConfig, hardware: Cluster, *, model_config: Any = None, params: ParamCounts | None = None,
             suggest: bool = True, resolve_auto: bool = True, reach: bool = True) -> Estimate:
    """The estimate of `config` on `hardware` (a Cluster from `resolve_hardware`). `model_config`: the model's
    transformers config when already resolved (else read from `config.model.name`); `params`: counts when
    already made (a search calls this many times). `resolve_auto=False`: the memory settings as the memory plan
    applies them unresolved (`auto` tiles at ALST's counts, `auto` offload off; no `memory_choice`) — what a
    bench ladder rung runs. `reach=False`: no longest sequence searched (`longest_seq_len` 0), for a suggestion.
    A call without `params` starts with no byte model kept from before (memory.forget_byte_models); one with them
    is part of a search and keeps them."""
    if params is None:
        forget_byte_models()
    model_config = model_config if model_config is not None else model_config_of(config)
    params = params or counts_for(model_config, lora_r=config.model.lora_r, lora_targets=config.model.lora_targets,
                                  trust_remote_code=config.model.trust_remote_code)
    result = predict(config, hardware, model_config=model_config, params=params, resolve_auto=resolve_auto,
                     reach=reach)
    if suggest and not result.fits:
        result.suggestions = cheapest_changes(config, hardware, model_config, params)
    return result
