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


def _liger(settings: Settings, t: int, act: int = 2, res: int = 2, vocab: int = VOCAB) -> dict[str, int]:
    shape = replace(ModelShape.from_config(preset_config("llama-3.1-8b")), vocab=vocab)
    return {name: nbytes for name, nbytes in _loss_parts(shape, replace(settings, seq_len=t), act, res)
            if "Liger" in name and "normed states Liger reads" not in name}


def _buffer(parts: dict[str, int]) -> int:
    (nbytes,) = [n for name, n in parts.items() if "logits buffer" in name]
    return nbytes


def test_liger_keeps_one_bf16_logits_buffer_of_a_power_of_two_tokens():
    """liger-kernel 0.8.5: chunks of next_pow2(⌈t / ⌈V/h⌉⌉) tokens (⌈128256 / 4096⌉ = 32), one buffer in the
    input's dtype that the logits' gradient overwrites — 2 B a logit, where the model had said 8 B and no
    rounding."""
    s = _liger_lora_settings()
    assert _buffer(_liger(s, 131072)) == 4096 * VOCAB * 2  # 131072 / 32 is already a power of two: 1.0 GiB
    assert _buffer(_liger(s, 100_000)) == 4096 * VOCAB * 2  # ⌈100000 / 32⌉ = 3125 -> 4096
    assert _buffer(_liger(s, 3000, vocab=1000)) == 3000 * 1000 * 2  # one chunk (V < h): never more than t tokens
    assert _liger(s, 131072)[LIGER_GRAD] == 131072 * H * 2
    assert len(_liger(s, 131072)) == 2  # LoRA, bf16: no weight gradient, no autocast copies


def test_liger_with_a_trainable_head_holds_its_weight_gradient_and_under_autocast_the_copies():
    """A full fine-tune: Liger makes the head's weight gradient in its forward (in the weight's dtype); with fp32
    weights under bf16 autocast the normed states and the head's weight reach it as bf16 copies."""
    s = replace(_liger_lora_settings(), lora_r=0)
    bf16 = _liger(s, 131072)
    assert bf16["loss head: Liger's gradient of the head's weight (made in forward)"] == VOCAB * H * 2
    assert not [name for name in bf16 if "autocast" in name]
    autocast = _liger(s, 131072, act=2, res=4)
    assert autocast["loss head: the head's weight cast for Liger (autocast)"] == VOCAB * H * 2
    assert autocast["loss head: the normed states cast for Liger (autocast)"] == 131072 * H * 2
