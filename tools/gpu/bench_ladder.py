"""The single-GPU measurements of docs/benchmarks/ (ALST Table 1's ladder, kernel rates, the bf16 policy).

A script, not a test. `lstune bench` has absorbed its ladder, kernel rates and longest-sequence search
(lstune/bench/: the rungs and rates here are lstune.bench's); what stays here is what `lstune bench` does not do:
the bf16 policy record, the copy/compute overlap, chunked attention's steady-state cost (`chunks`), and the
longest sequence of a deep model through a shallow one carrying the missing layers' bytes (`maxlen --as-layers`;
with `--emulate-host` also the deep checkpoint placement's device and host bytes). Each sub-command prints JSON
lines and appends them to `--out` (a .jsonl file), so a run cut short by its time limit still leaves every
finished measurement behind.

    python -m tools.gpu.bench_ladder rates  --out R.jsonl                  # bf16 GEMM and attention kernel rates
    python -m tools.gpu.bench_ladder policy --out R.jsonl                  # device bytes by dtype, checkpoint B/token
    python -m tools.gpu.bench_ladder ladder --rungs hf,tiled_loss --lengths 8k,16k --steps 2 --out R.jsonl
    python -m tools.gpu.bench_ladder maxlen --rung tiled_mlp --start 96k --out R.jsonl
    python -m tools.gpu.bench_ladder chunks --seq 128k --chunks off,4 --layers 2 --out R.jsonl   # chunked vs not
    python -m tools.gpu.bench_ladder maxlen --rung mini_seq --layers 2 --as-layers 32 --attn-chunks 8 \
        --emulate-host 125G --start 832k --out R.jsonl       # 32-layer longest with chunks + MEMO placement

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
def rung_applied(model, rung: str, seq: int, memory: dict[str, Any] | None = None) -> Iterator[tuple[Callable, Any]]:
    """(loss function of a batch, memory plan or None) with `rung` applied to `model`, its memory settings
    overridden by `memory` (e.g. {"attn_chunks": 4}); undone on exit."""
    options = RUNGS[rung]
    if options is not None and memory:
        options = {**options, **memory}
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


def measure(model, rung: str, seq: int, *, steps: int, device: str, warmup_seq: int | None = None,
            memory: dict[str, Any] | None = None, profile: bool = False) -> dict:
    """One rung at one length: per-step times, peaks, outcome ("ok" / "oom" / "error: ..."). `memory`: settings
    over the rung's (`rung_applied`). `profile`: one more step under torch.profiler, summarised (`profiled_step`)."""
    record: dict[str, Any] = {"kind": "step", "rung": rung, "seq": seq, "layers": _layers(model)}
    if memory:
        record["memory"] = memory
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    try:
        with rung_applied(model, rung, seq, memory) as (loss_fn, plan):
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
            if profile:  # the timings above stand whatever the profiler does
                try:
                    record["profile"] = profiled_step(model, loss_fn, batch, optimizer, device)
                except Exception as exc:  # noqa: BLE001  (a profiler failure is recorded, not the step's outcome)
                    record["profile"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            if plan is not None:
                record["plan"] = plan.summary()
                if plan.offloader is not None:
                    stats = plan.offloader.stats
                    record["offload"] = vars(stats).copy()
                if plan.attn_chunk_stats is not None:  # totals over the warm-up, timed and profiled steps
                    record["attn_chunk_reads"] = vars(plan.attn_chunk_stats).copy()
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


def profiled_step(model, loss_fn, batch, optimizer, device: str) -> dict[str, Any]:
    """One training step under torch.profiler, reduced to where its time went (`device_time_summary`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        _sync(device)
        start = time.perf_counter()
        train_step(model, loss_fn, batch, optimizer)
        _sync(device)
        wall = time.perf_counter() - start
    intervals = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA]
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]  # where idle device time may go
    return {**device_time_summary(intervals, wall),
            "top_host_ops": [[e.key[:120], round(e.self_cpu_time_total * 1e-6, 4), e.count] for e in host]}


def device_time_summary(intervals: list[tuple[float, float, str]], wall_s: float, top: int = 12) -> dict[str, Any]:
    """Where a step's device time went, from its device events' (start µs, end µs, name): compute kernels (their
    union on the timeline: the device busy computing on any stream), host<->device copies by direction, the
    attention kernels (flash / cuDNN / fmha / sdpa / efficient), the time no compute kernel ran (`idle_s`: waits on
    copies, launch gaps, host work) and the kernels that took longest in total. Chunked attention's extra cost is
    either slower kernels (compute up), copies not hidden or host work (idle up): this tells which."""
    def kind(name: str) -> str:
        low = name.lower()
        if low.startswith("memcpy"):
            return "htod" if "htod" in low else "dtoh" if "dtoh" in low else "dtod"
        return "memset" if low.startswith("memset") else "compute"

    totals: dict[str, float] = {}
    by_name: dict[str, float] = {}
    compute = []
    for start, end, name in intervals:
        k = kind(name)
        totals[k] = totals.get(k, 0.0) + (end - start)
        if k == "compute":
            compute.append((start, end))
            by_name[name] = by_name.get(name, 0.0) + (end - start)
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(compute):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    attention = sum(t for n, t in by_name.items()
                    if any(w in n.lower() for w in ("flash", "cudnn", "fmha", "sdpa", "attention", "efficient")))
    us = 1e-6
    return {"wall_s": wall_s, "compute_busy_s": busy * us, "idle_s": max(wall_s - busy * us, 0.0),
            "compute_kernel_s": totals.get("compute", 0.0) * us, "attention_kernel_s": attention * us,
            "copy_htod_s": totals.get("htod", 0.0) * us, "copy_dtoh_s": totals.get("dtoh", 0.0) * us,
            "copy_dtod_s": totals.get("dtod", 0.0) * us,
            "top_kernels": [[n[:120], round(t * us, 4)] for n, t in sorted(by_name.items(), key=lambda x: -x[1])[:top]]}


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


def allocator_fraction(emulated_total: int, total: int, context: int) -> float | None:
    """Fraction of this device's `total` bytes the caching allocator may hold so that, with this process's CUDA
    context of `context` bytes outside it, the device stands for one of `emulated_total` bytes (an H100 80 GB on
    an H200: its context takes the same share there). None when this device is no bigger."""
    if emulated_total >= total:
        return None
    return (emulated_total - context) / total


def cap_device(gpu: str, device: str) -> dict[str, Any] | None:
    """Cap the allocator at what `gpu` (a lstune.estimate.hardware name) would leave it, and check the cap holds
    (one allocation just above it must fail, expandable segments included): a run on a bigger card then finds
    the smaller card's limits. None on CPU or when this card is no bigger."""
    if not device.startswith("cuda"):
        return None
    from lstune.estimate.hardware import GPUS

    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    context = total - free - torch.cuda.memory_reserved()
    fraction = allocator_fraction(GPUS[gpu].device_bytes, total, context)
    if fraction is None:
        return None
    torch.cuda.set_per_process_memory_fraction(fraction)
    allowed = int(fraction * total)
    try:
        probe = torch.empty(allowed + GiB, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        enforced = True
    else:
        del probe
        enforced = False
    torch.cuda.empty_cache()
    record = {"kind": "device_cap", "gpu": gpu, "total": total, "context": context, "fraction": fraction,
              "allocator_cap": allowed, "enforced": enforced}
    if not enforced:
        raise SystemExit(f"cap_device: an allocation above the {allowed} B cap succeeded; the emulation is void")
    return record


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
    while it does not. In-process (the allocator recovers from an OOM once its tensors are freed).

    `--as-layers N`: the shallow model carries the missing layers' weights and adapter state (`_ballast`).
    `--emulate-host BYTES` (with `--as-layers`, offloaded rungs): each trial also carries the deep model's
    checkpoints as lstune would place them on a host of BYTES — chunked attention and the MEMO placement at
    full depth (issue 14), whose host side binds near 1M tokens. Per trial: `deep_plan` (lstune.estimate's
    budgets and placement for the N-layer model at that length), then `emulation_ballast`'s device bytes
    (allocated on the device) and host bytes (pinned, in the offloader's blocks), then one step of the shallow
    model with the deep plan's chunk count. What it models: every byte the deep placement holds for the
    missing layers at its peak (device parts, split α parts, the fetched-back part, the longest recomputed
    segment's inputs; host parts with the pinned allocator's rounding), and the real process's own host use
    (the live layer's attention chunks, pinned buffers, CUDA context) because the shallow run really has it.
    What it does not: the recomputed segments' extra forwards (FLOPs and time: the step time is not the deep
    model's) and their real transient tensors (only the planner's estimate of them, as bytes), fragmentation
    from 32 layers' interleaved allocations, page-cache or other host users the estimate does not see, and any
    host memory the deep model would need that the planner leaves out. Its boundary is therefore the deep
    model's if and only if the planner's byte model of placed checkpoints is right — which a full-depth step
    at the found length (17-40 min) would confirm. On a card bigger than `--emulate-gpu` (an H200 standing for
    an H100 80 GB) the allocator is capped to what that card would leave it (`cap_device`), checked first."""
    if args.emulate_host and not args.as_layers:
        raise SystemExit("maxlen: --emulate-host needs --as-layers (the deep model it stands for)")
    cap = cap_device(args.emulate_gpu, args.device) if args.emulate_host else None
    if cap:
        emit(args.out, cap)
    model = build(args.preset, args.layers, args.lora_r, args.device)
    memory = {"attn_chunks": _chunks_arg(args.attn_chunks)} if args.attn_chunks else None

    def trial(length: int) -> dict:
        if args.emulate_host:
            return measure_emulated(model, args, length)
        return measure(model, args.rung, length, steps=1, device=args.device, memory=memory)

    ballast = _ballast(model, args.as_layers, args.device)  # noqa: F841  (held: stands for the missing layers)
    step = parse_length(args.len_step)
    seq = parse_length(args.start) if args.start else None
    if args.fit_lengths:
        records = []
        for fit_seq in (parse_length(s) for s in args.fit_lengths.split(",")):
            records.append(trial(fit_seq))
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
        record = trial(seq)
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
                    "attn_chunks": args.attn_chunks, "emulate_host": args.emulate_host,
                    "longest_ok": best, "shortest_failed": worst, "len_step": step})


def _chunks_arg(text: str) -> str | int:
    return text if text in ("off", "auto") else int(text)


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


# ---- the deep model's checkpoints, emulated on a shallow one (issue 14: chunked attention + MEMO placement) ----


def deep_plan(preset: str, lora_r: int, seq: int, as_layers: int, host_bytes: int, attn_chunks: str | int,
              gpu: str = "h100-80gb") -> dict[str, Any]:
    """What lstune would run for the `as_layers`-deep preset at `seq` tokens on one `gpu` with `host_bytes` of
    host RAM, with the weights on the device (AdamW, ZeRO off: what `build` makes), mini-sequence, offloaded
    checkpoints and attention in `attn_chunks` chunks: lstune.estimate's memory choice (the placement's host and
    device budgets, exactly as `lstune train` gets them) and the checkpoint placement it plans at that length
    (lstune.estimate.placement: the same planner train calls). No torch, no GPU: arithmetic on the config."""
    from lstune.config.schema import TrainConfig
    from lstune.estimate import estimate
    from lstune.estimate.hardware import resolve_hardware
    from lstune.models.presets import preset_config

    config = TrainConfig.from_flat({"model": preset, "lora_r": lora_r, "seq_len": seq, "mini_sequence": True,
                                    "offload_checkpoints": True, "attn_chunks": attn_chunks, "zero_stage": "0"})
    hardware = resolve_hardware(gpu=gpu, host_mem=host_bytes, detect=False)
    model_config = preset_config(preset, num_hidden_layers=as_layers)
    e = estimate(config, hardware, model_config=model_config, suggest=False)
    choice = e.memory_choice
    return {"placement": e.breakdown.placement, "attn_chunks": choice.attn_chunks,
            "host_mem_budget": choice.host_mem_budget, "checkpoint_device_budget": choice.checkpoint_device_budget,
            "predicted_device_peak": e.device_peak_bytes, "predicted_host_peak": e.host_peak_bytes,
            "device_capacity": e.device_capacity, "host_capacity": e.host_capacity, "fits": e.fits}


def emulation_ballast(deep, layers: int) -> tuple[int, int]:
    """(device bytes, host bytes) of checkpoints the deep placement `deep` (a CheckpointPlacement of the deep
    model at the trial's length) holds beyond what a `layers`-deep model's own placement holds at that length.

    The shallow model runs with no budgets, so its own placement is `offload_all` (lstune.memory.placement):
    layers 0..layers-2 on the host, the last on the device, and one host part fetched back in backward. The deep
    plan's device side is `device_peak_bytes()` (device parts + the fetched-back part + the longest recomputed
    segment's inputs, the planner's own model of backward's transients); its host side `host_bytes()` (pinned
    blocks rounded as the offloader allocates them). The ballast is the difference, never negative. Exact when
    the shallow run's own placement is `offload_all`, i.e. its copy fraction α is 1 — on an H100 from a few K
    tokens on for 8B shapes (a layer's forward at 128K, ~0.5 s, hides its 1 GiB copy ten times over); each trial's
    record carries the shallow run's real placement (`plan.checkpoint_placement`) to check it."""
    from lstune.memory.placement import CheckpointPlacement

    own = CheckpointPlacement.offload_all(layers, deep.checkpoint_bytes, host_bytes_of=deep.host_bytes_of)
    return (max(deep.device_peak_bytes() - own.device_peak_bytes(), 0),
            max(deep.host_bytes() - own.host_bytes(), 0))


def host_ballast(nbytes: int, pinned: bool) -> list[torch.Tensor]:
    """`nbytes` of host memory allocated as the offloader allocates checkpoints (lstune.memory.host_copies: power-of-
    two pieces from torch's pinned, page-locked, caching host allocator on CUDA; plain pieces on CPU)."""
    from lstune.memory.host_copies import HostBlocks

    return HostBlocks((nbytes,), torch.uint8, pinned=pinned).blocks


def _release_host_cache() -> None:
    """Give cached pinned blocks back to the OS: a freed ballast must not stay pinned into the next trial."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if torch.cuda.is_available() and empty is not None:
        empty()


def measure_emulated(model, args, seq: int) -> dict[str, Any]:
    """One maxlen trial of the shallow model standing for the `--as-layers`-deep one under `--emulate-host`
    (module doc of `cmd_maxlen`): the deep plan at `seq`, its checkpoint ballast on the device and the host,
    then the step with the deep plan's chunk count."""
    plan = deep_plan(args.preset, args.lora_r, seq, args.as_layers, parse_length(args.emulate_host),
                     _chunks_arg(args.attn_chunks or "auto"), args.emulate_gpu)
    placement = plan.pop("placement")
    device_extra, host_extra = emulation_ballast(placement, _layers(model))
    info = {**plan, "deep_placement": placement.describe(), "deep_host_bytes": placement.host_bytes(),
            "deep_device_peak_ckpt_bytes": placement.device_peak_bytes(), "ballast_device_ckpt": device_extra,
            "ballast_host_ckpt": host_extra}
    try:
        dev = torch.empty(device_extra, dtype=torch.uint8, device=args.device)
        start = time.perf_counter()
        host = host_ballast(host_extra, pinned=args.device.startswith("cuda"))
        info["host_ballast_alloc_s"] = time.perf_counter() - start
    except (torch.OutOfMemoryError, RuntimeError) as exc:  # the host cannot pin it, or the device cannot hold it
        dev = host = None
        gc.collect()
        _release_host_cache()
        return {"kind": "step", "rung": args.rung, "seq": seq, "layers": _layers(model), "outcome": "oom-ballast",
                "error": str(exc).splitlines()[0][:300], "emulation": info}
    record = measure(model, args.rung, seq, steps=1, device=args.device, memory={"attn_chunks": plan["attn_chunks"]})
    del dev, host
    gc.collect()
    _release_host_cache()
    return {**record, "emulation": info}


def cmd_chunks(args) -> None:
    """Chunked attention's cost in steady state: `--rung` at `--seq` with each `--chunks` setting (off first),
    every setting warmed by one untimed step at the same length (kernels, autotuning, and the pinned host
    buffers of offloaded checkpoints and chunks, which the first step at a length allocates: +36 % at 64K on
    2026-11-23), then `--steps` timed steps; a record per setting, and the ratio of medians to `off`."""
    model = build(args.preset, args.layers, args.lora_r, args.device)
    seq = parse_length(args.seq)
    base = None
    for setting in args.chunks.split(","):
        chunks = setting if setting in ("off", "auto") else int(setting)
        record = measure(model, args.rung, seq, steps=args.steps, device=args.device, warmup_seq=seq,
                         memory={"attn_chunks": chunks}, profile=args.profile)
        if record["outcome"] == "ok":
            base = record["median_s"] if chunks == "off" else base
            if base and chunks != "off":
                record["vs_off"] = record["median_s"] / base
        emit(args.out, {**record, "preset": args.preset, "lora_r": args.lora_r, "chunks_bench": True})


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
    for name in ("rates", "policy", "ladder", "maxlen", "overlap", "chunks"):
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
    maxlen.add_argument("--attn-chunks", help="off|auto|N over the rung's setting (lstune's chunked attention)")
    maxlen.add_argument("--emulate-host", help="host RAM of the deep run to emulate, e.g. 128G (cmd_maxlen's doc)")
    maxlen.add_argument("--emulate-gpu", default="h100-80gb",
                        help="the deep run's GPU: its estimate, and (with --emulate-host) the allocator capped to it")
    chunks = sub.choices["chunks"]
    chunks.add_argument("--rung", choices=list(RUNGS), default="mini_seq")
    chunks.add_argument("--seq", default="128k")
    chunks.add_argument("--chunks", default="off,4", help="attn_chunks settings, off first (the baseline)")
    chunks.add_argument("--steps", type=int, default=2)
    chunks.add_argument("--profile", action="store_true",
                        help="one more step per setting under torch.profiler: where its device time went")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    {"rates": cmd_rates, "policy": cmd_policy, "ladder": cmd_ladder, "maxlen": cmd_maxlen,
     "overlap": cmd_overlap, "chunks": cmd_chunks}[args.cmd](args)


if __name__ == "__main__":
    main(sys.argv[1:])
