"""The hardware an estimate is for: a table of GPUs, and the cluster a run would use (devices × nodes, host memory).

Device bytes are what `torch.cuda.get_device_properties(...).total_memory` reports (less than the marketing
size: the driver keeps some). Throughputs are bf16: the dense matmul peak of the data sheet, and the two rates a
step time is computed with — `matmul_tflops` for everything that grows linearly with the sequence (matmuls
and the elementwise work around them: norms, rotary, casts, LoRA's thin matmuls) and `attention_tflops` for the
causal attention kernels. The H100 rates are fitted to the full-depth steps measured on one H100 80GB HBM3
(docs/benchmarks/2026-11-23-h100: Llama-3.1-8B LoRA, 8K-147K tokens; docs/estimate.md): 340 and 500 TFLOP/s,
against 700-800 for isolated GEMMs and 530-560 for isolated causal SDPA. The H200 (the H100's compute, 1.4 × its
memory bandwidth) keeps the attention rate and takes 530 for the linear work, fitted to its two full-depth 128K
steps (docs/benchmarks/2026-11-26-h200 and -h200-b: 50.72 and 51.21 s, where the H100's rates predicted 56.7 s);
attention is 78 % of that step, so the linear rate rests on one length and is the less certain of the two. The
other GPUs get the H100's fractions of their data-sheet peaks until `lstune bench` measures them.

The kernel rates (`gemm_kernel_tflops`, `attention_*_kernel_tflops`) are those `lstune bench --rates` measured for
the isolated kernels — GEMMs weighted by their FLOPs, causal attention at 128K — the "ideal" step's rates
(lstune.estimate.flops.KernelFlops): H100 80GB HBM3 2026-11-23 (762, 562, 529 TFLOP/s), H200 2026-11-26 (756, 550,
543); the other GPUs the H100's fractions of their peaks (not measured).

A GPU named without `--host-mem` brings a host of its class (`host_gib_per_gpu`: RAM per GPU of the node): 128 GiB
per H100 / H200 / A100-80GB (the one-GPU machines lstune was measured on had 125.9 GiB; 8-GPU nodes have 1-2 TiB),
64 GiB per A100-40GB / L40S. The estimate says which host it assumed; this machine's RAM is the host only when its
own CUDA device (or its CPU) is the device.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

from lstune.errors import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or the CPU): its memory and bf16 throughputs."""

    name: str
    device_bytes: int
    peak_tflops: float  # bf16 dense matmul, data sheet
    matmul_tflops: float  # bf16 matmul rate sustained inside a training step
    attention_tflops: float  # causal attention kernel, forward and backward
    host_link_gbps: float  # pinned host <-> device copies, GB/s
    kind: str = "cuda"  # "cuda" or "cpu"
    host_gib_per_gpu: int = 128  # the host a node of this GPU has, per GPU, when --host-mem is not given (module doc)
    # Isolated kernels' measured bf16 rates (module doc), the ideal step's; 0: none measured or scaled.
    gemm_kernel_tflops: float = 0.0
    attention_forward_kernel_tflops: float = 0.0
    attention_backward_kernel_tflops: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


_H100_KERNELS = (762.0, 562.0, 529.0)  # measured 2026-11-23 (docs/benchmarks/2026-11-23-h100)


def _scaled_kernels(peak: float) -> dict:
    """The H100's measured kernel rates as fractions of its 989 TFLOP/s peak, applied to `peak` (not measured)."""
    gemm, forward, backward = (rate * peak / 989.0 for rate in _H100_KERNELS)
    return {"gemm_kernel_tflops": gemm, "attention_forward_kernel_tflops": forward,
            "attention_backward_kernel_tflops": backward}


GPUS: dict[str, Hardware] = {
    "h100-80gb": Hardware("h100-80gb", 85_017_493_504, 989.0, 340.0, 500.0, 50.0, **_scaled_kernels(989.0)),
    "h200": Hardware("h200", int(139.8 * GIB), 989.0, 530.0, 510.0, 50.0, gemm_kernel_tflops=756.0,
                     attention_forward_kernel_tflops=550.0, attention_backward_kernel_tflops=543.0),
    "a100-80gb": Hardware("a100-80gb", int(79.15 * GIB), 312.0, 107.0, 156.0, 25.0, **_scaled_kernels(312.0)),
    "a100-40gb": Hardware("a100-40gb", int(39.39 * GIB), 312.0, 107.0, 156.0, 25.0, host_gib_per_gpu=64,
                          **_scaled_kernels(312.0)),
    "l40s": Hardware("l40s", int(44.39 * GIB), 362.0, 125.0, 163.0, 25.0, host_gib_per_gpu=64,
                     **_scaled_kernels(362.0)),
}
# A CPU "device": its memory is the host's (filled in by `resolve_hardware`); rates of a few cores.
CPU = Hardware("cpu", 0, 1.0, 0.2, 0.1, 10.0, kind="cpu")


def gpu_spec(name: str) -> Hardware:
    """The table entry for `name` (case-insensitive; `cpu` too); ConfigError naming the known ones otherwise."""
    key = name.strip().lower()
    if key == "cpu":
        return CPU
    if key not in GPUS:
        raise ConfigError([f"--gpu {name!r} is not a known GPU; use one of {', '.join(GPUS)} or cpu, or give "
                           "--device-mem (e.g. --device-mem 80G) for another one."])
    return GPUS[key]


@dataclass(frozen=True)
class Cluster:
    """The resolved hardware of a run: `gpus` devices per node on `nodes` nodes, `host_bytes` of RAM per node."""

    device: Hardware
    gpus: int
    nodes: int
    host_bytes: int
    source: str  # where the device came from: "local CUDA device", "--gpu h100-80gb", ...
    host_source: str = "--host-mem"  # where the host's size came from (`resolve_hardware`)
    # The step as `lstune estimate --trace` runs it in this cluster's place, on this CPU with fake tensors: the ALST
    # loss tiles (no Liger), mini-sequence without fused norms, offloaded attention chunks read in place, no CUDA
    # context (lstune.estimate.settings.settings). A plan made for it is the plan the trace runs.
    traced: bool = False

    @property
    def world_size(self) -> int:
        return self.gpus * self.nodes

    @property
    def on_cuda(self) -> bool:
        return self.device.kind == "cuda"

    def to_dict(self) -> dict:
        return {"device": self.device.to_dict(), "gpus": self.gpus, "nodes": self.nodes,
                "world_size": self.world_size, "host_bytes": self.host_bytes, "source": self.source,
                "host_source": self.host_source, **({"traced": True} if self.traced else {})}


def resolve_hardware(
    *, gpu: str | None = None, device_mem: int | None = None, host_mem: int | None = None, gpus: int = 1,
    nodes: int = 1, detect: bool = True,
) -> Cluster:
    """The cluster to estimate for. Device: `gpu` from the table, else this machine's CUDA device (when
    `detect`), else the CPU; `device_mem` overrides its memory (an unlisted GPU: H100 rates). Host: `host_mem`;
    else, for a GPU named (`gpu`, `device_mem`), the host of its class (`host_gib_per_gpu` × `gpus`: never this
    machine's RAM, which says nothing of the named one's); else this machine's RAM. CPU processes share the node's
    RAM: each has its 1/`gpus` share as its "device", as `lstune train` counts them
    (lstune.train.engine_choice.runtime_cluster)."""
    problems = []
    if nodes < 1:
        problems.append(f"--nodes {nodes}: give at least 1 node.")
    if gpus < 1:
        problems.append(f"--gpus {gpus}: give at least 1 process per node.")
    for flag, value, example in (("--device-mem", device_mem, "80G"), ("--host-mem", host_mem, "128G")):
        if value is not None and value < GIB:
            problems.append(f"{flag} {value} bytes is less than 1 GiB; give e.g. {flag} {example}.")
    if problems:
        raise ConfigError(problems)
    device, source = _device(gpu, device_mem, detect)
    host, host_source = _host(device, source, host_mem, gpus)
    if device.kind == "cpu":
        device = replace(device, device_bytes=device_mem or host // gpus)
    return Cluster(device, gpus, nodes, host, source, host_source)


def _host(device: Hardware, source: str, host_mem: int | None, gpus: int) -> tuple[int, str]:
    """(bytes of host RAM per node, where that figure came from): resolve_hardware's rule."""
    if host_mem is not None:
        return host_mem, "--host-mem"
    if device.kind == "cuda" and source.startswith("--"):
        per = device.host_gib_per_gpu
        return per * gpus * GIB, (f"assumed: {per} GiB per GPU, the default host of a {device.name} node; "
                                  "give --host-mem for yours")
    return local_host_bytes(), "this machine's RAM"


def _device(gpu: str | None, device_mem: int | None, detect: bool) -> tuple[Hardware, str]:
    if gpu is not None:
        spec = gpu_spec(gpu)
        if device_mem is not None and spec.kind == "cuda":
            return replace(spec, device_bytes=device_mem), f"--gpu {gpu} with --device-mem"
        return spec, f"--gpu {gpu}"
    if device_mem is not None:
        return replace(GPUS["h100-80gb"], name="gpu", device_bytes=device_mem), "--device-mem (H100 rates)"
    local = local_cuda_device() if detect else None
    if local is not None:
        return local, "this machine's CUDA device"
    return CPU, "this machine's CPU (no CUDA device; give --gpu or --device-mem to estimate for a GPU)"


def local_cuda_device() -> Hardware | None:
    """This machine's first CUDA device with its measured memory, rates from the table entry its name matches
    (H100 rates when none does), or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return replace(_table_entry(props.name, props.total_memory), name=props.name, device_bytes=props.total_memory)


def _table_entry(device_name: str, total_bytes: int) -> Hardware:
    name = device_name.lower()
    for model in ("h200", "h100", "l40s"):
        if model in name:
            return GPUS["h100-80gb" if model == "h100" else model]
    if "a100" in name:
        return GPUS["a100-80gb" if total_bytes > 60 * GIB else "a100-40gb"]
    return GPUS["h100-80gb"]


def local_host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
