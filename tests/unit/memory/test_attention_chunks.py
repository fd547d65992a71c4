"""Chunked attention (FPDT): exact against plain HF on many architectures, alone and with everything on; the
attention block's device peak no longer grows with its full-sequence tensors; offload path exact on CPU; refusals.

Sequences of 70 tokens in 3 chunks (24, 24, 22) with 16-token windows and packed documents of 29/24/17 tokens, so
document starts, window edges and chunk edges all fall in different places.
"""

from __future__ import annotations

import pytest
import torch

from lstune.config.schema import MemorySection
from lstune.errors import ConfigError, DataError, ModelError
from lstune.memory.apply import apply_memory_techniques
from lstune.memory.attention_chunks import (
    ChunkStats,
    attention_widths,
    auto_chunk_tokens,
    chunk_count,
    install_chunked_attention,
)
from lstune.memory.measure import peak_bytes
from lstune.memory.patching import run_undos
from lstune.models.attention import use_lstune_attention
from lstune.models.presets import build_model
from tests.support.archs import tiny_model
from tests.unit.memory._helpers import (
    assert_grads_match,
    hf_loss_sum,
    long_batch,
    packed_batch,
    run_grads,
    split_documents,
)

SEQ = 70
DOCS = [29, 24, 17]
ALONE = dict(attn_chunks=3, tiled_mlp="off", tiled_loss="off", checkpointing=False)
ALL = dict(attn_chunks=3, tiled_mlp=3, tiled_loss=3, mini_sequence=True, offload_checkpoints=True)
# GQA (llama, qwen3_moe), MQA, MHA (phi3), sliding windows (mistral; qwen2 and gemma3 per layer type), MLA with its
# own value head dim (deepseek_v3), absolute positions and fused qkv (gpt2), q/k norms (olmo2, qwen3_moe).
ARCHS = {
    "llama": {}, "mqa-llama": dict(num_key_value_heads=1), "mistral": {}, "qwen2": {}, "gemma3_text": {},
    "phi3": {}, "qwen3_moe": {}, "deepseek_v3": {}, "gpt2": {}, "olmo2": {},
}


def _model(arch: str):
    return tiny_model(arch.removeprefix("mqa-"), **ARCHS[arch])


def _reference(model, data: str):
    if data == "long":
        batch = long_batch(SEQ)
        return batch, run_grads(model, hf_loss_sum, [batch])
    batch = packed_batch(DOCS)
    return batch, run_grads(model, hf_loss_sum, split_documents(batch, DOCS))


def _compare(model, batch, reference, options, backend="sdpa", applied=lambda: None):
    from lstune.memory.block_attention import block_attention

    attention = use_lstune_attention(model, backend=backend, block_kernel=block_attention)  # as lstune train does
    plan = apply_memory_techniques(model, MemorySection(**options), seq_len=SEQ)
    applied()
    try:
        loss, grads = run_grads(model, plan.loss_sum, [batch])
    finally:
        plan.undo()
        attention.undo()
    assert plan.attn_chunks_at_seq_len == options["attn_chunks"]
    assert loss == pytest.approx(reference[0], rel=1e-5)
    assert_grads_match(grads, reference[1])
    return plan


@pytest.mark.parametrize("options", [ALONE, ALL], ids=["alone", "all"])
@pytest.mark.parametrize("data", ["long", "packed"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_chunked_attention_matches_hf(arch, data, options):
    model = _model(arch)
    batch, reference = _reference(model, data)
    _compare(model, batch, reference, options)


KERNELS = ("_flash_forward", "_flash_backward", "_torch_forward", "_torch_backward")


def _count_kernels(monkeypatch, calls: dict[str, int]) -> None:
    """Count the calls of each block kernel into `calls` from here on."""
    from lstune.memory import attention_blocks


    def counting(name):
        kernel = getattr(attention_blocks, name)

        def run(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)
        return run

    for name in KERNELS:
        monkeypatch.setattr(attention_blocks, name, counting(name))


@pytest.mark.parametrize("arch", ["llama", "phi3"])  # GQA, MHA
def test_blocks_inside_one_document_run_on_the_flash_kernel(monkeypatch, arch):
    """Long data: all 6 blocks of 3 chunks take the flash op, forward and backward, exactly. Packed 29/24/17 in chunks
    24/24/22: only chunk 0's diagonal block lies inside one document; 4 blocks are cut by a document start (PyTorch
    kernel) and one has no allowed pair (skipped)."""
    model = _model(arch)
    layers = model.config.num_hidden_layers
    for data, flash, pytorch in (("long", 6, 0), ("packed", 1, 4)):
        batch, reference = _reference(model, data)
        calls = dict.fromkeys(KERNELS, 0)
        # Counted from after the plan's probe runs (the first real block also ran the flash probe by then).
        _compare(model, batch, reference, ALONE, applied=lambda: _count_kernels(monkeypatch, calls))
        assert calls == {"_flash_forward": flash * layers, "_flash_backward": flash * layers,
                         "_torch_forward": pytorch * layers, "_torch_backward": pytorch * layers}, data
        monkeypatch.undo()


def test_a_flash_op_that_fails_its_probe_leaves_the_model_exact(monkeypatch):
    """A flash op that ignores `causal` fails the one-time probe: every block takes the PyTorch kernel, exactly."""
    import dataclasses

    from lstune.memory import attention_blocks

    right = attention_blocks.FLASH_OPS["cpu"][0]
    wrong = dataclasses.replace(right, forward=lambda q, k, v, causal, scale: right.forward(q, k, v, False, scale))
    monkeypatch.setitem(attention_blocks.FLASH_OPS, "cpu", (wrong,))
    monkeypatch.setattr(attention_blocks, "_PROBED", {})
    model = _model("llama")
    batch, reference = _reference(model, "long")
    calls = dict.fromkeys(KERNELS, 0)
    _compare(model, batch, reference, ALONE, applied=lambda: _count_kernels(monkeypatch, calls))
    layers = model.config.num_hidden_layers
    assert calls == {"_flash_forward": 0, "_flash_backward": 0, "_torch_forward": 6 * layers,
                     "_torch_backward": 6 * layers}
    assert list(attention_blocks._PROBED.values()) == [False]


def test_softcapped_attention_is_exact_when_chunked():
    """Gemma-2 softcaps logits: no lstune backend trains that on CPU, the chunked block kernel does (exactly)."""
    # Larger weights than the preset's so logits reach the cap: it changes the loss by ~3 %. Eager attention for
    # the reference: transformers before 5.24 picks SDPA for Gemma-2 even when it softcaps, and SDPA drops the cap.
    model = build_model("tiny-gemma2", seed=0, attn_logit_softcapping=1.0, initializer_range=0.2,
                        attn_implementation="eager")
    model.train()
    batch, reference = _reference(model, "packed")
    uncapped = build_model("tiny-gemma2", seed=0, initializer_range=0.2, attn_implementation="eager")
    uncapped.train()
    assert abs(_reference(uncapped, "packed")[1][0] - reference[0]) > 0.01 * reference[0]
    _compare(model, batch, reference, ALL, backend="auto")


def test_chunked_attention_with_lora_matches_hf():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model("qwen2"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           init_lora_weights=False))
    model.train()
    batch, reference = _reference(model, "packed")
    _compare(model, batch, reference, ALL)


def test_uneven_chunk_counts_and_more_chunks_than_documents_are_exact():
    model = tiny_model("mistral")
    batch, reference = _reference(model, "packed")
    for chunks in (2, 7):
        _compare(model, batch, reference, {**ALONE, "attn_chunks": chunks})


def test_rows_with_different_documents_are_exact():
    """Two rows packed differently (29/24/17 and 40/30 tokens): masks are per row."""
    first, second = packed_batch(DOCS), packed_batch([40, 30], seed=5)
    batch = {k: torch.cat([first[k], second[k]]) for k in first}
    model = tiny_model("mistral")
    parts = split_documents(first, DOCS) + split_documents(second, [40, 30])
    reference = run_grads(model, hf_loss_sum, parts)
    _compare(model, batch, reference, ALONE)
    _compare(model, batch, reference, ALL)


def _offloaded_chunks_step() -> ChunkStats:
    """One step of tiny Llama in 4 offloaded chunks under checkpointing, asserted equal to plain HF; its chunk stats."""
    model = tiny_model("llama")
    batch, reference = _reference(model, "long")
    attention = use_lstune_attention(model, backend="sdpa")
    plan = apply_memory_techniques(model, MemorySection(attn_chunks=4, tiled_mlp="off", offload_checkpoints=True),
                                   seq_len=SEQ)
    try:
        loss, grads = run_grads(model, plan.loss_sum, [batch])
    finally:
        plan.undo()
        attention.undo()
    assert loss == pytest.approx(reference[0], rel=1e-5)
    assert_grads_match(grads, reference[1])
    return plan.attn_chunk_stats


def test_offloaded_chunks_are_exact_and_live_on_the_host():
    """With --offload-checkpoints the saved chunks take the offload path (separate host buffers on CPU)."""
    stats = _offloaded_chunks_step()
    assert stats.peak_host_bytes > 0
    assert stats.host_bytes == 0  # everything freed after backward


def test_chunk_copies_in_several_pieces_are_exact(monkeypatch):
    """On CUDA each chunk copy is pinned in pieces (memory.host_copies) that `save_for_backward` keeps with a layout
    (`_ChunkStore.packed` / `adopt`). Forced here on CPU, with 512-byte pieces: every k, v and output copy spans
    several, the layout survives an enclosing checkpoint's drop and recompute, and loss and gradients stay exact."""
    from lstune.memory import attention_chunks, host_copies

    most = []

    class Pieces(host_copies.HostBlocks):
        def __init__(self, shape, dtype, *, pinned, split=True, blocks=None):
            super().__init__(shape, dtype, pinned=pinned, split=True, blocks=blocks)
            most.append(len(self.blocks))

    monkeypatch.setattr(host_copies, "HOST_BLOCK_BYTES", 512)
    monkeypatch.setattr(attention_chunks, "HostBlocks", Pieces)
    stats = _offloaded_chunks_step()
    assert max(most) > 4  # copies of several pieces were written and read back
    assert stats.host_bytes == 0


# --------------------------------------------------------------------------------------------------------------------
# Memory: the attention block's device peak, at two lengths
# --------------------------------------------------------------------------------------------------------------------

WIDE = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=8, intermediate_size=256)
CHUNK_TOKENS = 128


def _attention_peak_per_token(chunked: bool) -> float:
    """Device bytes per token of one attention module's forward + backward (offloaded chunks left out), from the
    peaks at 512 and 1024 tokens (4 and 8 chunks of 128)."""
    model = tiny_model("llama", **WIDE)
    attention = use_lstune_attention(model, backend="sdpa")
    layers = model.model.layers[:1]
    module = layers[0].self_attn
    peaks = []
    for seq in (512, 1024):
        stats = ChunkStats()
        undos = install_chunked_attention(layers, seq // CHUNK_TOKENS, offload=True, stats=stats) if chunked else []
        hidden = torch.randn(1, seq, WIDE["hidden_size"], requires_grad=True)
        positions = torch.arange(seq)[None]
        cos_sin = model.model.rotary_emb(hidden, positions)
        grad_out = torch.randn(1, seq, WIDE["hidden_size"])

        def step():
            out = module(hidden_states=hidden, position_embeddings=cos_sin, attention_mask=None,
                         position_ids=positions)[0]
            out.backward(grad_out)

        peaks.append(peak_bytes(step, exclude=lambda: stats.host_bytes))
        hidden.grad = None
        model.zero_grad(set_to_none=True)
        run_undos(undos)
    attention.undo()
    return (peaks[1] - peaks[0]) / 512


def test_attention_block_peak_no_longer_grows_with_its_full_sequence_tensors():
    hidden_bytes = WIDE["hidden_size"] * 4  # one fp32 hidden vector per token
    plain = _attention_peak_per_token(chunked=False)
    chunked = _attention_peak_per_token(chunked=True)
    # Unchunked: q, k, v, rotary copies, attention output, their gradients — many hidden vectors per token.
    assert plain > 8 * hidden_bytes
    # Chunked: what is left growing is the residual stream's share (the module's output and input gradient, 2 hidden
    # vectors per token) plus per-token int64 token/document ids.
    assert chunked < 2.25 * hidden_bytes, (chunked / hidden_bytes, plain / hidden_bytes)


def _one_attention_step(chunks: int, *, kv_heads: int = 8, seq: int = 96, batch: int = 2,
                        checkpointed: bool = False, model=None) -> ChunkStats:
    """Forward + backward of one attention module in `chunks` offloaded chunks, one document a row: its stats.
    `model`: another than the WIDE Llama with `kv_heads`."""
    from torch.utils.checkpoint import checkpoint

    model = model or tiny_model("llama", **dict(WIDE, num_key_value_heads=kv_heads))
    attention = use_lstune_attention(model, backend="sdpa")
    layers = model.model.layers[:1]
    stats = ChunkStats()
    undos = install_chunked_attention(layers, chunks, offload=True, stats=stats)
    try:
        hidden = torch.randn(batch, seq, model.config.hidden_size, requires_grad=True)
        positions = torch.arange(seq)[None].expand(batch, seq)
        cos_sin = model.model.rotary_emb(hidden, positions)

        def attend(x):
            return layers[0].self_attn(hidden_states=x, position_embeddings=cos_sin, attention_mask=None,
                                       position_ids=positions)[0]

        out = checkpoint(attend, hidden, use_reentrant=False) if checkpointed else attend(hidden)
        out.backward(torch.randn_like(out))
    finally:
        run_undos(undos)
        attention.undo()
    return stats


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "pytorch-kernel"])
@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_offloaded_chunk_copies_are_what_the_estimate_counts(monkeypatch, chunks, kv_heads, flash):
    """Every copy the chunk store makes to and from the host in one forward + backward of one attention module
    equals `offload_copy_bytes` (the estimate's traffic and exposed-copy time come from it). With offload every
    stored tensor but the token ids ("idx", "doc") lives on the host. One document: every block takes the flash
    kernel, unless the device has none."""
    from lstune.memory import attention_blocks
    from lstune.memory import attention_chunks as chunked

    if not flash:
        monkeypatch.delitem(attention_blocks.FLASH_OPS, "cpu")
    stats = _one_attention_step(chunks, kv_heads=kv_heads)
    head_dim = WIDE["hidden_size"] // WIDE["num_attention_heads"]
    expected = chunked.offload_copy_bytes(2 * 96, chunks, WIDE["hidden_size"], kv_heads * head_dim,
                                          WIDE["num_attention_heads"], element_size=4, flash=flash)
    assert (stats.bytes_to_host, stats.bytes_from_host) == expected


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "pytorch-kernel"])
@pytest.mark.parametrize("chunks", [3, 4, 6])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_every_host_read_but_the_first_of_a_backward_is_fetched_a_unit_ahead(monkeypatch, chunks, flash,
                                                                               checkpointed):
    """The store's schedule starts each host chunk's copy at least one compute unit before the unit that reads it
    (on CUDA, the copy hides under that unit), in the forward (each key chunk under the block before it; the next
    query chunk's first under this one's last block), and in backward but for its very first read: the last
    chunk's output, which nothing runs before. A forward re-run by a checkpoint is fetched ahead the same way."""
    from lstune.memory import attention_blocks

    if not flash:
        monkeypatch.delitem(attention_blocks.FLASH_OPS, "cpu")
    stats = _one_attention_step(chunks, checkpointed=checkpointed)
    assert stats.reads_late == 1
    forward_reads = chunks * (chunks - 1)  # k and v of every earlier chunk, per chunk
    assert stats.reads_ahead > (2 if checkpointed else 1) * forward_reads


# --------------------------------------------------------------------------------------------------------------------
# Settings and refusals
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [4, 6])
def test_a_sliding_windows_key_chunks_are_fetched_ahead_once_it_slides(chunks):
    """Mistral's 16-token window over 24-token chunks: chunk m reads key chunks m - 1 and m. The forward guesses
    each next chunk's first key chunk one further once the window slides, so it misses once (chunk 2, when it
    starts sliding: its k and v), whatever the chunk count; with the backward's first read, three late reads."""
    model = tiny_model("mistral")
    assert model.config.sliding_window == 16
    stats = _one_attention_step(chunks, seq=24 * chunks, batch=1, model=model)
    assert stats.reads_late == 3


@pytest.mark.parametrize("window", [None, 1, 5, 40])
def test_which_earlier_key_chunks_a_query_chunk_attends_is_decided_exactly_from_their_edges(window):
    """`block_kinds`' skipped blocks (None; the forward's plan: which blocks run and are fetched) against the full
    mask of every block, on rows of random packed documents cut at random chunk edges."""
    from lstune.memory.attention_blocks import allowed_pairs, block_kinds

    q5 = torch.zeros(2, 1, 1, 8, 4)
    k4 = torch.zeros(2, 1, 8, 4)

    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        seq = 64
        positions = []
        for _row in range(2):
            row, left = [], seq
            while left:
                length = min(left, int(torch.randint(1, 30, (1,), generator=generator)))
                row += list(range(length))
                left -= length
            positions.append(row)
        positions = torch.tensor(positions)
        index = torch.arange(seq).expand(2, seq)
        doc = index - positions
        edges = sorted({0, seq, *torch.randint(1, seq, (3,), generator=generator).tolist()})
        cuts = list(zip(edges, edges[1:]))
        for m, (qa, qb) in enumerate(cuts):
            for ka, kb in cuts[:m]:
                ids_q, ids_k = (index[:, qa:qb], doc[:, qa:qb]), (index[:, ka:kb], doc[:, ka:kb])
                expected = bool(allowed_pairs(*ids_q, *ids_k, window).any())
                attended = block_kinds(q5, k4, k4, ids_q, [ids_k, ids_q], window, None)
                assert attended[1] is not None  # the diagonal, always
                assert (attended[0] is not None) == expected, (positions.tolist(), (qa, qb), (ka, kb))


def test_chunk_counts():
    assert chunk_count("off", 10**6, 4096) == 1
    assert chunk_count("auto", 4096, 4096) == 1  # off up to one chunk's length
    assert chunk_count("auto", 4 * 4096 + 1, 4096) == 5
    assert chunk_count(3, 70, 4096) == 3
    from lstune.memory.attention_chunks import AttentionChunks, chunk_bounds

    for n in range(1, 120):  # counted without listing, as many as the bounds
        for setting in ("auto", 1, 2, 3, 6, 7, 50, 400):
            assert chunk_count(setting, n, 16) == len(chunk_bounds(AttentionChunks(setting, 16), n))
    assert chunk_count("auto", 2**40, 4096) == 2**28  # at once: an estimate of a 1T-token run asks this


def test_auto_chunks_are_the_shortest_whose_copies_hide_under_their_attention():
    from lstune.models.presets import preset_config

    # Forward: c >= h_kv · b · F / (2 · h_q · BW); backward: c >= (3 · b + 8) · F / (10 · BW); F / BW = 16000.
    assert attention_widths(preset_config("llama-3.1-8b")) == (4096, 1024)
    assert auto_chunk_tokens(4096, 1024) == 32768  # backward 22,400 (forward 4,000)
    assert auto_chunk_tokens(3072, 3072) == 32768  # MHA (Phi-3): forward 16,000, backward 22,400
    assert auto_chunk_tokens(8192, 128) == 32768  # MQA: the 1 MiB k copy floor (4,096) is lower
    assert auto_chunk_tokens(4096, 1024, pcie_bytes_per_s=50e9) == 16384  # Gen5: 11,200
    assert auto_chunk_tokens(3072, 3072, bytes_per_element=4, flops_per_s=100e12) == 8192  # fp32 MHA: forward and backward 8,000
    assert auto_chunk_tokens(64, 32) == 32768  # tiny widths: the 1 MiB floor is 16,384
    assert auto_chunk_tokens(64, 16) == 32768 and auto_chunk_tokens(64, 8) == 65536  # floor 32,768 / 65,536
    assert chunk_count("auto", 131072, auto_chunk_tokens(4096, 1024)) == 4


@pytest.mark.parametrize("value", ["many", 0, -2, True])
def test_bad_setting_is_a_config_problem(value):
    assert any("--attn-chunks" in p for p in MemorySection(attn_chunks=value).problems())
    with pytest.raises(ConfigError):
        apply_memory_techniques(tiny_model("llama"), MemorySection(attn_chunks=value), seq_len=SEQ)


def test_attention_that_bypasses_lstune_attention_is_refused():
    """HF's eager attention never reaches the chunk sink: refused instead of attending within each chunk only."""
    for implementation in ("eager", "sdpa"):  # HF's sdpa gets no mask for causal rows: caught by the call count
        model = tiny_model("llama", attn=implementation)
        with pytest.raises(ModelError, match="needs lstune's attention"):
            apply_memory_techniques(model, MemorySection(**ALONE), seq_len=SEQ)  # its norm-fusion probe runs it
        assert not any("forward" in vars(m) for m in model.modules())


def test_attention_dropout_is_refused():
    model = tiny_model("llama", attention_dropout=0.1)
    use_lstune_attention(model, backend="sdpa")
    plan = apply_memory_techniques(model, MemorySection(**ALONE), seq_len=SEQ)
    with pytest.raises(ModelError, match="no attention dropout"):
        plan.loss_sum(model, long_batch(SEQ))


def test_documents_must_restart_at_position_zero():
    model = tiny_model("llama")
    use_lstune_attention(model, backend="sdpa")
    plan = apply_memory_techniques(model, MemorySection(**ALONE), seq_len=SEQ)
    batch = packed_batch(DOCS)
    batch["position_ids"][0, 29:53] += 5  # the second document starts at position 5
    with pytest.raises(DataError, match="start at position 0"):
        plan.loss_sum(model, batch)


def test_the_norms_around_attention_run_per_chunk():
    """The norm feeding only the attention (Llama's input norm; Gemma-3 also the one after it) runs inside each chunk:
    its fp32 copies and the normed hidden state are O(chunk). The equivalence tests above run with it fused."""
    for arch, pair in (("llama", ("input_layernorm", None)),
                       ("gemma3_text", ("input_layernorm", "post_attention_layernorm"))):
        model = tiny_model(arch)
        use_lstune_attention(model, backend="sdpa")
        plan = apply_memory_techniques(model, MemorySection(**ALONE), seq_len=SEQ)
        assert plan.attn_fused_norms == {0: pair, 1: pair}
        assert all("forward" in vars(layer.input_layernorm) for layer in model.model.layers)
        plan.undo()
        assert not any("forward" in vars(layer.input_layernorm) for layer in model.model.layers)


def test_undo_restores_the_attention_modules():
    model = tiny_model("llama")
    use_lstune_attention(model, backend="sdpa")
    plan = apply_memory_techniques(model, MemorySection(**ALONE), seq_len=SEQ)
    assert all("forward" in vars(layer.self_attn) for layer in model.model.layers)
    plan.undo()
    assert not any("forward" in vars(layer.self_attn) for layer in model.model.layers)


def test_saved_keys_and_values_do_not_keep_a_fused_projections_output_alive():
    """A fused qkv projection's v is a view of its whole output: the store keeps its own copy instead (the estimate's
    Phi-3 rows count kv values per token, not q + 2·kv)."""
    from lstune.memory.attention_chunks import _own

    qkv = torch.randn(2, 10, 3 * 8)
    v = qkv[..., 16:].view(2, 10, 2, 4).transpose(1, 2)
    owned = _own(v)
    assert torch.equal(owned, v) and owned.untyped_storage().nbytes() == v.numel() * 4
    alone = torch.randn(2, 2, 10, 4)
    assert _own(alone) is alone
