"""The tables of docs/memory.md, measured with lstune's own meters (lstune.memory.measure); the whole-step
trace of `lstune estimate --trace` is lstune.train.trace.

Run as a script it prints them:
    python -m lstune.memory.tables --preset qwen3-0.6b --layers 2 --seq 1024 2048
    python -m lstune.memory.tables --preset qwen3-0.6b --dtype bfloat16 --loss-policies --seq 4096 65536 262144 1048576
    python -m lstune.memory.tables --preset qwen3-0.6b --layers 2 --seq 1100 --step-times --threads 2
"""

from __future__ import annotations

import argparse

import torch

from lstune.data.batch import IGNORE_INDEX
from lstune.memory.measure import no_leftover_grads, peak_bytes


# ---- the tables of docs/memory.md (script) -----------------------------------------------------


def _batch(seq: int, vocab: int, device) -> dict[str, torch.Tensor]:
    ids = torch.arange(seq, device=device)[None] % vocab
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = IGNORE_INDEX
    return {"input_ids": ids, "position_ids": torch.arange(seq, device=device)[None], "shift_labels": labels}


def hf_step(model, batch) -> None:
    """Plain Hugging Face: full logits, HF's causal-LM loss (summed), backward."""
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    count = (batch["shift_labels"] != IGNORE_INDEX).sum()
    loss = model.loss_function(
        logits=out.logits, labels=None, vocab_size=out.logits.shape[-1],
        shift_labels=batch["shift_labels"], num_items_in_batch=count,
    )
    loss.backward()


def lstune_step(plan):
    """One forward + backward through lstune's loss head with `plan`'s tiles."""

    def step(model, batch) -> None:
        loss, _ = plan.loss_sum(model, batch)
        loss.backward()

    return step


_UNCHUNKED = {"attn_chunks": "off"}  # unresolved `auto` would chunk the longer rows (no estimate chooses here)
CONFIGS = {
    "HF plain": None,
    "HF + checkpointing": {"tiled_mlp": "off", "tiled_loss": "off", "checkpointing": True, **_UNCHUNKED},
    "tiled loss": {"tiled_mlp": "off", "checkpointing": False, **_UNCHUNKED},
    "tiled loss + tiled MLP": {"checkpointing": False, **_UNCHUNKED},
    "tiled loss + tiled MLP + checkpointing (default)": {**_UNCHUNKED},
    "mini-sequence + checkpointing": {"mini_sequence": True, **_UNCHUNKED},
    "default + offload (device bytes)": {"offload_checkpoints": True, **_UNCHUNKED},
    "mini-sequence + offload (device bytes)": {"mini_sequence": True, "offload_checkpoints": True, **_UNCHUNKED},
    "mini-sequence + offload + attention in 4 chunks (device bytes)": {"mini_sequence": True,
                                                                        "offload_checkpoints": True, "attn_chunks": 4},
}


def _build(preset: str, layers: int, dtype: torch.dtype, device: str, fake):
    """The preset with real random weights, or (fake) with fake tensors: shapes and allocations, no data."""
    from lstune.models.presets import build_model, preset_config

    if fake is None:
        return build_model(preset, num_hidden_layers=layers, dtype=dtype).to(device)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(preset, num_hidden_layers=layers), dtype=dtype)
    with fake:
        model.to_empty(device=device)
    return model


def _run_config(model, name, options, seq, device) -> int:
    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques

    plan = apply_memory_techniques(model, MemorySection(**options), seq_len=seq) if options is not None else None
    step = lstune_step(plan) if options is not None and not name.startswith("HF") else hf_step
    batch = _batch(seq, model.config.vocab_size, device)
    exclude = (lambda: _host_bytes(plan)) if plan is not None and plan.offloader else None
    try:
        with no_leftover_grads(model):
            return peak_bytes(lambda: step(model, batch), device, exclude)
    finally:
        if plan is not None:
            plan.undo()


def _host_bytes(plan) -> int:
    """What the plan keeps in host memory now (offloaded checkpoints and attention chunks): not device bytes."""
    chunks = plan.attn_chunk_stats.host_bytes if plan.attn_chunk_stats is not None else 0
    return plan.offloader.stats.host_bytes + chunks


def measure_table(preset: str, layers: int, seqs: list[int], device: str, dtype: torch.dtype, fake: bool,
                  attention: str = "hf", rows: list[str] | None = None):
    """[(configuration, [peak bytes at each seq])] for plain HF and lstune's techniques; `rows`: only the
    configurations whose names contain one of these. Chunked attention needs lstune's attention: its rows are
    measured with `attention="lstune"` only."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    model = _build(preset, layers, dtype, device, mode)
    model.train()
    if attention == "lstune":
        # Every row gets the same mask-free attention, so the rows differ only by the memory techniques;
        # with HF's SDPA path transformers would also build an O(seq²) mask.
        from lstune.memory.block_attention import block_attention
        from lstune.models.attention import use_lstune_attention

        use_lstune_attention(model, backend="sdpa", block_kernel=block_attention)
    wanted = [(name, options) for name, options in CONFIGS.items()
              if (rows is None or any(r in name for r in rows))
              and (attention == "lstune" or (options or {}).get("attn_chunks", "off") == "off")]
    with mode or contextlib.nullcontext(), _one_document_positions(fake):
        return [(name, [_run_config_at(model, name, options, seq, device, fake) for seq in seqs])
                for name, options in wanted]


def _run_config_at(model, name, options, seq, device, fake) -> int:
    """Fake position_ids have no values: lstune's attention is told the documents (one per row) they would hold."""
    import contextlib

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from lstune.models.attention import stated_document_spans

    with unset_fake_temporarily():
        positions = torch.arange(seq)[None]
    stated = stated_document_spans(positions) if fake else contextlib.nullcontext()
    with stated:
        return _run_config(model, name, options, seq, device)


def _one_document_positions(fake: bool):
    """Under fake tensors transformers cannot read position_ids, assumes a packed batch and builds a seq x seq
    mask (an artifact: with real data it sees one document and builds none). Tell it what real data would."""
    import contextlib

    from lstune.models.hf_internals import no_packed_sequence_detection

    return no_packed_sequence_detection() if fake else contextlib.nullcontext()


def measure_loss_policies(preset: str, seqs: list[int], dtype: torch.dtype):
    """Peak bytes of the loss head alone (forward + backward, fake tensors) under ALST's and MST's tile policies."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lstune.memory.loss import alst_loss_policy, loss_sum_from_hidden, mst_loss_policy

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _build(preset, 1, dtype, "cpu", mode)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    rows = []
    with mode:
        for name, policy in (("ALST ~1 GiB tiles", alst_loss_policy(vocab)),
                             ("MST vocab/hidden tiles", mst_loss_policy(vocab, hidden))):
            for seq in seqs:
                h = torch.randn(1, seq, hidden, dtype=dtype, requires_grad=True)
                labels = torch.zeros(1, seq, dtype=torch.long)

                def step():
                    loss, _ = loss_sum_from_hidden(model, h, labels, tiles=policy)
                    loss.backward()

                with no_leftover_grads(model):
                    peak = peak_bytes(step)
                rows.append((name, seq, policy.tiles(seq, width=vocab), peak))
    return rows


TIMED = {
    "HF plain": None,
    "default (ALST tiles)": {},
    "default + offload": {"offload_checkpoints": True},
    "tiled_loss: 8": {"tiled_loss": 8},
    "mini-sequence (MST tiles)": {"mini_sequence": True},
}


def measure_step_times(preset: str, layers: int, seq: int) -> list[tuple[str, int, float]]:
    """Wall seconds of one forward + backward (real tensors, fp32) per configuration, after one warm-up step."""
    import time

    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques
    from lstune.models.presets import build_model

    model = build_model(preset, num_hidden_layers=layers)
    model.train()
    batch = _batch(seq, model.config.vocab_size, "cpu")
    with no_leftover_grads(model):
        hf_step(model, batch)
    rows = []
    for name, options in TIMED.items():
        plan = apply_memory_techniques(model, MemorySection(**options), seq_len=seq) if options is not None else None
        start = time.perf_counter()
        with no_leftover_grads(model):
            (lstune_step(plan) if plan else hf_step)(model, batch)
        rows.append((name, plan.loss_tiles_at_seq_len if plan else 1, time.perf_counter() - start))
        if plan is not None:
            plan.undo()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048], help="two or more lengths")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--fake", action="store_true", help="fake tensors: trace allocations at any length, no RAM")
    parser.add_argument("--attention", choices=["hf", "lstune"], default="hf",
                        help="lstune: every row uses lstune's mask-free attention (lstune.models.attention)")
    parser.add_argument("--rows", nargs="+", help="only the configurations whose names contain one of these")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (memory does not depend on it)")
    parser.add_argument("--loss-policies", action="store_true", help="compare ALST and MST loss tiling instead")
    parser.add_argument("--step-times", action="store_true", help="time one step per configuration instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.step_times:
        print(f"| configuration | loss tiles | seconds per step ({args.seq[0]} tokens, CPU) |")
        print("|---|---:|---:|")
        for name, tiles, seconds in measure_step_times(args.preset, args.layers, args.seq[0]):
            print(f"| {name} | {tiles} | {seconds:.1f} |")
        return
    if args.loss_policies:
        print("| loss tiling | tokens | tiles | peak of the loss head (MiB) |")
        print("|---|---:|---:|---:|")
        for name, seq, tiles, peak in measure_loss_policies(args.preset, args.seq, getattr(torch, args.dtype)):
            print(f"| {name} | {seq:,} | {tiles} | {peak / 2**20:,.0f} |")
        return
    rows = measure_table(args.preset, args.layers, args.seq, args.device, getattr(torch, args.dtype), args.fake,
                         args.attention, args.rows)
    s1, s2 = args.seq[-2:]
    peaks_header = " | ".join(f"peak @ {s} (MiB)" for s in args.seq)
    print(f"| configuration | {peaks_header} | bytes / token ({s1}→{s2}) |")
    print("|---|" + "---:|" * (len(args.seq) + 1))
    for name, peaks in rows:
        cells = " | ".join(f"{p / 2**20:,.0f}" for p in peaks)
        print(f"| {name} | {cells} | {(peaks[-1] - peaks[-2]) / (s2 - s1):,.0f} |")


if __name__ == "__main__":
    main()
