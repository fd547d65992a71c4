"""Checkpointing + host offload: O(1) layers of checkpoints stay on the device, prefetch, budget, threshold."""

from __future__ import annotations

import pytest
import torch

from lstune.config.schema import MemorySection
from lstune.memory.apply import apply_memory_techniques
from lstune.memory.checkpoint import offload_min_tokens
from lstune.models.introspect import decoder_layers
from lstune.models.presets import build_model
from lstune.memory.measure import LiveBytes
from tests.unit.memory._helpers import assert_grads_match, hf_loss_sum, long_batch, run_grads

HIDDEN = 128  # tiny-llama
PLAIN = dict(tiled_mlp="off", tiled_loss="off")


def _retained_per_token(layers: int, offload: bool) -> float:
    """Device bytes per token the autograd graph keeps after forward (host copies left out), 128 → 256 tokens."""
    model = build_model("tiny-llama", num_hidden_layers=layers)
    plan = apply_memory_techniques(model, MemorySection(offload_checkpoints=offload, **PLAIN), seq_len=256)
    retained = []
    for seq in (128, 256):
        with LiveBytes() as live:
            loss, _ = plan.loss_sum(model, long_batch(seq))
            host = plan.offloader.stats.host_bytes if offload else 0
            retained.append(live.current - host)
        del loss
    plan.undo()
    return (retained[1] - retained[0]) / 128


def test_offload_keeps_a_constant_number_of_layer_checkpoints_on_the_device():
    layer_bytes = HIDDEN * 4  # one fp32 checkpoint, per token
    plain = {n: _retained_per_token(n, offload=False) for n in (2, 6)}
    offload = {n: _retained_per_token(n, offload=True) for n in (2, 6)}
    assert plain[6] - plain[2] == pytest.approx(4 * layer_bytes, rel=0.05)  # O(layers) without offload
    assert abs(offload[6] - offload[2]) < 0.25 * layer_bytes  # O(1) with it
    assert plain[6] - offload[6] == pytest.approx(5 * layer_bytes, rel=0.05)  # all but the last layer moved


def test_backward_prefetches_every_offloaded_layer_and_frees_host_memory():
    model = build_model("tiny-llama")  # 4 layers
    plan = apply_memory_techniques(model, MemorySection(offload_checkpoints=True, **PLAIN), seq_len=64)
    stats = plan.offloader.stats
    loss, _ = plan.loss_sum(model, long_batch(64))
    assert (stats.offloaded, stats.kept) == (3, 1)
    assert stats.host_bytes == 3 * 64 * HIDDEN * 4
    loss.backward()
    del loss
    assert stats.prefetched == 3 and stats.fetched_on_demand == 0
    assert stats.host_bytes == 0 and stats.peak_host_bytes == 3 * 64 * HIDDEN * 4
    plan.undo()


def test_host_memory_budget_keeps_what_does_not_fit_on_the_device():
    model = build_model("tiny-llama")
    one_layer = 64 * HIDDEN * 4
    plan = apply_memory_techniques(model, MemorySection(offload_checkpoints=True, host_mem_budget=one_layer + 1, **PLAIN), seq_len=64)
    loss, _ = plan.loss_sum(model, long_batch(64))
    stats = plan.offloader.stats
    assert (stats.offloaded, stats.kept) == (1, 3)  # the earliest layer (longest-lived checkpoint) went
    assert stats.host_bytes <= one_layer + 1
    loss.backward()
    plan.undo()


def test_offload_needs_checkpointing():
    from lstune.errors import ConfigError

    with pytest.raises(ConfigError, match="needs --checkpointing on"):
        apply_memory_techniques(build_model("tiny-llama"), MemorySection(checkpointing=False, offload_checkpoints=True), seq_len=64)


def test_hf_gradient_checkpointing_is_replaced_not_doubled_and_restored():
    model = build_model("tiny-llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    layers = decoder_layers(model)
    plan = apply_memory_techniques(model, MemorySection(**PLAIN), seq_len=64)
    assert not any(layer.gradient_checkpointing for layer in layers)
    loss, _ = plan.loss_sum(model, long_batch(64))
    loss.backward()
    plan.undo()
    assert all(layer.gradient_checkpointing for layer in layers)
    assert not any("forward" in vars(layer) for layer in layers)


def test_without_grad_layers_run_plainly():
    model = build_model("tiny-llama")
    plan = apply_memory_techniques(model, MemorySection(offload_checkpoints=True, **PLAIN), seq_len=64)
    with torch.no_grad():
        plan.loss_sum(model, long_batch(64))
    assert plan.offloader.stats.offloaded == 0
    plan.undo()


def test_offload_threshold_follows_memo_eq1():
    # Llama-3.1-8B: a layer's forward hides its checkpoint copy at any length; only the 1 MiB floor applies.
    assert offload_min_tokens(218_112_000, 4096, 4096, 2) == 129
    # A thin layer computes too little per token: it needs long sequences (the attention term) to hide it.
    assert offload_min_tokens(184_576, 128, 128, 2) > 10_000
    # Slower PCIe needs longer sequences.
    assert offload_min_tokens(15_730_944, 1024, 2048, 2, pcie_bytes_per_s=12e9) > offload_min_tokens(
        15_730_944, 1024, 2048, 2
    )


def test_checkpoints_split_over_several_host_blocks_are_exact(monkeypatch):
    from lstune.memory import host_copies

    monkeypatch.setattr(host_copies, "HOST_BLOCK_BYTES", 1000)  # a 64 × 128 fp32 checkpoint → 33 blocks
    batch = long_batch(64)
    reference = build_model("tiny-llama")
    expected, reference_grads = run_grads(reference, lambda m, b: hf_loss_sum(m, b), [batch])
    model = build_model("tiny-llama")
    plan = apply_memory_techniques(model, MemorySection(offload_checkpoints=True, **PLAIN), seq_len=64)
    loss, grads = run_grads(model, plan.loss_sum, [batch])
    assert plan.offloader.stats.offloaded == 3
    assert plan.offloader.stats.peak_host_bytes == 3 * 64 * HIDDEN * 4  # CPU blocks are exact
    assert loss == pytest.approx(expected, rel=1e-6)
    assert_grads_match(grads, reference_grads, rtol=1e-5)
    plan.undo()
