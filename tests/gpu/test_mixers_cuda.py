"""Linear-attention and state-space mixers on CUDA: packed documents through whichever kernels transformers picks —
flash-linear-attention (`pip install lstune[fla]`), causal-conv1d, mamba-ssm when installed, its torch path
otherwise — equal each document run alone; and lstune's head-parallel view (one rank's heads) equals the module's
own forward on those heads' channels. SP across GPUs is the distributed tests' (gloo) job; a multi-GPU machine runs
tests/distributed with the same code on NCCL.

Tolerances: fp32 with TF32 off — the Triton kernels of flash-linear-attention still sum in another order than the
torch path, so 1e-3 relative rather than the CPU tests' 1e-5; the test prints which kernel ran.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest

pytestmark = pytest.mark.gpu

TYPES = ["qwen3_next", "qwen3_5_text", "bamba", "nemotron_h", "lfm2"]
DOCS = [301, 157, 66]


def _kernels() -> str:
    found = [name for name in ("fla", "causal_conv1d", "mamba_ssm") if importlib.util.find_spec(name) is not None]
    return ", ".join(found) or "torch paths only"


@pytest.fixture(autouse=True)
def _no_tf32():
    import torch

    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("model_type", TYPES)
def test_packed_documents_equal_each_document_alone_on_cuda(model_type):
    import torch

    from lstune.memory.loss import causal_lm_loss_sum
    from lstune.models.attention import use_lstune_attention
    from lstune.models.introspect import find_parts
    from lstune.train.mixers import install_mixers
    from tests.support.archs import tiny_model
    from tests.unit.memory._helpers import hf_loss_sum, packed_batch, run_grads, split_documents

    print(f"{model_type}: kernels installed: {_kernels()}")
    model = tiny_model(model_type, attn="sdpa").cuda()
    batch = {k: v.cuda() for k, v in packed_batch(DOCS).items()}
    ref_loss, ref_grads = run_grads(copy.deepcopy(model), hf_loss_sum, split_documents(batch, DOCS))
    parts = find_parts(model)
    install_mixers(parts.body, parts.layers, pack=True)
    use_lstune_attention(model, backend="sdpa")
    loss, grads = run_grads(model, causal_lm_loss_sum, [batch])
    assert loss == pytest.approx(ref_loss, rel=1e-4)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-3, atol=1e-4 * scale, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("model_type", TYPES)
def test_a_rank_s_view_equals_the_module_on_its_heads_on_cuda(model_type):
    """Rank 1 of 4's view of each mixer (its heads' channels, sliced weights) runs the module's own forward — with the
    CUDA kernels — and gives the slice the whole module would produce for those heads before the output projection."""
    import torch

    from lstune.models import mixers
    from lstune.models.introspect import find_parts
    from tests.support.archs import tiny_model

    model = tiny_model(model_type, attn="sdpa").cuda()
    for _, module in mixers.mixer_sites(find_parts(model).layers):
        family = mixers.family_of(module)
        units = family.units(module)
        counts = [units // 4 + (r < units % 4) for r in range(4)]
        start, count = sum(counts[:1]), counts[1]
        x = torch.randn(1, 300, mixers._input_width(module), device="cuda")
        with torch.no_grad():
            stream, kept = family.streams(module, x)
            local = stream[:, :, start : start + count]
            view = family.view(module, start, count, local)
            got = type(module).forward(view, local.flatten(2))
            full = family.view(module, 0, units, stream)
            whole = type(module).forward(full, stream.flatten(2)).reshape(1, 300, units, -1)
        torch.testing.assert_close(got.reshape(1, 300, count, -1), whole[:, :, start : start + count],
                                   rtol=1e-3, atol=1e-4 * float(whole.abs().max()))
