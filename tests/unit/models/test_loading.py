"""Model sources: an empty name, a typo of a preset, and a hub that cannot be reached (answered at once, not
after huggingface_hub's retries)."""

from __future__ import annotations

import time

import pytest

from lstune.errors import ModelError
from lstune.models.loading import resolve_model, resolve_source


def test_an_empty_model_name_is_not_a_folder():
    with pytest.raises(ModelError, match="--model is empty; give a preset"):
        resolve_source("")


def test_an_unknown_name_close_to_a_preset_suggests_it():
    with pytest.raises(ModelError, match="Did you mean 'tiny-llama'"):
        resolve_source("./tiny-lama")  # a path that does not exist: no hub lookup at all


@pytest.fixture
def unreachable_hub(tmp_path, monkeypatch):
    """A hub at a port nothing listens on (connection refused at once) and an empty cache."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        "http://127.0.0.1:9/{repo_id}/resolve/{revision}/{filename}")
    import transformers  # noqa: F401  (imported before the clock starts)


def test_an_unreachable_hub_is_reported_at_once_with_the_preset_hint(unreachable_hub):
    started = time.perf_counter()
    with pytest.raises(ModelError) as info:
        resolve_model("tiny-lama")
    assert time.perf_counter() - started < 5  # huggingface_hub's own retries take ~23 s
    message = str(info.value)
    assert "could not be reached" in message and "Did you mean 'tiny-llama'?" in message, message


def test_a_cached_config_needs_no_hub(unreachable_hub, tmp_path):
    from huggingface_hub import constants

    from lstune.models.loading import ModelSource, _check_hub_reachable

    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--cached" / "refs" / "main").write_text("abc")
    assert constants.HF_HUB_CACHE == str(tmp_path / "hub")
    _check_hub_reachable(ModelSource("hub", "org/cached", "org/cached"))  # no request, no error
