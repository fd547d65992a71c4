"""METP's MLP (`--metp-mlp`) on 4 gloo processes: MLP weights sharded over the SP group and rotated; loss and every
gradient (the shards' gathered back by `undo`) equal plain HF on the whole sequence, fp32.

Layouts (Ulysses, ring) = (1, 4), (2, 2), (4, 1), one long sample and packed documents crossing the shards; with
tiled MLP + checkpointing on top; LoRA on attention only (frozen MLP shards) trains; LoRA on the MLP is refused.
Each rank's stored MLP weights are 1/4 of the full ones.
"""

from __future__ import annotations

import pytest

SEQ = 64
DOCS = [29, 20, 15]
TOL = 2e-5
LAYOUTS = [(1, 4), (2, 2), (4, 1)]
ARCHS = ["llama", "qwen3", "gemma3_text"]


def _metp_worker(rank: int, world: int, archs: list[str]) -> dict:
    import copy

    from lstune.config.schema import MemorySection
    from lstune.errors import UserError
    from lstune.memory.apply import apply_memory_techniques
    from lstune.memory.attention_ring import RingAttention
    from lstune.memory.metp_mlp import install_metp_mlp
    from lstune.memory.rotation import Ring
    from lstune.models.introspect import find_parts
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.loss import global_mean, global_token_count, local_objective, sum_gradients
    from lstune.parallel.sp_data import count_tokens, shard_batch
    from lstune.parallel.ulysses import apply_ulysses
    import torch.nn.functional as F

    from tests.distributed._helpers import IGNORE, _relative_grad_diff, reference_samples
    from tests.support.archs import tiny_model
    from tests.unit.memory._helpers import hf_loss_sum, run_grads

    dims_of = {(u, r): ParallelDims(world, sp=world, ring=r).build_groups() for u, r in LAYOUTS}

    def loss_sum(model, batch):  # through the logits: a peft-wrapped model's base_model is the LoRA wrapper
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        return F.cross_entropy(logits.float().flatten(0, 1), batch["shift_labels"].flatten(), ignore_index=IGNORE,
                               reduction="sum"), None

    def lora(model, targets):
        from peft import LoraConfig, get_peft_model

        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))

    def run(model, batch, dims, memory: bool):
        ring = dims.ring
        if ring > 1:
            apply_ulysses(model, dims, core=RingAttention.of(dims), core_name="ring")
        else:
            apply_ulysses(model, dims)
        plan = None
        if memory:  # before METP, as lstune.train applies them; METP replaces tiled MLP (refused together)
            plan = apply_memory_techniques(model, MemorySection(tiled_mlp="off", tiled_loss=2, checkpointing=True,
                                                                attn_chunks="off"), seq_len=SEQ // world)
        metp = install_metp_mlp(find_parts(model).layers,
                                Ring(dims.sp, dims.sp_rank, tuple(dims.sp_group_ranks(dims.dp_rank)), dims.sp_group))
        stored = sum(p.numel() for p in metp.shard_parameters())
        shard = shard_batch(batch, dims.sp, dims.sp_rank, ring=ring)
        local_sum = (plan.loss_sum if plan is not None else loss_sum)(model, shard)[0]
        local_objective(local_sum, global_token_count([shard])).backward()
        owned = {id(p) for p in metp.shard_parameters()}
        sum_gradients([p for p in model.parameters() if id(p) not in owned])  # DP is 1: the shards' own are whole
        metp.undo()
        if plan is not None:
            plan.undo()
        return global_mean([local_sum.detach()], [count_tokens(shard)]), stored

    results = {}
    samples = reference_samples(SEQ, DOCS)
    for arch in archs:
        for variant in ("plain", "memory", "lora-attention", "lora-mlp"):
            base = tiny_model(arch)
            if variant == "lora-attention":
                base = lora(base, ["q_proj", "v_proj"])
            elif variant == "lora-mlp":
                base = lora(base, ["gate_proj", "down_proj"])
            full_mlp = sum(p.numel() for n, p in base.named_parameters() if ".mlp." in n and "lora" not in n)
            for data, (batch, pieces) in samples.items():
                n = int(count_tokens(batch))
                ref_loss, ref_grads = run_grads(copy.deepcopy(base), hf_loss_sum, pieces, scale=n)
                for layout, dims in dims_of.items():
                    if variant != "plain" and layout != (2, 2):
                        continue
                    model = copy.deepcopy(base)
                    key = (arch, variant, data, layout)
                    try:
                        loss, stored = run(model, batch, dims, memory=variant == "memory")
                    except UserError as error:
                        results[key] = ("refused", str(error))
                        continue
                    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
                    results[key] = ("ran", (loss, ref_loss / n, _relative_grad_diff(grads, ref_grads),
                                            grads.keys() == ref_grads.keys(), stored, full_mlp))
    return results


def test_metp_mlp_matches_hf(pools):
    results = pools[4].run(_metp_worker, ARCHS, timeout=900)
    assert len(results[0]) == len(ARCHS) * 2 * (len(LAYOUTS) + 3)
    for key, (outcome, detail) in results[0].items():
        if key[1] == "lora-mlp":
            assert outcome == "refused" and "LoRA" in detail, (key, detail)
            continue
        assert outcome == "ran", (key, detail)
        loss, ref_loss, diff, same_params, stored, full_mlp = detail
        assert same_params, key
        assert loss == pytest.approx(ref_loss, rel=TOL, abs=TOL), (key, loss, ref_loss)
        assert diff < TOL, (key, diff)
        assert stored * 4 == full_mlp, (key, stored, full_mlp)  # each rank stores a quarter of the MLP
    for other in results[1:]:
        for key, (outcome, detail) in other.items():
            if outcome == "ran":
                assert detail[2] < TOL, (key, detail[2])
