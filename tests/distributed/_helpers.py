"""Shared pieces of the distributed tests: tiny models, batches and a reference loss.

Everything here runs inside the spawned gloo workers, so it imports torch lazily and stays small.
"""

from __future__ import annotations

from typing import Any

IGNORE = -100


def tiny_model(arch: str, seed: int = 0, **overrides: Any):
    """A 2-layer fp32 model of preset `arch` with config `overrides` (e.g. head counts).

    Attention is HF's SDPA unless `attn=` names another implementation (Gemma-2 has only eager).
    """
    from lstune.models.presets import build_model

    attn = overrides.pop("attn", "sdpa")
    overrides.setdefault("num_hidden_layers", 2)
    return build_model(arch, seed=seed, attn_implementation=attn, **overrides)


def make_batch(seq: int, *, seed: int = 0, batch: int = 1, docs: int = 1, vocab: int = 320) -> dict:
    """A batch in the shared contract: `docs` packed documents per row (1 = one long sample).

    Labels are shifted on the full sequence: -100 at each document's last token.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    cuts = sorted(torch.randperm(seq - 2, generator=g)[: docs - 1].add(1).tolist())
    starts = [0, *cuts]
    position_ids = torch.zeros(batch, seq, dtype=torch.long)
    shift_labels = torch.full((batch, seq), IGNORE, dtype=torch.long)
    for start, stop in zip(starts, [*cuts, seq]):
        position_ids[:, start:stop] = torch.arange(stop - start)
        shift_labels[:, start : stop - 1] = input_ids[:, start + 1 : stop]
    return {"input_ids": input_ids, "position_ids": position_ids, "shift_labels": shift_labels}


def loss_sum(model, batch: dict):
    """(Σ token cross-entropy, token count) of `batch`, from the final hidden states (no HF loss)."""
    import torch.nn.functional as F

    out = model.base_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    logits = model.get_output_embeddings()(out.last_hidden_state).float()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap:
        logits = softcap * (logits / softcap).tanh()
    labels = batch["shift_labels"]
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return total, int((labels != IGNORE).sum())


def grads_of(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_grad_diff(a: dict, b: dict) -> tuple[float, str]:
    """Largest |a - b| relative to max |b| over all parameters, and the worst parameter's name."""
    assert a.keys() == b.keys(), f"different parameters have gradients: {set(a) ^ set(b)}"
    worst = max(a, key=lambda n: float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-12)))
    return float((a[worst] - b[worst]).abs().max() / b[worst].abs().max().clamp_min(1e-12)), worst


def train_steps(engine, batches, steps: int, accum: int, compute_loss_sum=None) -> list[tuple[float, float]]:
    """`steps` optimizer steps of the lstune objective on `engine`: (global mean loss, grad norm) each."""
    from lstune.parallel.loss import global_mean, global_token_count, local_objective
    from lstune.parallel.sp_data import count_tokens

    compute_loss_sum = compute_loss_sum or loss_sum
    out = []
    for _ in range(steps):
        window = [next(batches) for _ in range(accum)]
        n = global_token_count(window)
        sums = []
        for mb in window:
            s, _ = compute_loss_sum(engine.model, mb)
            engine.backward(local_objective(s, n))
            sums.append(s.detach())
        stats = engine.step()
        out.append((global_mean(sums, [count_tokens(mb) for mb in window]), stats["grad_norm"]))
    return out


def reference_samples(seq: int, docs: list[int]) -> dict:
    """{"long": one `seq`-token sample, "packed": documents of `docs` tokens}: each (batch, the pieces plain HF runs
    as separate samples for the reference)."""
    from tests.unit.memory._helpers import long_batch, packed_batch, split_documents

    long, packed = long_batch(seq), packed_batch(docs)
    return {"long": (long, [long]), "packed": (packed, split_documents(packed, docs))}


def compare_sp_with_hf(model_types: list[str], samples: dict, variants: dict, build=None) -> dict:
    """Each variant under SP against plain HF on the whole sequence (fp32), per model type and sample.

    `samples[data] = (batch, reference pieces)` (`reference_samples`); `variants[name](model, batch, data)` prepares
    its copy of the model (Ulysses, memory techniques), shards `batch` and returns (local loss sum, shard, *extra).
    Returns {(model_type, data, name): ("ran", (loss, reference loss, worst relative gradient difference, same
    parameters have gradients, *extra)) or ("refused", message of the UserError the variant raised)}. `build`: the
    model of a type (default: tests.support.archs.tiny_model).
    """
    import copy

    from lstune.errors import UserError
    from lstune.parallel.loss import global_mean, global_token_count, local_objective, sum_gradients
    from lstune.parallel.sp_data import count_tokens
    from tests.support.archs import tiny_model
    from tests.unit.memory._helpers import hf_loss_sum, run_grads

    results = {}
    for model_type in model_types:
        base = (build or tiny_model)(model_type)  # copied before any forward: some models keep graph tensors
        for data, (batch, pieces) in samples.items():
            n = int(count_tokens(batch))
            ref_loss, ref_grads = run_grads(copy.deepcopy(base), hf_loss_sum, pieces, scale=n)
            for name, run in variants.items():
                model = copy.deepcopy(base)
                try:
                    local_sum, shard, *extra = run(model, batch, data)
                    local_objective(local_sum, global_token_count([shard])).backward()
                except UserError as error:
                    results[(model_type, data, name)] = ("refused", str(error))
                    continue
                sum_gradients(model.parameters())
                loss = global_mean([local_sum.detach()], [count_tokens(shard)])
                grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
                diff = _relative_grad_diff(grads, ref_grads)
                results[(model_type, data, name)] = ("ran", (loss, ref_loss / n, diff, grads.keys() == ref_grads.keys(),
                                                             *extra))
    return results


def lstune_sp_variant(world: int, seq: int, *, ring: int = 1, memory: dict | None = None):
    """A `compare_sp_with_hf` variant prepared as `lstune train` composes it: lstune's attention with the block
    kernel, Ulysses over `world` ranks (its core a ring of `ring` ranks when ring > 1), the token mixers head-parallel
    over the whole SP group (lstune.train.mixers; nothing on a model without them), the memory techniques of `memory`
    (MemorySection fields; None: none), and the batch sharded as they need (FPDT order when attention is chunked,
    zigzag under a ring — inside each chunk when both). Its extra result: the attention chunks run."""
    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques
    from lstune.memory.attention_ring import RingAttention
    from lstune.memory.block_attention import block_attention
    from lstune.memory.loss import causal_lm_loss_sum
    from lstune.models.attention import use_lstune_attention
    from lstune.models.introspect import find_parts
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.sp_data import shard_batch
    from lstune.parallel.ulysses import SequenceExchange, apply_ulysses
    from lstune.train.mixers import install_mixers

    dims = ParallelDims(world, sp=world, ring=ring).build_groups()

    def run(model, batch, data):
        use_lstune_attention(model, backend="sdpa", block_kernel=block_attention)
        if ring > 1:
            apply_ulysses(model, dims, core=RingAttention.of(dims), core_name=f"ring of {ring}")
        else:
            apply_ulysses(model, dims)
        parts = find_parts(model)
        mixers = install_mixers(parts.body, parts.layers, pack=data == "packed", exchange=SequenceExchange(dims))
        step, chunks, count = causal_lm_loss_sum, None, 1
        if memory is not None:
            plan = apply_memory_techniques(model, MemorySection(**memory), seq_len=seq // world, parts=parts, ring=ring)
            step, chunks, count = plan.loss_sum, plan.attn_chunking, plan.attn_chunks_at_seq_len
            if mixers is not None:
                mixers.follow(chunks)
        shard = shard_batch(batch, dims.sp, dims.sp_rank, chunks, ring=ring)
        return step(model, shard)[0], shard, count
    return run


def assert_sp_matches_hf(results: dict, count: int, *, loss_tol: float, grad_tol: float) -> None:
    """`count` results of `compare_sp_with_hf`, every one run (none refused) with the same parameters given gradients,
    its loss within `loss_tol` (relative) and its worst gradient within `grad_tol` of plain HF's."""
    import pytest

    assert len(results) == count, sorted(results)
    for key, (outcome, detail) in results.items():
        assert outcome == "ran", f"{key}: refused: {detail}"
        loss, ref_loss, diff, same_keys = detail[:4]
        assert same_keys, key
        assert loss == pytest.approx(ref_loss, rel=loss_tol), f"{key}: loss {loss} != {ref_loss}"
        assert diff < grad_tol, f"{key}: gradients differ by {diff:.1e} (relative)"


def _relative_grad_diff(grads: dict, ref_grads: dict) -> float:
    """Largest |g - ref| over parameters, each relative to its own max |ref| (floored at 1e-3 of the largest)."""
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    return max(float((grads[k] - g).abs().max()) / max(float(g.abs().max()), 1e-3 * scale) for k, g in ref_grads.items()
               if k in grads)


def label_gpu_sub_groups(engine, offload_ratio: float) -> int:
    """Under partial optimizer offload DeepSpeed steps the sub-groups it keeps on the accelerator with a torch AdamW
    (`backup_optimizer`) — on the CPU accelerator every sub-group is "cpu", so that path never runs. Label the first
    int((1 - ratio) · n) sub-groups as DeepSpeed does on CUDA (the tensors stay where they are): their steps then
    take the AdamW, as on a GPU. The number labelled."""
    optimizer = engine._ds.optimizer
    count = int((1 - offload_ratio) * len(optimizer.fp32_partitioned_groups_flat)) if offload_ratio < 1 else 0
    for i in range(count):
        optimizer.subgroup_to_device[i] = "cuda"
    return count
