"""Config: parsing of every value kind, recipe + flag precedence, all errors reported together."""

from __future__ import annotations

import pytest

from lstune.config.load import build_config, read_recipe
from lstune.config.parse import format_length, parse_bytes, parse_length
from lstune.errors import ConfigError


@pytest.mark.parametrize(
    "text,expected",
    [("32768", 32768), ("32k", 32768), ("500K", 512000), ("1M", 1048576), ("1.5M", 1572864), (4096, 4096)],
)
def test_lengths_parse(text, expected):
    assert parse_length(text) == expected


@pytest.mark.parametrize("text", ["500q", "", "k", "1.3k", "-5", "1e5", True])
def test_bad_lengths_are_rejected_with_the_hint(text):
    with pytest.raises(ValueError, match="32k"):
        parse_length(text)


def test_format_length_round_trips():
    for n in (32768, 1048576, 1572864, 4096, 1000):
        assert parse_length(format_length(n)) == n


def test_bytes():
    assert parse_bytes("64G") == 64 * 1024**3
    assert parse_bytes("512MiB") == 512 * 1024**2
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_flags_override_recipe_and_defaults_fill_the_rest():
    config = build_config({"seq_len": "8k", "lr": 1e-4}, {"lr": "3e-4", "pack": True})
    assert config.data.seq_len == 8192
    assert config.optim.lr == pytest.approx(3e-4)
    assert config.data.pack is True
    assert config.model.name == "tiny-llama"


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        build_config(
            {"seq_len": "500q", "lerning_rate": 1e-3, "grad_accum": 0},
            {"micro_batch_size": "two", "lora_alpha": "16"},
            recipe_name="r.yaml",
        )
    problems = info.value.problems
    text = str(info.value)
    assert len(problems) == 5, problems
    assert "seq_len in r.yaml '500q' is not a length; use e.g. 32768, 32k" in text
    assert "unknown key 'lerning_rate' in r.yaml" in text and "Did you mean" in text
    assert "grad_accum in r.yaml '0' must be at least 1" in text
    assert "--micro-batch-size 'two' is not a whole number" in text
    assert "--lora-alpha needs LoRA" in text


def test_contradictions_are_errors():
    with pytest.raises(ConfigError, match="contradict"):
        build_config({}, {"resume": "latest", "overwrite": True, "output_dir": "x"})
    with pytest.raises(ConfigError, match="--resume needs --output-dir"):
        build_config({}, {"resume": "latest"})
    with pytest.raises(ConfigError, match="--max-steps and --epochs"):
        build_config({}, {"max_steps": "3", "epochs": "1"})


@pytest.mark.parametrize("memory", [{"tiled_mlp": "2"}, {"mini_sequence": "true"}])
def test_metp_mlp_with_mlp_tiles_or_mini_sequence_is_refused(memory):
    """METP runs each MLP on (s/SP)×(I/SP) itself; explicit MLP tiles or mini-sequence with it are refused."""
    flags = {"model": "tiny-llama", "data": "x.jsonl", "metp_mlp": "true", **memory}
    with pytest.raises(ConfigError, match="--metp-mlp runs each MLP itself"):
        build_config({}, flags)
    build_config({}, {**flags, **{k: "off" if k == "tiled_mlp" else "false" for k in memory}})


def test_recipe_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_recipe(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        read_recipe(bad)
    broken = tmp_path / "broken.yaml"
    broken.write_text("seq_len: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_recipe(broken)


def test_a_resolved_config_is_itself_a_valid_recipe():
    """The config.yaml a run writes lists every key (None and defaults included); it must load as a recipe."""
    written = build_config({}, {"seq_len": "8k"}).to_dict()
    assert build_config(written).to_dict() == written


def test_each_section_owns_its_rules():
    from lstune.config.schema import MemorySection, ModelSection, ParallelSection

    assert ModelSection(lora_alpha=8).problems() == ["--lora-alpha needs LoRA; add --lora-r 16 (or another rank), or drop it."]
    assert ModelSection(lora_r=8, lora_alpha=8).problems() == []
    assert MemorySection(tiled_mlp="off", mini_sequence=True).problems() == [
        "--mini-sequence tiles the MLP: drop --tiled-mlp off, or drop --mini-sequence."
    ]
    assert any("--zero-stage 0" in p for p in ParallelSection(gpus=2, zero_stage="0").problems())
    assert ParallelSection(gpus=2, zero_stage="1").problems() == []


def test_a_non_empty_output_folder_is_refused_unless_resumed_or_overwritten(tmp_path):
    (tmp_path / "somefile").write_text("x")
    with pytest.raises(ConfigError, match="nothing is overwritten unasked"):
        build_config({}, {"output_dir": str(tmp_path)})
    assert build_config({}, {"output_dir": str(tmp_path), "overwrite": True}).run.overwrite is True
    for flags in ({}, {"overwrite": True}, {"resume": "latest"}):  # a file is never a run's folder
        with pytest.raises(ConfigError, match="is a file; give a folder"):
            build_config({}, {"output_dir": str(tmp_path / "somefile"), **flags})
    assert (tmp_path / "somefile").read_text() == "x"


def test_rope_settings():
    config = build_config({}, {"rope_scaling": "YaRN", "rope_factor": "4", "original_max_position_embeddings": "8192"})
    assert (config.model.rope_scaling, config.model.rope_factor) == ("yarn", 4.0)
    assert build_config({}, {"rope_scaling": "linear"}).model.rope_factor == "auto"
    with pytest.raises(ConfigError) as info:
        build_config({}, {"rope_factor": "0.5", "rope_scaling": "ntk"})
    text = str(info.value)
    assert "--rope-factor '0.5' is not auto or a number (must be at least 1.0)" in text
    assert "--rope-scaling 'ntk' is not one of none, linear, dynamic, yarn, llama3" in text
    with pytest.raises(ConfigError, match="--rope-factor sets RoPE scaling; add --rope-scaling yarn"):
        build_config({}, {"rope_factor": "2"})


def test_data_sources():
    assert build_config({}, {"data": ["builtin:passkey"]}).data.source == "builtin:passkey"
    assert build_config({"data": ["builtin:passkey:2", "builtin:passkey:1"]}, {}).data.source == [
        "builtin:passkey:2", "builtin:passkey:1"]
    with pytest.raises(ConfigError, match="has a weight but is the only source"):
        build_config({}, {"data": ["builtin:passkey:0.5"]})
    with pytest.raises(ConfigError, match="must be a data source, or a list of them"):
        build_config({"data": ["builtin:passkey", 3]}, {})


def test_chunked_attention_under_a_ring_is_accepted():
    # Issue 35: chunked attention runs under a ring (chunk-major zigzag layout); the former refusal is gone.
    for setting in ("2", "auto", "off"):
        memory = build_config({}, {"sp": "4", "sp_ring": "2", "attn_chunks": setting}).memory
        assert str(memory.attn_chunks) == setting
