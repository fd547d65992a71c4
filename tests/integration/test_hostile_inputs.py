"""Hostile and careless input: every case exits 2 with a message naming the problem, prints no traceback,
and touches no file outside lstune's own (a folder of the user's files is compared before and after)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.integration.conftest import TINY, TINY_MODEL


@pytest.fixture
def user_files(tmp_path):
    """A folder of the user's files, and a check that nothing in it changed."""
    folder = tmp_path / "users"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "config.yaml").write_text("not lstune's")

    def snapshot():
        return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}

    before = snapshot()
    yield folder
    assert snapshot() == before, "a file outside lstune's own was touched"


def refused(result, *fragments):
    assert result.code == 2, (result.code, result.out[-2000:], result.err[-2000:])
    assert "Traceback" not in result.err + result.out
    for fragment in fragments:
        assert fragment in result.err, (fragment, result.err)


# --- usage: typer raises its vendored click exceptions --------------------------------------------------------


@pytest.mark.parametrize("args, fragment", [
    (("train", "--seq-lenn", "4k"), "No such option: --seq-lenn"),
    (("trian",), "No such command 'trian'"),
    (("train", "--lr"), "'--lr' requires an argument"),
    (("train", "--dry-run", "--log-level", "loud"), "--log-level 'loud'"),
    (("train", "--dry-run", "--unknown-thing=1"), "No such option"),
])
def test_usage_errors(cli, user_files, args, fragment):
    refused(cli(*args), fragment)


# --- numbers: NaN, inf, out of range, beyond int64 ---------------------------------------------------------------


@pytest.mark.parametrize("flag, value, fragment", [
    ("--lr", "nan", "not a finite number"),
    ("--lr", "inf", "not a finite number"),
    ("--weight-decay", "inf", "not a finite number"),
    ("--adam-beta1", "1", "must be less than 1.0"),
    ("--adam-beta2", "1.5", "must be less than 1.0"),
    ("--adam-eps", "0", "must be more than 0.0"),
    ("--max-grad-norm", "nan", "not a finite number"),
    ("--min-lr-ratio", "nan", "not a finite number"),
    ("--min-lr-ratio", "2", "must be at most 1.0"),
    ("--epochs", "inf", "not a finite number"),
    ("--epochs", "0", "must be more than 0.0"),
    ("--seed", "18446744073709551617", "must be at most 9223372036854775807"),
    ("--micro-batch-size", "99999999999999999999", "must be at most"),
    ("--seq-len", "99999999999999999999999", "beyond any possible length"),
    ("--max-steps", "1e3", "not a whole number"),
    ("--keep-last", "-1", "must be at least 0"),
    ("--lr", "1e400", "not a finite number"),
])
def test_bad_numbers(cli, user_files, flag, value, fragment):
    refused(cli("train", flag, value, "--dry-run"), f"{flag} '{value}'", fragment)


def test_nan_lora_dropout(cli, user_files):
    refused(cli("train", "--lora-r", "4", "--lora-dropout", "nan", "--dry-run"), "--lora-dropout 'nan'", "finite")


# --- recipes ----------------------------------------------------------------------------------------------------


def _recipe(tmp_path, body: bytes | str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    return path


def test_billion_laughs_recipe_is_refused_at_once(cli, tmp_path, user_files):
    levels = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        levels.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    import time

    started = time.perf_counter()
    refused(cli("train", "--config", _recipe(tmp_path, "\n".join(levels)), "--dry-run"), "expands to more than")
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize("body, fragment", [
    (b"lr: 1e-4\nmodel: \"\xff\xfe\"\n", "not UTF-8"),
    ("lr: [1, 2]\n", "lr in"),
    ("seq_len: {a: 1}\n", "is a mapping"),
    ("lora_r: 4\nlora_targets: [[q_proj]]\n", "list of module names"),
    ("x: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
    ("- just\n- a list\n", "must be a mapping"),
    ("seq_len: 4k\n  bad: indent\n", "not valid YAML"),
])
def test_bad_recipes(cli, tmp_path, user_files, body, fragment):
    refused(cli("train", "--config", _recipe(tmp_path, body), "--dry-run"), fragment)


def test_oversized_recipe(cli, tmp_path, user_files):
    refused(cli("train", "--config", _recipe(tmp_path, "# " + "x" * (2 * 1024 * 1024)), "--dry-run"), "at most")


# --- impossible sizes, refused before loading ------------------------------------------------------------------


@pytest.mark.parametrize("flag, value", [("--micro-batch-size", "1000000000"), ("--seq-len", "1099511627776")])
def test_impossible_sizes(cli, tmp_path, user_files, flag, value):
    result = cli("train", *TINY, flag, value, "--output-dir", tmp_path / "o")
    refused(result, "predicted not to fit", "GiB", "--force")
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


# --- data -------------------------------------------------------------------------------------------------------


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, columns: dict) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def _data_cases(tmp_path):
    bad_json = [json.dumps({"text": f"doc {i}"}) for i in range(3000)]
    bad_json[2345] = '{"text": "cut'
    (tmp_path / "bad.jsonl").write_text("\n".join(bad_json) + "\n")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    return {
        "non_utf8": (tmp_path / "latin1.jsonl", ["latin1.jsonl line 2", "not UTF-8"]),
        "bad_json_deep": (tmp_path / "bad.jsonl", ["bad.jsonl line 2346", "not valid JSON"]),
        "negative_id": (_write(tmp_path / "neg.jsonl", [{"input_ids": [5, -3, 7]}]), ["negative id -3"]),
        "label_beyond_vocab": (_write(tmp_path / "lab.jsonl", [{"input_ids": [5, 6, 7], "labels": [5, 999, 7]}]),
                               ["token id 999", "vocabulary of 320"]),
        "negative_label": (_write(tmp_path / "nl.jsonl", [{"input_ids": [5, 6, 7], "labels": [5, -7, 7]}]),
                           ["labels has -7"]),
        "text_is_list": (_write(tmp_path / "tl.jsonl", [{"text": ["a", "b"]}]), ["'text' field holds list"]),
        "text_is_mapping": (_write(tmp_path / "tm.jsonl", [{"text": {"a": "b"}}]), ["'text' field holds dict"]),
        "parquet_int_text": (_parquet(tmp_path / "it.parquet", {"text": [1, 2, 3]}), ["'text' field holds int"]),
        "parquet_str_ids": (_parquet(tmp_path / "si.parquet", {"input_ids": [["a", "b"], ["c"]]}),
                            ["'input_ids' must be a list of whole numbers"]),
        "parquet_float_ids": (_parquet(tmp_path / "fi.parquet", {"input_ids": [[5.7, 6.2, 7.0], [8.0, 9.0]]}),
                              ["'input_ids' must be a list of whole numbers", "float"]),
        "json_float_labels": (_write(tmp_path / "fl.jsonl", [{"input_ids": [5, 6, 7], "labels": [5, 6.5, 7]}]),
                              ["'labels' must be a list of whole numbers"]),
    }


@pytest.mark.parametrize("case", ["non_utf8", "bad_json_deep", "negative_id", "label_beyond_vocab", "negative_label",
                                  "text_is_list", "text_is_mapping", "parquet_int_text", "parquet_str_ids",
                                  "parquet_float_ids", "json_float_labels"])
def test_bad_data(cli, tmp_path, user_files, case):
    data, fragments = _data_cases(tmp_path)[case]
    result = cli("train", *TINY_MODEL, "--max-steps", "1", "--data", data, "--output-dir", tmp_path / "out")
    refused(result, *fragments)
    assert not (tmp_path / "out" / "checkpoint-1").exists()


# --- the output folder ------------------------------------------------------------------------------------------


def test_symlinked_config_is_refused_and_its_target_untouched(cli, tmp_path, text_data, user_files):
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(user_files / "config.yaml", out / "config.yaml")
    refused(cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", out, "--overwrite"),
            "symbolic links", "config.yaml")


def test_symlinked_checkpoint_is_refused(cli, tmp_path, text_data, user_files):
    out = tmp_path / "out"
    assert cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", out).code == 0
    os.symlink(user_files, out / "checkpoint-5")
    refused(cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "2", "--output-dir", out, "--resume"),
            "symbolic links", "checkpoint-5")


def test_foreign_file_at_lstunes_name_stops_overwrite(cli, tmp_path, text_data, user_files):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("the user's own metrics\n")
    refused(cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", out, "--overwrite"),
            "metrics.jsonl", "did not write")
    assert (out / "metrics.jsonl").read_text() == "the user's own metrics\n"


def test_resume_into_another_runs_folder_is_refused(cli, tmp_path, text_data, user_files):
    first, other = tmp_path / "first", tmp_path / "other"
    for out in (first, other):
        assert cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "2", "--output-dir", out).code == 0
    before = {p.name: p.stat().st_mtime_ns for p in other.rglob("*")}
    refused(cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "3", "--output-dir", other,
                "--resume", first / "checkpoint-2"), "another folder", "empty or new --output-dir")
    assert {p.name: p.stat().st_mtime_ns for p in other.rglob("*")} == before


def test_a_second_run_into_a_locked_folder_is_refused(cli, tmp_path, text_data, user_files):
    from lstune.train.lock import OutputLock

    out = tmp_path / "out"
    out.mkdir()
    lock = OutputLock(out).acquire()  # another run holds the folder
    try:
        refused(cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", out, "--overwrite"),
                "in use by another lstune run", f"pid {os.getpid()}")
    finally:
        lock.release()


# --- resuming what cannot be resumed ----------------------------------------------------------------------------


@pytest.mark.parametrize("change, fragment", [
    (("--model", "tiny-qwen2"), "--model is 'tiny-qwen2'"),
    (("--lora-r", "4"), "--lora-r is 4"),
])
def test_resume_with_another_model_or_lora_is_refused(cli, tmp_path, text_data, user_files, change, fragment):
    out = tmp_path / "run"
    assert cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", out).code == 0
    args = [a for a in TINY_MODEL if a not in ("--model", "tiny-llama")]
    refused(cli("train", *args, *change, "--data", text_data, "--max-steps", "2", "--output-dir", out, "--resume"),
            fragment, "checkpoint-1")
    assert not (out / "checkpoint-2").exists()


def test_full_disk_names_the_path_and_keeps_the_previous_checkpoint(cli, tmp_path, text_data, monkeypatch):
    from lstune.train import engine as engine_module

    out = tmp_path / "run"
    real_save, calls = engine_module.TorchEngine.save, []

    def save_then_fill(self, ckpt_dir):
        calls.append(ckpt_dir)
        if len(calls) > 1:
            raise OSError(28, "No space left on device", str(ckpt_dir / "optimizer.pt"))
        real_save(self, ckpt_dir)

    monkeypatch.setattr(engine_module.TorchEngine, "save", save_then_fill)
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "4", "--save-every", "2", "--output-dir", out)
    refused(result, "no space left", "checkpoint-4", "checkpoint-2 is intact")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("checkpoint", ".tmp"))) == ["checkpoint-2"]


def test_a_run_refused_for_its_data_can_be_retried_in_the_same_folder(cli, tmp_path, text_data, user_files):
    out = tmp_path / "out"
    bad = _write(tmp_path / "neg.jsonl", [{"input_ids": [5, -3, 7]}])
    refused(cli("train", *TINY_MODEL, "--max-steps", "1", "--data", bad, "--output-dir", out), "negative id")
    result = cli("train", *TINY_MODEL, "--max-steps", "1", "--data", text_data, "--output-dir", out)
    assert result.code == 0, result.err
    assert (out / "final").is_dir()


def test_overwrite_with_a_broken_new_run_keeps_the_old_one(cli, tmp_path, text_data):
    out = tmp_path / "out"
    assert cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "2", "--output-dir", out).code == 0
    for name in ("final_report.txt", "config.yaml.bak", "metrics.jsonl.orig"):
        (out / name).write_text("the user's")
    (out / "finals").mkdir()
    old = sorted(p.name for p in out.iterdir())
    bad = _write(tmp_path / "neg.jsonl", [{"input_ids": [5, -3, 7]}])
    refused(cli("train", *TINY_MODEL, "--max-steps", "1", "--data", bad, "--output-dir", out, "--overwrite"), "negative id")
    assert sorted(p.name for p in out.iterdir()) == old  # the old run is intact: the new one failed its checks
    assert cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", out, "--overwrite").code == 0
    assert not (out / "checkpoint-2").exists() and (out / "checkpoint-1").is_dir()
    for name in ("final_report.txt", "config.yaml.bak", "metrics.jsonl.orig"):
        assert (out / name).read_text() == "the user's"
    assert (out / "finals").is_dir()


def test_a_changed_lr_on_resume_takes_effect(cli, tmp_path, text_data):
    out = tmp_path / "run"
    base = [*TINY_MODEL, "--data", text_data, "--schedule", "constant", "--output-dir", out]
    assert cli("train", *base, "--max-steps", "2").code == 0
    result = cli("train", *[a if a != "1e-3" else "5e-4" for a in base], "--max-steps", "3", "--resume")
    assert result.code == 0, result.err
    assert "lr 0.001 → 0.0005" in result.out and "take effect" in result.out
    from tests.integration.conftest import read_metrics

    assert [m["lr"] for m in read_metrics(out)] == [1e-3, 1e-3, 5e-4]


def test_every_changed_setting_on_resume_is_said(cli, tmp_path, text_data):
    out = tmp_path / "run"
    base = [*TINY_MODEL, "--data", text_data, "--output-dir", out]
    assert cli("train", *base, "--max-steps", "3", "--stop-at-step", "1").code == 0
    result = cli("train", *base, "--max-steps", "3", "--resume", "--weight-decay", "0.5", "--adam-eps", "0.001",
                 "--max-grad-norm", "0.5", "--stop-at-step", "2")
    assert result.code == 0, result.err
    said = " ".join(result.out.split())
    for change in ("weight_decay 0.0 → 0.5", "adam_eps 1e-08 → 0.001", "max_grad_norm 1.0 → 0.5"):
        assert change in said, (change, said[-3000:])
    assert "stop_at_step" not in said  # about this invocation, not the run


def test_resume_given_a_checkpoint_alone_continues_in_its_folder(cli, tmp_path, text_data, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "2", "--save-every", "1",
               "--stop-at-step", "1", "--output-dir", out).code == 0
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "2", "--resume", out / "checkpoint-1")
    assert result.code == 0, result.err
    assert (out / "checkpoint-2").is_dir() and (out / "final").is_dir()
    assert not (tmp_path / "runs").exists()


def test_a_tilde_output_dir_is_the_home_folder(cli, tmp_path, text_data, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", "~/run").code == 0
    assert (tmp_path / "home" / "run" / "final").is_dir() and not (tmp_path / "~").exists()


def test_a_relative_model_folder_resumes_from_another_working_directory(cli, tmp_path, text_data, monkeypatch):
    assert cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", tmp_path / "base").code == 0
    (tmp_path / "base" / "final").rename(tmp_path / "mdl")
    flags = ["--data", text_data, "--seq-len", "256", "--max-steps", "2"]
    monkeypatch.chdir(tmp_path)
    assert cli("train", "--model", "mdl", *flags, "--stop-at-step", "1", "--output-dir", "run").code == 0
    monkeypatch.chdir(tmp_path / "base")
    result = cli("train", "--model", tmp_path / "mdl", *flags, "--output-dir", tmp_path / "run", "--resume")
    assert result.code == 0, result.err
    assert (tmp_path / "run" / "final").is_dir()


def test_a_lora_base_inside_the_folder_overwrite_clears_is_refused(cli, tmp_path, text_data, user_files):
    out = tmp_path / "out"
    assert cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", out).code == 0
    before = sorted(p.name for p in (out / "final").iterdir())
    refused(cli("train", "--model", out / "final", "--data", text_data, "--seq-len", "256", "--lora-r", "4",
                "--max-steps", "1", "--output-dir", out, "--overwrite"), "which this run writes or replaces")
    assert sorted(p.name for p in (out / "final").iterdir()) == before


def test_an_output_folder_inside_the_data_folder_is_refused(cli, tmp_path, text_data, user_files):
    data = tmp_path / "ds"
    data.mkdir()
    text_data.rename(data / "train.jsonl")
    refused(cli("train", *TINY_MODEL, "--data", data, "--max-steps", "1", "--output-dir", data / "out"),
            "inside the --data folder")
    assert sorted(p.name for p in data.iterdir()) == ["train.jsonl"]


# --- null and repeated recipe keys, misnamed hints, a 1-step run's warmup ------------------------------------------


def test_null_recipe_values_are_refused_together(cli, tmp_path, user_files):
    body = "data: builtin:passkey\nlr: null\nseq_len:\nmodel: null\ncheckpointing: null\nreport_to: null\nmax_steps: null\n"
    result = cli("train", "--config", _recipe(tmp_path, body), "--dry-run")
    refused(result, *(f"{key} in {tmp_path / 'recipe.yaml'} is empty (null); give a value or remove the key"
                      for key in ("lr", "seq_len", "model", "checkpointing", "report_to")))
    assert "max_steps" not in result.err  # null is its default: a --dry-run config says so


def test_a_recipe_key_given_twice_is_refused(cli, tmp_path, user_files):
    refused(cli("train", "--config", _recipe(tmp_path, "data: builtin:passkey\nlr: 1e-4\nlr: 1e-3\n"), "--dry-run"),
            "gives 'lr' twice (lines 2 and 3); keep one.")


def test_a_recipe_folder_is_called_a_folder(cli, tmp_path, user_files):
    refused(cli("train", "--config", user_files, "--dry-run"), "is a folder; give the path of a YAML recipe file")


@pytest.mark.parametrize("args, fragment", [
    (("train", *TINY, "--report-to", "", "--dry-run"), "--report-to '' is empty; give tensorboard, wandb, mlflow"),
    (("estimate", "--model", "", "--gpu", "h100-80gb"), "--model '' is empty; give a preset"),
])
def test_empty_values_get_their_own_hint(cli, user_files, args, fragment):
    result = cli(*args)
    refused(result, fragment)
    assert "q_proj" not in result.err and "folder without config.json" not in result.err


def test_a_refused_data_weight_is_the_only_problem(cli, tmp_path, text_data, user_files):
    result = cli("train", "--data", f"{text_data}:0", "--data", f"{text_data}:1", "--dry-run")
    refused(result, "has the weight 0")
    assert "--data is required" not in result.err


def test_plot_help_shows_its_default(cli):
    result = cli("plot", "--help")
    assert result.code == 0 and "metrics.png]" in result.out and "write ." not in result.out, result.out


def test_a_one_step_run_trains_at_its_lr(cli, tmp_path, text_data):
    out = tmp_path / "run"
    result = cli("train", "--model", "tiny-llama", "--seq-len", "256", "--lr", "1e-3", "--data", text_data,
                 "--max-steps", "1", "--output-dir", out)
    assert result.code == 0, result.err
    from tests.integration.conftest import read_metrics

    steps = [m for m in read_metrics(out) if "lr" in m]
    assert steps and steps[0]["lr"] > 0, steps


# --- a model folder lstune did not write ------------------------------------------------------------------------


def _model_folder(tmp_path, name="model", **changes) -> Path:
    from lstune.models.presets import preset_config

    folder = tmp_path / name
    preset_config("tiny-llama").save_pretrained(folder)
    values = json.loads((folder / "config.json").read_text())
    values.update(changes)
    (folder / "config.json").write_text(json.dumps(values))
    return folder


@pytest.mark.parametrize("key, value, fragment", [
    ("num_hidden_layers", -2, "num_hidden_layers is -2, not a positive size"),
    ("hidden_size", 0, "hidden_size is 0, not a positive size"),
    ("hidden_size", float("nan"), "hidden_size is nan, not a finite number"),
    ("intermediate_size", "big", "intermediate_size is 'big', not a number"),
    ("hidden_size", 10**15, "hidden_size is 1000000000000000, beyond any model"),
    ("intermediate_size", float("inf"), "intermediate_size is inf, not a finite number"),
    ("num_attention_heads", 0, "num_attention_heads is 0"),
    ("vocab_size", 0, "vocab_size is 0"),
])
@pytest.mark.parametrize("command", ["estimate", "train"])
def test_impossible_model_sizes_are_refused_before_anything_is_built(cli, tmp_path, user_files, command, key, value,
                                                                    fragment):
    folder = _model_folder(tmp_path, **{key: value})
    args = ["--model", folder, "--seq-len", "256"]
    if command == "train":
        args += ["--data", "builtin:passkey", "--max-steps", "1", "--output-dir", tmp_path / "out", "--init", "random"]
    refused(cli(command, *args), f"{folder / 'config.json'}: {fragment}")


def test_a_model_config_nested_too_deeply_is_refused(cli, tmp_path, user_files):
    folder = _model_folder(tmp_path)
    (folder / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    refused(cli("estimate", "--model", folder, "--seq-len", "256"), "config.json is nested too deeply")


def _weights_folder(tmp_path, name: str) -> Path:
    from lstune.models.loading import load_model

    folder = _model_folder(tmp_path, name)
    load_model("tiny-llama", init="random").model.save_pretrained(folder)
    return folder


def _lying_header(folder: Path) -> None:
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    name = next(key for key in header if key != "__metadata__")
    header[name]["data_offsets"][1] += 10**12
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size:])


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def _pickle_payload(folder: Path) -> None:
    import torch

    (folder / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": _Payload()}, folder / "pytorch_model.bin")


@pytest.mark.parametrize("damage, fragments", [
    (_lying_header, ["model.safetensors is not a valid safetensors file", "invalid shape, data type, or offset"]),
    (_pickle_payload, ["pytorch_model.bin cannot be loaded", "posix.system"]),
])
def test_a_model_folders_broken_weights_are_refused_naming_the_file(cli, tmp_path, user_files, damage, fragments):
    folder = _weights_folder(tmp_path, "weights")
    damage(folder)
    result = cli("train", "--model", folder, "--seq-len", "64", "--data", "builtin:passkey", "--max-steps", "1",
                 "--output-dir", tmp_path / "out")
    refused(result, *fragments)
    assert "weights_only" not in result.err and not (tmp_path / "out" / "checkpoint-1").exists()


def test_overwrite_never_removes_what_a_crafted_run_record_names(cli, tmp_path, text_data):
    from lstune.config.record import RECORD_FORMAT, RECORD_NAME

    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    (out / "results").mkdir()
    (out / "results" / "table.csv").write_text("1,2")
    crafted = {"format": RECORD_FORMAT, "version": 1, "entries": ["thesis.tex", "results", "config.yaml", RECORD_NAME]}
    (out / RECORD_NAME).write_text(json.dumps(crafted))
    result = cli("train", *TINY_MODEL, "--data", text_data, "--max-steps", "1", "--output-dir", out, "--overwrite")
    assert result.code == 0, result.err[-2000:]
    assert (out / "thesis.tex").read_text() == "years of work"
    assert (out / "results" / "table.csv").read_text() == "1,2"
    assert "thesis.tex" not in json.loads((out / RECORD_NAME).read_text())["entries"]


@pytest.mark.parametrize("flag, fragment", [
    ("--data", "data source {path} is a FIFO (named pipe), not a file or folder of records"),
    ("--output-dir", "--output-dir '{path}' is a FIFO (named pipe); give a folder"),
    ("--config", "--config '{path}' is a FIFO (named pipe), not a file"),
    ("--chat-template", "--chat-template '{path}' is a FIFO (named pipe), not a known template"),
])
def test_a_fifo_is_called_a_fifo_and_never_read(cli, tmp_path, user_files, flag, fragment):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    args = [*TINY_MODEL, "--data", "builtin:passkey", "--max-steps", "1", "--output-dir", tmp_path / "out", flag, fifo]
    refused(cli("train", *args), fragment.format(path=fifo))


def test_resume_at_a_file_says_it_is_a_file(cli, tmp_path, user_files):
    refused(cli("train", *TINY, "--max-steps", "1", "--resume", user_files / "notes.txt", "--output-dir", tmp_path / "o"),
            f"Cannot resume from {user_files / 'notes.txt'}: it is a file, not a folder")
