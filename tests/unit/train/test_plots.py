"""metrics.png from metrics.jsonl: drawn while a run writes (a cut last line), never over a file lstune did not write."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lstune.errors import UserError
from lstune.train.plots import PLOT_FILE, draw, plot_run


def _write_metrics(folder, steps=6, cut_tail=True):
    lines = []
    for s in range(1, steps + 1):
        record = {"step": s, "loss": 5.0 / s, "tokens_seen": 256 * s, "tokens_per_s": 1000.0 + s,
                  "peak_device_mem_bytes": 2**30, "host_rss_bytes": 2**29}
        if s % 3 == 0:
            record.update(eval_loss=4.0 / s, eval_ppl=1.0)
        lines.append(json.dumps(record))
    text = "\n".join(lines) + "\n" + ('{"step": 7, "lo' if cut_tail else "")
    (folder / "metrics.jsonl").write_text(text)


def test_plot_has_four_labelled_panels_with_both_losses(tmp_path):
    _write_metrics(tmp_path)
    path = plot_run(tmp_path)
    assert path == tmp_path / PLOT_FILE and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from lstune.train.plots import read_metrics

    figure = draw(read_metrics(tmp_path / "metrics.jsonl"))
    axes = figure.axes
    assert [ax.get_xlabel() for ax in axes] == ["step", "tokens seen", "step", "step"]
    assert [ax.get_ylabel() for ax in axes] == ["loss (nats per token)", "loss (nats per token)", "tokens / s", "GiB"]
    labels = [line.get_label() for line in axes[0].get_lines()]
    assert labels == ["training loss", "validation loss"]
    assert list(axes[0].get_lines()[1].get_xdata()) == [3, 6]


def test_refuses_a_foreign_png_and_missing_metrics(tmp_path):
    with pytest.raises(UserError, match="no metrics.jsonl"):
        plot_run(tmp_path)
    _write_metrics(tmp_path)
    (tmp_path / PLOT_FILE).write_bytes(b"mine")
    with pytest.raises(UserError, match="did not write it"):
        plot_run(tmp_path)
    assert (tmp_path / PLOT_FILE).read_bytes() == b"mine"
    assert plot_run(tmp_path, tmp_path / "other.png").is_file()


def test_an_out_file_lstune_did_not_write_is_never_replaced(tmp_path):
    _write_metrics(tmp_path)
    mine = tmp_path / "notes.png"
    mine.write_bytes(b"\x89PNG\r\n\x1a\n a user's own picture")
    metrics = (tmp_path / "metrics.jsonl").read_bytes()
    for target in (mine, tmp_path / "metrics.jsonl"):
        with pytest.raises(UserError, match="did not write it"):
            plot_run(tmp_path, target)
    assert mine.read_bytes().endswith(b"own picture") and (tmp_path / "metrics.jsonl").read_bytes() == metrics
    ours = plot_run(tmp_path, tmp_path / "plot.png")
    assert plot_run(tmp_path, ours) == ours  # lstune's own plot (its PNG mark) is replaced on request
    with pytest.raises(UserError, match="is a folder"):
        plot_run(tmp_path, tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        plot_run(tmp_path, tmp_path / "missing" / "plot.png")


def test_records_missing_fields_leave_gaps_instead_of_failing(tmp_path):
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0, "tokens_per_s": None, "host_rss_bytes": 2**30},
             {"step": "3", "loss": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    path = plot_run(tmp_path)
    axes = draw([{"step": 1, "loss": 3.0}]).axes
    assert path.is_file() and axes[2].get_ylim() == (0, 1.15)
    assert list(axes[0].get_lines()[0].get_ydata()) == [3.0]


def test_cli_imports_no_matplotlib():
    code = "import sys, lstune.cli.app; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_passkey_accuracy_gets_its_own_axis_on_the_step_panel(tmp_path):
    from lstune.train.plots import read_metrics

    _write_metrics(tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    for record in records:
        if "eval_loss" in record:
            record["eval_passkey_acc"] = record["step"] / 8
    axes = draw(records).axes
    accuracy = [ax for ax in axes if ax.get_ylabel() == "passkey accuracy (%)"]
    assert len(accuracy) == 1 and accuracy[0].get_ylim() == (-5, 105)
    assert list(accuracy[0].get_lines()[0].get_xdata()) == [3, 6]
    assert list(accuracy[0].get_lines()[0].get_ydata()) == [37.5, 75.0]
    assert len(draw(read_metrics(tmp_path / "metrics.jsonl")).axes) == 4, "no accuracy axis without accuracy"
