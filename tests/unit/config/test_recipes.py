"""Every shipped recipe is valid, names a known model, and documents how it is run."""

from __future__ import annotations

from pathlib import Path

import pytest

from lstune.config.load import build_config, read_recipe
from lstune.models.loading import resolve_source

RECIPES = sorted((Path(__file__).resolve().parents[3] / "recipes").rglob("*.yaml"))


def test_there_are_recipes():
    assert RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_recipe_is_valid_and_documented(path):
    config = build_config(read_recipe(path), recipe_name=str(path))
    resolve_source(config.model.name)
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    text = "\n".join(header)
    assert f"lstune train --config recipes/{path.relative_to(path.parents[1])}" in text
    assert "Hardware:" in text and "Measured" in text


def test_recipes_ship_with_the_package_and_are_found_by_name(tmp_path, monkeypatch):
    """lstune/recipes is the package's view of recipes/ (package data: pyproject's package-data lists it), and
    `--config` takes a shipped recipe by name from any folder."""
    from lstune.config.load import RECIPES_DIR, find_recipe, shipped_recipes

    assert sorted(p.resolve() for p in shipped_recipes().values()) == sorted(p.resolve() for p in RECIPES)
    assert RECIPES_DIR.parent.name == "lstune"
    pyproject = (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
    assert '"recipes/*/*.yaml"' in pyproject
    monkeypatch.chdir(tmp_path)
    demo = shipped_recipes()["tiny-llama/4k-cpu-demo"]
    for name in ("tiny-llama/4k-cpu-demo", "tiny-llama/4k-cpu-demo.yaml", "recipes/tiny-llama/4k-cpu-demo.yaml"):
        assert find_recipe(name) == demo
        assert read_recipe(name)["model"] == "tiny-llama"
    assert find_recipe("nope/x") == Path("nope/x")


def test_lstune_recipes_lists_every_recipe(capsys):
    from lstune.cli.app import main
    from lstune.config.load import shipped_recipes

    with pytest.raises(SystemExit) as exit_:
        main(["recipes"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in shipped_recipes())


@pytest.mark.parametrize("path", [p for p in RECIPES if "8b" in p.parent.name],
                         ids=lambda p: str(p.relative_to(p.parents[1])))
def test_real_model_recipes_say_what_access_they_need(path):
    """A gated hub model needs its licence accepted and HF_TOKEN; the random-init preset tries the shapes offline."""
    config = build_config(read_recipe(path), recipe_name=str(path))
    text = path.read_text()
    preset = config.model.name.split("/")[-1].lower()
    assert f"--model {preset}" in text, "how to try the shapes with the preset"
    if config.model.name.startswith("meta-llama/"):
        assert "HF_TOKEN" in text and "Community License" in text and "gated" in text
