"""The runtime of a single process, and the output folder's rules (nothing overwritten unasked)."""

from __future__ import annotations

import pytest
import torch

from lstune.config.schema import RunSection
from lstune.errors import UserError
from lstune.train.outputs import (
    CONFIG_FILE,
    LOG_FILE,
    RECORD_NAME,
    OutputFolder,
    default_output_dir,
    resolve_output_dir,
    write_config_snapshot,
)
from lstune.train.runtime import Runtime, start_runtime


def test_a_single_process_runtime_is_its_own_world():
    runtime = start_runtime("fp32")
    assert runtime.device.type in ("cpu", "cuda") and runtime.autocast_dtype is None
    assert (runtime.rank, runtime.world_size, runtime.is_main, runtime.distributed, runtime.sp) == (0, 1, True, False, 1)
    assert runtime.sum([1.5, 2.0]) == [1.5, 2.0]
    assert runtime.any(True) and not runtime.any(False)
    order = []
    with runtime.main_first():
        order.append("main")
    runtime.barrier()
    assert order == ["main"]


def test_the_runtime_silences_the_library_warnings_users_cannot_act_on():
    """DeepSpeed's deprecated collectives (every ZeRO step) and its NCCL barriers without a bound device warn from
    inside the library; after start_runtime they are silent, and other warnings are not."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start_runtime("fp32")
        warnings.warn("torch.distributed.reduce_scatter_tensor is deprecated", FutureWarning)
        warnings.warn("barrier(): using the device under current context. You can specify `device_id`", UserWarning)
        warnings.warn("something else", UserWarning)
    assert [str(w.message) for w in caught] == ["something else"]


def test_bf16_is_autocast_on_cpu_only_when_asked():
    assert start_runtime("bf16").autocast_dtype == torch.bfloat16
    if not torch.cuda.is_available():
        assert start_runtime("auto").autocast_dtype is None


def test_dims_follow_the_model_heads():
    from lstune.models.presets import preset_config

    runtime = Runtime(torch.device("cpu"), None)
    runtime.set_dims("auto", preset_config("tiny-llama"))
    assert runtime.sp == 1 and runtime.dims.dp == 1
    assert runtime.dims.world_comm.size == 1 and runtime.dims.sp_comm.size == 1


def test_a_non_empty_output_folder_needs_resume_or_overwrite(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="nothing is overwritten unasked"):
        resolve_output_dir(RunSection(output_dir=str(tmp_path)), "tiny-llama")
    assert resolve_output_dir(RunSection(output_dir=str(tmp_path), overwrite=True), "x") == (tmp_path, None)


def test_overwrite_clears_only_what_lstune_wrote(tmp_path):
    previous = OutputFolder(tmp_path).open(overwrite=False)
    for name in ("metrics.jsonl", CONFIG_FILE):
        previous.claim(name).write_text("x")
    previous.claim("final").mkdir()
    previous.close()
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "checkpoint-3.bak").mkdir()  # not a name lstune writes (a checkpoint-3 of the user's is refused:
    # tests/unit/train/test_outputs.py)
    folder = OutputFolder(tmp_path).open(overwrite=True)
    try:
        folder.clear_previous()
    finally:
        folder.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["checkpoint-3.bak", "notes.txt", RECORD_NAME, LOG_FILE])


def test_default_folder_and_config_snapshot(tmp_path):
    assert default_output_dir("org/Model-7B").parts[:1] == ("runs",)
    assert default_output_dir("org/Model-7B").name.startswith("model-7b-")
    folder = OutputFolder(tmp_path).open(overwrite=False)
    try:
        write_config_snapshot(folder, {"seq_len": 4096})
    finally:
        folder.close()
    text = (tmp_path / CONFIG_FILE).read_text()
    assert text.startswith("# resolved config written by lstune") and "seq_len: 4096" in text
