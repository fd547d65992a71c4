"""The configurations a bench measures: ALST Table 1's ladder (arXiv:2506.13996, Sec. 5) on the user's model.

Each rung adds one technique to the one before, over the user's flags (model, LoRA, dtype, optimizer):

    hf          plain Hugging Face: its SDPA attention, its gradient checkpointing, its own loss (full logits);
                no lstune patch at all (lstune.bench.trial's `hf_loss_sum`)
    tiled_loss  lstune's attention (no 4D mask) and checkpointing, logits + loss in tiles
    tiled_mlp   + the MLP in sequence tiles (what `lstune train` runs by default)
    offload     + checkpoints offloaded to host memory
    mini_seq    + the mini-sequence policy (MST: norms fused into the MLP tiles)
    lstune      the flags as given: what `lstune train` with the same flags runs
    sp          `lstune` on --gpus processes: Ulysses sequence parallelism

Sequence-parallel layouts over --gpus processes, all of them one SP group (opt-in, `--rungs`; METP's ring
attention, lstune.memory.attention_ring), to compare at equal degree:

    sp_ulysses  Ulysses alone (--sp-ring 1; at most one rank per query head)
    sp_ring     ring attention alone (--sp-ring = --gpus)
    sp_hybrid   Ulysses × ring: a ring of 2, Ulysses over the rest (--gpus 4 or more)

On CPU (gloo) these check that each layout runs; their times mean something only on GPUs.

Every rung but `lstune` and the `sp*` ones runs in one process; `lstune` runs on --gpus processes unless it is one
rung of the ladder (the ladder's `sp` rung is that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lstune.config.schema import TrainConfig

_OFF = {"tiled_mlp": "off", "tiled_loss": "off", "mini_sequence": False, "checkpointing": True, "attn_chunks": "off",
        "offload_checkpoints": False, "host_mem_budget": None}


@dataclass(frozen=True)
class Rung:
    name: str
    label: str
    memory: dict[str, Any] | None  # memory settings (flat keys) over the flags; None: the flags' own
    plain_hf: bool = False
    all_processes: bool = False  # runs on the flags' --gpus processes (else one)
    sp_ring: str | int | None = None  # an SP layout over all --gpus: "none" (Ulysses), "all" (ring) or a ring size


RUNGS: dict[str, Rung] = {r.name: r for r in (
    # The estimate has no plain-HF model; HF's step is closest to lstune's with nothing tiled.
    Rung("hf", "plain HF (SDPA, HF checkpointing, HF loss)", dict(_OFF), plain_hf=True),
    Rung("tiled_loss", "+ tiled loss", {**_OFF, "tiled_loss": "auto"}),
    Rung("tiled_mlp", "+ tiled MLP", {**_OFF, "tiled_loss": "auto", "tiled_mlp": "auto"}),
    Rung("offload", "+ offloaded checkpoints", {**_OFF, "tiled_loss": "auto", "tiled_mlp": "auto",
                                                "offload_checkpoints": True}),
    Rung("mini_seq", "+ mini-sequence", {**_OFF, "tiled_loss": "auto", "tiled_mlp": "auto",
                                         "offload_checkpoints": True, "mini_sequence": True}),
    Rung("lstune", "lstune (the flags as given)", None, all_processes=True),
    Rung("sp", "+ sequence parallelism (--gpus)", None, all_processes=True),
    Rung("sp_ulysses", "SP over --gpus: Ulysses alone", {"attn_chunks": "off"}, all_processes=True, sp_ring="none"),
    Rung("sp_ring", "SP over --gpus: ring attention alone", {"attn_chunks": "off"}, all_processes=True, sp_ring="all"),
    Rung("sp_hybrid", "SP over --gpus: Ulysses × ring 2", {"attn_chunks": "off"}, all_processes=True, sp_ring=2),
)}
SP_LAYOUTS = ("sp_ulysses", "sp_ring", "sp_hybrid")
LADDER = ("hf", "tiled_loss", "tiled_mlp", "offload", "mini_seq")
MEMORY_KEYS = tuple(_OFF)


def rung_config(config: TrainConfig, rung: Rung, *, in_ladder: bool = False) -> TrainConfig:
    """The configuration `rung` runs: the flags with the rung's memory settings, on one process or on --gpus."""
    values = config.to_dict()
    values.update(rung.memory or {})
    one_process = not rung.all_processes or (in_ladder and rung.name == "lstune")
    if one_process:
        values.update(gpus=1, sp="auto", hostfile=None)
    if rung.sp_ring is not None:
        gpus = values["gpus"]
        ring = {"none": 1, "all": gpus}.get(rung.sp_ring, rung.sp_ring)
        values.update(sp=gpus, sp_ring=ring)
    return TrainConfig.from_flat(values)


def select_rungs(config: TrainConfig, names: list[str] | None, ablation: bool) -> tuple[list[Rung], list[str]]:
    """The rungs to measure, in order, and the problems with the choice (unknown names, SP on one process)."""
    problems = []
    if names is not None and ablation:
        problems.append("--ablation measures the whole ladder; drop --rungs, or drop --ablation to measure only "
                        f"{','.join(names)}.")
    if ablation:
        return ladder(config), problems
    chosen = []
    for name in names or ["lstune"]:
        if name not in RUNGS:
            problems.append(f"--rungs {name!r} is not a configuration; use some of {', '.join(RUNGS)}.")
        elif RUNGS[name] not in chosen:
            chosen.append(RUNGS[name])
    for rung in chosen:
        if rung.name in ("sp", *SP_LAYOUTS) and config.parallel.gpus < 2:
            problems.append(f"--rungs {rung.name} runs on several processes: add --gpus 2 (or more).")
        elif rung.name == "sp_hybrid" and (config.parallel.gpus < 4 or config.parallel.gpus % 2):
            problems.append("--rungs sp_hybrid (Ulysses × a ring of 2) needs an even --gpus of 4 or more.")
    return chosen, problems


def ladder(config: TrainConfig) -> list[Rung]:
    """hf → tiled_loss → tiled_mlp → offload → mini_seq, then the flags' own configuration when it differs
    from every rung's, then SP over --gpus processes."""
    rungs = [RUNGS[name] for name in LADDER]
    if same_as(config) is None:
        rungs.append(RUNGS["lstune"])
    if config.parallel.gpus > 1:
        rungs.append(RUNGS["sp"])
    return rungs


def same_as(config: TrainConfig) -> str | None:
    """The ladder rung whose memory settings are exactly the flags' (None when none is)."""
    given = {key: value for key, value in config.to_dict().items() if key in MEMORY_KEYS}
    return next((name for name in LADDER if RUNGS[name].memory == given), None)
