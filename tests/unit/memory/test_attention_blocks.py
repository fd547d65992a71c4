"""Chunked attention's block kernels: PyTorch's flash op (CPU) against the pure-PyTorch kernel on random blocks —
forward (out, lse), and backward (dq, dk, dv) with a query block's output and lse merged over two key blocks, as
chunked attention runs it; which blocks take which kernel; and the probe that keeps a wrong flash op from running."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from lstune.memory import attention_blocks as blocks
from lstune.memory.attention_blocks import CAUSAL, FULL, MASKED, allowed_pairs, block_kind, merge

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_probes(monkeypatch):
    monkeypatch.setattr(blocks, "_PROBED", {})


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _ids(start: int, n: int, batch: int = 2, doc: int = 0):
    return torch.arange(start, start + n).expand(batch, n), torch.full((batch, n), doc)


def _close(value, reference, rel=1e-5):
    error = (value - reference).norm() / reference.norm()
    assert error < rel, f"relative error {error:.1e}"


def _two_key_blocks(kv_heads, group, dim=32, t=40, s=24):
    """Query rows t (tokens s..s+t) of a GQA layout, an earlier key block (tokens 0..s) and their own (diagonal)."""
    q5 = _rand(2, kv_heads, group, t, dim, seed=1)
    ids_q, ids_early = _ids(s, t), _ids(0, s)
    early = (_rand(2, kv_heads, s, dim, seed=2), _rand(2, kv_heads, s, dim, seed=3), ids_early)
    own = (_rand(2, kv_heads, t, dim, seed=4), _rand(2, kv_heads, t, dim, seed=5), ids_q)
    return q5, ids_q, [early, own]


@pytest.mark.parametrize("kv_heads, group", [(4, 1), (2, 3)], ids=["mha", "gqa"])
def test_flash_forward_and_backward_match_the_pytorch_kernel_in_fp32(kv_heads, group):
    q5, ids_q, keys = _two_key_blocks(kv_heads, group)
    scale = 0.17
    kinds = [block_kind(q5, k4, v4, ids_q, ids_k, None, None) for k4, v4, ids_k in keys]
    assert kinds == [FULL, CAUSAL]
    masks = [allowed_pairs(*ids_q, *ids_k, None) for _, _, ids_k in keys]
    merged = {}
    for kernel in ("flash", "torch"):
        acc = (None, None)
        for kind, (k4, v4, _), mask in zip(kinds, keys, masks):
            part = blocks.block_forward(kind if kernel == "flash" else MASKED, q5, k4, v4, mask, scale, None)
            if kernel == "flash":  # each block on its own, too
                reference = blocks.block_forward(MASKED, q5, k4, v4, mask, scale, None)
                _close(part[0], reference[0]), _close(part[1], reference[1])
            acc = merge(*acc, *part)
        merged[kernel] = acc
    _close(merged["flash"][0], merged["torch"][0]), _close(merged["flash"][1], merged["torch"][1])
    out5, lse = merged["torch"]
    dout5 = _rand(*q5.shape, seed=6)
    delta = (dout5 * out5).sum(-1)
    for kind, (k4, v4, _), mask in zip(kinds, keys, masks):
        fast = blocks.block_backward(kind, q5, k4, v4, dout5, (out5, lse), None, scale, None)
        exact = blocks.block_backward(MASKED, q5, k4, v4, dout5, (delta, lse), mask, scale, None)
        assert [g.shape for g in fast] == [q5.shape, k4.shape, v4.shape]
        for value, reference in zip(fast, exact):
            _close(value, reference)


def test_the_merged_backward_is_the_gradient_of_the_merged_attention():
    """Summed over the two key blocks, the flash backward with the merged (out, lse) is autograd's gradient of full
    causal attention over all keys."""
    q5, ids_q, keys = _two_key_blocks(2, 2)
    (k_early, v_early, _), (k_own, v_own, _) = keys
    leaves = [x.clone().requires_grad_() for x in (q5, k_early, v_early, k_own, v_own)]
    k4, v4 = torch.cat(leaves[1:5:2], dim=2), torch.cat(leaves[2:5:2], dim=2)
    mask = allowed_pairs(*ids_q, *_ids(0, 64), None)[:, 0, 0]
    q4 = leaves[0].reshape(2, 4, 40, 32)
    k4, v4 = (x.repeat_interleave(2, dim=1) for x in (k4, v4))
    out4 = torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask[:, None], scale=0.2)
    dout5 = _rand(*q5.shape, seed=7)
    out4.backward(dout5.reshape(out4.shape))
    acc = (None, None)
    for kind, (k, v, _) in zip((FULL, CAUSAL), keys):
        acc = merge(*acc, *blocks.block_forward(kind, q5, k, v, None, 0.2, None))
    _close(acc[0], out4.detach().reshape(q5.shape))
    dq = 0
    for kind, (k, v, _), leaf_k, leaf_v in zip((FULL, CAUSAL), keys, leaves[1::2], leaves[2::2]):
        dq_part, dk, dv = blocks.block_backward(kind, q5, k, v, dout5, acc, None, 0.2, None)
        dq = dq + dq_part
        _close(dk, leaf_k.grad), _close(dv, leaf_v.grad)
    _close(dq, leaves[0].grad)


def test_block_kinds():
    q5, k4 = _rand(2, 2, 2, 8, 16), _rand(2, 2, 8, 16)
    ids_q, early, own = _ids(8, 8), _ids(0, 8), _ids(8, 8)
    assert block_kind(q5, k4, k4, ids_q, early, None, None) == FULL
    assert block_kind(q5, k4, k4, ids_q, own, None, None) == CAUSAL
    assert block_kind(q5, k4, k4, ids_q, early, 16, None) == FULL  # the window reaches every key (15 back)
    assert block_kind(q5, k4, k4, ids_q, early, 15, None) == MASKED  # it cuts the first key off the last query
    assert block_kind(q5, k4, k4, ids_q, early, None, 30.0) == MASKED  # softcapped
    assert block_kind(q5, k4, k4[..., :8], ids_q, early, None, None) == MASKED  # value head dim differs (MLA)
    assert block_kind(q5, k4.double(), k4.double(), ids_q, early, None, None) == MASKED  # mixed dtypes
    index, doc = ids_q
    second_document = doc.clone()
    second_document[1, 5:] = 3  # row 1 starts a document inside the query block
    assert block_kind(q5, k4, k4, (index, second_document), early, None, None) == MASKED
    assert block_kind(q5, k4, k4, (index, second_document), (index, second_document), None, None) == MASKED
    other = _ids(0, 8, doc=-4)  # all keys in another document (no pair allowed)
    assert block_kind(q5, k4, k4, ids_q, other, None, None) == MASKED


def test_fake_tensors_take_the_pytorch_kernel():
    """A memory trace has no values to decide from: every block is MASKED (and no probe runs on fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q5, k4 = torch.randn(1, 2, 2, 8, 16), torch.randn(1, 2, 8, 16)
        assert block_kind(q5, k4, k4, _ids(8, 8, 1), _ids(0, 8, 1), None, None) == MASKED
    assert blocks._PROBED == {}


def _with_ops(monkeypatch, **changes) -> blocks.FlashOps:
    ops = dataclasses.replace(blocks.FLASH_OPS["cpu"][0], **changes)
    monkeypatch.setitem(blocks.FLASH_OPS, "cpu", (ops,))
    return ops


def test_a_wrong_flash_op_is_caught_by_the_probe_and_never_used(monkeypatch, caplog):
    """A flash op that ignores `causal` (so the diagonal block sees the future) fails the probe once, with a warning;
    blocks then take the PyTorch kernel."""
    right = blocks.FLASH_OPS["cpu"][0]
    _with_ops(monkeypatch, forward=lambda q, k, v, causal, scale: right.forward(q, k, v, False, scale))
    q5, k4 = _rand(1, 2, 2, 8, 16), _rand(1, 2, 8, 16)
    with caplog.at_level(logging.WARNING, logger="lstune"):
        for _ in range(3):
            assert block_kind(q5, k4, k4, _ids(8, 8, 1), _ids(0, 8, 1), None, None) == MASKED
    assert [r.message for r in caplog.records if "differ from the PyTorch block kernel" in r.getMessage()] != []
    assert len(caplog.records) == 1


@pytest.mark.parametrize("wrong", ["raises", "lse layout", "backward delta"])
def test_the_probe_refuses_ops_that_raise_or_differ(monkeypatch, wrong):
    right = blocks.FLASH_OPS["cpu"][0]

    def raising(q, k, v, causal, scale):
        raise RuntimeError("no kernel image is available")

    def lse_transposed(q, k, v, causal, scale):  # [B, t, H] memory read as [B, H, t]
        out, lse = right.forward(q, k, v, causal, scale)
        return out, lse.transpose(1, 2).contiguous().reshape(lse.shape)

    def backward_without_delta(dout, q, k, v, out, lse, causal, scale):  # as if delta were not taken from `out`
        return right.backward(dout, q, k, v, torch.zeros_like(out), lse, causal, scale)

    change = {"raises": dict(forward=raising), "lse layout": dict(forward=lse_transposed),
              "backward delta": dict(backward=backward_without_delta)}[wrong]
    ops = _with_ops(monkeypatch, **change)
    assert not blocks.flash_usable(CPU, torch.float32, 16)
    assert blocks._PROBED == {("cpu", torch.float32, 16, ops): False}


def _two_ops(monkeypatch, **first_changes) -> tuple[blocks.FlashOps, blocks.FlashOps]:
    """The CPU ops twice, as CUDA lists cuDNN before flash: a first (changed) and a second (the real ones)."""
    right = blocks.FLASH_OPS["cpu"][0]
    first = dataclasses.replace(right, name="first", **first_changes)
    second = dataclasses.replace(right, name="second")
    monkeypatch.setitem(blocks.FLASH_OPS, "cpu", (first, second))
    return first, second


def test_the_first_ops_that_pass_the_probe_are_used(monkeypatch, caplog):
    """Ops listed first win when they pass; a first that differs is refused once, with a warning naming the next."""
    right = blocks.FLASH_OPS["cpu"][0]
    first, second = _two_ops(monkeypatch)
    assert blocks.flash_ops(CPU, torch.float32, 16) is first
    monkeypatch.setattr(blocks, "_PROBED", {})
    first, second = _two_ops(monkeypatch, forward=lambda q, k, v, causal, scale: right.forward(q, k, v, False, scale))
    with caplog.at_level(logging.WARNING, logger="lstune"):
        assert blocks.flash_ops(CPU, torch.float32, 16) is second
        assert blocks.flash_ops(CPU, torch.float32, 16) is second
    assert [r.getMessage() for r in caplog.records] == [caplog.records[0].getMessage()]
    assert "first attention ops differ" in caplog.text and "using the second ops if they pass" in caplog.text


def test_ops_that_raise_on_a_real_block_hand_it_to_the_next_ops(monkeypatch, caplog):
    """Ops that pass the probe (48 query rows) but refuse a larger block are dropped for the run with one warning;
    the next ops compute that block and every later one, with the same result as the PyTorch kernel."""
    right = blocks.FLASH_OPS["cpu"][0]
    calls = {"first": 0}

    def refuses_large(q, k, v, causal, scale):
        calls["first"] += 1
        if q.shape[2] > 48:
            raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")
        return right.forward(q, k, v, causal, scale)

    first, second = _two_ops(monkeypatch, forward=refuses_large)
    q5, k4, v4 = _rand(1, 2, 2, 64, 16), _rand(1, 2, 64, 16, seed=2), _rand(1, 2, 64, 16, seed=3)
    assert block_kind(q5, k4, v4, _ids(64, 64, 1), _ids(0, 64, 1), None, None) == FULL
    probe_calls = calls["first"]
    with caplog.at_level(logging.WARNING, logger="lstune"):
        out, lse = blocks.block_forward(FULL, q5, k4, v4, None, 0.25, None)
        again = blocks.block_forward(FULL, q5, k4, v4, None, 0.25, None)
    assert calls["first"] == probe_calls + 1  # tried once, then never again
    assert "first attention op failed" in caplog.text and len(caplog.records) == 1
    assert blocks.flash_ops(CPU, torch.float32, 16) is second
    allowed = allowed_pairs(*_ids(64, 64, 1), *_ids(0, 64, 1), None)
    exact = blocks.block_forward(MASKED, q5, k4, v4, allowed, 0.25, None)
    _close(out, exact[0]), _close(lse, exact[1]), _close(again[0], exact[0])


def test_running_out_of_memory_in_the_ops_is_not_a_fallback(monkeypatch):
    right = blocks.FLASH_OPS["cpu"][0]

    def out_of_memory(q, k, v, causal, scale):
        if q.shape[2] > 48:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return right.forward(q, k, v, causal, scale)

    first, _ = _two_ops(monkeypatch, forward=out_of_memory)
    q5, k4 = _rand(1, 2, 2, 64, 16), _rand(1, 2, 64, 16, seed=2)
    with pytest.raises(torch.OutOfMemoryError):
        blocks.block_forward(FULL, q5, k4, k4, None, 0.25, None)
    assert blocks.flash_ops(CPU, torch.float32, 16) is first


def test_when_the_last_ops_raise_too_the_error_is_raised(monkeypatch):
    def refuses(q, k, v, causal, scale):
        if q.shape[2] > 48:
            raise RuntimeError("no kernel")
        return right.forward(q, k, v, causal, scale)

    right = blocks.FLASH_OPS["cpu"][0]
    monkeypatch.setitem(blocks.FLASH_OPS, "cpu", (dataclasses.replace(right, forward=refuses),))
    q5, k4 = _rand(1, 2, 2, 64, 16), _rand(1, 2, 64, 16, seed=2)
    with pytest.raises(RuntimeError, match="no kernel"):
        blocks.block_forward(FULL, q5, k4, k4, None, 0.25, None)


def test_the_cuda_ops_calls_match_their_schemas_on_meta_tensors(monkeypatch):
    """Without a GPU, the CUDA ops' calls (cuDNN's and flash's, forward and backward, as the block kernel makes them)
    run on meta tensors: arguments the schemas refuse, or an lse layout the backward does not take, fail here. The
    cuDNN forward's lse is [B, H, t, 1] in this torch: the wrapper hands [B, H, t] on and restores it for backward."""
    monkeypatch.setattr(blocks, "_CUDNN_LSE_DIMS", {})
    q = torch.empty(1, 4, 48, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 4, 32, 64, device="meta", dtype=torch.bfloat16)
    for ops in blocks.FLASH_OPS["cuda"]:
        for causal, keys in ((False, k), (True, q)):
            out, lse = ops.forward(q, keys, keys, causal, 0.125)
            assert out.shape == q.shape and lse.shape == (1, 4, 48) and lse.dtype == torch.float32, ops.name
            grads = ops.backward(out, q, keys, keys, out, lse, causal, 0.125)
            assert [g.shape for g in grads] == [q.shape, keys.shape, keys.shape], ops.name
    assert blocks._CUDNN_LSE_DIMS == {"lse": 4}
    assert [ops.name for ops in blocks.FLASH_OPS["cuda"]] == ["cuDNN", "flash"]  # cuDNN first: SDPA's kernel


def test_the_probe_passes_the_real_ops_for_each_dtype_and_expanded_gqa(monkeypatch):
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert blocks.flash_usable(CPU, dtype, 64)
    _with_ops(monkeypatch, gqa=False)  # the CUDA way: k/v expanded to the query heads, dk/dv summed back
    assert blocks.flash_usable(CPU, torch.float32, 64)
    assert not blocks.flash_usable(torch.device("meta"), torch.float32, 64)  # no ops for the device type


def test_under_autocast_flash_blocks_run_in_the_autocast_dtype():
    """With fp32 weights under autocast, rotary leaves q and k fp32 and v 16-bit: the block runs in autocast's dtype,
    as SDPA would, and agrees with the PyTorch kernel (whose matmuls autocast casts) within bf16 rounding."""
    q5, ids_q, keys = _two_key_blocks(2, 2)
    (k4, v4, ids_k), _ = keys
    v4 = v4.bfloat16()
    assert block_kind(q5, k4, v4, ids_q, ids_k, None, None) == MASKED  # mixed dtypes, no autocast
    mask = allowed_pairs(*ids_q, *ids_k, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert block_kind(q5, k4, v4, ids_q, ids_k, None, None) == FULL
        fast = blocks.block_forward(FULL, q5, k4, v4, None, 0.2, None)
        exact = blocks.block_forward(MASKED, q5, k4, v4, mask, 0.2, None)
        dout5 = _rand(*q5.shape, seed=8)
        delta = (dout5 * exact[0]).sum(-1)
        grads = [blocks.block_backward(FULL, q5, k4, v4, dout5, exact, None, 0.2, None),
                 blocks.block_backward(MASKED, q5, k4, v4, dout5, (delta, exact[1]), mask, 0.2, None)]
    _close(fast[0], exact[0], rel=2e-2), _close(fast[1], exact[1], rel=1e-2)
    for value, reference in zip(*grads):
        _close(value, reference, rel=3e-2)
