"""Named hardware brings named assumptions (issue 32): a GPU named without --host-mem gets the stated host of its
class, never this machine's RAM; the estimate's text says which host it assumed."""

from __future__ import annotations

import lstune.estimate.hardware as hardware
from lstune.estimate.hardware import GPUS, resolve_hardware

GiB = 2**30


def test_a_named_gpu_without_host_mem_takes_its_classs_host_not_this_machines(monkeypatch):
    monkeypatch.setattr(hardware, "local_host_bytes", lambda: 24 * GiB)  # a CPU box
    one = resolve_hardware(gpu="h100-80gb")
    assert one.host_bytes == 128 * GiB and "assumed" in one.host_source and "--host-mem" in one.host_source
    assert resolve_hardware(gpu="h200", gpus=8).host_bytes == 8 * 128 * GiB
    assert resolve_hardware(gpu="l40s", gpus=2).host_bytes == 2 * 64 * GiB
    assert resolve_hardware(device_mem=80 * GiB).host_bytes == 128 * GiB  # an unlisted GPU: the H100's class
    given = resolve_hardware(gpu="h100-80gb", host_mem=64 * GiB)
    assert given.host_bytes == 64 * GiB and given.host_source == "--host-mem"
    # This machine's own device (here its CPU) is judged with this machine's RAM, and says so.
    cpu = resolve_hardware(gpu="cpu")
    assert cpu.host_bytes == 24 * GiB and cpu.host_source == "this machine's RAM"
    assert resolve_hardware(detect=False).host_source == "this machine's RAM"


def test_every_listed_gpu_states_a_host_and_kernel_rates():
    for spec in GPUS.values():
        assert spec.host_gib_per_gpu in (64, 128)
        assert spec.gemm_kernel_tflops > spec.matmul_tflops  # an isolated GEMM beats a training step's matmuls
        assert 0 < spec.attention_backward_kernel_tflops <= spec.attention_forward_kernel_tflops


def test_the_estimates_text_names_the_host_it_assumed(monkeypatch):
    from lstune.cli.app import app
    from typer.testing import CliRunner

    monkeypatch.setattr(hardware, "local_host_bytes", lambda: 24 * GiB)
    result = CliRunner().invoke(app, ["estimate", "--model", "tiny-llama", "--seq-len", "4k", "--gpu", "h100-80gb"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "host 128.0 GiB per node (assumed: 128 GiB per GPU, the default host of a h100-80gb node; give " \
           "--host-mem for yours)" in text
    assert "MFU" in text and "HFU" in text and "× with recompute" in text and "× without" in text
