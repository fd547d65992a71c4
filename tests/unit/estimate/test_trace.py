"""`lstune estimate --trace` (lstune.train.trace): the dtypes of the target run, every static term counted, and the
analytic model within 3 % of the trace on a fast subset of docs/estimate.md's grid."""

from __future__ import annotations

import functools

import pytest

from lstune.config.schema import TrainConfig
from lstune.estimate.shapes import count_parameters
from lstune.models.presets import preset_config
from lstune.train.trace import grid_row, trace_step


def _trace(target_cuda: bool, **flat):
    return _traced(target_cuda, tuple(sorted(flat.items())))


@functools.lru_cache(maxsize=None)  # several tests read the same trace; a trace takes seconds
def _traced(target_cuda: bool, items: tuple):
    config = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 1024, **dict(items)})
    return config, trace_step(config, model_config=preset_config("tiny-llama"), target_cuda=target_cuda)


def test_a_cuda_lora_run_is_traced_with_a_bf16_base_and_bf16_checkpoints():
    config, t = _trace(True, lora_r=8)
    counts = count_parameters(preset_config("tiny-llama"), lora_r=8)
    hidden = 128
    assert t.residual_dtype == "bfloat16" and t.checkpoint_bytes_per_token_layer == 2 * hidden
    assert t.gradient_bytes == 4 * counts.adapters and t.optimizer_bytes == 8 * counts.adapters
    weights = 2 * counts.frozen + 4 * counts.adapters
    assert weights <= t.parameter_bytes < weights + 64 * 1024  # + buffers (rotary tables)
    assert t.traced_peak_bytes > t.parameter_bytes + t.gradient_bytes + t.optimizer_bytes


def test_an_fp32_cpu_run_keeps_fp32_checkpoints_and_full_fine_tune_counts_every_gradient():
    _, t = _trace(False)
    counts = count_parameters(preset_config("tiny-llama"))
    assert t.residual_dtype == "float32" and t.checkpoint_bytes_per_token_layer == 4 * 128
    assert t.gradient_bytes == 4 * counts.total and t.optimizer_bytes == 8 * counts.total


def test_offloaded_checkpoints_leave_the_device_peak_for_the_host():
    _, plain = _trace(True, lora_r=8)
    _, offload = _trace(True, lora_r=8, offload_checkpoints=True)
    assert offload.host_peak_bytes == 3 * 1024 * 2 * 128  # 3 of 4 layers, one pinned block each (a power of 2)
    assert offload.device_peak_bytes < plain.device_peak_bytes


@pytest.mark.parametrize("arch, setting, seq", [
    ("llama-3.1-8b", "LoRA defaults", 8192),
    ("llama-3.1-8b", "LoRA, MLP untiled", 16384),
    ("llama-3.1-8b", "full, SP 4 ZeRO-3", 16384),  # used to miss: fp32 trace of a bf16 engine, tiling's fp32 sums
    ("llama-3.1-8b", "full fine-tune", 16384),  # used to miss: every gradient counted at the loss head's peak
    ("phi-3-mini", "full fine-tune", 16384),  # used to miss (+7.8 %): the same, and the loss head's terms
    ("qwen3-8b", "LoRA defaults", 16384),  # used to miss (+3.5 %): the loss tile's length, the head's input twice
    ("mixtral-8x7b", "LoRA defaults", 16384),  # used to miss (-21 %): peft's B·A of the expert weights
    ("llama-3.1-8b", "LoRA, no checkpointing", 8192),  # used to miss (-27 %): no loss-head moment without checkpoints
])
def test_the_analytic_model_is_within_3_percent_of_the_trace(arch, setting, seq):
    row = grid_row(arch, setting, seq)
    assert abs(row["error"]) <= 0.03, row


@pytest.mark.parametrize("arch, setting", [
    # FPDT's chunk working set sets these peaks (mini-sequence keeps the loss head small). They used to miss by
    # -5 %, -3.8 % and -15 %: the score tiles of two row tiles alive together, dk/dv three times, the offloaded
    # path's dq on the device, and Phi-3's saved v keeping its fused qkv output alive.
    ("llama-3.1-8b", "LoRA + mini-sequence, attn chunks 4"),
    ("llama-3.1-8b", "LoRA + mini-sequence + offload, attn chunks 4"),
    ("phi-3-mini", "LoRA + mini-sequence, attn chunks 4"),
    # gpt-oss-20b (MoE 32 experts, sinks, windowed and full layers): the kind of plan its predicted longest length
    # (1,124K on one H100 + 128 GiB) takes, checked on its first two layers.
    ("gpt-oss-20b", "LoRA + mini-sequence + offload, attn chunks 4"),
])
def test_the_analytic_model_of_chunked_attention_is_within_3_percent_of_the_trace(arch, setting):
    row = grid_row(arch, setting, 8192)
    assert abs(row["error"]) <= 0.03, row


def test_sequence_parallelism_is_traced_for_real_on_a_fake_process_group(monkeypatch):
    import torch.distributed as dist

    from lstune.parallel import ulysses

    calls = []
    real = ulysses._all_to_all
    monkeypatch.setattr(ulysses, "_all_to_all", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    config = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 2048, "lora_r": 8})
    sp2 = trace_step(config, model_config=preset_config("tiny-llama"), target_cuda=True, sp=2)
    assert calls and not dist.is_initialized()  # Ulysses' all-to-alls ran; the fake group is gone afterwards
    assert sp2.seq_len == 1024
    _, alone = _trace(True, lora_r=8)  # one rank's share without SP: the per-rank model the analytic one uses
    assert abs(sp2.device_peak_bytes - alone.device_peak_bytes) <= 0.01 * alone.device_peak_bytes


def test_per_head_norms_are_counted_at_the_query_and_key_widths():
    """Qwen3's q_norm and k_norm normalise each head: their inputs are the query and key widths (4096 and 1024 for
    Qwen3-8B), not the hidden width four times. At 16K the peak (a layer's backward under mini-sequence + offload)
    was 3.1 % over the trace while k_norm counted at hidden width."""
    counts = count_parameters(preset_config("qwen3-8b", num_hidden_layers=2))
    assert sorted(counts.norm_widths) == [1024, 4096, 4096, 4096]
    row = grid_row("qwen3-8b", "LoRA + mini-sequence + offload", 16384)
    assert abs(row["error"]) <= 0.005, row


def test_a_full_fine_tune_peaks_in_the_input_embeddings_backward_with_every_gradient_alive():
    """Six Llama-3.1-8B layers at 2K: the layers' working sets are smaller than the embedding's fp32 gradient (1.96
    GiB), so the step peaks in aten.embedding_dense_backward, every gradient made and the first layer's input
    gradient beside them — 32 MiB above the optimizer step, which the model used to stop at (-0.09 %)."""
    row = grid_row("llama-3.1-8b", "full fine-tune", 2048, layers=6)
    assert abs(row["error"]) <= 0.0002, row
