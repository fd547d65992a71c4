"""The hardware fingerprint: every field bench.json promises, read without importing torch or starting CUDA."""

from __future__ import annotations

import subprocess
import sys

from lstune.bench.fingerprint import describe, fingerprint, git_commit


def test_the_fingerprint_has_every_field_and_imports_no_torch():
    code = ("import json, sys; from lstune.bench.fingerprint import fingerprint; print(json.dumps(fingerprint())); "
            "assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    fp = fingerprint()
    assert {"gpus", "cuda", "host_ram_bytes", "cpu_cores", "versions", "lstune", "python"} <= set(fp)
    assert {"torch", "transformers", "deepspeed", "peft", "liger-kernel"} <= set(fp["versions"])
    assert fp["versions"]["torch"] and fp["host_ram_bytes"] > 2**30 and fp["cpu_cores"] >= 1
    for gpu in fp["gpus"]:
        assert {"name", "memory_bytes", "driver"} <= set(gpu)


def test_the_git_commit_is_the_checkouts():
    commit = git_commit()
    if commit:  # a git checkout (the tests' own)
        assert len(commit["commit"]) == 40 and isinstance(commit["dirty"], bool)


def test_the_description_names_gpu_versions_and_commit():
    fp = {"gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 81559 * 2**20, "driver": "580.1"}],
          "cuda": "13.0", "host_ram_bytes": 125 * 2**30, "cpu_cores": 16, "cpu": "x86_64", "python": "3.11.7",
          "versions": {"torch": "2.11.0", "transformers": "5.23.0", "deepspeed": None, "peft": "0.21.2",
                       "liger-kernel": "0.8.5"},
          "lstune": {"version": "0.1.0", "commit": "8279a1d" + "0" * 33, "dirty": False}}
    lines = describe(fp)
    assert "H100" in lines[0] and "79.6 GiB" in lines[0] and "driver 580.1" in lines[0] and "CUDA 13.0" in lines[0]
    assert "deepspeed" not in lines[1] and "liger-kernel 0.8.5" in lines[1]
    assert lines[2] == "lstune 0.1.0 at 8279a1d000"
