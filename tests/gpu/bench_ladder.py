"""The single-GPU measurements of docs/benchmarks/ (ALST Table 1's ladder, kernel rates, the bf16 policy).

A script, not a test. `lstune bench` has absorbed its ladder, kernel rates and longest-sequence search
(lstune/bench/: the rungs and rates here are lstune.bench's); what stays here is what `lstune bench` does not do:
the bf16 policy record, the copy/compute overlap, and the longest sequence of a deep model through a shallow one
carrying the missing layers' bytes (`maxlen --as-layers`). Each sub-command prints JSON lines and appends them
to `--out` (a .jsonl file), so a run cut short by its time limit still leaves every finished measurement behind.

    python -m tests.gpu.bench_ladder rates  --out R.jsonl                  # bf16 GEMM and attention kernel rates
    python -m tests.gpu.bench_ladder policy --out R.jsonl                  # device bytes by dtype, checkpoint B/token
    python -m tests.gpu.bench_ladder ladder --rungs hf,tiled_loss --lengths 8k,16k --steps 2 --out R.jsonl
    python -m tests.gpu.bench_ladder maxlen --rung tiled_mlp --start 96k --out R.jsonl

The model is a preset (random init) built directly on the device in bf16, LoRA (peft) on every linear layer
with fp32 adapters, micro-batch 1, AdamW over the adapters, one training step = forward + backward + optimizer
step under bf16 autocast (what `lstune train` runs on CUDA). One model serves every rung of a run: each rung is
applied, measured and undone.

Rungs (each adds one thing to the one before):
  hf          plain Hugging Face: its SDPA attention, its gradient checkpointing (non-reentrant), its loss
              (full logits); no lstune patch at all
  tiled_loss  lstune attention (SDPA per document, no mask) + lstune checkpointing + tiled logits/loss
  tiled_mlp   + tiled MLP (ALST's ceil(seq/hidden) tiles)
  offload     + checkpoints offloaded to pinned host memory (async, prefetched)
  mini_seq    + mini-sequence policy (norms fused into the MLP tiles, MST loss tiles)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import torch

def _ladder() -> dict[str, dict[str, Any] | None]:
    from lstune.bench.rungs import LADDER, RUNGS as BENCH_RUNGS

    return {name: None if BENCH_RUNGS[name].plain_hf else dict(BENCH_RUNGS[name].memory) for name in LADDER}


RUNGS = _ladder()  # rung → MemorySection settings (None: plain HF), lstune bench's ladder
GiB = 2**30


def parse_length(text: str) -> int:
    text = text.strip().lower()
    scale = {"k": 1024, "m": 1024**2, "g": 1024**3}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def emit(out: str | None, record: dict[str, Any]) -> None:
    line = json.dumps(record, default=str)
    print(line, flush=True)
    if out:
        with open(out, "a") as fh:
            fh.write(line + "\n")


def host_peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- the model ------------------------------------------------------------------------------------------------


def build(preset: str, layers: int | None, lora_r: int, device: str) -> Any:
    """The preset in bf16 on `device` (random init on the device: no 32 GB fp32 copy on the host), LoRA via
    lstune's own helper (fp32 adapters: peft upcasts them), SDPA as HF's attention for the `hf` rung."""
    from transformers import AutoModelForCausalLM

    from lstune.models.loading import apply_lora
    from lstune.models.presets import preset_config

    overrides = {"num_hidden_layers": layers} if layers else {}
    config = preset_config(preset, **overrides)
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if lora_r:
        model = apply_lora(model, r=lora_r, alpha=None, dropout=0.0, targets="auto")
    return model.train()


def batch_of(seq: int, vocab: int, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seq)
    ids = torch.randint(0, vocab, (1, seq), generator=gen)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    positions = torch.arange(seq)[None]
    return {k: v.to(device) for k, v in {"input_ids": ids, "position_ids": positions, "shift_labels": labels}.items()}


@contextlib.contextmanager
def rung_applied(model, rung: str, seq: int) -> Iterator[tuple[Callable, Any]]:
    """(loss function of a batch, memory plan or None) with `rung` applied to `model`; undone on exit."""
    options = RUNGS[rung]
    if options is None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            yield _hf_loss, None
        finally:
            model.gradient_checkpointing_disable()
        return
    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques
    from lstune.models.attention import use_lstune_attention

    attention = use_lstune_attention(model)
    plan = None
    try:
        plan = apply_memory_techniques(model, MemorySection(**options), seq_len=seq)
        yield (lambda m, b: _mean(*plan.loss_sum(m, b))), plan
    finally:
        if plan is not None:
            plan.undo()
        attention.undo()


def _mean(total, count):
    return total / count


def _hf_loss(model, batch):
    labels = torch.cat([batch["input_ids"][:, :1], batch["shift_labels"][:, :-1]], dim=1)  # HF shifts itself
    return model(input_ids=batch["input_ids"], labels=labels, use_cache=False).loss


def train_step(model, loss_fn, batch, optimizer) -> float:
    with torch.autocast("cuda" if batch["input_ids"].is_cuda else "cpu", dtype=torch.bfloat16):
        loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(model, rung: str, seq: int, *, steps: int, device: str, warmup_seq: int | None = None) -> dict:
    """One rung at one length: per-step times, peaks, outcome ("ok" / "oom" / "error: ...")."""
    record: dict[str, Any] = {"kind": "step", "rung": rung, "seq": seq, "layers": _layers(model)}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    try:
        with rung_applied(model, rung, seq) as (loss_fn, plan):
            if warmup_seq:  # kernels, allocator and autotuning warmed on a short batch: not timed
                train_step(model, loss_fn, batch_of(warmup_seq, _vocab(model), device), optimizer)
            batch = batch_of(seq, _vocab(model), device)
            _reset_peaks(device)
            times, losses = [], []
            for _ in range(steps):
                _sync(device)
                start = time.perf_counter()
                losses.append(train_step(model, loss_fn, batch, optimizer))
                _sync(device)
                times.append(time.perf_counter() - start)
            record.update(outcome="ok", step_s=times, median_s=statistics.median(times), min_s=min(times),
                          loss=losses[-1], tokens_per_s=seq / min(times))
            record.update(_peaks(device))
            if plan is not None:
                record["plan"] = plan.summary()
                if plan.offloader is not None:
                    stats = plan.offloader.stats
                    record["offload"] = vars(stats).copy()
    except torch.OutOfMemoryError as exc:
        record.update(outcome="oom", error=str(exc).splitlines()[0][:300])
        record.update(_peaks(device))
    except Exception as exc:  # a failure is a result too: record it and go on with the next measurement
        record.update(outcome=f"error: {type(exc).__name__}", error=str(exc)[:500])
    finally:
        model.zero_grad(set_to_none=True)
        del optimizer
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    record["host_peak_rss"] = host_peak_rss()
    return record


def _layers(model) -> int:
    return _config(model).num_hidden_layers


def _config(model):
    from lstune.models.introspect import text_config

    return text_config(model)


def _vocab(model) -> int:
    return _config(model).vocab_size


def _capacity(device: str) -> int:
    """Device bytes the allocator can have: total minus what the CUDA context and others hold now."""
    if not device.startswith("cuda"):
        return int(os.environ.get("BENCH_CPU_CAPACITY", 8 * GiB))
    free, _total = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved()


def _reset_peaks(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def _peaks(device: str) -> dict[str, int]:
    if not device.startswith("cuda"):
        return {}
    return {"peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved(),
            "device_total": torch.cuda.get_device_properties(0).total_memory}


# ---- sub-commands ---------------------------------------------------------------------------------------------


def cmd_ladder(args) -> None:
    """Phases `RUNGS:LENGTHS:STEPS` on one model (built once): every rung at every length, shortest first."""
    model = build(args.preset, args.layers, args.lora_r, args.device)
    emit(args.out, {"kind": "model", "preset": args.preset, "layers": _layers(model), **_model_bytes(model),
                    "residual_dtype": _residual_dtype(model, args.device)})
    warm = parse_length(args.warmup) if args.warmup else None
    for phase in args.phase:
        rungs, lengths, steps = phase.split(":")
        for rung in rungs.split(","):
            for seq in (parse_length(s) for s in lengths.split(",")):
                record = measure(model, rung, seq, steps=int(steps), device=args.device, warmup_seq=warm)
                emit(args.out, {**record, "preset": args.preset, "lora_r": args.lora_r})
                if record["outcome"] != "ok":
                    break  # longer lengths of this rung cannot fit either


def predicted_max(records: list[dict], rung: str, layers: int, capacity: int, step: int) -> int | None:
    """Longest length (a multiple of `step`) whose peak, fitted linearly on the two longest measured lengths
    of `rung` at `layers` layers, stays under `capacity` bytes."""
    points = sorted((r["seq"], r["peak_allocated"]) for r in records
                    if r.get("kind") == "step" and r.get("rung") == rung and r.get("layers") == layers
                    and r.get("outcome") == "ok" and "peak_allocated" in r)
    if len(points) < 2:
        return None
    (s1, p1), (s2, p2) = points[-2:]
    slope = (p2 - p1) / (s2 - s1)
    if slope <= 0:
        return None
    return max(step, int(s2 + (capacity - p2) / slope) // step * step)


def cmd_maxlen(args) -> None:
    """Longest length that completes a step, by steps of `--len-step` from `--start`: up while it fits, down
    while it does not. In-process (the allocator recovers from an OOM once its tensors are freed)."""
    model = build(args.preset, args.layers, args.lora_r, args.device)
    ballast = _ballast(model, args.as_layers, args.device)  # noqa: F841  (held: stands for the missing layers)
    step = parse_length(args.len_step)
    seq = parse_length(args.start) if args.start else None
    if args.fit_lengths:
        records = []
        for fit_seq in (parse_length(s) for s in args.fit_lengths.split(",")):
            records.append(measure(model, args.rung, fit_seq, steps=1, device=args.device))
            emit(args.out, {**records[-1], "preset": args.preset, "lora_r": args.lora_r, "fit": True})
        capacity = _capacity(args.device) - parse_length(args.margin)
        predicted = predicted_max(records, args.rung, _layers(model), capacity, step)
        emit(args.out, {"kind": "prediction", "rung": args.rung, "layers": _layers(model), "predicted_max": predicted,
                        "capacity": capacity})
        seq = predicted or seq
    cap = parse_length(args.max_len) if args.max_len else None
    if cap and seq:
        seq = min(seq, cap)
    if not seq:
        raise SystemExit("maxlen: no --start and nothing to predict from")
    best, worst, tries = 0, None, 0
    while tries < args.max_tries and seq > 0:
        tries += 1
        record = measure(model, args.rung, seq, steps=1, device=args.device)
        emit(args.out, {**record, "preset": args.preset, "lora_r": args.lora_r, "search": True})
        if record["outcome"] == "ok":
            best = max(best, seq)
            if (worst is not None and seq + step >= worst) or (cap and seq + step > cap):
                break
            seq += step
        else:
            worst = seq if worst is None else min(worst, seq)
            if best and seq - step <= best:
                break
            seq -= step
    emit(args.out, {"kind": "maxlen", "rung": args.rung, "preset": args.preset, "layers": _layers(model),
                    "as_layers": args.as_layers, "ballast_bytes": ballast.numel() if ballast is not None else 0,
                    "longest_ok": best, "shortest_failed": worst, "len_step": step})


def _ballast(model, as_layers: int | None, device: str) -> torch.Tensor | None:
    """Device bytes of the layers a shallow model lacks to be `as_layers` deep: frozen weights plus adapters
    with their gradients and AdamW state (fp32: 4 + 4 + 8 bytes per element). With checkpoints offloaded the
    device peak of a deeper model is the shallow one's plus exactly these, so a shallow model carrying this
    ballast finds the deep model's longest sequence at a fraction of its step time."""
    from lstune.models.introspect import decoder_layers

    layers = decoder_layers(model)
    if not as_layers or as_layers <= len(layers):
        return None
    per_layer = sum(p.numel() * (p.element_size() if not p.requires_grad else 16) for p in layers[0].parameters())
    nbytes = (as_layers - len(layers)) * per_layer
    print(json.dumps({"kind": "ballast", "as_layers": as_layers, "bytes": nbytes}), flush=True)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _model_bytes(model) -> dict[str, Any]:
    by_kind: dict[str, int] = {}
    for p in model.parameters():
        key = f"{'trainable' if p.requires_grad else 'frozen'}_{str(p.dtype).removeprefix('torch.')}_{p.device.type}"
        by_kind[key] = by_kind.get(key, 0) + p.numel() * p.element_size()
    return {"param_bytes": by_kind, "allocated_after_build": torch.cuda.memory_allocated()
            if torch.cuda.is_available() else None}


def cmd_policy(args) -> None:
    """The bf16 policy as a CUDA run holds it: parameter bytes by dtype, the residual stream's dtype, and
    the bytes one layer's checkpoint takes per token (offloaded: counted on the host by the offloader)."""
    model = build(args.preset, args.layers, args.lora_r, args.device)
    record = {"kind": "policy", "preset": args.preset, "layers": _layers(model), **_model_bytes(model)}
    seq = parse_length(args.seq)
    step = measure(model, "offload", seq, steps=1, device=args.device)
    offload = step.get("offload") or {}
    offloaded = offload.get("offloaded", 0)
    if offloaded:
        record["checkpoint_bytes_per_token_per_layer"] = offload["peak_host_bytes"] / (offloaded * seq)
    record["hidden_size"] = _config(model).hidden_size
    record["step"] = step
    record["residual_dtype"] = _residual_dtype(model, args.device)
    emit(args.out, record)


def _residual_dtype(model, device: str) -> str:
    from lstune.memory.loss import final_hidden_states

    batch = batch_of(64, _vocab(model), device)
    with torch.no_grad(), torch.autocast("cuda" if device.startswith("cuda") else "cpu", dtype=torch.bfloat16):
        return str(final_hidden_states(model, batch).dtype)


def cmd_rates(args) -> None:
    """Measured bf16 GEMM rate and causal attention kernel rate (forward, backward): lstune.bench.rates."""
    from lstune.bench.rates import measure_rates

    for rate in measure_rates(args.device):
        emit(args.out, {"kind": "rate", **rate})


def cmd_overlap(args) -> None:
    emit(args.out, copy_overlap(parse_length(args.seq), 4096, args.device))


def copy_overlap(seq: int, hidden: int, device: str) -> dict[str, Any]:
    """Offload's copy hidden or exposed: one layer's checkpoint (seq x hidden, bf16) copied to pinned host
    memory on a side stream, as the offloader does, while the compute stream runs a matmul of about a layer's
    MLP, against the two timed alone."""
    x = torch.randn(seq, hidden, device=device, dtype=torch.bfloat16)
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    w = torch.randn(hidden, int(3.5 * hidden), device=device, dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def copy():
        host.copy_(x, non_blocking=True)

    def compute():
        return x @ w

    def overlapped():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            copy()
        compute()
        torch.cuda.current_stream().wait_stream(side)

    from lstune.bench.rates import timed

    copy_s, compute_s, both_s = (timed(fn, device) for fn in (copy, compute, overlapped))
    exposed = max(0.0, both_s - max(compute_s, copy_s))
    return {"kind": "overlap", "seq": seq, "bytes": x.numel() * 2, "copy_s": copy_s,
            "copy_gb_per_s": x.numel() * 2 / copy_s / 1e9, "compute_s": compute_s, "overlapped_s": both_s,
            "serial_s": copy_s + compute_s, "exposed_s": exposed,
            "hidden_fraction": 1 - exposed / min(copy_s, compute_s)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("rates", "policy", "ladder", "maxlen", "overlap"):
        p = sub.add_parser(name)
        p.add_argument("--out")
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        p.add_argument("--preset", default="llama-3.1-8b")
        p.add_argument("--layers", type=int, default=None)
        p.add_argument("--lora-r", type=int, default=16)
    sub.choices["policy"].add_argument("--seq", default="16k")
    sub.choices["overlap"].add_argument("--seq", default="64k")
    ladder = sub.choices["ladder"]
    ladder.add_argument("--phase", action="append", required=True, help="RUNGS:LENGTHS:STEPS, e.g. hf,offload:8k,16k:1")
    ladder.add_argument("--warmup", default="4k")
    maxlen = sub.choices["maxlen"]
    maxlen.add_argument("--rung", choices=list(RUNGS), required=True)
    maxlen.add_argument("--start")
    maxlen.add_argument("--fit-lengths", help="measure these first and start at the linear fit's longest length")
    maxlen.add_argument("--as-layers", type=int, help="carry the device bytes of a model this deep (see _ballast)")
    maxlen.add_argument("--max-len", help="never try longer than this (a step's time grows with length squared)")
    maxlen.add_argument("--margin", default="1.5G", help="device bytes kept free in the prediction")
    maxlen.add_argument("--len-step", default="8k")
    maxlen.add_argument("--max-tries", type=int, default=4)
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    {"rates": cmd_rates, "policy": cmd_policy, "ladder": cmd_ladder, "maxlen": cmd_maxlen,
     "overlap": cmd_overlap}[args.cmd](args)


if __name__ == "__main__":
    main(sys.argv[1:])
