"""DeepSpeed's own UlyssesSPAttentionHF as an independent reference for lstune's Ulysses wrapper.

Same q/k/v shards in, same attention output shards and same q/k/v gradients out, for MHA, GQA, MQA and
kv replication on 2 and 4 gloo processes (DeepSpeed supports only head counts the SP degree divides).
"""

from __future__ import annotations

import pytest

# (q heads, kv heads); every one is divisible or replicable at SP 2 and 4.
HEADS = [(4, 4), (8, 2), (4, 1), (8, 4)]


def _compare_worker(rank: int, world: int) -> list[tuple]:
    import deepspeed
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.ulysses import UlyssesAttention

    deepspeed.init_distributed(dist_backend="gloo")
    dims = ParallelDims(world, sp=world).build_groups()
    batch, seq, head_dim = 2, 32, 8
    local = seq // world
    results = []
    for q_heads, kv_heads in HEADS:
        torch.manual_seed(q_heads * 10 + kv_heads)
        full = [torch.randn(batch, h, seq, head_dim) for h in (q_heads, kv_heads, kv_heads)]
        mine = [t[:, :, rank * local : (rank + 1) * local] for t in full]
        positions = torch.arange(seq).expand(batch, -1)[:, rank * local : (rank + 1) * local]

        outputs, grads = [], []
        for wrapper in (_deepspeed_wrapper(UlyssesSPAttentionHF, sdpa_attention_forward, dims, q_heads, kv_heads,
                                           head_dim, batch),
                        UlyssesAttention(sdpa_attention_forward, "sdpa", dims)):
            q, k, v = (t.clone().requires_grad_() for t in mine)
            module = _Module(q_heads // kv_heads)
            out, _ = wrapper(module, q, k, v, None, position_ids=positions, scaling=head_dim**-0.5)
            out = out.reshape(batch, local, -1)
            out.backward(torch.ones_like(out) * torch.linspace(-1, 1, out.shape[-1]))
            outputs.append(out.detach())
            grads.append([t.grad for t in (q, k, v)])
        out_diff = float((outputs[0] - outputs[1]).abs().max())
        grad_diff = max(float((a - b).abs().max()) for a, b in zip(*grads))
        results.append(((q_heads, kv_heads), out_diff, grad_diff))
    return results


def _deepspeed_wrapper(cls, core, dims, q_heads, kv_heads, head_dim, batch):
    return cls(
        attn=core,
        batch_size=batch,
        attn_head_count=q_heads,
        attn_head_size=head_dim,
        kv_head_count=kv_heads,
        num_hidden_layers=1,
        process_group=dims.sp_group,
        seq_length_is_variable=True,
    )


class _Module:
    """Stands in for an HF attention module: what the kernels read from it."""

    def __init__(self, groups: int):
        self.num_key_value_groups = groups
        self.is_causal = True
        self.training = True


@pytest.mark.parametrize("world", [2, 4])
def test_same_outputs_and_gradients_as_deepspeed_ulysses(pools, world):
    for heads, out_diff, grad_diff in pools[world].run(_compare_worker)[0]:
        assert out_diff < 1e-6, f"{heads}: outputs differ by {out_diff:.2e}"
        assert grad_diff < 1e-6, f"{heads}: q/k/v gradients differ by {grad_diff:.2e}"
