"""The shared option builder: every section field is a flag of `train`, and given flags round-trip to argv."""

from __future__ import annotations

import pytest

from lstune.cli.options import section_parameters, to_argv
from lstune.config.schema import FLAT_FIELDS, flag_name


@pytest.mark.parametrize("key", list(FLAT_FIELDS))
def test_every_field_is_a_flag_in_train_help(cli_help, key):
    assert flag_name(key) in cli_help


@pytest.fixture(scope="module")
def cli_help():
    from typer.testing import CliRunner

    from lstune.cli.app import app

    result = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    return result.output


def test_help_shows_defaults_and_brackets_grouped_by_section(cli_help):
    flat = " ".join(cli_help.replace("│", " ").split())
    assert "(k = 1024). [default: 4k]" in flat and "never the full [seq, vocab] logits" in flat
    assert "[default: auto]" in flat and "[default: None]" not in flat
    panels = [title for title in ("Model", "Data", "Memory", "Parallelism", "Optimisation", "Run") if f"\n{title}:\n" in cli_help]
    assert len(panels) == 6


def test_sections_choose_the_options():
    names = [p.name for p in section_parameters(["memory"])]
    assert names == ["tiled_mlp", "tiled_loss", "mini_sequence", "checkpointing", "offload_checkpoints",
                     "host_mem_budget", "checkpoint_device_budget", "attn_chunks", "recompute_attention"]


def test_given_flags_round_trip_through_argv(tmp_path):
    """A relaunched process must see exactly the options this one was given."""
    from lstune.config.load import build_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text("lr: 1.0e-4\n")
    flags = {"seq_len": "8k", "pack": True, "checkpointing": "off", "offload_checkpoints": False, "gpus": "2",
             "resume": None}
    argv = to_argv(flags, recipe)
    assert argv == ["--config", str(recipe), "--seq-len", "8k", "--pack", "--checkpointing", "off",
                    "--no-offload-checkpoints", "--gpus", "2"]
    assert build_config({}, {k: v for k, v in flags.items()}).to_dict()["checkpointing"] is False


def test_repeated_data_round_trips_through_argv_and_the_cli():
    """--data given twice reaches the relaunched processes twice; given once it stays a plain source."""
    from typer.main import get_command
    from lstune.cli.app import app

    assert to_argv({"data": ["a.jsonl:0.7", "b/:0.3"]}) == ["--data", "a.jsonl:0.7", "--data", "b/:0.3"]
    command = get_command(app).commands["train"]
    ctx = command.make_context("train", ["--data", "x:1", "--data", "y:2"], resilient_parsing=True)
    assert ctx.params["data"] == ["x:1", "y:2"]


@pytest.mark.parametrize(
    ("root", "front"),
    [
        ({"debug": False, "log_level": "warning"}, ["--log-level", "warning"]),
        ({"debug": True, "log_level": "info"}, ["--debug", "--log-level", "info"]),
    ],
)
def test_relaunched_processes_get_debug_and_log_level(root, front):
    """The launched processes run this command again: with its --debug and --log-level, before `train`."""
    from types import SimpleNamespace

    from lstune.cli.train import _relaunch_argv

    ctx = SimpleNamespace(find_root=lambda: SimpleNamespace(params=root))
    assert _relaunch_argv(ctx, {"seq_len": 512}, None) == [*front, "train", "--seq-len", "512"]
