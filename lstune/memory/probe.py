"""A few-token probe forward, used to discover and verify structure that config and module tree don't show.

Used at `apply_memory_techniques` time only (never per step): which norms feed the MLP (mini-sequence
fusion), whether a fused layer still computes what the original did, and whether the loss head
reproduces the model's own logits (logit scaling / softcapping found from the config).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lstune.models.chunk_layout import AttentionChunks
from lstune.models.introspect import ModelParts

if TYPE_CHECKING:
    from torch import nn

PROBE_TOKENS = 8


def probe_inputs(
    parts: ModelParts, n: int = PROBE_TOKENS, chunks: AttentionChunks | None = None
) -> dict[str, torch.Tensor]:
    """`input_ids` and `position_ids` of `n` tokens on the model's device (token ids 1..n, below any vocab).

    With chunked attention installed (`chunks`), `n` is rounded up to equal chunks and each chunk is one document
    (positions restart at 0): under SP every rank runs the same probe, which is no shard of one sample, and the
    gathered chunks then read the same as FPDT's pieces (lstune.models.chunk_layout) and as contiguous shards. Under a
    ring (`chunks.ring` > 1) each half chunk is one document: a ring position's two zigzag pieces of a chunk are its
    halves, which then read alike in the chunk-major order and in the unchunked ring's (every rank the same)."""
    device = parts.output_embedding.weight.device
    count = chunks.count(n) if chunks is not None else 1
    docs = count * (2 if count > 1 and chunks.ring > 1 else 1)
    n = docs * -(-n // docs)
    ids = torch.arange(1, n + 1, device=device).unsqueeze(0)
    positions = (torch.arange(n, device=device) % (n // docs)).unsqueeze(0)
    return {"input_ids": ids, "position_ids": positions}


@torch.no_grad()
def probe_hidden_states(parts: ModelParts, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Final hidden states of the decoder body on the probe, in eval mode (dropout off)."""
    body = parts.body
    with eval_mode(body):
        out = body(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


class eval_mode:
    """Put a module tree in eval mode and afterwards restore each module's own `training` flag."""

    def __init__(self, module: "nn.Module"):
        self.module = module

    def __enter__(self):
        self.flags = [(m, m.training) for m in self.module.modules()]
        self.module.eval()
        return self.module

    def __exit__(self, *exc):
        for module, flag in self.flags:
            module.training = flag
