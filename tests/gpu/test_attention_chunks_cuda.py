"""Chunked attention (FPDT) on a CUDA device: exact in fp32 with the real offload streams (a missed stream sync
would corrupt a saved chunk), close in bf16, and the attention block's device peak (torch.cuda.max_memory_allocated)
no longer growing with its full-sequence tensors; the CUDA flash-attention ops the block kernel uses pass their probe
and match the PyTorch kernel. Written without a GPU at hand: not yet run."""

from __future__ import annotations

import pytest
import torch

from lstune.config.schema import MemorySection
from lstune.memory.apply import apply_memory_techniques
from lstune.memory.attention_chunks import ChunkStats, install_chunked_attention
from lstune.memory.measure import peak_bytes
from lstune.memory.patching import run_undos
from lstune.models.attention import use_lstune_attention
from lstune.models.presets import build_model
from tests.support.archs import tiny_model
from tests.unit.memory._helpers import hf_loss_sum, packed_batch, run_grads

pytestmark = pytest.mark.gpu

ALL = dict(attn_chunks=4, tiled_mlp=3, tiled_loss=3, offload_checkpoints=True)


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize(("arch", "dtype", "loss_rel", "grad_rel"), [
    ("tiny-llama", torch.float32, 1e-5, 1e-4),
    ("tiny-mistral", torch.float32, 1e-5, 1e-4),
    ("tiny-llama", torch.bfloat16, 2e-2, 5e-2),
])
def test_chunked_attention_on_cuda_with_offload_streams(arch, dtype, loss_rel, grad_rel):
    model = build_model(arch).to("cuda", dtype).train()
    batch = {k: v.cuda() for k, v in packed_batch([300, 200, 124]).items()}
    ref_loss, ref_grads = run_grads(model, hf_loss_sum, [batch])
    attention = use_lstune_attention(model, backend="sdpa")
    plan = apply_memory_techniques(model, MemorySection(**ALL), seq_len=624)
    try:
        loss, grads = run_grads(model, plan.loss_sum, [batch])
    finally:
        plan.undo()
        attention.undo()
    assert loss == pytest.approx(ref_loss, rel=loss_rel)
    for name, ref in ref_grads.items():
        err = (grads[name].float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)
        assert err < grad_rel, f"{name}: relative gradient error {err:.2e}"
    assert plan.attn_chunk_stats.peak_host_bytes > 0 and plan.attn_chunk_stats.host_bytes == 0


def _attention_peak_per_token(chunked: bool, hidden: int = 1024) -> float:
    model = tiny_model("llama", hidden_size=hidden, num_attention_heads=8, num_key_value_heads=8,
                       intermediate_size=hidden).cuda()
    attention = use_lstune_attention(model, backend="sdpa")
    layers = model.model.layers[:1]
    peaks = []
    for seq in (4096, 8192):
        undos = install_chunked_attention(layers, seq // 1024, offload=True, stats=ChunkStats()) if chunked else []
        x = torch.randn(1, seq, hidden, device="cuda", requires_grad=True)
        positions = torch.arange(seq, device="cuda")[None]
        cos_sin = model.model.rotary_emb(x, positions)
        grad_out = torch.randn(1, seq, hidden, device="cuda")

        def step():
            out = layers[0].self_attn(hidden_states=x, position_embeddings=cos_sin, attention_mask=None,
                                      position_ids=positions)[0]
            out.backward(grad_out)

        peaks.append(peak_bytes(step, "cuda"))
        model.zero_grad(set_to_none=True)
        run_undos(undos)
    attention.undo()
    return (peaks[1] - peaks[0]) / 4096


def test_attention_block_device_peak_on_cuda():
    hidden_bytes = 1024 * 4
    plain, chunked = _attention_peak_per_token(False), _attention_peak_per_token(True)
    assert chunked < 2.5 * hidden_bytes < plain, (chunked / hidden_bytes, plain / hidden_bytes)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fused_ops_pass_the_probe_and_match_the_pytorch_block_kernel(head_dim, dtype):
    """The CUDA ops (cuDNN's, then PyTorch's flash) were wired from their schemas without a GPU: each one's probe must
    pass (else blocks run the next ops, in the end the PyTorch kernel, with a warning) — its GQA blocks' forward and
    merged backward match the PyTorch kernel — and cuDNN, the faster, is the one chosen."""
    from lstune.memory import attention_blocks as blocks

    device = torch.device("cuda")
    for ops in blocks.FLASH_OPS["cuda"]:
        assert blocks._probe_error(ops, device, dtype, head_dim) < blocks._PROBE_TOLERANCE[dtype], ops.name
    assert blocks.flash_ops(device, dtype, head_dim).name == "cuDNN"
    assert not blocks.flash_usable(device, torch.float32, head_dim)  # no fp32 fused ops on CUDA: PyTorch kernel


def test_long_documents_run_the_cuda_flash_kernel_and_stay_close(monkeypatch):
    """bf16 Llama on one 2,048-token document in 4 chunks: all 10 blocks per layer take the flash op, forward and
    backward, and the loss and gradients stay within bf16 rounding of the unchunked model."""
    from lstune.memory import attention_blocks as blocks
    from tests.unit.memory._helpers import long_batch

    calls = {"_flash_backward": 0, "_torch_backward": 0}

    def counting(name):
        kernel = getattr(blocks, name)

        def run(*args):
            calls[name] += 1
            return kernel(*args)
        return run

    model = build_model("tiny-llama").to("cuda", torch.bfloat16).train()
    batch = {k: v.cuda() for k, v in long_batch(2048).items()}
    ref_loss, ref_grads = run_grads(model, hf_loss_sum, [batch])
    attention = use_lstune_attention(model, backend="sdpa")
    plan = apply_memory_techniques(model, MemorySection(attn_chunks=4, tiled_mlp="off", offload_checkpoints=True),
                                   seq_len=2048)
    for name in calls:  # counted from after the plan's own probe runs
        monkeypatch.setattr(blocks, name, counting(name))
    try:
        loss, grads = run_grads(model, plan.loss_sum, [batch])
    finally:
        plan.undo()
        attention.undo()
    assert calls == {"_flash_backward": 10 * model.config.num_hidden_layers, "_torch_backward": 0}
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    for name, ref in ref_grads.items():
        err = (grads[name].float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)
        assert err < 5e-2, f"{name}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("dtype,small_pieces", [(torch.float32, False), (torch.bfloat16, False),
                                                (torch.float32, True)])
def test_offloaded_reads_on_their_schedule_equal_the_device_store(dtype, small_pieces, monkeypatch):
    """The chunk store's reads run ahead on two side streams, each host-to-device copy waiting only for its own
    key's device-to-host copy: a missed wait would read a chunk before it landed. Llama attention on one
    8,192-token document in 4 chunks: the output and every gradient with the chunks offloaded equal those with the
    chunks kept on the device — bit for bit in fp32 (the PyTorch block kernel: deterministic), within run-to-run
    noise in bf16 (the fused kernels' backward accumulates dq with atomics) — and every host read but the
    backward's first started a unit ahead. `small_pieces`: each copy in 1 MiB blocks (a chunk's output in 8, its
    keys in 2), so every copy is written and read back piece by piece."""
    if small_pieces:
        from lstune.memory import host_copies

        monkeypatch.setattr(host_copies, "HOST_BLOCK_BYTES", 1 << 20)
        monkeypatch.setattr(host_copies, "MIN_PIECE_BYTES", 1 << 16)
    model = tiny_model("llama", hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
                       intermediate_size=1024).to("cuda", dtype)
    attention = use_lstune_attention(model, backend="sdpa")
    layers = model.model.layers[:1]
    module = layers[0].self_attn
    seq = 8192
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, seq, 1024, device="cuda", dtype=dtype, generator=generator)
    grad_out = torch.randn(1, seq, 1024, device="cuda", dtype=dtype, generator=generator)
    positions = torch.arange(seq, device="cuda")[None]
    cos_sin = model.model.rotary_emb(x, positions)
    results = {}
    for offload in (False, True):
        stats = ChunkStats()
        undos = install_chunked_attention(layers, 4, offload=offload, stats=stats)
        hidden = x.clone().requires_grad_()
        try:
            out = module(hidden_states=hidden, position_embeddings=cos_sin, attention_mask=None,
                         position_ids=positions)[0]
            out.backward(grad_out)
        finally:
            run_undos(undos)
        torch.cuda.synchronize()
        results[offload] = [out.detach(), hidden.grad] + [p.grad.clone() for p in module.parameters()]
        module.zero_grad(set_to_none=True)
        if offload:
            assert stats.reads_late == 1 and stats.reads_ahead > 0, stats
            assert stats.host_bytes == 0
    attention.undo()
    for kept, offloaded in zip(results[False], results[True]):
        if dtype == torch.float32:
            assert torch.equal(kept, offloaded)
        else:
            err = (kept.float() - offloaded.float()).norm() / kept.float().norm().clamp_min(1e-12)
            assert err < 1e-2, f"relative difference {err:.2e}"


def test_offloaded_chunks_pin_their_size_not_the_next_power_of_two():
    """4 chunks of 3,072 tokens, fp32, hidden 1024 (8 heads, 2 kv heads of 128): each chunk's output is 12 MiB and
    its keys and values 3 MiB each. One pinned allocation per copy would hold 16 and 4 MiB (torch's host allocator
    rounds every allocation up to a power of two): 96.4 MiB for the forward's 16 copies of 72.4 MiB. In pieces
    (lstune.memory.host_copies) only each copy's last piece under 1 MiB is rounded."""
    from lstune.memory.host_copies import MIN_PIECE_BYTES

    stats_of = getattr(torch.cuda.memory, "host_memory_stats", None)
    assert stats_of is not None, "this torch has no torch.cuda.memory.host_memory_stats"
    model = tiny_model("llama", hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
                       intermediate_size=1024).to("cuda")
    attention = use_lstune_attention(model, backend="sdpa")
    layers = model.model.layers[:1]
    seq = 4 * 3072
    x = torch.randn(1, seq, 1024, device="cuda", requires_grad=True)
    positions = torch.arange(seq, device="cuda")[None]
    cos_sin = model.model.rotary_emb(x, positions)
    stats = ChunkStats()
    undos = install_chunked_attention(layers, 4, offload=True, stats=stats)
    try:
        torch.cuda.synchronize()
        before = stats_of()["active_bytes.current"]
        out = layers[0].self_attn(hidden_states=x, position_embeddings=cos_sin, attention_mask=None,
                                  position_ids=positions)[0]
        torch.cuda.synchronize()
        pinned = stats_of()["active_bytes.current"] - before
        exact = stats.bytes_to_host  # k, v, o and lse of 4 chunks: what the forward saved
        assert exact == 4 * (2 * 3 * 2**20 + 12 * 2**20 + 3072 * 8 * 4), exact
        assert exact <= pinned < exact + 16 * MIN_PIECE_BYTES, (pinned, exact)
        out.sum().backward()
    finally:
        run_undos(undos)
        attention.undo()
