"""Saved attention (`--recompute-attention off`, lstune.memory.attention_saved): loss and every gradient equal to
recomputing attention (`on`, today's checkpointing) across the architecture matrix, long and packed, LoRA, chunked
attention, offload and placement (fp32, CPU); the attention forward runs once per layer, not twice; the bytes kept
are the estimate's."""

from __future__ import annotations

import pytest
import torch

from lstune.config.schema import MemorySection
from lstune.memory import attention_saved
from lstune.memory.apply import apply_memory_techniques
from lstune.memory.block_attention import block_attention
from lstune.memory.measure import LiveBytes
from lstune.models.attention import use_lstune_attention
from lstune.models.presets import build_model
from tests.conftest import TINY_ARCHS
from tests.unit.memory._helpers import assert_grads_match, long_batch, nonzero_lora_B, packed_batch, run_grads

SEQ = 100
DOCS = [41, 33, 26]
SETTINGS = {
    "checkpointing": dict(tiled_mlp="off", tiled_loss="off", checkpointing=True),
    "offload": dict(tiled_mlp="off", tiled_loss="off", offload_checkpoints=True),
    "budget": dict(tiled_mlp=3, tiled_loss=3, offload_checkpoints=True, host_mem_budget=250_000),
    "chunks": dict(tiled_mlp=3, tiled_loss=3, offload_checkpoints=True, attn_chunks=3),
    "chunks-on-device": dict(tiled_mlp="off", tiled_loss="off", checkpointing=True, attn_chunks=2),
}


def _batch(data: str) -> dict:
    return long_batch(SEQ) if data == "long" else packed_batch(DOCS)


def _run(model, options: dict, recompute: str, batches: list[dict], calls: dict | None = None):
    """(plan, loss, grads) with lstune's attention and `options` under `--recompute-attention recompute`; `calls`
    (`_count_kernels`) zeroed once the plan's probes ran, so it counts the step's kernels."""
    attention = use_lstune_attention(model, backend="sdpa", block_kernel=block_attention)  # as train installs it
    plan = apply_memory_techniques(model, MemorySection(**options, recompute_attention=recompute), seq_len=SEQ)
    if calls is not None:
        calls.update(dict.fromkeys(calls, 0))
    try:
        loss, grads = run_grads(model, plan.loss_sum, batches)
    finally:
        plan.undo()
        attention.undo()
    return plan, loss, grads


def _assert_equal_on_and_off(model, options: dict, batches: list[dict]):
    _, ref_loss, ref_grads = _run(model, options, "on", batches)
    plan, loss, grads = _run(model, options, "off", batches)
    assert plan.save_attention
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert_grads_match(grads, ref_grads, rtol=1e-5)
    return plan


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = build_model(arch, seed=0).train()
        return cache[arch]

    return get


@pytest.mark.parametrize("data", ["long", "packed"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_saved_attention_matches_recompute_across_architectures(models, arch, data):
    _assert_equal_on_and_off(models(arch), SETTINGS["offload"], [_batch(data)])


@pytest.mark.parametrize("data", ["long", "packed"])
def test_softcapped_layers_are_recomputed_and_match(models, monkeypatch, data):
    """Gemma-2's softcapped logits run lstune's block kernel on CPU (issue 34); the saved path leaves them to
    `local_attention`, recomputed in backward: forward and recompute each run every layer's attention once."""
    from tests.support.archs import tiny_model

    model = tiny_model("gemma2", attn_logit_softcapping=2.0)  # a cap the tiny logits reach
    layers = model.config.num_hidden_layers
    calls = _count_kernels(monkeypatch)
    plan, _, _ = _run(model, SETTINGS["checkpointing"], "off", [_batch(data)], calls)
    assert plan.save_attention
    assert calls == {"saved_forward": 0, "saved_backward": 0, "local": 2 * layers}
    _assert_equal_on_and_off(model, SETTINGS["checkpointing"], [_batch(data)])


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s != "offload"])
@pytest.mark.parametrize("data", ["long", "packed"])
def test_saved_attention_matches_recompute_with_each_setting(models, setting, data):
    _assert_equal_on_and_off(models("tiny-llama"), SETTINGS[setting], [_batch(data)])


def test_saved_attention_with_lora_and_accumulation_matches_recompute():
    from peft import LoraConfig, get_peft_model

    model = build_model("tiny-qwen3", seed=0)
    model = nonzero_lora_B(get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"])))
    model.train()
    _assert_equal_on_and_off(model, SETTINGS["budget"], [long_batch(SEQ, seed=3), packed_batch(DOCS)])


def _count_kernels(monkeypatch) -> dict:
    """Counts of the saved path's fused forward/backward calls and of the plain path's (`local_attention`)."""
    from lstune.models import attention as attention_mod

    calls = {"saved_forward": 0, "saved_backward": 0, "local": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(attention_saved, "span_forward", counting("saved_forward", attention_saved.span_forward))
    monkeypatch.setattr(attention_saved, "span_backward", counting("saved_backward", attention_saved.span_backward))
    monkeypatch.setattr(attention_mod, "local_attention", counting("local", attention_mod.local_attention))
    return calls


@pytest.mark.parametrize("setting", ["checkpointing", "offload"])
def test_attention_forward_runs_once_per_layer(models, monkeypatch, setting):
    model = models("tiny-llama")
    layers = model.config.num_hidden_layers
    calls = _count_kernels(monkeypatch)
    _run(model, SETTINGS[setting], "on", [long_batch(SEQ)], calls)
    assert calls == {"saved_forward": 0, "saved_backward": 0, "local": 2 * layers}
    plan, _, _ = _run(model, SETTINGS[setting], "off", [long_batch(SEQ)], calls)
    assert calls == {"saved_forward": layers, "saved_backward": layers, "local": 0}
    if plan.offloader is not None:  # all but the last layer's on the host with their checkpoints, O and lse each
        stats = plan.offloader.stats
        assert (stats.saved_on_host, stats.saved_on_device) == (2 * (layers - 1), 2)
        assert stats.saved_prefetched == 2 * (layers - 1) and stats.fetched_on_demand == 0


def test_unsupported_attention_is_left_to_recompute(models, monkeypatch):
    """A sliding window shorter than a document: that layer's attention runs as before (recomputed), still exact."""
    model = models("tiny-mistral")
    window = model.config.sliding_window
    model.config.sliding_window = 16
    try:
        calls = _count_kernels(monkeypatch)
        plan, _, _ = _run(model, SETTINGS["checkpointing"], "off", [long_batch(SEQ)], calls)
        assert plan.save_attention
        assert calls["saved_forward"] == 0 and calls["local"] == 2 * model.config.num_hidden_layers
        _assert_equal_on_and_off(model, SETTINGS["checkpointing"], [long_batch(SEQ)])
    finally:
        model.config.sliding_window = window


def test_kept_bytes_are_the_estimates(models):
    """Live bytes after the forward (allocation trace), `off` minus `on`: every layer's O (activation dtype) and fp32
    lse — what the estimate's byte model says it keeps."""
    model = models("tiny-llama")
    config = model.config
    batch = long_batch(SEQ)

    def live_after_forward(recompute: str) -> int:
        attention = use_lstune_attention(model, backend="sdpa", block_kernel=block_attention)  # as train installs it
        plan = apply_memory_techniques(model, MemorySection(**SETTINGS["checkpointing"],
                                                            recompute_attention=recompute), seq_len=SEQ)
        try:
            with LiveBytes() as live:
                loss, _ = plan.loss_sum(model, batch)
                after = live.current
                loss.backward()
            model.zero_grad(set_to_none=True)
            return after
        finally:
            plan.undo()
            attention.undo()

    from lstune.config.schema import TrainConfig
    from lstune.estimate import estimate
    from lstune.estimate.hardware import resolve_hardware

    flat = {"model": "tiny-llama", "seq_len": SEQ, "dtype": "fp32", "recompute_attention": "off",
            **SETTINGS["checkpointing"]}
    predicted = estimate(TrainConfig.from_flat(flat), resolve_hardware(gpu="cpu", host_mem=64 << 30),
                         model_config=config, suggest=False, reach=False).breakdown
    assert predicted.attention_saved_layers == config.num_hidden_layers
    expected = predicted.attention_saved_layers * SEQ * predicted.attention_saved_bytes_per_token_layer
    assert live_after_forward("off") - live_after_forward("on") == expected


@pytest.mark.parametrize("setting", ["chunks", "chunks-on-device"])
def test_chunked_attention_blocks_run_once(models, monkeypatch, setting):
    """Chunked attention's forward blocks run in the first forward only: the recompute reads the saved chunks."""
    from lstune.memory import attention_chunks

    calls = {"blocks": 0}
    block_forward = attention_chunks.block_forward

    def counting(*args, **kwargs):
        calls["blocks"] += 1
        return block_forward(*args, **kwargs)

    monkeypatch.setattr(attention_chunks, "block_forward", counting)
    model = models("tiny-llama")
    _run(model, SETTINGS[setting], "on", [long_batch(SEQ)], calls)
    recomputed = calls["blocks"]
    _run(model, SETTINGS[setting], "off", [long_batch(SEQ)], calls)
    assert recomputed and calls["blocks"] * 2 == recomputed


PLACEMENTS = {
    "segments": (1.0, None, None, 0.0, None, 0.0),
    "alpha_half": (0.5, 0.5, None, 0.5, None, 0.0),
}


@pytest.mark.parametrize("data", ["long", "packed"])
@pytest.mark.parametrize("fractions", sorted(PLACEMENTS))
def test_placement_matches_and_keeps_nothing_for_layers_it_recomputes(data, fractions):
    """MEMO placement (host, device, split and not-stored layers): equal to recomputing; layers whose checkpoint is
    not stored keep nothing, the others their O and lse (on the host where their checkpoint has a host part)."""
    from lstune.memory import checkpoint as ckpt
    from lstune.memory.patching import run_undos
    from lstune.memory.placement import CheckpointPlacement
    from lstune.models.introspect import decoder_layers
    from tests.unit.memory._helpers import hf_loss_sum

    model = build_model("tiny-llama", num_hidden_layers=6).train()
    placement = CheckpointPlacement(PLACEMENTS[fractions])
    attention = use_lstune_attention(model, backend="sdpa", block_kernel=block_attention)  # as train installs it
    results = {}
    try:
        for save in (False, True):
            offloader = ckpt.CheckpointOffloader(6, placement=placement)
            undos = ckpt.install_checkpointing(decoder_layers(model), offloader, save_attention=save)
            try:
                results[save] = run_grads(model, hf_loss_sum, [_batch(data)]), offloader.stats
            finally:
                run_undos(undos)
    finally:
        attention.undo()
    (ref_loss, ref_grads), _ = results[False]
    (loss, grads), stats = results[True]
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert_grads_match(grads, ref_grads, rtol=1e-5)
    host = sum(1 for a in placement.host_fraction if a)
    stored = sum(1 for a in placement.host_fraction if a is not None)
    assert (stats.saved_on_host, stats.saved_on_device) == (2 * host, 2 * (stored - host))


@pytest.mark.parametrize("recompute", ["on", "off"])
def test_host_copies_to_reserve_are_those_a_step_makes(models, monkeypatch, recompute):
    """`MemoryPlan.host_copies` (what `reserve_host` pins before the first step, so that step finds its pinned blocks
    cached) lists exactly the host copies a step makes: offloaded checkpoints and, with attention saved, their
    layers' outputs and lse."""
    from lstune.memory import host_copies

    made = []
    init = host_copies.HostBlocks.__init__

    def recording(self, shape, dtype, *, pinned, split=True, blocks=None):
        init(self, shape, dtype, pinned=pinned, split=split, blocks=blocks)
        if blocks is None:
            made.append((self.shape.numel(), dtype))

    monkeypatch.setattr(host_copies.HostBlocks, "__init__", recording)
    plan, _, _ = _run(models("tiny-llama"), SETTINGS["offload"], recompute, [long_batch(SEQ, batch=2)], {})
    assert plan.offload and made
    assert sorted(made, key=str) == sorted(plan.host_copies(micro_batch=2), key=str)
    assert plan.reserve_host(2) == 0  # on CPU nothing is pinned


def _refusing(run):
    """`run` that raises on spans longer than the probe's 48-token blocks, as ops may on shapes they refuse."""
    def op(*args, **kwargs):
        if max(a.shape[2] for a in args[:3]) > 64:
            raise RuntimeError("span too long for this op")
        return run(*args, **kwargs)
    return op


@pytest.mark.parametrize("refuses", ["forward", "backward", "both"])
@pytest.mark.parametrize("alone", [False, True])
def test_an_op_that_fails_on_a_real_span_hands_it_on(models, monkeypatch, refuses, alone):
    """Ops that pass the probe but refuse a real span are dropped for the run (a warning) and the next ops run it;
    with none left, a forward leaves the call to the plain path (recomputed) and a backward takes the PyTorch
    kernel from the kept (O, lse). Exact every way."""
    from lstune.memory import attention_blocks

    cpu = attention_blocks.FLASH_OPS["cpu"][0]
    forward = _refusing(cpu.forward) if refuses in ("forward", "both") else cpu.forward
    backward = _refusing(cpu.backward) if refuses in ("backward", "both") else cpu.backward
    picky = attention_blocks.FlashOps("picky", forward, backward, cpu.dtypes, True)
    monkeypatch.setitem(attention_blocks.FLASH_OPS, "cpu", (picky,) if alone else (picky, cpu))
    monkeypatch.setattr(attention_blocks, "_PROBED", {})
    _assert_equal_on_and_off(models("tiny-llama"), SETTINGS["checkpointing"], [long_batch(SEQ)])
    assert attention_blocks._PROBED[("cpu", torch.float32, 32, picky)] is False
