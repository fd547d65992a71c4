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
