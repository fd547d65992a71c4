"""The loss head's terms of the byte model: the final norm before Liger's loss (lstune.memory.loss.normed_in_tiles)."""

from __future__ import annotations

from dataclasses import replace

from lstune.estimate.memory import Engine, Settings, _loss_parts, loss_backend
from lstune.estimate.shapes import ModelShape
from lstune.models.presets import preset_config

T, H, VOCAB = 2**20, 4096, 128256  # Llama-3.1-8B at 1M tokens
FUSED_NORM = "loss head: final norm in the tiles (its input, one tile's)"
NORMED = "loss head: the normed states Liger reads (in backward, the norm's input gradient)"
LIGER_GRAD = "loss head: Liger's gradient of its input"


def _liger_lora_settings() -> Settings:
    return Settings(seq_len=T, micro_batch=1, sp=1, world=1, engine=Engine("torch"), lora_r=16, on_cuda=True,
                    dtype="auto", tiled_mlp="auto", tiled_loss="auto", mini_sequence=False, checkpointing=True,
                    offload_checkpoints=True, host_mem_budget=None)


def test_before_liger_the_fused_final_norm_keeps_its_input_one_tile_and_its_output():
    """bf16 LoRA: HF's norm keeps 6 B per hidden value of the whole sequence (fp32 input, bf16 output); in the ALST
    loss tiles (2,089 tokens here) it keeps its 2 B input and one tile's 6 B, and the 2 B normed output
    lives until Liger has read it."""
    shape = ModelShape.from_config(preset_config("llama-3.1-8b"))
    s = _liger_lora_settings()
    assert loss_backend(s) == "liger" and (shape.hidden, shape.vocab) == (H, VOCAB)
    fused, unfused = dict(_loss_parts(shape, s, 2, 2)), dict(_loss_parts(shape, replace(s, fuse_norms=False), 2, 2))
    tile = 2089  # ALST: 2^30 // (4 · vocab) = 2,092 tokens -> 502 tiles of at most ⌈T / 502⌉
    assert unfused["loss head: final norm"] == T * H * 6  # 24 GiB
    assert fused[FUSED_NORM] == T * H * 2 + tile * H * 6 and fused[NORMED] == T * H * 2
    assert fused[LIGER_GRAD] == unfused[LIGER_GRAD] == T * H * 2
    assert sum(fused.values()) == sum(unfused.values()) - T * H * 2 + tile * H * 6  # 8 GiB less, but one tile
