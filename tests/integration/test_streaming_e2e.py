"""`lstune train --data-streaming`: trains from a stream, resumes exactly, refuses what it cannot do exactly."""

from __future__ import annotations

import re

import pytest

from tests.integration.conftest import TINY_MODEL, read_metrics

def _flat(text: str) -> str:
    """The output without the summary table's borders and line breaks (its cells wrap at the terminal's width)."""
    return re.sub(r"[│┃\s]+", " ", text)


STREAM = ["--data-streaming", "--data-shuffle-buffer", "4", "--pack", "--seq-len", "128"]


def test_a_streamed_run_resumes_as_if_uninterrupted(cli, tmp_path, text_data):
    """Steps 4-6 after a resume read the samples the uninterrupted run read (their losses are equal)."""
    common = [*TINY_MODEL, "--data", text_data, *STREAM, "--max-steps", "6", "--seed", "3"]
    full, part = tmp_path / "full", tmp_path / "part"
    result = cli("train", *common, "--output-dir", full)
    assert result.code == 0, result.err
    assert "streaming json file" in _flat(result.out) and "shuffle buffer 4 records" in _flat(result.out)
    first = cli("train", *common, "--save-every", "3", "--stop-at-step", "3", "--output-dir", part)
    assert first.code == 0, first.err
    resumed = cli("train", *common, "--output-dir", part, "--resume")
    assert resumed.code == 0, resumed.err
    losses = [m["loss"] for m in read_metrics(full)]
    assert len(losses) == 6 and len(set(losses)) > 1
    assert [m["loss"] for m in read_metrics(part)] == pytest.approx(losses, rel=1e-6)
    # The checkpoint records the stream's order: a resume under another seed would read another stream, refused.
    reseeded = cli("train", *common[:-1], "4", "--output-dir", part, "--resume")
    assert reseeded.code == 2 and "--seed is 4 but" in reseeded.err and "resume with --seed 3" in reseeded.err
    # Its count of consumed samples is a position in the stream: resuming without streaming is refused.
    switched = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "8", "--output-dir", part, "--resume")
    assert switched.code == 2 and "resume with --data-streaming, or start a new run" in switched.err


def test_streaming_without_max_steps_or_with_eval_split_is_refused(cli, tmp_path, text_data):
    result = cli("train", *TINY_MODEL, "--data", text_data, "--data-streaming", "--output-dir", tmp_path / "run")
    assert result.code == 2 and "--data-streaming needs --max-steps" in result.err
    result = cli("train", *TINY_MODEL, "--data", text_data, "--data-streaming", "--max-steps", "2",
                 "--eval-split", "0.1", "--output-dir", tmp_path / "run")
    assert result.code == 2 and "With --data-streaming give --eval-data SOURCE" in result.err
    assert "Traceback" not in result.err and not (tmp_path / "run").exists()


def test_lstune_data_previews_a_stream(cli, text_data):
    result = cli("data", *TINY_MODEL, "--data", text_data, *STREAM)
    assert result.code == 0, result.err
    assert "streaming json file" in _flat(result.out) and "· samples" not in result.out
    assert "Document" in result.out


def test_two_processes_read_their_shares_of_the_stream(cli, tmp_path, text_data):
    """SP=2 on 2 gloo processes reads global samples 0, 1 (rank 0, rank 1) per step, then the SP group works through
    both: the numbers of one process accumulating 2 samples of the same stream."""
    from tests.integration.conftest import run_subprocess

    common = [*TINY_MODEL, "--data", text_data, *STREAM, "--max-steps", "2"]
    proc = run_subprocess("train", *common, "--gpus", "2", "--sp", "2", "--output-dir", tmp_path / "sp2", timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one = cli("train", *common, "--grad-accum", "2", "--output-dir", tmp_path / "one")
    assert one.code == 0, one.err
    sp2, one = read_metrics(tmp_path / "sp2"), read_metrics(tmp_path / "one")
    assert [m["label_tokens"] for m in sp2] == [m["label_tokens"] for m in one]
    assert [m["loss"] for m in sp2] == pytest.approx([m["loss"] for m in one], rel=1e-5)
