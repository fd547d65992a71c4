"""Checkpoints read as files lstune did not write: every file a resume loads is listed in and verified against the
manifest, and every parser error (JSON of the wrong type or nested too deep, a pickle payload, a lying
safetensors header) is a CheckpointError naming the file — never torch's advice to load with weights_only=False."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from lstune.errors import CheckpointError
from lstune.train.checkpoint import MANIFEST_NAME, TRAINER_STATE_NAME, load_checkpoint, save_checkpoint
from tests.unit.train.test_checkpoint import save


def _rewrite_manifest(checkpoint: Path, *, keep=lambda path: True) -> None:
    """Recompute the manifest over the folder's files, as a crafted or copied checkpoint would."""
    manifest = json.loads((checkpoint / MANIFEST_NAME).read_text())
    files = []
    for path in sorted(checkpoint.rglob("*")):
        relative = path.relative_to(checkpoint).as_posix()
        if path.is_file() and relative != MANIFEST_NAME and keep(relative):
            data = path.read_bytes()
            files.append({"path": relative, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest["files"] = files
    (checkpoint / MANIFEST_NAME).write_text(json.dumps(manifest))


def _load(checkpoint: Path, read_state=lambda folder: None) -> dict:
    return load_checkpoint(checkpoint, read_state=read_state, restore_rng=False)


def test_a_file_the_manifest_does_not_list_is_refused_before_anything_loads(tmp_path):
    checkpoint = save(tmp_path, 1)
    (checkpoint / "optimizer" / "extra_shard.pt").write_bytes(b"added later")
    calls = []
    with pytest.raises(CheckpointError, match=r"optimizer/extra_shard.pt is not listed in its lstune-checkpoint.json"):
        _load(checkpoint, calls.append)
    assert calls == []


def test_a_manifest_listing_only_itself_or_nothing_is_refused(tmp_path):
    checkpoint = save(tmp_path, 1)
    _rewrite_manifest(checkpoint, keep=lambda path: False)
    with pytest.raises(CheckpointError, match="does not list trainer_state.json"):
        _load(checkpoint)


def test_a_symbolic_link_inside_a_checkpoint_is_refused(tmp_path):
    checkpoint = save(tmp_path, 1)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "shard.pt").write_bytes(b"x")
    os.symlink(outside, checkpoint / "linked")
    with pytest.raises(CheckpointError, match="linked is a symbolic link"):
        _load(checkpoint)


@pytest.mark.parametrize("state, fragment", [
    ({"step": "1"}, "step is '1', not a number"),
    ({"step": 1, "consumed_samples": [1]}, "consumed_samples is [1], not a number"),
    ({"step": 1, "config": "x"}, "config is 'x', not a object"),
    ({"step": -1}, "step is -1, not a count"),
    ([1, 2], "holds a JSON list where a object belongs"),
])
def test_a_train_state_of_the_wrong_types_is_refused_naming_the_field(tmp_path, state, fragment):
    checkpoint = save(tmp_path, 1)
    (checkpoint / TRAINER_STATE_NAME).write_text(json.dumps(state))
    _rewrite_manifest(checkpoint)
    with pytest.raises(CheckpointError, match="trainer_state.json") as caught:
        _load(checkpoint)
    assert fragment in str(caught.value)


def test_json_nested_past_the_recursion_limit_is_a_message(tmp_path):
    checkpoint = save(tmp_path, 1)
    (checkpoint / TRAINER_STATE_NAME).write_text('{"step": 1, "config": ' + "[" * 200_000 + "]" * 200_000 + "}")
    _rewrite_manifest(checkpoint)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        _load(checkpoint)
    (checkpoint / MANIFEST_NAME).write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        _load(checkpoint)


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo never",))


def test_a_pickle_payload_is_refused_without_advising_weights_only_false(tmp_path):
    from lstune.untrusted import torch_load

    checkpoint = save(tmp_path, 1)
    torch.save({"state": _Payload()}, checkpoint / "optimizer.pt")
    _rewrite_manifest(checkpoint)

    def read_state(folder):
        torch_load(folder / "optimizer.pt", error=CheckpointError)

    with pytest.raises(CheckpointError) as caught:
        _load(checkpoint, read_state)
    message = str(caught.value)
    assert "optimizer.pt" in message and "posix.system" in message
    assert "weights_only" not in message and "will likely succeed" not in message


def test_an_engine_parser_error_is_a_checkpoint_error_naming_the_checkpoint(tmp_path):
    checkpoint = save(tmp_path, 1)

    def read_state(folder):
        torch.load(folder / "model.safetensors", weights_only=True)  # not a torch file: torch's own error

    with pytest.raises(CheckpointError, match=f"Checkpoint {checkpoint} cannot be loaded"):
        _load(checkpoint, read_state)


def test_torch_engine_refuses_a_lying_safetensors_header_naming_the_file(tmp_path):
    from lstune.train.engine import load_model_weights

    model = torch.nn.Linear(2, 2)
    folder = tmp_path / "model"
    folder.mkdir()
    header = json.dumps({"weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 10**12]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    with pytest.raises(CheckpointError, match="model.safetensors is not a valid safetensors file"):
        load_model_weights(model, folder)


def test_a_deepspeed_checkpoint_of_another_zero_stage_is_refused_up_front(tmp_path):
    from lstune.config.load import build_config
    from lstune.errors import ConfigError
    from lstune.parallel.engine_ds import DS_TAG, ZERO_STAGE_FILE
    from lstune.train.preflight import check_resume_compatible

    def write_state(folder):
        (folder / DS_TAG).mkdir()
        (folder / DS_TAG / ZERO_STAGE_FILE).write_text(json.dumps({"stage": 3}))

    checkpoint = save_checkpoint(tmp_path, 2, write_state=write_state, train_state={"config": {}})
    config = build_config(flags={"zero_stage": "2", "data": ["builtin:passkey"]})
    with pytest.raises(ConfigError, match=r"ZeRO-3 checkpoint and this run uses ZeRO-2.*--zero-stage 3"):
        check_resume_compatible(config, checkpoint, 1)
    check_resume_compatible(build_config(flags={"zero_stage": "3", "data": ["builtin:passkey"]}), checkpoint, 1)


@pytest.mark.parametrize("recorded", [True, False], ids=["stream-order", "older-checkpoint-config"])
def test_a_streamed_resume_under_another_seed_or_shuffle_buffer_is_refused_up_front(tmp_path, recorded):
    """--data-streaming resumes by replaying the stream: another --seed or --data-shuffle-buffer would replay another
    order (not the interrupted run's continuation), so it is refused naming both values and the fix. A checkpoint
    written before the order was recorded is checked against its config (a None buffer: the default)."""
    from lstune.config.load import build_config
    from lstune.config.schema import DEFAULT_SHUFFLE_BUFFER
    from lstune.errors import ConfigError
    from lstune.train.preflight import check_resume_compatible, stream_order

    def config(**flags):
        return build_config(flags={"data": ["a.jsonl"], "data_streaming": True, "max_steps": 4, **flags})

    saved = config(seed=42)
    train_state = {"config": {**saved.to_dict(), "data_shuffle_buffer": None}}
    if recorded:
        train_state["stream_order"] = stream_order(saved)
    checkpoint = save_checkpoint(tmp_path, 2, write_state=lambda folder: None, train_state=train_state)
    check_resume_compatible(config(seed=42), checkpoint, 1)
    check_resume_compatible(config(seed=42, data_shuffle_buffer=DEFAULT_SHUFFLE_BUFFER), checkpoint, 1)
    with pytest.raises(ConfigError, match=r"--seed is 7 but .* with --seed 42: .* resume with --seed 42") as seed:
        check_resume_compatible(config(seed=7), checkpoint, 1)
    assert "--data-shuffle-buffer" not in str(seed.value)
    with pytest.raises(ConfigError, match=rf"--data-shuffle-buffer is 0 but .* --data-shuffle-buffer "
                                          rf"{DEFAULT_SHUFFLE_BUFFER}: .*resume with --data-shuffle-buffer"):
        check_resume_compatible(config(seed=42, data_shuffle_buffer=0), checkpoint, 1)
    # Map-style data replays no stream: a changed seed is allowed there (and said, lstune.train.run.config_changes).
    map_style = save_checkpoint(tmp_path / "map", 2, write_state=lambda folder: None,
                                train_state={"config": build_config(flags={"data": ["a.jsonl"], "seed": 42}).to_dict()})
    check_resume_compatible(build_config(flags={"data": ["a.jsonl"], "seed": 7}), map_style, 1)


def test_a_train_state_without_consumed_samples_is_refused_on_resume(tmp_path):
    """The resume's data position comes from consumed_samples: a state without it is a CheckpointError (exit 2)
    naming the file and field, not a KeyError traceback."""
    from types import SimpleNamespace

    from lstune.train.run import _resume

    checkpoint = save(tmp_path, 1)
    (checkpoint / TRAINER_STATE_NAME).write_text(json.dumps({"step": 1}))
    _rewrite_manifest(checkpoint)
    with pytest.raises(CheckpointError, match="trainer_state.json: consumed_samples is missing"):
        _resume(SimpleNamespace(load=lambda folder: None), checkpoint)
