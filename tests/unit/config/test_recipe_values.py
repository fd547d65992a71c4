"""Recipe values that must be refused before a run: null settings, keys given twice, a folder for a recipe,
empty names; and the hints each refusal gives."""

from __future__ import annotations

import pytest
import yaml

from lstune.config.load import build_config, read_recipe
from lstune.config.parse import parse_str_list
from lstune.errors import ConfigError


def _problems(*args, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        build_config(*args, **kwargs)
    return info.value.problems


def test_null_for_a_setting_with_a_value_by_default_is_refused_together():
    keys = ["lr", "seq_len", "micro_batch_size", "zero_stage", "report_to", "model", "checkpointing"]
    problems = _problems({key: None for key in keys}, recipe_name="n.yaml")
    for key in keys:
        assert any(p.startswith(f"{key} in n.yaml is empty (null); give a value or remove the key") for p in problems), (
            key, problems)
    assert len(problems) == len(keys)


def test_null_is_kept_where_it_is_the_default():
    config = build_config({"max_steps": None, "lora_alpha": None, "output_dir": None, "offload_optimizer": None})
    assert config.optim.max_steps is None and config.model.lora_alpha is None


def test_a_resolved_config_reads_back_as_itself():
    """A --dry-run config lists every key, null where a setting has no value: it is a valid recipe."""
    config = build_config({"data": "builtin:passkey", "seq_len": "8k"}, {"lora_r": "4"})
    printed = yaml.safe_dump(config.to_dict(), sort_keys=False)
    assert "null" in printed
    assert build_config(yaml.safe_load(printed)).to_dict() == config.to_dict()


def test_a_key_given_twice_is_refused_with_its_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("lr: 1e-4\nseq_len: 4k\nlr: 2e-4\nseq_len: 8k\n")
    with pytest.raises(ConfigError) as info:
        read_recipe(path)
    assert info.value.problems == [
        f"--config {str(path)!r} gives 'lr' twice (lines 1 and 3); keep one.",
        f"--config {str(path)!r} gives 'seq_len' twice (lines 2 and 4); keep one.",
    ]


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {lr: 0.1, seed: 1}\nother:\n  <<: *b\n  lr: 0.2\n")
    assert read_recipe(path)["other"] == {"lr": 0.2, "seed": 1}


def test_two_spellings_of_one_setting_are_refused():
    problems = _problems({"seq-len": "2k", "seq_len": "1k"}, recipe_name="r.yaml")
    assert problems == ["seq-len in r.yaml and seq_len in r.yaml name the same setting; keep one."]


def test_a_folder_given_as_recipe_is_called_a_folder(tmp_path):
    (tmp_path / "4k.yaml").write_text("seq_len: 4k\n")
    with pytest.raises(ConfigError, match="is a folder; give the path of a YAML recipe file in it, e.g. 4k.yaml"):
        read_recipe(tmp_path)


def test_a_refused_data_value_is_not_also_reported_missing():
    def data_given(config):
        return ["--data is required: ..."] if config.data.source is None else []

    problems = _problems({}, {"data": ["g.jsonl:0", "g.jsonl:1"]}, checks=data_given)
    assert len(problems) == 1 and "has the weight 0" in problems[0], problems


def test_an_empty_model_name_is_refused():
    problems = _problems({}, {"model": "  "})
    assert problems == ["--model '  ' is empty; give a preset (`lstune presets`), a local model folder or a hub id "
                        "like meta-llama/Llama-3.1-8B."]


@pytest.mark.parametrize("flags, hint", [
    ({"report_to": ""}, "--report-to '' is empty; give tensorboard, wandb, mlflow or none (comma-separated)."),
    ({"report_to": [1]}, "must be a list of tracker names (strings); give tensorboard, wandb, mlflow or none"),
    ({"lora_r": "4", "lora_targets": ","}, "is empty; give module names like q_proj,v_proj or auto"),
])
def test_list_settings_hint_their_own_values(flags, hint):
    problems = _problems({}, flags)
    assert len(problems) == 1 and hint in problems[0], problems
    assert "q_proj" not in problems[0] or "lora_targets" in flags


def test_parse_str_list_without_a_hint_names_no_modules():
    with pytest.raises(ValueError) as info:
        parse_str_list("")
    assert "module" not in str(info.value) and "empty" in str(info.value)
    assert parse_str_list("auto") == "auto" and parse_str_list("auto", auto=False) == ["auto"]
