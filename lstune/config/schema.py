"""The typed config of a training run: one dataclass, one field per flag / recipe key.

A recipe (YAML) and command-line flags use the same names (`seq_len` in YAML is `--seq-len` on the
command line). Each field's metadata holds its help text, its parser and its section; the CLI builds its
options from these, so the help, the recipe keys and the validation never drift apart.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from functools import partial
from typing import Any, Callable

from lstune.config import parse as p


def _opt(default: Any, help: str, parser: Callable[[Any], Any], section: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, "parser": parser, "section": section, **meta})


MODEL, DATA, OPTIM, MEMORY, PARALLEL, RUN = "Model", "Data", "Optimisation", "Memory", "Parallelism", "Run"

_nonneg_int = partial(p.parse_int, minimum=0)
_pos_int = partial(p.parse_int, minimum=1)


@dataclass
class TrainConfig:
    """Everything `lstune train` needs. Defaults train the embedded demo (tiny-llama on passkey data)."""

    # --- model
    model: str = _opt(
        "tiny-llama",
        "Hub id (org/name), local HF model folder, or preset name (see `lstune presets`).",
        str,
        MODEL,
    )
    init: str = _opt(
        "auto",
        "Weights: 'pretrained' loads them, 'random' initialises from the config; 'auto' = random for "
        "presets, pretrained otherwise.",
        partial(p.parse_choice, choices=("auto", "pretrained", "random")),
        MODEL,
    )
    dtype: str = _opt(
        "auto",
        "Compute dtype: 'auto' = bf16 autocast with fp32 master weights on CUDA, fp32 on CPU; or fp32.",
        partial(p.parse_choice, choices=("auto", "bf16", "fp32")),
        MODEL,
    )
    attn: str = _opt(
        "auto",
        "Attention kernel: auto, sdpa, flex or flash_attention_2 (needs flash-attn and CUDA).",
        partial(p.parse_choice, choices=("auto", "sdpa", "flex", "flash_attention_2")),
        MODEL,
    )
    trust_remote_code: bool = _opt(
        False, "Allow model code from the hub repository (only for models you trust).", p.parse_bool, MODEL
    )
    lora_r: int = _opt(0, "LoRA rank; 0 = full fine-tune.", _nonneg_int, MODEL)
    lora_alpha: int | None = _opt(None, "LoRA alpha (default: 2 × rank).", _pos_int, MODEL)
    lora_dropout: float = _opt(
        0.0, "LoRA dropout.", partial(p.parse_float, minimum=0.0, maximum=0.99), MODEL
    )
    lora_targets: Any = _opt(
        "auto",
        "Modules LoRA adapts: comma-separated names, or 'auto' = every linear layer but the output head.",
        p.parse_str_list,
        MODEL,
        accepts_list=True,
    )
    merge_lora: bool = _opt(
        False, "With LoRA: also write the merged full model to OUTPUT_DIR/final-merged.", p.parse_bool, MODEL
    )

    # --- data
    data: str = _opt(
        "builtin:passkey",
        "Training data: a JSONL/JSON/Parquet/Arrow file or folder, a save_to_disk folder, a hub dataset "
        "name, or builtin:passkey (bundled synthetic task).",
        str,
        DATA,
    )
    seq_len: int = _opt(4096, f"Tokens per sample; {p.LENGTH_HINT} (k = 1024).", p.parse_length, DATA)
    pack: bool = _opt(
        False,
        "Pack documents into full-length samples (positions restart per document; attention never "
        "crosses documents) instead of one padded/truncated sample per record.",
        p.parse_bool,
        DATA,
    )
    max_records: int | None = _opt(None, "Use only the first N records of the data.", _pos_int, DATA)

    # --- memory (lstune.memory; docs/memory.md)
    tiled_mlp: Any = _opt(
        "auto",
        "Run each MLP over sequence tiles, recomputed in backward: 'auto' = ceil(seq / hidden) tiles (ALST), "
        "'off', or a tile count.",
        p.parse_auto_off_int,
        MEMORY,
    )
    tiled_loss: Any = _opt(
        "auto",
        "Compute logits + loss tile by tile, never the full [seq, vocab] logits: 'auto' = tiles of <= ~1 GiB of "
        "fp32 logits, 'off' (one tile), or a tile count.",
        p.parse_auto_off_int,
        MEMORY,
    )
    mini_sequence: bool = _opt(
        False,
        "Mini-sequence policy (MST): MLP tiles of hidden-size tokens with the layer norm fused in, loss in "
        "vocab/hidden tiles.",
        p.parse_bool,
        MEMORY,
    )
    checkpointing: bool = _opt(
        True, "Activation checkpointing of every decoder layer: on or off.", p.parse_bool, MEMORY, style="value"
    )
    offload_checkpoints: bool = _opt(
        False,
        "Keep each layer's checkpointed hidden state in host memory (async copies, prefetched in backward); "
        "falls back to plain checkpointing when the sequence is too short for it to pay.",
        p.parse_bool,
        MEMORY,
    )
    host_mem_budget: int | None = _opt(
        None,
        "Host memory offloaded checkpoints may use, e.g. 64G; layers beyond it stay on the device.",
        p.parse_bytes,
        MEMORY,
    )

    # --- parallelism (lstune.parallel; docs/parallel.md)
    gpus: int = _opt(
        1,
        "Processes per node: lstune launches them itself (one per GPU; on a machine without CUDA, CPU "
        "processes with gloo). Under torchrun / deepspeed / accelerate launch the launcher's world is used.",
        _pos_int,
        PARALLEL,
    )
    sp: Any = _opt(
        "auto",
        "Sequence-parallel degree (Ulysses): 'auto' picks it from the processes and attention heads, or a "
        "number dividing the process count.",
        p.parse_auto_int,
        PARALLEL,
    )
    zero_stage: Any = _opt(
        "auto",
        "DeepSpeed ZeRO stage 0-3; 'auto' chooses from model size and device memory (0 = plain single-device "
        "AdamW).",
        partial(p.parse_choice, choices=("auto", "0", "1", "2", "3")),
        PARALLEL,
    )
    offload_optimizer: bool | None = _opt(
        None, "Keep Adam state in host memory (DeepSpeed); default: decided with --zero-stage auto.",
        p.parse_bool, PARALLEL,
    )
    offload_params: bool | None = _opt(
        None, "Keep weights in host memory (ZeRO-3); default: decided with --zero-stage auto.",
        p.parse_bool, PARALLEL,
    )
    hostfile: str | None = _opt(
        None, "DeepSpeed hostfile for multi-node runs (one line per node: `node-1 slots=8`).",
        p.parse_optional_str, PARALLEL,
    )

    # --- optimisation
    max_steps: int | None = _opt(
        None, "Optimizer steps to train (default: one epoch over the data).", _pos_int, OPTIM
    )
    epochs: float | None = _opt(
        None, "Epochs to train when --max-steps is not given (default 1).",
        partial(p.parse_float, above=0.0), OPTIM,
    )
    lr: float = _opt(2e-5, "Peak learning rate.", partial(p.parse_float, minimum=0.0), OPTIM)
    min_lr_ratio: float = _opt(
        0.1, "Final learning rate of the cosine schedule, as a fraction of --lr.",
        partial(p.parse_float, minimum=0.0, maximum=1.0), OPTIM,
    )
    schedule: str = _opt(
        "cosine", "Learning-rate schedule after warmup: cosine, linear or constant.",
        partial(p.parse_choice, choices=("cosine", "linear", "constant")), OPTIM,
    )
    warmup_steps: int | None = _opt(
        None, "Linear warmup steps (default: 3% of the steps).", _nonneg_int, OPTIM
    )
    weight_decay: float = _opt(0.0, "AdamW weight decay.", partial(p.parse_float, minimum=0.0), OPTIM)
    # Adam divides by (1 - beta^t) and by sqrt(v) + eps: beta = 1 or eps = 0 divide by zero.
    adam_beta1: float = _opt(0.9, "AdamW beta1, in [0, 1).", partial(p.parse_float, minimum=0.0, below=1.0), OPTIM)
    adam_beta2: float = _opt(0.95, "AdamW beta2, in [0, 1).", partial(p.parse_float, minimum=0.0, below=1.0), OPTIM)
    adam_eps: float = _opt(1e-8, "AdamW epsilon (> 0).", partial(p.parse_float, above=0.0), OPTIM)
    max_grad_norm: float = _opt(
        1.0, "Clip the gradient norm to this (0 = no clipping).", partial(p.parse_float, minimum=0.0), OPTIM
    )
    micro_batch_size: int = _opt(1, "Samples per forward/backward.", _pos_int, OPTIM)
    grad_accum: int = _opt(
        1, "Micro-batches per optimizer step; the loss is normalised over the whole window's tokens.",
        _pos_int, OPTIM,
    )
    seed: int = _opt(42, "Random seed (weights init, data order).", _nonneg_int, OPTIM)

    # --- run
    output_dir: str | None = _opt(
        None, "Where checkpoints, metrics and the final model go (default: runs/MODEL-TIMESTAMP).",
        p.parse_optional_str, RUN,
    )
    save_every: int | None = _opt(
        None, "Save a checkpoint every N steps (always at the end).", _pos_int, RUN
    )
    keep_last: int | None = _opt(2, "Keep the newest N checkpoints (0 = keep all).", _nonneg_int, RUN)
    resume: str | None = _opt(
        None, "Resume: 'latest' (newest checkpoint in --output-dir) or a checkpoint path.",
        p.parse_optional_str, RUN, flag_value="latest",
    )
    overwrite: bool = _opt(
        False, "Allow an existing --output-dir; its old checkpoints and metrics are removed.",
        p.parse_bool, RUN,
    )
    stop_at_step: int | None = _opt(
        None,
        "Stop after this step with a checkpoint, keeping the schedule planned for --max-steps; continue later "
        "with --resume (for jobs with a time limit).",
        _pos_int,
        RUN,
    )
    log_every: int = _opt(1, "Print a progress line every N steps.", _pos_int, RUN)
    skip_nonfinite_steps: bool = _opt(
        False,
        "Skip a step whose loss or gradient norm is NaN/inf (its update is not applied) instead of stopping "
        "the run; it still stops after 10 such steps in a row.",
        p.parse_bool,
        RUN,
    )
    trust_checkpoint: bool = _opt(
        False,
        "Resume from a DeepSpeed checkpoint even when its files hold Python objects beyond tensors and plain "
        "data, which loading would execute: only for checkpoints you wrote or trust.",
        p.parse_bool,
        RUN,
    )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def config_fields() -> list:
    """The fields of TrainConfig in declaration order (the CLI's option order)."""
    return list(fields(TrainConfig))


def field_default(f) -> Any:
    return f.default if f.default is not MISSING else None
