"""`lstune estimate`: will this run fit, with which settings, how fast — from the model's config alone.

Takes the same flags and recipes as `lstune train` (the config sections), plus the hardware to estimate for.
The library answer is the run plan's estimate (`lstune.train.plan.plan`, analytic) or
`lstune.train.trace.trace_estimate` (--trace: the plan for the step the trace runs, and its trace);
this module parses, calls one of them and renders the result.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import typer

from lstune.cli.help import HelpCommand
from rich.markup import escape

from lstune.cli.options import config_parameter, given_flags, section_parameters

HELP = (
    "Predict the device and host memory peak of a training run, the longest sequence that fits, the cheapest "
    "changes that would fit, and the step time — before anything is downloaded or rented.\n\n"
    "Takes every `lstune train` flag and recipe (--config). Hardware: this machine's CUDA device when there is "
    "one, else --gpu or --device-mem; --host-mem defaults to the host of the named GPU's class (said in the "
    "output), or this machine's RAM for its own device."
)
SECTIONS = ("model", "data", "memory", "parallel", "optim")
_HW = "Hardware"


def register(app: typer.Typer) -> None:
    command = _estimate_command
    command.__signature__ = _signature()
    app.command("estimate", help=HELP, no_args_is_help=False, cls=HelpCommand)(command)


def _option(name: str, annotation: Any, option: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=option)


def _signature() -> inspect.Signature:
    """The command's parameters; help texts escaped, as cli.options does: typer renders them as rich markup, which
    would swallow "[default: ...]"."""
    from lstune.estimate.hardware import GPUS  # torch-free

    own = [
        _option("gpu", Optional[str], typer.Option(
            None, "--gpu", metavar="NAME", rich_help_panel=_HW,
            help=escape(f"Estimate for this GPU: {', '.join(GPUS)} or cpu "
                        "[default: this machine's CUDA device, else cpu]."))),
        _option("device_mem", Optional[str], typer.Option(
            None, "--device-mem", metavar="BYTES", rich_help_panel=_HW,
            help="Memory of one device, e.g. 80G (another GPU, or to override the table's).")),
        _option("host_mem", Optional[str], typer.Option(
            None, "--host-mem", metavar="BYTES", rich_help_panel=_HW,
            help=escape("Host memory of one node, e.g. 512G [default: with --gpu or --device-mem, the host of "
                        "that GPU's class (128 GiB per H100/H200/A100-80GB, 64 GiB per A100-40GB/L40S); else this "
                        "machine's RAM]."))),
        _option("nodes", Optional[str], typer.Option(
            None, "--nodes", metavar="N", rich_help_panel=_HW,
            help=escape("Nodes, each with --gpus devices [default: 1]."))),
        _option("trace", bool, typer.Option(
            False, "--trace", help="Measure instead: run the prepared model's real training step on fake tensors "
                                   "(no memory used; seconds to a minute).")),
        _option("as_json", bool, typer.Option(False, "--json", help="Print one JSON object (for scripts).")),
    ]
    return inspect.Signature([config_parameter(), *own, *section_parameters(SECTIONS)])


def _estimate_command(**kwargs: Any) -> int:
    from lstune.config.load import build_config, read_recipe

    config_path = kwargs.pop("config")
    hardware_flags = {k: kwargs.pop(k) for k in ("gpu", "device_mem", "host_mem", "nodes")}
    trace, as_json = kwargs.pop("trace"), kwargs.pop("as_json")
    recipe = read_recipe(config_path) if config_path else {}
    config = build_config(recipe, given_flags(kwargs), recipe_name=str(config_path or "the recipe"),
                          checks=_model_problems)
    hardware = _hardware(config, **hardware_flags)
    if trace:
        from lstune.train.trace import trace_estimate

        result = trace_estimate(config, hardware)
    else:
        from lstune.estimate.preset_facts import preset_spec
        from lstune.train.plan import plan

        # The run's plan: train's refusals, then the estimate; a preset's config and counts from the kept facts.
        result = plan(config, hardware, spec=preset_spec(config)).estimate
    from lstune.estimate.prediction import sp_report

    sequence_parallel = sp_report(config, hardware)
    if as_json:
        import json

        typer.echo(json.dumps({**result.to_dict(), "sequence_parallel": sequence_parallel}, indent=1))
        return 0
    if trace:
        _render(result.estimate)
        _render_trace(result)
    else:
        _render(result)
    if sequence_parallel is not None:
        _render_sequence_parallel(sequence_parallel)
    return 0


def _render_sequence_parallel(report: dict) -> None:
    """The SP split, one rank's traffic per step at the link rates, METP's MLP vs ZeRO-3 + tiled MLP (predicted)."""
    from lstune.cli.render import console, human_bytes

    t = report["traffic"]
    line = (f"sequence parallelism (predicted; NVLink 450 GB/s inside a node, 50 GB/s across): Ulysses {t['ulysses']} × "
            f"ring {t['ring']}; per rank and step: all-to-alls {human_bytes(t['ulysses_bytes'])} (~{t['ulysses_s']:.0f} s, "
            "not overlapped)")
    if t["ring"] > 1:
        line += (f", ring K/V {human_bytes(t['ring_bytes'])} (~{t['ring_s']:.0f} s, "
                 + ("all-gathered per attention chunk, not overlapped)" if t.get("ring_gathered") else
                    "hidden under the hops' attention)" if t["ring_overlap"] else "longer than the hops' attention)"))
    lines = [line]
    if t["metp_bytes"]:
        lines[0] += f", METP MLP shards {human_bytes(t['metp_bytes'])} (~{t['metp_s']:.0f} s)"
    mlp = report.get("mlp")
    if mlp:
        lines.append(f"MLP per layer and rank (predicted), METP vs ZeRO-3 + tiled MLP: training state held "
                     f"{human_bytes(mlp['metp_weights'])} vs {human_bytes(mlp['zero3_weights'])}; working set at the "
                     f"layer's backward peak {human_bytes(mlp['metp_peak'])} vs {human_bytes(mlp['zero3_peak'])}; moved "
                     f"per micro-batch {human_bytes(mlp['metp_moved'])} vs {human_bytes(mlp['zero3_moved'])} "
                     "(METP Table 1)")
    for line in lines:
        console().print(line)


def _render_trace(report) -> None:
    from lstune.cli.render import console, human_bytes

    t, analytic = report.trace, report.comparable.device_peak_bytes
    diff = (analytic - t.device_peak_bytes) / max(t.device_peak_bytes, 1)
    console().print(
        f"trace (fake tensors, {t.seconds:.0f} s; one rank, {t.seq_len:,} local tokens, {t.layers} layers, loss head "
        f"{t.loss_backend}) of the plan above — the step as it runs on this CPU (ALST loss tiles, not Liger; no "
        f"CUDA context): device peak [bold]{human_bytes(t.device_peak_bytes)}[/bold], the plan's estimate "
        f"{human_bytes(analytic)} ({diff:+.1%}); weights {human_bytes(t.parameter_bytes)}, gradients "
        f"{human_bytes(t.gradient_bytes)}, optimizer {human_bytes(t.optimizer_bytes)}; host {human_bytes(t.host_peak_bytes)}; "
        f"checkpoints {t.checkpoint_bytes_per_token_layer:,} B per token per layer ({t.residual_dtype})"
    )
    # The plan above is the traced step's (Cluster.traced): its verdict and longest length are not the GPU run's.
    console().print("the verdict, longest length and step above are those of the step the trace runs (no Liger, no "
                    "fused norms); `lstune estimate` without --trace gives the run's own (its longest may be longer)")


def _model_problems(config) -> list[str]:
    """The model must resolve (its config is all the estimate reads); the data source is not needed."""
    from lstune.errors import UserError
    from lstune.models.loading import resolve_source

    try:
        resolve_source(config.model.name)
    except UserError as exc:
        return exc.problems
    return []


def _hardware(config, *, gpu, device_mem, host_mem, nodes):
    from lstune.config.parse import parse_bytes, parse_int
    from lstune.errors import ConfigError
    from lstune.estimate.hardware import resolve_hardware

    problems, values = [], {}
    for flag, raw, parser in (("--device-mem", device_mem, parse_bytes), ("--host-mem", host_mem, parse_bytes),
                              ("--nodes", nodes, lambda v: parse_int(v, minimum=1))):
        if raw is None:
            continue
        try:
            values[flag] = parser(raw)
        except ValueError as exc:
            problems.append(f"{flag} {raw!r} {exc}.")
    if problems:
        raise ConfigError(problems)
    return resolve_hardware(gpu=gpu, device_mem=values.get("--device-mem"), host_mem=values.get("--host-mem"),
                            gpus=config.parallel.gpus, nodes=values.get("--nodes", 1))


def _render(e) -> None:
    from rich.table import Table

    from lstune.cli.render import console, human_bytes
    from lstune.config.parse import format_length

    con, hw, b = console(), e.hardware, e.breakdown
    dp = hw.world_size // e.sp
    con.print(f"[bold]{e.model}[/bold] at {format_length(e.seq_len)} tokens: SP {e.sp} × DP {dp} on "
              f"{hw.nodes} × {hw.gpus} {hw.device.name} ({hw.source}); host {human_bytes(hw.host_bytes)} per node "
              f"({hw.host_source}), {human_bytes(e.host_capacity)} of it usable (the rest kept for the OS)")
    d = b.dtypes
    con.print(f"engine: {e.engine.describe()}; dtypes: frozen {_dt(d['frozen'])}, trainable {_dt(d['trainable'])}, "
              f"residual stream {_dt(d['residual'])}, activations {_dt(d['act'])}")
    p = e.params
    con.print(f"parameters: {p.frozen:,} frozen, {p.trainable:,} trainable; checkpoints "
              f"{b.checkpoint_bytes_per_token_layer:,} B per token per layer"
              + (f", attention's output kept beside them: {b.attention_saved_bytes_per_token_layer:,} B per token per "
                 f"layer ({b.attention_saved_layers} layers; not recomputed)" if b.attention_saved_layers else
                 ", attention recomputed in backward")
              + f"; the training state a checkpoint saves takes at least {human_bytes(e.saved_checkpoint_min_bytes)} "
              "of disk")
    if e.memory_choice is not None:
        con.print(f"memory: {e.memory_choice.describe()}")
    table = Table(title=f"per rank (peak in the {b.phase})", title_justify="left")
    for column, justify in (("", "left"), ("device", "right"), ("host", "right"), ("", "left")):
        table.add_column(column, justify=justify)
    for item in b.items:
        table.add_row(item.name, _bytes(item.device), _bytes(item.host), item.detail)
    table.add_row("[bold]total[/bold]", human_bytes(e.device_peak_bytes), human_bytes(b.host_peak),
                  f"host per node: {human_bytes(e.host_peak_bytes)} ({hw.gpus} ranks)")
    m = e.margin
    table.add_row("capacity", human_bytes(e.device_capacity), human_bytes(e.host_capacity),
                  f"left: device {human_bytes(e.device_capacity - e.device_peak_bytes)}, "
                  f"host {human_bytes(e.host_capacity - e.host_peak_bytes)}")
    table.add_row("margin a fit keeps", human_bytes(m.device), human_bytes(m.host),
                  f"{m.device_share:.0%} of the device, {m.host_share:.0%} of the usable host (docs/estimate.md)")
    con.print(table)
    colour = "green" if e.fits else "red"
    con.print(f"verdict: [{colour}]{e.verdict()}[/{colour}]")
    con.print(f"longest sequence that fits this configuration: [bold]{format_length(e.longest_seq_len)}[/bold]"
              if e.longest_seq_len else "longest sequence that fits: none (even 1K tokens do not fit)")
    con.print(f"step (predicted): {e.flops.hardware:.3g} FLOPs run ({e.flops.model:.3g} model FLOPs), "
              f"~{e.step_seconds:,.1f} s, ~{e.tokens_per_second:,.0f} tokens/s; MFU {e.mfu:.1%} (model FLOPs), "
              f"HFU {e.hfu:.1%} (recompute counted) of the {hw.device.peak_tflops:g} TFLOP/s bf16 peak")
    if e.ideal_seconds:
        run, bare = e.ideal_seconds
        con.print(f"  × ideal (the step's kernels alone at {hw.device.name}'s kernel rates): "
                  f"{e.step_seconds / run:.2f} × with recompute ({run:,.1f} s), "
                  f"{e.step_seconds / bare:.2f} × without ({bare:,.1f} s)")
    c = e.copies
    if c.checkpoint_bytes or c.chunk_out_bytes:
        chunks = (f"; attention chunks {human_bytes(c.chunk_out_bytes)} out, {human_bytes(c.chunk_in_bytes)} in"
                  f" ({'hidden under attention' if not c.exposed_seconds else f'~{c.exposed_seconds:,.1f} s not hidden'})"
                  if c.chunk_out_bytes else "")
        con.print(f"host copies per step: checkpoints {human_bytes(c.checkpoint_bytes)}{chunks}")
    for note in e.notes:
        con.print(f"[yellow]note[/yellow]: {note}")
    if e.suggestions:
        _render_suggestions(con, e, human_bytes)


def _render_suggestions(con, e, human_bytes) -> None:
    from rich.table import Table

    fits = any(s.fits for s in e.suggestions)
    table = Table(title="changes that would fit" if fits else "closest changes (none fits)", title_justify="left")
    for column in ("change", "device peak", "host peak", "step time", "fits"):
        table.add_column(column, justify="left" if column == "change" else "right")
    for s in e.suggestions:
        table.add_row(s.flags, human_bytes(s.device_peak_bytes), human_bytes(s.host_peak_bytes),
                      f"{s.step_seconds:,.1f} s", "yes" if s.fits else "no")
    con.print(table)


def _bytes(n: int) -> str:
    from lstune.cli.render import human_bytes

    return human_bytes(n) if n else "-"


def _dt(nbytes: int) -> str:
    return {2: "bf16", 4: "fp32"}.get(nbytes, f"{nbytes} B")
