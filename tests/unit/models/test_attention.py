"""lstune attention vs transformers' eager attention and a naive document-masked reference (fp32, CPU)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lstune.errors import ConfigError, ModelError, UserError
from lstune.models import attention, hf_internals
from lstune.models.attention import (
    check_attention_support,
    cu_seqlens,
    document_spans,
    local_attention,
    use_lstune_attention,
)
from lstune.models.presets import build_model, preset_config
from tests.conftest import TINY_ARCHS

GRAD_TOL = dict(rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------------


def packed_batch(doc_lengths_per_row: list[list[int]], seed: int = 0) -> dict[str, torch.Tensor]:
    """input_ids / position_ids / shift_labels for rows packed with documents of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    seq = sum(doc_lengths_per_row[0])
    input_ids = torch.randint(3, 320, (len(doc_lengths_per_row), seq), generator=gen)
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in doc_lengths_per_row])
    shift_labels = torch.full_like(input_ids, -100)
    for row, lengths in enumerate(doc_lengths_per_row):
        start = 0
        for n in lengths:
            shift_labels[row, start : start + n - 1] = input_ids[row, start + 1 : start + n]
            start += n
    return {"input_ids": input_ids, "position_ids": position_ids, "shift_labels": shift_labels}


def token_loss(model, batch) -> torch.Tensor:
    # use_cache=False: with a cache, transformers' eager reference stops separating packed documents.
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    labels = batch["shift_labels"]
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return total / (labels != -100).sum()


def eager_and_lstune(arch: str, backend: str = "auto", **overrides):
    reference = build_model(arch, attn_implementation="eager", **overrides)
    model = build_model(arch, attn_implementation="eager", **overrides)
    return reference, model, use_lstune_attention(model, backend=backend)


def assert_same_loss_and_grads(reference, model, batch) -> None:
    ref_loss, loss = token_loss(reference, batch), token_loss(model, batch)
    ref_loss.backward()
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, ref_params[name].grad, **GRAD_TOL, msg=lambda m: f"{name}: {m}")


def reference_attention(q, k, v, doc_lengths_per_row, *, scaling=None, window=None, softcap=None):
    """Dense softmax attention with an explicit [B, S, S] document-causal mask, written from the document lengths."""
    batch, heads, seq, dim = q.shape
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    doc_ids = [[i for i, n in enumerate(row) for _ in range(n)] for row in doc_lengths_per_row]
    doc = torch.tensor(doc_ids, device=q.device)
    i, j = torch.arange(seq, device=q.device)[:, None], torch.arange(seq, device=q.device)[None, :]
    allowed = (doc[:, :, None] == doc[:, None, :]) & (j <= i)
    if window is not None:
        allowed &= i - j < window
    scores = q @ k.transpose(-1, -2) * (scaling if scaling is not None else dim**-0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def positions(doc_lengths_per_row):
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in doc_lengths_per_row])


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


# --------------------------------------------------------------------------------------------------------------------
# whole models vs HF eager
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_single_document_loss_and_every_grad_match_eager(arch):
    reference, model, _ = eager_and_lstune(arch)
    assert_same_loss_and_grads(reference, model, packed_batch([[40], [40]]))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_each_packed_document_equals_the_document_alone(arch):
    reference, model, _ = eager_and_lstune(arch)
    rows = [[17, 9, 14], [25, 15]]
    batch = packed_batch(rows)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        unseparated = model(input_ids=batch["input_ids"]).logits
        for row, lengths in enumerate(rows):
            start = 0
            for n in lengths:
                alone = reference(input_ids=batch["input_ids"][row : row + 1, start : start + n]).logits[0]
                torch.testing.assert_close(packed[row, start : start + n], alone, rtol=1e-5, atol=1e-5)
                start += n
    # The check can fail: without position_ids the same tokens see earlier documents and their logits change.
    assert not torch.allclose(packed[0, 17:], unseparated[0, 17:], atol=1e-3)


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-gemma3"])
def test_packed_grads_equal_the_sum_over_documents_alone(arch):
    reference, model, _ = eager_and_lstune(arch)
    batch = packed_batch([[17, 9, 14]])
    token_loss(model, batch).backward()
    count = (batch["shift_labels"] != -100).sum()
    start = 0
    for n in (17, 9, 14):
        doc = {key: value[:, start : start + n] for key, value in batch.items()}
        (token_loss(reference, doc) * (doc["shift_labels"] != -100).sum() / count).backward()
        start += n
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[name].grad, **GRAD_TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("tiny-mistral", {"sliding_window": 8}),  # every layer windowed
        ("tiny-gemma2", {"sliding_window": 8}),  # alternating sliding / full layers
        ("tiny-gemma3", {"sliding_window": 8}),
        ("tiny-qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ],
)
def test_sliding_window_is_honoured_exactly(arch, overrides, monkeypatch):
    monkeypatch.setattr(attention, "_MIN_WINDOW_BLOCK", 8)  # several query blocks at this tiny length
    reference, model, _ = eager_and_lstune(arch, **overrides)
    assert_same_loss_and_grads(reference, model, packed_batch([[30, 10], [40]]))


def test_custom_scaling_matches_eager():
    # Gemma scales queries by query_pre_attn_scalar**-0.5, not head_dim**-0.5.
    reference, model, _ = eager_and_lstune("tiny-gemma2", query_pre_attn_scalar=7)
    assert_same_loss_and_grads(reference, model, packed_batch([[40]]))


# --------------------------------------------------------------------------------------------------------------------
# no mask
# --------------------------------------------------------------------------------------------------------------------


def test_no_seq_by_seq_tensor_is_ever_built():
    seq = 4096
    batch = packed_batch([[1500, 1000, 1596]])
    model = build_model("tiny-llama", num_hidden_layers=1)
    sdpa_control = LargestTensor()
    with torch.no_grad(), sdpa_control:  # transformers' own sdpa path must build a mask for this packed batch
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    assert sdpa_control.largest >= seq * seq

    handle = use_lstune_attention(model)
    masks = []

    def spy(**kwargs):
        masks.append(attention._build_no_mask(**kwargs))
        return masks[-1]

    own_mask = hf_internals.attention_mask_function(handle.key)
    hf_internals.register_attention(handle.key, hf_internals.attention_function(handle.key), spy)
    try:
        tracker = LargestTensor()
        with tracker:
            token_loss(model, batch).backward()
    finally:
        hf_internals.register_attention(handle.key, hf_internals.attention_function(handle.key), own_mask)
    assert masks and all(isinstance(mask, attention.ModelMask) for mask in masks)  # a description, no tensor
    assert tracker.largest < seq * seq // 8, tracker.largest


# --------------------------------------------------------------------------------------------------------------------
# local_attention vs a naive reference
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("window", [None, 5, 100])
def test_local_attention_sdpa_matches_reference(kv_heads, window, monkeypatch):
    monkeypatch.setattr(attention, "_MIN_WINDOW_BLOCK", 64)
    rows = [[300, 20, 1, 279], [600]]
    gen = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(2, 4, 600, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 600, 8, generator=gen, requires_grad=True) for _ in range(2))
    out = local_attention(q, k, v, position_ids_BS=positions(rows), scaling=0.3, sliding_window=window, backend="sdpa")
    expected = reference_attention(q, k, v, rows, scaling=0.3, window=window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (7, None), (None, 2.0), (7, 2.0)])
def test_local_attention_flex_forward_matches_reference(window, softcap):
    # PyTorch has no flex backward on CPU: this checks lstune's block mask and score_mod; CUDA runs the same ones.
    rows = [[50, 30, 48], [128]]
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 128, 16, generator=gen), *torch.randn(2, 2, 2, 128, 16, generator=gen)
    pos = positions(rows)
    out = local_attention(q, k, v, position_ids_BS=pos, sliding_window=window, softcap=softcap, backend="flex")
    expected = reference_attention(q, k, v, rows, window=window, softcap=softcap)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_document_metadata():
    pos = positions([[3, 2, 1], [6]])
    assert document_spans(pos) == [[(0, 3), (3, 5), (5, 6)], [(0, 6)]]
    cu, longest = cu_seqlens(pos)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 12] and longest == 6
    # HF hands [1, S] position_ids to every row; None means one document per row.
    q = torch.randn(2, 2, 6, 4)
    same = local_attention(q, q, q, position_ids_BS=torch.arange(6)[None])
    torch.testing.assert_close(same, local_attention(q, q, q))


# --------------------------------------------------------------------------------------------------------------------
# softcap, refusals, checks
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_softcap_runs_lstunes_block_kernel_on_sdpa_and_trains_on_cpu():
    """Issue 34: SDPA cannot softcap, so softcapped calls on sdpa (auto's choice on CPU) run lstune's block kernel —
    exact, gradients too; without the kernel they are refused, never ignored; flex cannot train on CPU."""
    from lstune.memory.block_attention import block_attention

    # A cap this low bends the small logits of a random-init model, so ignoring it would change the loss.
    batch = packed_batch([[40]])
    reference, model, _ = eager_and_lstune("tiny-gemma2", backend="sdpa", attn_logit_softcapping=0.05)
    with pytest.raises(ModelError, match="softcapped logits.*block_kernel"):
        token_loss(model, batch)
    reference = build_model("tiny-gemma2", attn_implementation="eager", attn_logit_softcapping=0.05)
    model = build_model("tiny-gemma2", attn_implementation="eager", attn_logit_softcapping=0.05)
    use_lstune_attention(model, block_kernel=block_attention)  # auto: sdpa on CPU
    assert_same_loss_and_grads(reference, model, batch)
    flex = build_model("tiny-gemma2", attn_implementation="eager", attn_logit_softcapping=0.05)
    use_lstune_attention(flex, backend="flex")
    with pytest.raises(ModelError, match="softcaps attention logits.*flex backward"):
        token_loss(flex, batch)
    with torch.no_grad():  # flex runs without gradients on CPU
        torch.testing.assert_close(token_loss(flex, batch), token_loss(reference, batch), rtol=1e-6, atol=1e-6)
    # The check can fail: the same model without the cap gives another loss.
    with torch.no_grad():
        uncapped = build_model("tiny-gemma2", attn_implementation="eager")
        assert not torch.allclose(token_loss(uncapped, batch), token_loss(model, batch), rtol=0, atol=1e-4)


def test_refusals_name_the_problem():
    model = build_model("tiny-llama", num_hidden_layers=1)
    with use_lstune_attention(model):
        with pytest.raises(UserError, match="padding"):
            model(input_ids=torch.ones(1, 8, dtype=torch.long), attention_mask=torch.tensor([[1] * 6 + [0] * 2]))
        model(input_ids=torch.ones(1, 8, dtype=torch.long), attention_mask=torch.ones(1, 8, dtype=torch.long))

    model.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ModelError, match="attention sinks"):
        use_lstune_attention(model)
    with pytest.raises(ModelError, match="bidirectional"):
        use_lstune_attention(build_model("tiny-gemma3", use_bidirectional_attention=True))
    with pytest.raises(ConfigError, match="'fast' is unknown"):
        use_lstune_attention(build_model("tiny-llama", num_hidden_layers=1), backend="fast")
    with pytest.raises(UserError, match="flash-attn and a CUDA device"):
        use_lstune_attention(build_model("tiny-llama", num_hidden_layers=1), backend="flash_attention_2")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(UserError, match="KV cache"):
        local_attention(q, q[:, :, :1], q[:, :, :1])


def test_check_attention_support():
    check_attention_support(preset_config("tiny-llama"), pack=True, seq_len=4096, device="cpu")
    check_attention_support(preset_config("gemma-2-9b"), pack=True, seq_len=131072, device="cuda")
    # Softcapping on CPU and on sdpa: lstune's block kernel (issue 34); flex cannot train on CPU.
    check_attention_support(preset_config("gemma-2-9b"), pack=False, seq_len=4096, device="cpu")
    check_attention_support(preset_config("gemma-2-9b"), pack=False, seq_len=4096, backend="sdpa", device="cuda")
    with pytest.raises(ModelError, match="attn_logit_softcapping=50.0.*flex backward") as error:
        check_attention_support(preset_config("gemma-2-9b"), pack=False, seq_len=4096, backend="flex", device="cpu")
    assert "'auto' or 'sdpa'" in str(error.value)
    with pytest.raises(ModelError, match="bidirectional"):
        check_attention_support(preset_config("tiny-gemma3", use_bidirectional_attention=True), pack=False, seq_len=64)
    with pytest.raises(UserError, match="no flex_attention backward"):
        check_attention_support(preset_config("tiny-llama"), pack=False, seq_len=64, backend="flex", device="cpu")
    with pytest.raises(ConfigError):
        check_attention_support(preset_config("tiny-llama"), pack=False, seq_len=64, backend="fa3")


def test_undo_restores_and_other_models_are_untouched(caplog):
    model, bystander = build_model("tiny-llama", num_hidden_layers=1), build_model("tiny-llama", num_hidden_layers=1)
    assert hf_internals.attention_implementation(model.config) == "sdpa"
    batch = packed_batch([[10, 6]])
    with caplog.at_level(logging.INFO, logger="lstune"):
        handle = use_lstune_attention(model)
    assert handle.key in caplog.text and "no attention mask" in caplog.text
    assert hf_internals.attention_implementation(model.config) == handle.key
    assert hf_internals.attention_implementation(bystander.config) == "sdpa"
    assert hf_internals.attention_function(handle.key) and hf_internals.attention_mask_function(handle.key)

    handle.undo()
    handle.undo()
    assert hf_internals.attention_implementation(model.config) == "sdpa"
    assert hf_internals.attention_function(handle.key) is None and hf_internals.attention_mask_function(handle.key) is None
    with torch.no_grad():
        torch.testing.assert_close(token_loss(model, batch), token_loss(bystander, batch))


# --------------------------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["sdpa", "flex", "flash_attention_2"])
@pytest.mark.parametrize("window", [None, 64])
def test_cuda_backends_match_reference(backend, window):
    if backend not in attention.available_backends():
        pytest.skip(f"{backend} not available")
    rows = [[700, 300, 24], [1024]]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 1024, 64, device="cuda", generator=gen, dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(2, 2, 1024, 64, device="cuda", generator=gen, dtype=torch.bfloat16, requires_grad=True)
        for _ in "kv"
    )
    softcap = None if backend == "sdpa" else 5.0
    out = local_attention(q, k, v, position_ids_BS=positions(rows).cuda(), sliding_window=window, softcap=softcap,
                          backend=backend)
    expected = reference_attention(*(t.float() for t in (q, k, v)), rows, window=window, softcap=softcap)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2)


def test_a_model_computing_with_its_mask_tensor_is_refused():
    """lstune hands a model's layers a ModelMask, not a tensor: code that reads it as one (Doge adds a learned
    per-key bias to its mask) gets a refusal naming the problem, while `hasattr` / `getattr` with a default still
    see an object without that attribute."""
    from lstune.models.attention import MaskTensorUse, ModelMask

    mask = ModelMask(mask_function=lambda b, h, q, kv: kv <= q, local_size=None)
    with pytest.raises(ModelError, match=r"reads the mask's `dtype`.*computes with the mask tensor itself"):
        mask.dtype
    with pytest.raises(MaskTensorUse, match="slices the mask"):
        mask[:, :, :, :4]
    assert not hasattr(mask, "shape") and getattr(mask, "device", None) is None


def test_doge_is_refused_end_to_end():
    from transformers import CONFIG_MAPPING

    if "doge" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no Doge")
    from tests.support.arch_sweep import SEQ, build
    from tests.unit.memory._helpers import long_batch
    from lstune.memory.loss import causal_lm_loss_sum

    model, problem = build("doge")
    assert problem is None, problem
    handle = use_lstune_attention(model, backend="sdpa")
    try:
        with pytest.raises(ModelError, match="reads the mask's `dtype`"):
            causal_lm_loss_sum(model, long_batch(SEQ))
    finally:
        handle.undo()
