"""Which engine trains the model, and whether the run fits: the estimate's answer for this machine.

The run plan (lstune.train.plan) asks lstune.estimate the same question `lstune estimate` answers (`plan_run` is
that estimate alone), for the hardware this process runs on (its device, the processes per node and nodes of the launch, this machine's RAM), before any weight is
loaded. The engine is the estimate's: with `--zero-stage auto`, the first of single-device AdamW (one process),
ZeRO-1, -2, -3, ZeRO-3 with Adam state on the host, and with the weights on the host too, then with 3/4, 1/2 or
1/4 of the Adam state on the host (the rest on the GPU, `--offload-ratio`), then every other k/32 of it
(lstune.estimate.partial_offload_ratios), whose predicted
device and host peaks fit; `--zero-stage N`, `--offload-optimizer` and `--offload-params` are taken as given.
On CPU one process always trains with plain AdamW and several with ZeRO-1 (nothing to offload to). The `auto`
memory settings come from the same estimate (`Estimate.memory_choice`, lstune.estimate.choose_memory): the
fewest MLP / loss tiles that keep the peak within 90% of the device, checkpoint offload only when the run does not
fit without it; train prepares the model with them (`MemoryChoice.applied_to`) and its plan says why.

`check_fits` stops a run the estimate says will not fit, with exit code 2 and the cheapest changes that
would, unless `--force`. On CPU the "device" is this machine's RAM, so only a run predicted to need more than
all of it stops (the CPU demo and tests are far below).
"""

from __future__ import annotations

from lstune.config.schema import TrainConfig
from lstune.errors import ConfigError


def runtime_cluster(runtime, host_cap: int | None = None):
    """The hardware this run has: this device (CUDA or CPU) × the launch's processes per node × nodes
    (lstune.train.plan.machine_cluster); `host_cap`: the most host memory it may use."""
    from lstune.train.plan import machine_cluster

    local = runtime.launch.local_world_size if runtime.launch else 1
    nodes = max(1, runtime.world_size // max(local, 1))
    return machine_cluster(runtime.device.type, local, nodes, host_cap)


def plan_run(config: TrainConfig, runtime, model_config, *, cluster=None, resolve_auto: bool = True):
    """The estimate (lstune.estimate.Estimate) of this run on this machine: engine, peaks, verdict
    (`resolve_auto`: see lstune.estimate.estimate)."""
    from lstune.estimate import estimate

    return estimate(config, cluster or runtime_cluster(runtime), model_config=model_config, resolve_auto=resolve_auto)


def zero_plan(prediction):
    """The ZeroPlan of the estimate's engine for DeepSpeed, or None for the single-device TorchEngine."""
    from lstune.parallel.engine_ds import ZeroPlan

    engine = prediction.engine
    if engine.kind == "torch":
        return None
    static = sum(i.device for i in prediction.breakdown.items if i.name.startswith(("param", "grad", "optim")))
    return ZeroPlan(engine.zero_stage, engine.offload_optimizer, engine.offload_params, static,
                    f"{engine.describe()}; {_peaks(prediction)}", engine.offload_ratio)


def prediction_note(prediction) -> str:
    choice = prediction.memory_choice
    memory = f"; {choice.describe()}" if choice is not None else ""
    return f"estimate: {prediction.engine.describe()}; {_peaks(prediction)}; {prediction.verdict()}{memory}"


def _peaks(prediction) -> str:
    from lstune.estimate.memory import size_text

    m = prediction.margin
    return (f"predicted peak {size_text(prediction.device_peak_bytes)} of {size_text(prediction.device_capacity)} "
            f"per device, host {size_text(prediction.host_peak_bytes)} of {size_text(prediction.host_capacity)} "
            f"(a fit keeps {m.device_share:.0%} of the device and {m.host_share:.0%} of the host free)")


def check_fits(config: TrainConfig, prediction, runtime) -> None:
    """ConfigError (exit 2) when the run is predicted not to fit and --force is not given."""
    if prediction.fits or config.run.force:
        return
    from lstune.config.parse import format_length
    from lstune.estimate.memory import size_text

    changes = [s for s in prediction.suggestions if s.fits][:3]
    advice = "; ".join(f"{s.flags} (peak {size_text(s.device_peak_bytes)})" for s in changes)
    longest = prediction.longest_seq_len
    raise ConfigError([
        f"--seq-len {format_length(config.data.seq_len)} is predicted not to fit: {_peaks(prediction)}. "
        + (f"Changes that would fit: {advice}. " if advice else "")
        + (f"The longest sequence that fits as configured is {format_length(longest)}. " if longest else "")
        + "See `lstune estimate` with the same flags for the breakdown, or add --force to try anyway."
    ])

