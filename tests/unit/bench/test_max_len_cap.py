"""A search that reaches --max-len says so (it is the cap, not the configuration's longest), the measurement at
--seq-len serves as the search's first probe, and longest.png's labels do not overlap (issue 38)."""

from __future__ import annotations

import pytest

from lstune.bench.search import CAP_NOTE, find_max_len, longest_text
from lstune.config.parse import format_length
from tests.unit.bench.test_outputs import _bench, fake_trials  # noqa: F401 (a fixture)


def _probe(limit: int):
    return lambda n: {"id": n, "seq_len": n, "outcome": "ok" if n <= limit else "oom"}


def test_a_search_ended_by_the_cap_is_marked_and_worded_so():
    capped = find_max_len(_probe(10**9), start=512, step=512, max_len=2048).to_dict()
    assert capped["capped"] and capped["longest_ok"] == 2048
    assert longest_text(capped, format_length) == f"≥ 2k ({CAP_NOTE})"
    found = find_max_len(_probe(1500), start=512, step=512, max_len=2048).to_dict()
    assert not found["capped"] and longest_text(found, format_length) == "1k"
    assert not find_max_len(_probe(10**9), start=512, step=512).to_dict()["capped"]


def test_the_measurement_is_the_searchs_first_probe_and_the_report_names_the_cap(tmp_path, fake_trials):  # noqa: F811
    out = tmp_path / "b"
    result = _bench(out, "256", warmup="1", find_max_len=True, len_step="256", max_len="1k", rungs="hf,lstune")
    steps = [job for job in fake_trials if job.kind == "step"]
    # Per rung: the measurement at 256 (two steps: reused by the search), then 512 and 1K searched.
    assert [(job.rung, job.seq_len) for job in steps] == [("hf", 256), ("hf", 512), ("hf", 1024),
                                                           ("lstune", 256), ("lstune", 512), ("lstune", 1024)]
    for search in result.searches.values():
        assert search["capped"] and search["longest_ok"] == 1024 and len(search["trials"]) == 3
    markdown = (out / "bench.md").read_text()
    assert f"≥ 1k ({CAP_NOTE})" in markdown and "reached --max-len" not in markdown
    from PIL import Image  # matplotlib's own dependency

    assert Image.open(out / "longest.png").size[0] >= 600


def test_a_one_step_measurement_is_not_taken_for_the_two_steps_a_probe_runs(tmp_path, fake_trials):  # noqa: F811
    _bench(tmp_path / "b", "256", find_max_len=True, len_step="256", max_len="512", rungs="hf")
    steps = [(job.seq_len, job.warmup, job.steps) for job in fake_trials if job.kind == "step"]
    assert steps == [(256, 0, 1), (256, 1, 1), (512, 1, 1)]


def test_longest_png_labels_do_not_overlap(tmp_path):
    """Every text drawn on the bars and under them keeps clear of its neighbours."""
    import matplotlib

    matplotlib.use("Agg")
    from types import SimpleNamespace

    from lstune.bench.plots import _longest

    names = ["hf", "tiled_loss", "tiled_mlp", "offload", "mini_seq", "lstune"]
    labels = ["plain HF", "+ tiled loss", "+ tiled MLP", "+ offloaded checkpoints", "+ mini-sequence",
              "lstune (these flags)"]
    result = SimpleNamespace(
        searches={n: {"longest_ok": 2048, "shortest_failed": None, "len_step": 256, "capped": True} for n in names},
        rungs=[{"name": n, "label": lab, "config": {"lora_r": 0, "model": "tiny-llama"}} for n, lab in zip(names, labels)],
        fingerprint={"gpus": []},
    )
    fig = _longest(result)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    texts = [t for t in ax.texts] + list(ax.get_xticklabels())
    boxes = [t.get_window_extent(renderer) for t in texts if t.get_text()]
    overlaps = [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]
    assert not overlaps
    assert all(fig.bbox.contains(b.x0, b.y0) and fig.bbox.contains(b.x1, b.y1) for b in boxes)


def test_a_loaded_machine_is_noted_since_step_times_follow_its_load():
    from lstune.bench.run import load_notes

    fp = {"cpu_cores": 2, "cpu_cores_usable": 2}
    assert load_notes([1.0, 1.5], fp) == [] and load_notes([None, None], fp) == []
    note = load_notes([9.2, 15.8], fp)[0]
    assert "load average 9.2 to 15.8 on 2 usable cores" in note and "idle machine" in note
