"""Saved attention on CPU (issue 33): step time with attention recomputed in backward (`--recompute-attention on`)
and kept (`off`) on an attention-heavy tiny Llama, and the estimate's FLOP counter against a hand count.

    PYTHONPATH=. python docs/benchmarks/2026-11-27-cpu-saved-attention/measure.py 8192 16384

One fp32 model, 2 layers, hidden 256 (8 heads of 32, 4 kv heads), checkpointing on, lstune's attention (sdpa: the
CPU flash op); per length a warm-up step each, then 3 steps each, alternating on/off; medians.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import transformers

from lstune.config.schema import MemorySection
from lstune.estimate.flops import step_flops
from lstune.memory.apply import apply_memory_techniques
from lstune.models.attention import use_lstune_attention

CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=1 << 16)


def hand_count(seq: int, saved: bool) -> float:
    """Hardware FLOPs of one step, counted by hand: matmuls forward 2·P·S (layers) + 2·D·V·S (head), backward twice
    that (full fine-tune), checkpointing one more layer forward; causal attention 4·d·h per (query, key) pair
    forward over S(S+1)/2 pairs per layer, its kernel backward 2.5 × that, checkpointing one more forward unless
    the output is saved."""
    d, v, i, h, kv, hd, n = 256, 512, 512, 8, 4, 32, 2
    layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * i
    layers_fwd = 2 * layer * seq * n
    head_fwd = 2 * d * v * seq
    attention_fwd = n * 4 * hd * h * seq * (seq + 1) // 2
    return 3 * (layers_fwd + head_fwd) + layers_fwd + attention_fwd * (1 + 2.5 + (0 if saved else 1))


def main(lengths: list[int]) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    model = transformers.LlamaForCausalLM(config).train()
    use_lstune_attention(model, backend="sdpa")
    results = {}
    for seq in lengths:
        ids = torch.randint(0, 512, (1, seq))
        batch = {"input_ids": ids, "position_ids": torch.arange(seq)[None], "shift_labels": ids.roll(-1, 1)}
        plans = {mode: None for mode in ("on", "off")}
        times = {mode: [] for mode in plans}
        for step in range(4):
            for mode in plans:
                plan = apply_memory_techniques(model, MemorySection(tiled_mlp="off", tiled_loss="off",
                                                                    recompute_attention=mode), seq_len=seq)
                start = time.perf_counter()
                loss, _ = plan.loss_sum(model, batch)
                loss.backward()
                elapsed = time.perf_counter() - start
                model.zero_grad(set_to_none=True)
                plan.undo()
                if step:
                    times[mode].append(elapsed)
        on, off = (statistics.median(times[m]) for m in ("on", "off"))
        flops = {mode: step_flops(config, seq, lora=False, checkpointing=True,
                                  attention_saved_layers=2 if mode == "off" else 0).hardware for mode in plans}
        results[seq] = {"step_s_recompute": round(on, 3), "step_s_saved": round(off, 3),
                        "ratio_saved_over_recompute": round(off / on, 3),
                        "flops_ratio_saved_over_recompute": round(flops["off"] / flops["on"], 3),
                        "flops_match_hand_count": all(flops[m] == hand_count(seq, m == "off") for m in plans),
                        "times": times}
        print(json.dumps({seq: results[seq]}), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main([int(n) for n in sys.argv[1:]] or [8192, 16384])
