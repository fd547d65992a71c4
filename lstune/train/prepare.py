"""Apply lstune's techniques to a loaded model, in one fixed order.

Order (each step sees the result of the previous one):
1. move to the device (on CUDA with LoRA, frozen base weights in bf16; adapters stay fp32);
2. LoRA adapters (peft) — before anything wraps modules, so peft finds the plain linear layers;
3. attention backend: lstune's attention function (no 4D mask, packed documents from position_ids);
4. sequence parallelism: Ulysses all-to-alls around that attention when SP > 1;
5. memory techniques (lstune.memory): tiled MLP / mini-sequence, tiled loss, checkpointing + offload,
   sized for the per-rank sequence length.
The engine (optimizer, ZeRO) is built last, over the parameters that remain trainable.
"""

from __future__ import annotations

import logging
import math

from lstune.config.schema import TrainConfig
from lstune.models.loading import apply_lora

log = logging.getLogger("lstune")


def prepare_model(model, config: TrainConfig, runtime):
    """Returns the prepared model and the memory plan (what was applied, for the run's plan display)."""
    import torch

    from lstune.memory.apply import apply_memory_techniques
    from lstune.models.attention import use_lstune_attention

    device, spec = runtime.device, config.model
    if device.type == "cuda" and spec.lora_r and spec.dtype != "fp32":
        model = model.to(dtype=torch.bfloat16)
    model = model.to(device)
    if spec.lora_r:
        model = apply_lora(model, r=spec.lora_r, alpha=spec.lora_alpha, dropout=spec.lora_dropout, targets=spec.lora_targets)
        log.info("LoRA r=%d applied", spec.lora_r)
    use_lstune_attention(model, backend=spec.attn)
    if runtime.sp > 1:
        from lstune.parallel.ulysses import apply_ulysses

        apply_ulysses(model, runtime.dims)
    plan = apply_memory_techniques(model, config.memory, seq_len=math.ceil(config.data.seq_len / runtime.sp))
    model.train()
    return model, plan
