"""Apply lstune's techniques to a loaded model, in one fixed order.

Order (each step sees the result of the previous one):
1. move to the device (on CUDA with LoRA, frozen base weights in bf16; adapters stay fp32);
2. LoRA adapters (peft) — before anything wraps modules, so peft finds the plain linear layers;
3. attention backend: lstune's attention function (no 4D mask, packed documents from position_ids);
4. memory techniques (lstune.memory): tiled MLP / mini-sequence, tiled loss, checkpointing + offload.
The engine (optimizer) is built last, over the parameters that remain trainable.
"""

from __future__ import annotations

import logging

from lstune.config.schema import TrainConfig
from lstune.models.loading import apply_lora

log = logging.getLogger("lstune")


def prepare_model(model, config: TrainConfig, device, *, local_seq_len: int | None = None):
    """Returns the prepared model and the memory plan (what was applied, for the run's plan display).
    `local_seq_len` is the per-rank sequence length under sequence parallelism."""
    import torch

    from lstune.memory.apply import apply_memory_techniques

    if device.type == "cuda" and config.lora_r and config.dtype != "fp32":
        model = model.to(dtype=torch.bfloat16)
    model = model.to(device)
    if config.lora_r:
        model = apply_lora(
            model, r=config.lora_r, alpha=config.lora_alpha, dropout=config.lora_dropout, targets=config.lora_targets
        )
        log.info("LoRA r=%d applied", config.lora_r)
    from lstune.models.attention import use_lstune_attention

    use_lstune_attention(model, backend=config.attn)
    plan = apply_memory_techniques(
        model,
        seq_len=local_seq_len or config.seq_len,
        tiled_mlp=config.tiled_mlp,
        tiled_loss=config.tiled_loss,
        mini_sequence=config.mini_sequence,
        checkpointing=config.checkpointing,
        offload_checkpoints=config.offload_checkpoints,
        host_mem_budget=config.host_mem_budget,
    )
    model.train()
    return model, plan
