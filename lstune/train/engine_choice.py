"""Which engine trains the model: plain AdamW on one device, or DeepSpeed ZeRO (with host offload).

Rules (`--zero-stage auto`):
- several processes: DeepSpeed, with the stage and offload `auto_zero_config` picks for the model size and
  device memory (lstune.parallel.engine_ds);
- one process: plain AdamW when the resident training state fits in half the device's memory —
  2 bytes per weight (bf16 on CUDA) + 16 bytes per trainable parameter (fp32 master, gradient, Adam m, v);
  otherwise DeepSpeed ZeRO-3 with Adam state (and, if needed, weights) on the host — ALST's single-GPU
  setup. On CPU one process always uses plain AdamW.
`--zero-stage N`, `--offload-optimizer` and `--offload-params` override the choice.
"""

from __future__ import annotations

import os

from lstune.config.schema import ParallelSection, zero_problems
from lstune.errors import ConfigError

STATIC_SHARE = 0.5  # of device memory the training state may take; the rest is for activations


def choose_zero(parallel: ParallelSection, model, runtime):
    """A ZeroPlan for DeepSpeed, or None for the single-device TorchEngine."""
    from lstune.parallel.engine_ds import ZeroPlan, auto_zero_config

    offload_optimizer, offload_params = bool(parallel.offload_optimizer), bool(parallel.offload_params)
    problems = zero_problems(
        parallel.zero_stage, processes=runtime.world_size, offload_optimizer=offload_optimizer,
        offload_params=offload_params,
    )
    if problems:
        raise ConfigError(problems)
    if parallel.zero_stage == "0":
        return None
    if parallel.zero_stage != "auto":
        return ZeroPlan(int(parallel.zero_stage), offload_optimizer, offload_params, 0, "chosen with --zero-stage")
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    device_mem = _device_memory(runtime)
    offloads_asked = offload_optimizer or offload_params
    if runtime.world_size == 1 and not offloads_asked:
        if runtime.device.type != "cuda" or 2 * total + 16 * trainable <= STATIC_SHARE * device_mem:
            return None
    plan = auto_zero_config(trainable, device_mem, runtime.world_size)
    if offloads_asked:
        plan = ZeroPlan(3, offload_optimizer or plan.offload_optimizer, offload_params, 0, "host offload asked for")
    return plan


def _device_memory(runtime) -> int:
    """Bytes of memory of one device: the GPU's, or this process's share of host RAM on CPU."""
    if runtime.device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(runtime.device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = runtime.launch.local_world_size if runtime.launch else 1
    return host // max(local, 1)
