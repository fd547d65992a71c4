"""The bench's output folder (lstune.bench.outputs): a file at one of the bench's names that no earlier bench wrote is
the user's and stops the bench before any trial, with or without --overwrite; links there are refused; --overwrite
replaces only what the folder's record lists, and the user's other files are never touched. Last, run_bench itself
with fake trial processes: every name it writes is recorded, and a second bench honours the record."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lstune.bench.outputs import RECORD_NAME, BenchFolder, check_folder, open_new_log
from lstune.train.atomic import write_text_new
from lstune.errors import ConfigError, UserError


def _earlier_bench(folder: Path, names: list[str]) -> None:
    """What an earlier bench left: `names` written, each recorded first, as the bench writes them."""
    bench = BenchFolder(folder, set())
    for name in names:
        bench.claim(folder / name)
        if name == "trials":
            (folder / name).mkdir(parents=True, exist_ok=True)
        else:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            write_text_new(folder / name, "the earlier bench's\n")


def _snapshot(folder: Path) -> dict[str, bytes | str]:
    return {p.relative_to(folder).as_posix(): (os.readlink(p) if p.is_symlink() else
                                               b"<dir>" if p.is_dir() else p.read_bytes())
            for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("name", ["tokens-per-s.png", "longest.png", "bench.json", "bench.md", "trials/trial-1.log",
                                  "trials/trial-12.json", "trials/trial-3.job.json", RECORD_NAME])
def test_a_users_file_at_a_bench_name_is_refused_and_left_as_it_was(tmp_path, name, overwrite):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text("mine\n")
    before = _snapshot(tmp_path)
    with pytest.raises(UserError, match=name.split("/")[-1].replace(".", r"\.")) as refused:
        check_folder(tmp_path, overwrite=overwrite)
    assert "Move them away" in str(refused.value) or "move it away" in str(refused.value)
    assert _snapshot(tmp_path) == before


def test_a_users_trials_folder_or_file_is_refused(tmp_path):
    (tmp_path / "trials").write_text("mine\n")
    with pytest.raises(UserError, match="trials"):
        check_folder(tmp_path, overwrite=True)
    (tmp_path / "trials").unlink()
    (tmp_path / "trials").mkdir()
    (tmp_path / "trials" / "notes.txt").write_text("mine\n")
    with pytest.raises(UserError, match="trials"):
        check_folder(tmp_path, overwrite=True)


def test_links_at_bench_names_are_refused_even_where_the_record_lists_them(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep\n")
    out = tmp_path / "b"
    _earlier_bench(out, ["bench.json", "bench.md", "trials", "trials/trial-1.log"])
    (out / "bench.md").unlink()
    (out / "bench.md").symlink_to(outside / "precious.txt")
    with pytest.raises(UserError, match=r"symbolic links where lstune bench writes: bench\.md"):
        check_folder(out, overwrite=True)
    (out / "bench.md").unlink()
    (out / "trials" / "trial-1.log").unlink()
    (out / "trials" / "trial-1.log").symlink_to(outside / "precious.txt")
    with pytest.raises(UserError, match="trials/trial-1.log"):
        check_folder(out, overwrite=True)
    assert (outside / "precious.txt").read_text() == "keep\n"


def test_an_earlier_benchs_files_need_overwrite(tmp_path):
    _earlier_bench(tmp_path, ["bench.json", "bench.md", "tokens-per-s.png", "trials", "trials/trial-1.log"])
    with pytest.raises(ConfigError, match="of an earlier bench; add --overwrite"):
        check_folder(tmp_path, overwrite=False)
    folder = check_folder(tmp_path, overwrite=True)
    assert folder.previous == {"bench.json", "bench.md", "tokens-per-s.png", "trials", "trials/trial-1.log"}


def test_a_folder_holding_only_other_files_or_a_spent_record_needs_no_overwrite(tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    _earlier_bench(tmp_path, ["bench.json"])
    (tmp_path / "bench.json").unlink()  # the user removed the earlier bench's files, not its record
    assert check_folder(tmp_path, overwrite=False).previous == set()


def test_overwrite_removes_only_the_earlier_benchs_names_this_one_did_not_write(tmp_path):
    _earlier_bench(tmp_path, ["bench.json", "longest.png", "trials", "trials/trial-1.log", "trials/trial-2.log",
                              "trials/trial-3.json"])
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "trials" / "notes.txt").write_text("mine too\n")
    folder = check_folder(tmp_path, overwrite=True)
    folder.claim(tmp_path / "trials", tmp_path / "trials" / "trial-1.log", tmp_path / "bench.json")
    folder.clear_previous()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "bench.json", RECORD_NAME, "notes.txt", "trials", "trials/notes.txt", "trials/trial-1.log"]
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
    record = json.loads((tmp_path / RECORD_NAME).read_text())["entries"]
    assert record == ["bench.json", "trials", "trials/trial-1.log"]


def test_a_record_naming_anything_but_the_benchs_own_names_removes_nothing_else(tmp_path):
    (tmp_path / "victim.txt").write_text("mine\n")
    out = tmp_path / "b"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    (out / RECORD_NAME).write_text(json.dumps({"format": "lstune-bench-files", "version": 1, "entries": [
        "../victim.txt", "notes.txt", "trials/../notes.txt", "/etc/hostname", "bench.json"]}))
    (out / "bench.json").write_text("{}")
    folder = check_folder(out, overwrite=True)
    assert folder.previous == {"bench.json"}
    folder.clear_previous()
    assert (tmp_path / "victim.txt").exists() and (out / "notes.txt").exists() and not (out / "bench.json").exists()


def test_a_name_that_appears_while_the_bench_runs_is_not_claimed(tmp_path):
    folder = check_folder(tmp_path, overwrite=False)
    folder.claim(tmp_path / "trials")
    (tmp_path / "trials").mkdir()
    (tmp_path / "trials" / "trial-2.log").write_text("mine\n")
    with pytest.raises(UserError, match="trial-2.log appeared"):
        folder.claim(tmp_path / "trials" / "trial-2.log")
    assert (tmp_path / "trials" / "trial-2.log").read_text() == "mine\n"


def test_files_are_never_written_through_a_link(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep\n")
    link = tmp_path / "bench.json"
    link.symlink_to(target)
    write_text_new(link, "new\n")
    assert target.read_text() == "keep\n" and not link.is_symlink() and link.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "precious.txt"]  # no temp file left
    log = tmp_path / "trial-1.log"
    log.symlink_to(target)
    with pytest.raises(OSError):
        os.close(open_new_log(log))
    assert target.read_text() == "keep\n"


def test_written_files_have_the_umasks_mode_not_a_temp_files(tmp_path):
    mask = os.umask(0o022)
    try:
        write_text_new(tmp_path / "bench.md", "x")
    finally:
        os.umask(mask)
    assert (tmp_path / "bench.md").stat().st_mode & 0o777 == 0o644


# run_bench with fake trial processes: the runner, the report and the plots as the CLI runs them, in a second.

FINGERPRINT = {"gpus": [], "cuda": None, "host_ram_bytes": 8 * 2**30, "cpu_cores": 2, "cpu_cores_usable": 2,
               "cpu": "x86_64", "python": "3", "platform": "test", "versions": {}, "lstune": {"version": "0"}}


def _fake_record(job) -> dict:
    if job.kind == "estimates":
        return {"outcome": "ok", "points": [{"seq_len": n, "device_peak_bytes": n * 4096} for n in job.lengths]}
    estimate = {"model_flops": 1e9, "hardware_flops": 1.2e9, "peak_tflops": 1.0, "device_peak_bytes": 2**20,
                "step_seconds": 0.1}
    return {"outcome": "ok", "median_s": 0.1, "min_s": 0.09, "world_size": 1, "tokens_per_step": job.seq_len,
            "peak_allocated": job.seq_len * 4096, "peak_reserved": job.seq_len * 4096, "peak_rss": 2**24,
            "estimate": estimate}


@pytest.fixture
def fake_trials(monkeypatch):
    """Trials that write their log and record as a trial process does, instantly; the list of jobs started."""
    from lstune.bench import runner

    started = []

    class Done(runner._Process):
        pid = os.getpid()

        def exit_code(self):
            return 0

    def start(self, job, result_path, log_path):
        started.append(job)
        os.close(open_new_log(log_path))
        write_text_new(result_path, json.dumps(_fake_record(job)))
        return Done()

    monkeypatch.setattr(runner.TrialRunner, "_start", start)
    return started


def _bench(out: Path, lengths: str, **flags):
    from lstune.bench.options import parse_options
    from lstune.bench.run import run_bench
    from lstune.config.schema import TrainConfig

    options, problems = parse_options({"lengths": lengths, "warmup": "0", "steps": "1", "output_dir": str(out),
                                       **flags})
    assert not problems
    config = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 256})
    return run_bench(config, options, command="lstune bench (test)", fingerprint=FINGERPRINT)


def test_run_bench_records_every_name_it_writes_and_a_second_bench_honours_the_record(tmp_path, fake_trials):
    out = tmp_path / "b"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    first = _bench(out, "256,512")
    recorded = set(json.loads((out / RECORD_NAME).read_text())["entries"])
    written = {p.relative_to(out).as_posix() for p in out.rglob("*")} - {RECORD_NAME, "notes.txt"}
    assert recorded == written and {"peak-vs-length.png", "tokens-per-s.png", "trials/trial-3.log"} <= written
    assert {p.relative_to(out).as_posix() for p in first.files} <= recorded
    assert len(fake_trials) == 3

    with pytest.raises(ConfigError, match="--overwrite"):
        _bench(out, "256")
    (out / "trials" / "trial-9.log").write_text("mine\n")
    with pytest.raises(UserError, match="trials/trial-9.log, which lstune bench did not write"):
        _bench(out, "256", overwrite=True)
    assert len(fake_trials) == 3  # refused before any trial
    (out / "trials" / "trial-9.log").unlink()

    _bench(out, "256", overwrite=True)  # two trials: the first bench's third is removed
    assert len(fake_trials) == 5
    after = {p.relative_to(out).as_posix() for p in out.rglob("*")}
    assert not any(name.startswith("trials/trial-3") for name in after)
    assert set(json.loads((out / RECORD_NAME).read_text())["entries"]) == after - {RECORD_NAME, "notes.txt"}
    assert (out / "notes.txt").read_text() == "mine\n"
