"""Helpers for the memory tests: batches (long sample, packed), the plain-HF reference, gradient checks."""

from __future__ import annotations

import torch

IGNORE = -100


def long_batch(seq: int, vocab: int = 320, *, batch: int = 1, seed: int = 0, ignore_every: int = 7):
    """One long document per row: labels pre-shifted on the full sequence, some prompt tokens ignored."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE
    labels[:, ::ignore_every] = IGNORE  # ignored positions inside the sequence, as prompt masking makes
    positions = torch.arange(seq).expand(batch, seq).clone()
    return {"input_ids": ids, "position_ids": positions, "shift_labels": labels}


def packed_batch(doc_lens: list[int], vocab: int = 320, *, seed: int = 1):
    """Documents packed into one row: position_ids restart at 0, each document's last label ignored."""
    gen = torch.Generator().manual_seed(seed)
    ids, labels, positions = [], [], []
    for n in doc_lens:
        doc = torch.randint(3, vocab, (n,), generator=gen)
        lab = torch.roll(doc, -1)
        lab[-1] = IGNORE
        ids.append(doc), labels.append(lab), positions.append(torch.arange(n))
    return {"input_ids": torch.cat(ids)[None], "position_ids": torch.cat(positions)[None],
            "shift_labels": torch.cat(labels)[None]}


def split_documents(batch: dict, doc_lens: list[int]) -> list[dict]:
    """The documents of a packed row as separate one-row batches."""
    out, start = [], 0
    for n in doc_lens:
        out.append({k: v[:, start:start + n] for k, v in batch.items()})
        start += n
    return out


def hf_loss_sum(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain HF model's summed loss: full logits, then HF's own causal-LM loss with shift_labels."""
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    count = (batch["shift_labels"] != IGNORE).sum()
    mean = model.loss_function(
        logits=out.logits, labels=None, vocab_size=out.logits.shape[-1],
        shift_labels=batch["shift_labels"], num_items_in_batch=count,
    )
    return mean * count, count


def run_grads(model, step, batches, scale=None) -> tuple[float, dict[str, torch.Tensor]]:
    """Backward `sum(step(b) / scale)` over micro-batches; return the total loss and every trainable grad."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        loss_sum, _ = step(model, batch)
        loss = loss_sum / scale if scale is not None else loss_sum
        loss.backward()
        total += loss_sum.item()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return total, grads


def run_with_plan(model, options: dict, seq: int, batches) -> tuple:
    """(plan, loss, grads) of `batches` with `MemorySection(**options)` applied to `model` (and lstune's attention
    where the options chunk it); all of it undone afterwards, the plan's record kept for the caller's checks."""
    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques
    from lstune.memory.block_attention import block_attention
    from lstune.models.attention import use_lstune_attention

    attention = (use_lstune_attention(model, backend="sdpa", block_kernel=block_attention)
                 if options.get("attn_chunks") else None)
    plan = apply_memory_techniques(model, MemorySection(**options), seq_len=seq)
    try:
        loss, grads = run_grads(model, plan.loss_sum, batches)
    finally:
        plan.undo()
        if attention is not None:
            attention.undo()
    return plan, loss, grads


def assert_grads_match(grads: dict, reference: dict, *, rtol: float = 1e-4) -> None:
    """Every trainable parameter's gradient matches (fp32): no parameter missing, none extra."""
    assert grads.keys() == reference.keys(), sorted(set(grads) ^ set(reference))
    for name, ref in reference.items():
        scale = ref.abs().max().item()
        torch.testing.assert_close(grads[name], ref, rtol=rtol, atol=1e-5 * scale + 1e-12, msg=lambda m: f"{name}: {m}")


def nonzero_lora_B(model, seed: int = 7):
    """peft starts lora_B at zero, which leaves lora_A without a gradient and hides the adapters from the loss: give
    it small random values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return model
