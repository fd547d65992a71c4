"""The bench's options and configurations: parsing, every bad input named, the ladder's rungs."""

from __future__ import annotations

import pytest

from lstune.bench.options import parse_lengths, parse_options
from lstune.bench.rungs import LADDER, RUNGS, ladder, rung_config, select_rungs
from lstune.bench.run import problems_with
from lstune.config.schema import TrainConfig


def _config(**flat) -> TrainConfig:
    return TrainConfig.from_flat({"model": "tiny-llama", **flat})


def test_lengths_parse_sorted_without_repeats():
    assert parse_lengths("32k, 16k,64K,16k") == [16384, 32768, 65536]
    assert parse_lengths([1024, "2k"]) == [1024, 2048]


@pytest.mark.parametrize("raw, words", [
    ({"lengths": "16k,abc"}, ["--lengths", "'abc'", "32k"]),
    ({"lengths": ","}, ["--lengths", "empty"]),
    ({"steps": "0"}, ["--steps", "at least 1"]),
    ({"warmup": "-1"}, ["--warmup", "at least 0"]),
    ({"len_step": "8q"}, ["--len-step", "not a length"]),
    ({"max_host_mem": "lots"}, ["--max-host-mem", "64G"]),
    ({"max_host_mem": "0"}, ["--max-host-mem '0'", "less than 256 MiB", "2G"]),
    ({"max_host_mem": "100M"}, ["--max-host-mem '100M'", "less than 256 MiB"]),
    ({"trial_timeout": "0"}, ["--trial-timeout", "at least 1"]),
    ({"rungs": ""}, ["--rungs", "empty", "hf, tiled_loss"]),
])
def test_every_bad_option_is_named_with_its_fix(raw, words):
    _, problems = parse_options(raw)
    assert len(problems) == 1 and all(w in problems[0] for w in words), problems


def test_problems_are_collected_not_stopped_at_the_first():
    _, problems = parse_options({"steps": "0", "lengths": "x", "warmup": "y"})
    assert len(problems) == 3


@pytest.mark.parametrize("names, ablation, gpus, words", [
    (["fast"], False, 1, ["--rungs 'fast'", "hf", "tiled_mlp"]),
    (["sp"], False, 1, ["--rungs sp", "--gpus 2"]),
    (["hf"], True, 1, ["--ablation", "drop --rungs"]),
])
def test_bad_configuration_choices_are_refused(names, ablation, gpus, words):
    options, _ = parse_options({"rungs": ",".join(names), "ablation": ablation})
    problems = problems_with(_config(gpus=gpus), options)
    assert problems and all(w in problems[0] for w in words), problems


def test_search_settings_without_the_search_are_refused():
    options, _ = parse_options({"max_len": "64k"})
    assert any("--find-max-len" in p for p in problems_with(_config(), options))
    options, _ = parse_options({"max_len": "4k", "len_step": "8k", "find_max_len": True})
    assert any("shorter than --len-step" in p for p in problems_with(_config(), options))


def test_the_ladder_adds_the_flags_own_settings_only_when_they_differ_and_sp_with_several_gpus():
    # The defaults' `auto` settings are the estimate's, no rung's; flags equal to a rung's add nothing.
    assert [r.name for r in ladder(_config())] == [*LADDER, "lstune"]
    assert [r.name for r in ladder(_config(offload_checkpoints=False, attn_chunks="off", mini_sequence=False))] == \
        list(LADDER)  # tiled_mlp
    # Chunked attention and mini-sequence `auto` are no rung's: the estimate may turn them on for the flags' run.
    assert [r.name for r in ladder(_config(offload_checkpoints=False, mini_sequence=False))] == [*LADDER, "lstune"]
    assert [r.name for r in ladder(_config(offload_checkpoints=False, attn_chunks="off"))] == [*LADDER, "lstune"]
    assert [r.name for r in ladder(_config(tiled_loss=4))] == [*LADDER, "lstune"]
    assert [r.name for r in ladder(_config(gpus=2))] == [*LADDER, "lstune", "sp"]
    rungs, problems = select_rungs(_config(), None, False)
    assert [r.name for r in rungs] == ["lstune"] and not problems


def test_rung_configs_keep_the_flags_and_set_the_rungs_memory_and_processes():
    given = _config(lora_r=8, seq_len=2048, gpus=2, offload_checkpoints=True)
    hf = rung_config(given, RUNGS["hf"], in_ladder=True)
    assert (hf.model.lora_r, hf.data.seq_len, hf.parallel.gpus) == (8, 2048, 1)
    assert (hf.memory.tiled_loss, hf.memory.tiled_mlp, hf.memory.offload_checkpoints) == ("off", "off", False)
    tiled = rung_config(given, RUNGS["tiled_mlp"], in_ladder=True)
    assert (tiled.memory.tiled_mlp, tiled.memory.offload_checkpoints) == ("auto", False)
    assert rung_config(given, RUNGS["sp"], in_ladder=True).parallel.gpus == 2
    assert rung_config(given, RUNGS["lstune"], in_ladder=True).parallel.gpus == 1
    assert rung_config(given, RUNGS["lstune"]).parallel.gpus == 2  # alone: on --gpus, like train
    assert not rung_config(given, RUNGS["lstune"]).problems()


def test_more_gpus_than_the_machine_shows_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    from lstune.bench.run import run_bench
    from lstune.errors import ConfigError

    options, problems = parse_options({"rungs": "lstune", "lengths": "1k", "output_dir": str(tmp_path / "b")})
    assert not problems
    fingerprint = {"gpus": [{"name": "H100", "memory_bytes": 80 * 2**30, "driver": "x"}] * 4}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ConfigError, match=r"--gpus 4 but this machine shows 2 CUDA devices \(CUDA_VISIBLE_DEVICES=0,1\)"):
        run_bench(_config(gpus=4), options, command="lstune bench", fingerprint=fingerprint)
    assert not (tmp_path / "b").exists()


def test_sp_layout_rungs_set_the_split_over_every_process():
    from lstune.bench.rungs import RUNGS, rung_config, select_rungs

    config = _config(gpus=4)
    layouts = {name: rung_config(config, RUNGS[name]).parallel for name in ("sp_ulysses", "sp_ring", "sp_hybrid")}
    assert {n: (p.gpus, p.sp, p.sp_ring) for n, p in layouts.items()} == {
        "sp_ulysses": (4, 4, 1), "sp_ring": (4, 4, 4), "sp_hybrid": (4, 4, 2)}
    assert rung_config(config, RUNGS["sp_ring"]).memory.attn_chunks == "off"
    assert select_rungs(_config(gpus=2), ["sp_hybrid"], False)[1] == [
        "--rungs sp_hybrid (Ulysses × a ring of 2) needs an even --gpus of 4 or more."]
    assert "add --gpus 2" in select_rungs(_config(gpus=1), ["sp_ring"], False)[1][0]


def test_streamed_data_is_refused_by_bench():
    options, _ = parse_options({})
    problems = problems_with(_config(data="a.jsonl", data_streaming=True), options)
    assert any("drop --data-streaming" in p for p in problems), problems
    assert not problems_with(_config(data="a.jsonl"), options)
