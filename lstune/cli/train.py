"""`lstune train`: parse flags (built from the config sections' fields), validate, run, render."""

from __future__ import annotations

import inspect
from typing import Any

import typer

from lstune.cli.options import config_parameter, given_flags, section_parameters, to_argv

HELP = (
    "Fine-tune a causal LM on long sequences.\n\n"
    "Flags override the recipe given with --config; every config problem is reported at once, before any "
    "model or data is loaded. The demo: lstune train --config recipes/tiny-llama/4k-cpu-demo.yaml."
)


def register(app: typer.Typer) -> None:
    command = _train_command
    command.__signature__ = _signature()
    app.command("train", help=HELP, no_args_is_help=False)(command)


def _signature() -> inspect.Signature:
    dry_run = inspect.Parameter(
        "dry_run", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
        default=typer.Option(False, "--dry-run", help=(
            "Check the config as the run does before loading anything (the model's config included: SP layout, "
            "attention, 4-bit weights), print the resolved config and exit; loads no weights, writes nothing.")),
    )
    ctx = inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
    return inspect.Signature([ctx, config_parameter(), dry_run, *section_parameters()])


def _train_command(**kwargs: Any) -> int:
    from lstune.cli.render import RichReporter, console, print_config, print_summary
    from lstune.config.load import build_config, read_recipe
    from lstune.train.preflight import preflight_problems

    ctx = kwargs.pop("ctx")
    config_path = kwargs.pop("config")
    dry_run = kwargs.pop("dry_run")
    flags = given_flags(kwargs)
    recipe = read_recipe(config_path) if config_path else {}
    name = str(config_path) if config_path else "the recipe"
    config = build_config(recipe, flags, recipe_name=name, checks=lambda c: _data_given(c) + preflight_problems(c))
    if dry_run:
        # The run's own refusals from the config alone (it makes them before loading anything): the dry run's
        # verdict is the run's. Only once the cheap checks above pass: this reads the model's config.
        refuse(model_problems(config))
        print_config(config)
        return 0
    if _needs_launch(config):
        from lstune.parallel.launch import relaunch
        from lstune.train.preflight import check_parallel_layout

        check_parallel_layout(config)
        argv = _relaunch_argv(ctx, flags, config_path)
        return relaunch(argv, config.parallel.gpus, config.parallel.hostfile, force=config.run.force)

    from lstune.parallel.comm import close_process_group
    from lstune.train.run import train

    result = train(config, RichReporter(console(), log_every=config.run.log_every))
    if result.is_main:
        print_summary(result)
    close_process_group()  # every rank got here: end the group before the process exits (lstune.parallel.comm)
    return 130 if result.interrupted else 0


MISSING_DATA = (
    "--data is required: a JSONL/JSON/Parquet/Arrow file or folder, a save_to_disk folder or a hub dataset (or "
    "builtin:passkey, the bundled synthetic task: lstune train --config recipes/tiny-llama/4k-cpu-demo.yaml)."
)


def refuse(problems: list[str]) -> None:
    from lstune.errors import ConfigError

    if problems:
        raise ConfigError(problems)


def model_problems(config, *, device: str | None = None) -> list[str]:
    """What a run refuses from the config and the model's config alone, before any weight or data loads: the model
    resolving, the process layout (`check_parallel_layout`), attention support and --rope-scaling (train's model
    support check), 4-bit weights a random init does not have (`load_model`'s refusal). `device` ("cuda"/"cpu") is
    where the run will train; None: cuda when available. Reads the model's config (imports transformers): run it
    after the cheap checks pass. The natural home is lstune.train.preflight; it is here while that module is
    being changed elsewhere, and `lstune bench` shares it."""
    from lstune.errors import UserError
    from lstune.models.loading import resolve_model

    try:
        spec = resolve_model(config.model.name, trust_remote_code=config.model.trust_remote_code)
    except UserError as exc:
        return exc.problems
    problems = []
    for check in (_check_layout_and_positions, _check_attention, _check_weights):
        try:
            check(config, spec, device)
        except UserError as exc:
            problems.extend(exc.problems)
    return problems


def _check_layout_and_positions(config, spec, device) -> None:
    """SP must fit --gpus and the heads; --rope-scaling must fit the model's RoPE (and SP: dynamic scaling
    cannot be sharded). On a copy of the config: the run writes the scaling into a config of its own."""
    import copy

    from lstune.models.rope import apply_rope_scaling
    from lstune.parallel.dims import ParallelDims

    parallel, model = config.parallel, config.model
    if parallel.hostfile is None:
        sp = ParallelDims.for_model(parallel.gpus, parallel.sp, spec.config).sp
    else:  # the world size comes from the hostfile at launch: only a fixed degree is known here
        sp = parallel.sp if isinstance(parallel.sp, int) else 1
    apply_rope_scaling(copy.deepcopy(spec.config), model.rope_scaling, model.rope_factor, seq_len=config.data.seq_len,
                       original=model.original_max_position_embeddings, sp=sp, model_name=model.name,
                       pack=config.data.pack)


def _check_attention(config, spec, device) -> None:
    from lstune.models.attention import check_attention_support

    check_attention_support(spec.config, pack=config.data.pack, seq_len=config.data.seq_len,
                            backend=config.model.attn, device=device)


def _check_weights(config, spec, device) -> None:
    """load_model quantizes pretrained weights only; a preset (or --init random) has none to quantize."""
    from lstune.models.quant import refuse_random_4bit

    init, source = config.model.init, spec.source
    if config.model.load_in_4bit and (init == "random" or (init == "auto" and source.kind == "preset")):
        refuse_random_4bit(source.name)


def _data_given(config) -> list[str]:
    """No silent default: a run without --data (or `data:` in its recipe) would train on something not asked for."""
    return [MISSING_DATA] if config.data.source is None else []


def _relaunch_argv(ctx: typer.Context, flags: dict[str, Any], config_path) -> list[str]:
    """This command again, as each launched process runs it (with this one's --debug and --log-level)."""
    root = ctx.find_root().params
    front = ["--debug"] if root.get("debug", False) else []
    if root.get("log_level"):
        front += ["--log-level", root["log_level"]]
    return front + ["train", *to_argv(flags, config_path)]


def _needs_launch(config) -> bool:
    """--gpus N / --hostfile outside a launcher: start the processes (they run this same command)."""
    from lstune.parallel.launch import detect_launch_env

    parallel = config.parallel
    return (parallel.gpus > 1 or parallel.hostfile is not None) and detect_launch_env() is None
