"""`lstune train` checks the output folder's disk before it trains: the estimate's least bytes of a checkpoint are
a true lower bound of what a save writes (AdamW on one device, full and LoRA; ZeRO-3 is checked in
test_train_distributed), a disk without room for one is refused before the weights load (exit 2), --force trains
anyway with the warning, and what --overwrite removes counts as free."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import lstune.train.disk_space as disk_space
from lstune.estimate.memory import saved_checkpoint_min_bytes
from tests.integration.conftest import TINY


def _trainable(out: str) -> int:
    return int(re.search(r"^\s*trainable parameters\s+([\d,]+)\s*$", out, re.M).group(1).replace(",", ""))


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _need(trainable: int) -> int:
    return saved_checkpoint_min_bytes(SimpleNamespace(trainable=trainable))


@pytest.mark.parametrize("lora", [[], ["--lora-r", "8"]])
def test_a_checkpoint_takes_at_least_the_estimates_bytes_and_not_much_more(cli, tmp_path, lora):
    result = cli("train", *TINY, *lora, "--max-steps", "1", "--output-dir", tmp_path / "o")
    assert result.code == 0, result.err[-2000:]
    need, saved = _need(_trainable(result.out)), _bytes(tmp_path / "o" / "checkpoint-1")
    assert need <= saved <= 1.15 * need, (need, saved)


def test_a_disk_without_room_for_one_checkpoint_is_refused_before_the_weights_load(cli, tmp_path, monkeypatch):
    monkeypatch.setattr(disk_space, "free_bytes", lambda path: 1_000_000)
    result = cli("train", *TINY, "--lora-r", "0", "--max-steps", "1", "--output-dir", tmp_path / "o")
    assert result.code == 2 and "Traceback" not in result.err + result.out, result.err[-2000:]
    for words in (f"{str(tmp_path / 'o')!r} has 1.0 MiB free on its disk", "trainable parameters",
                  "first save would fail", "--force"):
        assert words in result.err, (words, result.err)
    assert not list((tmp_path / "o").glob("checkpoint-*")) and not (tmp_path / "o" / "metrics.jsonl").exists()
    assert "self-check" not in result.out + result.err  # refused before the model was built


def test_force_trains_anyway_and_says_why_it_may_not_save(cli, tmp_path, monkeypatch):
    monkeypatch.setattr(disk_space, "free_bytes", lambda path: 1_000_000)
    result = cli("train", *TINY, "--lora-r", "0", "--max-steps", "1", "--force", "--output-dir", tmp_path / "o")
    assert result.code == 0, result.err[-2000:]
    assert "warning (--force)" in result.out + result.err and (tmp_path / "o" / "checkpoint-1").is_dir()


def test_what_overwrite_removes_counts_as_free(cli, tmp_path, monkeypatch):
    first = cli("train", *TINY, "--lora-r", "0", "--max-steps", "1", "--output-dir", tmp_path / "o")
    assert first.code == 0, first.err[-2000:]
    need = _need(_trainable(first.out))
    monkeypatch.setattr(disk_space, "free_bytes", lambda path: need // 2)  # the earlier run's checkpoint frees it
    again = cli("train", *TINY, "--lora-r", "0", "--max-steps", "1", "--overwrite", "--output-dir", tmp_path / "o")
    assert again.code == 0, again.err[-2000:]
    elsewhere = cli("train", *TINY, "--lora-r", "0", "--max-steps", "1", "--output-dir", tmp_path / "new")
    assert elsewhere.code == 2 and "first save would fail" in elsewhere.err, elsewhere.err[-2000:]


def test_room_for_fewer_checkpoints_than_the_run_keeps_at_once_is_said_at_the_start(cli, tmp_path, monkeypatch):
    probe = cli("train", *TINY, "--lora-r", "0", "--max-steps", "1", "--output-dir", tmp_path / "probe")
    need = _need(_trainable(probe.out))
    monkeypatch.setattr(disk_space, "free_bytes", lambda path: need * 3 // 2)  # room for one
    once = cli("train", *TINY, "--lora-r", "0", "--max-steps", "1", "--output-dir", tmp_path / "once")
    assert once.code == 0 and "warning: --output-dir" not in once.out + once.err
    more = cli("train", *TINY, "--lora-r", "0", "--max-steps", "3", "--save-every", "1", "--output-dir",
               tmp_path / "more")
    assert more.code == 0, more.err[-2000:]  # a warning, not a refusal: the disk is not really full here
    words = " ".join((more.out + more.err).split())
    assert "it saves 3 checkpoint(s)" in words and "--keep-last 2 keeps up to 3 at once" in words
    assert "its final model takes at least 1.6 MiB more at the end" in words  # 820,352 parameters, 16-bit at least
