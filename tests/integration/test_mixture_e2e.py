"""`lstune train --data a:0.7 --data b:0.3`: trains, reports realised proportions, resumes exactly."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import TINY_MODEL, read_metrics


@pytest.fixture
def two_sources(tmp_path, text_data):
    other = tmp_path / "chat"
    other.mkdir()
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "yes " * (i + 2)}]}
            for i in range(4)]
    (other / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [f"{text_data}:0.7", f"{other}:0.3"]


def data_flags(sources):
    return [part for s in sources for part in ("--data", s)]


def test_mixture_trains_and_reports_its_shares(cli, tmp_path, two_sources):
    out = tmp_path / "run"
    result = cli("train", *TINY_MODEL, *data_flags(two_sources), "--max-steps", "4", "--output-dir", out)
    assert result.code == 0, result.err
    assert "mixture of 2 sources" in result.out
    assert "data mixture realised over 4 samples:" in result.out
    assert len(read_metrics(out)) == 4
    # The resolved config is itself a recipe that reruns the same mixture.
    from lstune.config.load import build_config, read_recipe
    from lstune.train.outputs import CONFIG_FILE

    recipe = read_recipe(out / CONFIG_FILE)
    recipe.pop("output_dir")  # that folder now holds this run
    assert build_config(recipe, {}).data.source == two_sources


def test_mixture_resume_equals_uninterrupted(cli, tmp_path, two_sources):
    common = [*TINY_MODEL, *data_flags(two_sources), "--max-steps", "8", "--seed", "3"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert cli("train", *common, "--output-dir", full).code == 0
    first = cli("train", *common, "--save-every", "4", "--stop-at-step", "4", "--output-dir", part)
    assert first.code == 0, first.err
    resumed = cli("train", *common, "--output-dir", part, "--resume")
    assert resumed.code == 0, resumed.err
    assert [m["loss"] for m in read_metrics(part)] == pytest.approx([m["loss"] for m in read_metrics(full)], rel=1e-6)


def test_bad_mixture_weights_are_refused(cli, tmp_path, text_data):
    result = cli("train", *TINY_MODEL, "--data", f"{text_data}:0.7", "--data", "builtin:passkey", "--output-dir",
                 tmp_path / "run")
    assert result.code == 2 and "give every source of a mixture a weight" in result.err
    result = cli("train", *TINY_MODEL, "--data", f"{text_data}:-1", "--data", "builtin:passkey:1", "--output-dir",
                 tmp_path / "run")
    assert result.code == 2 and "has the weight -1; a mixture weight is a number > 0" in result.err
    assert "Traceback" not in result.err and not (tmp_path / "run").exists()
