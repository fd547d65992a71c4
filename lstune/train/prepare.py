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

    device = runtime.device
    if device.type == "cuda" and config.lora_r and config.dtype != "fp32":
        model = model.to(dtype=torch.bfloat16)
    model = model.to(device)
    if config.lora_r:
        model = apply_lora(
            model, r=config.lora_r, alpha=config.lora_alpha, dropout=config.lora_dropout, targets=config.lora_targets
        )
        log.info("LoRA r=%d applied", config.lora_r)
    use_lstune_attention(model, backend=config.attn)
    if runtime.sp > 1:
        from lstune.parallel.ulysses import apply_ulysses

        apply_ulysses(model, runtime.dims)
    plan = apply_memory_techniques(
        model,
        seq_len=math.ceil(config.seq_len / runtime.sp),
        tiled_mlp=config.tiled_mlp,
        tiled_loss=config.tiled_loss,
        mini_sequence=config.mini_sequence,
        checkpointing=config.checkpointing,
        offload_checkpoints=config.offload_checkpoints,
        host_mem_budget=config.host_mem_budget,
    )
    model.train()
    return model, plan
