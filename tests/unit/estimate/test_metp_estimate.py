"""The estimate's METP terms (lstune.estimate.sequence_parallel.metp_moment_bytes / metp_state_bytes, counted by
lstune.estimate.memory under --metp-mlp) against what METP's own module holds: the live bytes of one MLP's forward and
backward, metered on SP rank 0 of a fake process group (its point-to-point sends move no data but hand back buffers
of the real shapes, as in `estimate --trace`); and the predicted MLP below the untiled MLP's, shrinking as 1/SP."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from lstune.estimate.memory import Engine, Settings, breakdown, without_metp_mlp
from lstune.estimate.sequence_parallel import metp_moment_bytes, metp_state_bytes
from lstune.estimate.shapes import ModelShape, count_parameters
from lstune.models.presets import preset_config


@contextmanager
def _fake_group(size: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _metered_metp(sp: int, tokens: int, hidden: int, intermediate: int, dtype) -> tuple[int, int]:
    """(peak live bytes of one METP MLP's forward + backward, bytes of its output and incoming gradient)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from lstune.memory.measure import LiveBytes
    from lstune.memory.metp_mlp import install_metp_mlp
    from lstune.memory.rotation import Ring

    layers = torch.nn.ModuleList([torch.nn.Module()])
    layers[0].mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=intermediate)).to(dtype)
    with _fake_group(sp):
        install_metp_mlp(layers, Ring(sp, 0, tuple(range(sp))))
        x = torch.randn(1, tokens, hidden, dtype=dtype, requires_grad=True)
        live = LiveBytes()
        with live:
            y = layers[0].mlp(x)
            y.backward(torch.ones_like(y))
    return live.peak, 2 * y.numel() * y.element_size()


@pytest.mark.parametrize("sp, tokens, hidden, intermediate, dtype", [
    (4, 1024, 128, 1024, torch.bfloat16),
    (4, 2048, 128, 1024, torch.bfloat16),
    (4, 1024, 256, 1024, torch.bfloat16),
    (8, 1024, 128, 2048, torch.bfloat16),
    (4, 1024, 128, 1024, torch.float32),
])
def test_the_metp_moment_is_what_the_module_holds_at_its_peak(sp, tokens, hidden, intermediate, dtype):
    """Within 2 % of the metered module, across tokens, hidden, intermediate, SP and the tokens' dtype (each term
    moves the total: a coefficient off by one shows)."""
    shape = ModelShape.from_config(preset_config("tiny-llama", hidden_size=hidden, intermediate_size=intermediate))
    act = torch.tensor([], dtype=dtype).element_size()
    predicted = sum(metp_moment_bytes(shape, tokens=tokens, sp=sp, act_bytes=act).values())
    peak, output_and_gradient = _metered_metp(sp, tokens, hidden, intermediate, dtype)
    assert predicted + output_and_gradient == pytest.approx(peak, rel=0.02)


def test_at_sp_2_the_moment_is_an_upper_bound():
    shape = ModelShape.from_config(preset_config("tiny-llama", hidden_size=128, intermediate_size=1024))
    predicted = sum(metp_moment_bytes(shape, tokens=2048, sp=2, act_bytes=2).values())
    peak, output_and_gradient = _metered_metp(2, 2048, 128, 1024, torch.bfloat16)
    assert peak <= predicted + output_and_gradient <= 1.15 * peak


LLAMA_8B = preset_config("llama-3.1-8b")


def _settings(sp: int, metp: bool, **kw) -> Settings:
    base = {"seq_len": 1 << 21, "micro_batch": 1, "sp": sp, "world": sp, "engine": Engine("deepspeed", 1), "lora_r": 0,
            "on_cuda": True, "dtype": "auto", "tiled_mlp": "off", "tiled_loss": "auto", "mini_sequence": False,
            "checkpointing": True, "offload_checkpoints": True, "host_mem_budget": None, "metp_mlp": metp}
    return Settings(**{**base, **kw})


def _item(b, prefix: str) -> int:
    return sum(i.device for i in b.items if i.name.startswith(prefix))


@pytest.fixture(scope="module")
def llama_8b():
    return ModelShape.from_config(LLAMA_8B), count_parameters(LLAMA_8B)


def test_zero_holds_the_model_less_the_mlp_and_each_rank_one_sp_th_of_the_mlp_in_fp32_with_adam(llama_8b):
    shape, params = llama_8b
    b = breakdown(shape, params, _settings(8, True))
    mlp = 3 * shape.hidden * shape.intermediate * shape.layers
    assert _item(b, "parameters") == (params.total - mlp) * 2 + 4 * mlp // 8  # bf16 under ZeRO; fp32 shard masters
    assert _item(b, "gradients: METP") == 4 * mlp // 8 and _item(b, "optimizer state: METP") == 8 * mlp // 8
    assert _item(b, "optimizer state") - _item(b, "optimizer state: METP") == 12 * (params.trainable - mlp) // 8
    # ZeRO-3 gathers a layer without its MLP
    zero3 = breakdown(shape, params, _settings(8, True, engine=Engine("deepspeed", 3)))
    rest = without_metp_mlp(params, shape, trainable=True)
    assert rest.largest_layer == params.largest_layer - 3 * shape.hidden * shape.intermediate
    assert _item(zero3, "parameters (ZeRO-3") == (rest.total * 2) // 8 + 2 * rest.largest_layer * 2
    # LoRA: the shards are frozen base weights, no gradient, no Adam state
    lora = breakdown(shape, params, _settings(8, True, lora_r=16))
    assert _item(lora, "parameters: METP") == 2 * mlp // 8 and _item(lora, "gradients: METP") == 0


def test_metp_predicts_less_than_the_untiled_mlp_and_shrinks_as_one_over_sp(llama_8b):
    """The layer's MLP moment and the MLP's training state: METP's below the untiled MLP's (whose weights ZeRO-1
    replicates), and at a fixed global length twice the SP degree halves METP's (or better: its intermediates are
    (s/p)×(I/p))."""
    shape, params = llama_8b

    def mlp_bytes(sp: int) -> int:
        t = (1 << 21) // sp
        state = shape.layers * sum(metp_state_bytes(shape, sp, trainable=True, frozen_bytes=2))
        return state + sum(metp_moment_bytes(shape, tokens=t, sp=sp, act_bytes=2).values())

    # The untiled MLP on 8 ranks under ZeRO-1: its moment (5 intermediates of (s/p)×I, lstune.estimate.memory) and
    # its state (bf16 weights and fp32 gradients replicated, master + m + v sharded).
    t, mlp = (1 << 21) // 8, 3 * shape.hidden * shape.intermediate * shape.layers
    untiled = 5 * t * shape.intermediate * 2 + mlp * (2 + 4 + 12 / 8)
    assert mlp_bytes(8) < untiled / 3
    for sp in (4, 8, 16):
        assert 0.25 < mlp_bytes(2 * sp) / mlp_bytes(sp) <= 0.5
    # and the breakdown's peak takes it: the untiled MLP moment is gone from the METP run's peak
    untiled_run, metp_run = (breakdown(shape, params, _settings(8, metp)) for metp in (False, True))
    assert metp_run.device_peak < untiled_run.device_peak
    assert not any("the MLP (untiled)" in i.name for i in metp_run.items)
