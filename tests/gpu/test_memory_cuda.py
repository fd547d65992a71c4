"""The memory techniques on a CUDA device: exactness (fp32, tight; bf16, loose), the real offload streams,
Liger's fused loss, and peak memory from torch.cuda.max_memory_allocated."""

from __future__ import annotations

import pytest
import torch

from lstune.config.schema import MemorySection
from lstune.memory.apply import apply_memory_techniques
from lstune.memory.loss import causal_lm_loss_sum, liger_applies
from lstune.models.presets import build_model
from lstune.memory.measure import peak_bytes
from tests.unit.memory._helpers import hf_loss_sum, long_batch, packed_batch, run_grads

pytestmark = pytest.mark.gpu

ALL = dict(tiled_mlp=3, tiled_loss=3, mini_sequence=True, offload_checkpoints=True)


@pytest.fixture
def offload_always(monkeypatch):
    """Tiny models are below the PCIe threshold (offload would fall back); force the CUDA offload path."""
    from lstune.memory import checkpoint

    monkeypatch.setattr(checkpoint, "offload_min_tokens", lambda *args, **kwargs: 0)


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


def _on_cuda(batch):
    return {k: v.cuda() for k, v in batch.items()}


def _compare(model, batch, options, *, loss_rel, grad_rel):
    ref_loss, ref_grads = run_grads(model, hf_loss_sum, [batch])
    plan = apply_memory_techniques(model, MemorySection(**options), seq_len=batch["input_ids"].shape[1])
    try:
        loss, grads = run_grads(model, plan.loss_sum, [batch])
    finally:
        plan.undo()
    assert loss == pytest.approx(ref_loss, rel=loss_rel)
    for name, ref in ref_grads.items():
        err = (grads[name].float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)
        assert err < grad_rel, f"{name}: relative gradient error {err:.2e}"
    return plan


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-gemma2", "tiny-qwen3-moe", "tiny-phi3"])
def test_fp32_on_cuda_is_exact_with_the_offload_streams(arch, offload_always):
    """fp32 on the GPU: a missed stream sync in offload/prefetch would corrupt a checkpoint and fail this."""
    model = build_model(arch).cuda().train()
    plan = _compare(model, _on_cuda(packed_batch([300, 200, 124])), ALL, loss_rel=1e-5, grad_rel=1e-4)
    assert plan.offload and plan.offloader.stats.prefetched == model.config.num_hidden_layers - 1


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3", "tiny-mixtral"])
def test_bf16_matches_hf_loosely(arch, offload_always):
    model = build_model(arch, dtype=torch.bfloat16).cuda().train()
    _compare(model, _on_cuda(long_batch(512)), ALL, loss_rel=2e-2, grad_rel=5e-2)


def test_liger_fused_loss_matches_the_tiled_loss():
    pytest.importorskip("liger_kernel")
    model = build_model("tiny-gemma2").cuda()  # softcap 30, tied embeddings
    batch = _on_cuda(long_batch(256))
    assert liger_applies(model.lm_head, batch["input_ids"])
    liger_loss, liger_grads = run_grads(model, lambda m, b: causal_lm_loss_sum(m, b, tiles="auto"), [batch])
    tiled_loss, tiled_grads = run_grads(model, lambda m, b: causal_lm_loss_sum(m, b, tiles=4), [batch])
    assert liger_loss == pytest.approx(tiled_loss, rel=1e-4)
    for name, ref in tiled_grads.items():
        torch.testing.assert_close(liger_grads[name], ref, rtol=1e-3, atol=1e-5)


def test_liger_after_the_final_norm_in_tiles_matches_the_tiled_loss(monkeypatch):
    """The plan's Liger path (final norm fused, normed in 4 loss tiles before Liger: `loss.normed_in_tiles`) against
    the plan's tiled path, which norms in its own 4 tiles."""
    pytest.importorskip("liger_kernel")
    from lstune.memory import loss

    model = build_model("tiny-gemma2").cuda()  # softcap 30, tied embeddings
    monkeypatch.setattr(loss, "LOSS_TILE_BYTES", 4 * 64 * model.config.vocab_size)  # ALST tiles of 64 tokens
    batch = _on_cuda(long_batch(256))
    results = {}
    for tiles, backend in (("auto", "liger"), (4, "tiled")):
        plan = apply_memory_techniques(model, MemorySection(tiled_mlp="off", tiled_loss=tiles, checkpointing=False),
                                       seq_len=256)
        try:
            results[backend] = run_grads(model, plan.loss_sum, [batch])
        finally:
            plan.undo()
        assert (plan.loss_backend, plan.final_norm_fused) == (backend, True)
    assert results["liger"][0] == pytest.approx(results["tiled"][0], rel=1e-4)
    for name, ref in results["tiled"][1].items():
        torch.testing.assert_close(results["liger"][1][name], ref, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("head_trains", [False, True])
def test_liger_peak_is_what_the_estimate_counts(head_trains):
    """Liger's loss over 16K tokens at Llama-3.1-8B's head (bf16): the peak above its input is the estimate's Liger
    parts (`_liger_parts`: its input's gradient, one 512-token logits buffer, the head's weight gradient when the
    head trains), within 5 % + 8 MiB (the kernel's own scratch). The model before 2026-11-26 said 8 B a logit
    (+375 MiB here)."""
    pytest.importorskip("liger_kernel")
    from dataclasses import replace

    from lstune.estimate.memory import Engine, Settings, _loss_parts
    from lstune.estimate.shapes import ModelShape
    from lstune.models.presets import preset_config
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    t, config = 16384, preset_config("llama-3.1-8b")
    h, v = config.hidden_size, config.vocab_size
    hidden = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / h**0.5).requires_grad_(head_trains)
    labels = torch.randint(0, v, (t,), device="cuda")

    def step():
        liger_fused_linear_cross_entropy(hidden, weight, labels, reduction="sum").backward()

    measured = peak_bytes(step, "cuda")
    s = Settings(seq_len=t, micro_batch=1, sp=1, world=1, engine=Engine("torch"), lora_r=0 if head_trains else 16,
                 on_cuda=True, dtype="auto", tiled_mlp="auto", tiled_loss="auto", mini_sequence=False,
                 checkpointing=True, offload_checkpoints=False, host_mem_budget=None, fuse_norms=False)
    parts = {n: b for n, b in _loss_parts(ModelShape.from_config(config), s, 2, 2) if "Liger" in n}
    predicted = sum(parts.values())
    # The .grad fields stay alive after the step: the head's is the estimate's head gradient, not Liger's.
    assert abs(measured - predicted) <= 0.05 * predicted + 8 * 2**20, (measured, parts)


def test_offload_falls_back_below_the_pcie_threshold():
    model = build_model("tiny-llama").cuda()  # thin layers: offload only pays past ~14.5K tokens
    plan = apply_memory_techniques(model, MemorySection(offload_checkpoints=True), seq_len=1024)
    assert not plan.offload and "offload off" in plan.offload_note
    plan.undo()


def _step_peak(model, batch, options) -> int:
    plan = apply_memory_techniques(model, MemorySection(**options), seq_len=batch["input_ids"].shape[1]) if options else None

    def step():
        loss, _ = (plan.loss_sum(model, batch) if plan else hf_loss_sum(model, batch))
        loss.backward()

    try:
        return peak_bytes(step, "cuda")
    finally:
        model.zero_grad(set_to_none=True)
        if plan:
            plan.undo()


def test_peak_memory_per_token_on_a_mid_size_model():
    """Qwen3-0.6B shape (2 layers, bf16) at 4K and 8K tokens: lstune's bytes per token are a fraction of HF's."""
    model = build_model("qwen3-0.6b", num_hidden_layers=2, dtype=torch.bfloat16).cuda().train()
    vocab = model.config.vocab_size
    slopes = {}
    for name, options in (("hf", None), ("lstune", {"offload_checkpoints": True})):
        p1 = _step_peak(model, _on_cuda(long_batch(4096, vocab)), options)
        p2 = _step_peak(model, _on_cuda(long_batch(8192, vocab)), options)
        slopes[name] = (p2 - p1) / 4096
    assert slopes["hf"] >= 2 * 4 * vocab  # fp32 logits copies dominate plain HF
    assert slopes["lstune"] < slopes["hf"] / 10


def test_offload_removes_the_checkpoints_from_the_device_peak():
    """6 layers at 32K tokens: the peak (at the loss head's backward, every checkpoint alive) drops by
    most of the 5 offloaded checkpoints (the last layer's stays)."""
    model = build_model("qwen3-0.6b", num_hidden_layers=6, dtype=torch.bfloat16).cuda().train()
    batch = _on_cuda(long_batch(32768, model.config.vocab_size))
    kept = _step_peak(model, batch, {})
    offloaded = _step_peak(model, batch, {"offload_checkpoints": True})
    checkpoint = 32768 * model.config.hidden_size * 2
    assert kept - offloaded >= 0.5 * 5 * checkpoint


def test_offload_copy_hides_under_compute():
    """The side-stream copy of a checkpoint runs during the compute stream's matmul: the overlapped pair takes
    far less than the two in series (H100, 2026-11-23: copy 10.0 ms at 54 GB/s, matmul 9.5 ms, together 11.0 ms)."""
    from tools.gpu.bench_ladder import copy_overlap

    result = copy_overlap(65536, 4096, "cuda")
    assert result["overlapped_s"] < 0.75 * result["serial_s"], result
    assert result["hidden_fraction"] > 0.5, result


def test_offloaded_checkpoints_pin_their_size_not_the_next_power_of_two():
    """Five checkpoints of 1.27 GiB each (bf16, 163K tokens × 4096): one pinned allocation each would pin 2 GiB
    (torch's host allocator rounds up to a power of two); the offloader's blocks pin under one block more."""
    from lstune.memory.checkpoint import CheckpointOffloader
    from lstune.memory.host_copies import HOST_BLOCK_BYTES

    stats_of = getattr(torch.cuda.memory, "host_memory_stats", None)
    assert stats_of is not None, "this torch has no torch.cuda.memory.host_memory_stats"
    hidden = torch.randn(1, 163_000, 4096, device="cuda", dtype=torch.bfloat16)
    nbytes = hidden.numel() * hidden.element_size()
    offloader = CheckpointOffloader(n_layers=6)
    before = stats_of()["active_bytes.current"]
    handles = [offloader._copy_out(i, hidden) for i in range(5)]
    torch.cuda.synchronize()
    pinned = stats_of()["active_bytes.current"] - before
    assert 5 * nbytes <= pinned < 5 * (nbytes + HOST_BLOCK_BYTES), (pinned, nbytes)
    back, _ = offloader._copy_in(handles[0])
    torch.cuda.synchronize()
    assert torch.equal(back, hidden)


def test_prefetched_checkpoints_come_from_the_compute_streams_pool():
    """A checkpoint's device copy (HostBlocks.to_device) is allocated from the compute stream's pool: once read and
    freed, the compute stream's next allocation of that size reuses its block (allocated on the copy stream, the
    block went back to that stream's cache, and the compute allocation reserved another 64 MiB)."""
    from lstune.memory.checkpoint import CheckpointOffloader

    hidden = torch.randn(1, 8192, 4096, device="cuda", dtype=torch.bfloat16)  # 64 MiB
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no cached block of earlier tests to serve the allocation below
    offloader = CheckpointOffloader(n_layers=2)
    handle = offloader._copy_out(0, hidden)
    back, arrived = offloader._copy_in(handle)
    torch.cuda.current_stream().wait_event(arrived)
    assert torch.equal(back, hidden)
    del back
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    again = torch.empty_like(hidden)
    assert torch.cuda.memory_reserved() == reserved, "the copy's block was not the compute stream's to reuse"
    del again


@pytest.mark.parametrize("data", ["long", "packed"])
def test_saved_attention_matches_recompute_in_bf16_with_the_offload_streams(data, offload_always):
    """--recompute-attention off on CUDA (issue 33): cuDNN's (or PyTorch's flash) op with the kept output and lse,
    copied to the host with the checkpoints and prefetched, against recomputing (bf16: loose; a missed stream wait
    or a wrong lse layout is off by O(1))."""
    from lstune.models.attention import use_lstune_attention

    model = build_model("tiny-llama").cuda().to(torch.bfloat16).train()
    batch = _on_cuda(long_batch(512) if data == "long" else packed_batch([300, 200, 12]))
    results = {}
    attention = use_lstune_attention(model, backend="sdpa")
    try:
        for mode in ("on", "off"):
            plan = apply_memory_techniques(model, MemorySection(offload_checkpoints=True, recompute_attention=mode),
                                           seq_len=512)
            try:
                results[mode] = run_grads(model, plan.loss_sum, [batch]), plan.offloader.stats
            finally:
                plan.undo()
    finally:
        attention.undo()
    (ref_loss, ref_grads), _ = results["on"]
    (loss, grads), stats = results["off"]
    layers = model.config.num_hidden_layers
    assert (stats.saved_on_host, stats.saved_on_device) == (2 * (layers - 1), 2)  # O and lse of every layer
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    for name, ref in ref_grads.items():
        err = (grads[name].float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)
        assert err < 5e-2, f"{name}: relative gradient error {err:.2e}"
