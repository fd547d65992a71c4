"""The typed config of a run: `TrainConfig` composes one typed section per concern.

Sections: `model` (ModelSection), `data` (DataSection), `memory` (MemorySection), `parallel`
(ParallelSection), `optim` (OptimSection), `run` (RunSection) — torchtitan's `config/configs.py` layout.
Library entry points take the section they need (`apply_memory_techniques(model, config.memory, ...)`),
and each section owns `problems()`, the rules about its own values, used by the CLI and by those entry
points alike; `TrainConfig.problems()` adds the few rules that span two sections.

Users keep flat names: a recipe key (`seq_len: 32k`) and a flag (`--seq-len 32k`) name one field of
one section; `flat_key(field)` is that name (the field's own name, or its `key` metadata where the
section calls it something else: `model.name` is `model`, `data.source` is `data`). Each field's
metadata holds its help text, parser and metavar; the CLI builds its options from them
(lstune.cli.options), so the help, the recipe keys and the validation never drift apart.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any, Callable, ClassVar

from lstune.config import parse as p
from lstune.config.record import holds_a_run
from lstune.untrusted import path_kind


def _opt(default: Any, help: str, parser: Callable[[Any], Any], **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, "parser": parser, **meta})


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


_nonneg_int = partial(p.parse_int, minimum=0)
_pos_int = partial(p.parse_int, minimum=1)
DEFAULT_SHUFFLE_BUFFER = 1000  # records held by --data-streaming's shuffle buffer unless --data-shuffle-buffer
TILE_SETTING_HINT = "'auto', 'off' or a tile count >= 1"
_LORA_ONLY = ("lora_alpha", "lora_targets", "merge_lora", "lora_dropout", "lora_dora", "lora_rslora")
LORA_ONLY = _LORA_ONLY  # the model keys that act only with a LoRA rank


@dataclass
class ModelSection:
    """Which model, its weights, precision and attention kernel, and LoRA."""

    title: ClassVar[str] = "Model"

    name: str = _opt(
        "tiny-llama",
        "Hub id (org/name), local HF model folder, or preset name (see `lstune presets`).",
        p.parse_model_name,
        key="model",
        metavar="MODEL",
    )
    init: str = _opt(
        "auto",
        "Weights: 'pretrained' loads them, 'random' initialises from the config; 'auto' = random for "
        "presets, pretrained otherwise.",
        partial(p.parse_choice, choices=("auto", "pretrained", "random")),
    )
    dtype: str = _opt(
        "auto",
        "Compute dtype: 'auto' = bf16 autocast with fp32 master weights on CUDA, fp32 on CPU; or fp32.",
        partial(p.parse_choice, choices=("auto", "bf16", "fp32")),
    )
    attn: str = _opt(
        "auto",
        "Attention kernel: auto, sdpa, flex or flash_attention_2 (needs flash-attn and CUDA).",
        partial(p.parse_choice, choices=("auto", "sdpa", "flex", "flash_attention_2")),
    )
    trust_remote_code: bool = _opt(
        False, "Allow model code from the hub repository (only for models you trust).", p.parse_bool
    )
    rope_scaling: str = _opt(
        "none",
        "Extend the model's positions (RoPE scaling, saved in the final model's config): none, linear, dynamic, "
        "yarn or llama3.",
        partial(p.parse_choice, choices=("none", "linear", "dynamic", "yarn", "llama3")),
    )
    rope_factor: Any = _opt(
        "auto",
        "RoPE scaling factor (>= 1); 'auto' = --seq-len / the model's original positions.",
        partial(p.parse_auto_float, minimum=1.0),
        metavar="auto|F",
    )
    original_max_position_embeddings: int | None = _opt(
        None,
        "The context the model was pretrained at, which --rope-scaling extends (default: from the model's config).",
        _pos_int,
        metavar="N",
    )
    lora_r: int = _opt(0, "LoRA rank; 0 = full fine-tune.", _nonneg_int)
    lora_alpha: int | None = _opt(None, "LoRA alpha (default: 2 × rank).", _pos_int)
    lora_dropout: float = _opt(0.0, "LoRA dropout.", partial(p.parse_float, minimum=0.0, maximum=0.99))
    lora_targets: Any = _opt(
        "auto",
        "Modules LoRA adapts: comma-separated names, or 'auto' = every linear layer but the output head.",
        partial(p.parse_str_list, items="module names", hint="module names like q_proj,v_proj or auto"),
        accepts_list=True,
        metavar="auto|NAMES",
    )
    merge_lora: bool = _opt(
        False, "With LoRA: also write the merged full model to OUTPUT_DIR/final-merged.", p.parse_bool
    )
    # peft's LoRA variants (issue 38).
    lora_dora: bool = _opt(False, "DoRA (peft use_dora): adapt each weight's magnitude and direction.", p.parse_bool)
    lora_rslora: bool = _opt(False, "rsLoRA (peft use_rslora): scale adapters by alpha/sqrt(r), not alpha/r.",
                             p.parse_bool)
    load_in_4bit: bool = _opt(
        False,
        "QLoRA: load the frozen base in 4 bits (bitsandbytes NF4, double quantization, bf16 compute; "
        "`pip install 'lstune[qlora]'`). Needs --lora-r and pretrained weights.",
        p.parse_bool,
    )

    def problems(self) -> list[str]:
        # Compared with the defaults (not "was it given"), so a resolved config written by lstune, which
        # lists every key, is itself a valid recipe.
        changed = [f.name for f in fields(self) if getattr(self, f.name) != f.default]
        problems = [
            f"{flag_name(name)} needs LoRA; add --lora-r 16 (or another rank), or drop it."
            for name in changed
            if name in _LORA_ONLY and not self.lora_r
        ]
        if self.load_in_4bit and not self.lora_r:
            problems.append("--load-in-4bit quantizes the frozen base of a LoRA run (QLoRA): add --lora-r 16 (or "
                            "another rank), or drop --load-in-4bit.")
        if self.load_in_4bit and self.merge_lora:
            problems.append("--merge-lora with --load-in-4bit would merge the adapter into a 4-bit base, rounding it "
                            "again; drop --merge-lora and merge the saved adapter into the full-precision model.")
        if self.rope_scaling == "none":
            problems += [
                f"{flag_name(name)} sets RoPE scaling; add --rope-scaling yarn (or linear, dynamic, llama3), or drop it."
                for name in changed
                if name in ("rope_factor", "original_max_position_embeddings")
            ]
        return problems


@dataclass
class DataSection:
    """Where the training data comes from and how it becomes samples."""

    title: ClassVar[str] = "Data"

    source: Any = _opt(
        None,
        "Training data (required): a JSONL/JSON/Parquet/Arrow file or folder, a save_to_disk folder, a hub "
        "dataset, or builtin:passkey (the demo's task). Repeat as SOURCE:WEIGHT for a mixture (README: Data).",
        p.parse_data_sources,
        key="data",
        metavar="SOURCE",
        accepts_list=True,
        multiple=True,
    )
    seq_len: int = _opt(
        4096, f"Tokens per sample; {p.LENGTH_HINT} (k = 1024).", p.parse_length, metavar="LENGTH",
        show=p.format_length,
    )
    pack: bool = _opt(
        False,
        "Pack documents into full-length samples (positions restart per document; attention never "
        "crosses documents) instead of one padded/truncated sample per record.",
        p.parse_bool,
    )
    max_records: int | None = _opt(None, "Use only the first N records of the data (of each source).", _pos_int)
    chat_template: str | None = _opt(
        None,
        "Chat template for chat records (messages, Alpaca, ShareGPT), replacing the tokenizer's: a Jinja file, or "
        "chatml or llama3.",
        p.parse_optional_str,
        metavar="FILE|NAME",
    )
    # Which part of the source, and which of its columns are lstune's fields (issue 38).
    data_split: str | None = _opt(
        None, "The split of a hub dataset or saved DatasetDict folder to train on (default: train).",
        p.parse_optional_str, metavar="SPLIT",
    )
    data_subset: str | None = _opt(
        None, "The subset (configuration) of a hub dataset, e.g. wikitext-103-raw-v1.", p.parse_optional_str,
        metavar="NAME",
    )
    data_fields: Any = _opt(
        None, "Read lstune's fields from other columns: FIELD=COLUMN, comma-separated (text=body or "
        "prompt=question,completion=answer).", p.parse_field_map, metavar="FIELD=COLUMN", accepts_list=True,
    )
    # Sources larger than the datasets cache's disk (issue 38): lstune.data.streaming.
    data_streaming: bool = _opt(
        False, "Read --data as a stream: tokenized, packed and shuffled on the fly, nothing stored; for sources "
        "larger than the cache disk. Needs --max-steps (docs/data.md).", p.parse_bool,
    )
    data_shuffle_buffer: int | None = _opt(
        None, f"With --data-streaming: records in the shuffle buffer, 0 = stream order (default "
        f"{DEFAULT_SHUFFLE_BUFFER}).", _nonneg_int,
    )
    eval_data: str | None = _opt(
        None, "Validation data, in the same formats as --data (evaluated every --eval-every steps and at the end); "
        "builtin:passkey-eval (16 held-out passkey records) adds the passkey accuracy.",
        p.parse_optional_str, metavar="SOURCE",
    )
    eval_split: float | None = _opt(
        None,
        "Hold out this fraction of the training samples for validation instead of --eval-data, e.g. 0.01 "
        "(a seeded choice in long mode; the last samples of the shuffled packed stream with --pack).",
        partial(p.parse_float, above=0.0, below=1.0), metavar="FRACTION",
    )
    eval_max_samples: int | None = _opt(
        None, "Evaluate on at most N validation samples (bounds the time of each evaluation).", _pos_int
    )

    def problems(self) -> list[str]:
        problems = self._mixture_problems()
        if self.eval_data is not None and self.eval_split is not None:
            problems.append("--eval-data and --eval-split both give validation data; keep one.")
        if self.eval_max_samples is not None and not self.has_eval():
            problems.append("--eval-max-samples bounds validation: add --eval-data or --eval-split, or drop it.")
        return problems + self._streaming_problems()

    def _streaming_problems(self) -> list[str]:
        """What --data-streaming does not do (yet): refused rather than approximated (docs/data.md)."""
        if not self.data_streaming:
            return ["--data-shuffle-buffer sets --data-streaming's shuffle: add --data-streaming, or drop it."] \
                if self.data_shuffle_buffer is not None else []
        problems = []
        sources = self.source if isinstance(self.source, list) else [self.source]
        if len(sources) > 1:
            problems.append("--data-streaming reads one --data source; a mixture of streams is not supported. Give "
                            "one source, or drop --data-streaming.")
        if any(isinstance(s, str) and s.startswith("builtin:") for s in sources):
            problems.append("--data-streaming: builtin: sources are small files shipped with lstune; drop "
                            "--data-streaming.")
        if self.eval_split is not None:
            problems.append("--eval-split holds out samples of a dataset whose length is known; a stream's is not. "
                            "With --data-streaming give --eval-data SOURCE (read as usual, not streamed).")
        return problems

    def _mixture_problems(self) -> list[str]:
        if self.source is None:
            return []  # a missing --data is reported where it is required (the commands that read data)
        entries = self.source if isinstance(self.source, list) else [self.source]
        try:
            weights = [p.split_weight(entry)[1] for entry in entries]
        except ValueError as exc:
            return [f"--data {exc}."]
        if len(entries) == 1 and weights[0] is not None:
            return [f"--data {entries[0]!r} has a weight but is the only source; weights mix several --data "
                    "sources: add another, or drop the weight."]
        if any(w is None for w in weights) and any(w is not None for w in weights):
            return ["--data: give every source of a mixture a weight (a.jsonl:0.7 --data b/:0.3), or none "
                    "(each source then counts by its size)."]
        return []

    def reading(self) -> dict[str, Any]:
        """How to read --data: its split, subset and field mapping (`lstune.data.dataset.build_dataset`'s keywords)."""
        return dict(split=self.data_split, subset=self.data_subset, fields=self.data_fields)

    def shuffle_buffer(self) -> int:
        """--data-streaming's shuffle buffer, in records."""
        return DEFAULT_SHUFFLE_BUFFER if self.data_shuffle_buffer is None else self.data_shuffle_buffer

    def has_eval(self) -> bool:
        return self.eval_data is not None or self.eval_split is not None


_TRACKER_NAMES = ("tensorboard", "wandb", "mlflow")
_TRACKERS_HINT = "tensorboard, wandb, mlflow or none (comma-separated)"


def _parse_trackers(value: Any) -> Any:
    """'none' (the default, kept as written so a resolved config reads back the same) or a list of names."""
    names = p.parse_str_list(value, items="tracker names", hint=_TRACKERS_HINT, auto=False)
    return "none" if names == ["none"] else names


def valid_tile_setting(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return value in ("auto", "off") or (isinstance(value, int) and value >= 1)


@dataclass
class MemorySection:
    """The single-device memory techniques (lstune.memory; docs/memory.md)."""

    title: ClassVar[str] = "Memory"

    tiled_mlp: Any = _opt(
        "auto",
        "Run each MLP over sequence tiles, recomputed in backward: a tile count, 'off', or 'auto' = the fewest "
        "tiles that keep the estimated peak within 90% of the device (docs/memory.md).",
        p.parse_auto_off_int,
        metavar="auto|off|N",
    )
    tiled_loss: Any = _opt(
        "auto",
        "Logits + loss tile by tile, never the full [seq, vocab] logits: a tile count, 'off' (one tile), or "
        "'auto' = Liger's fused loss on CUDA, else the fewest tiles that fit (docs/memory.md).",
        p.parse_auto_off_int,
        metavar="auto|off|N",
    )
    mini_sequence: Any = _opt(
        "auto",
        "MST's tiles: MLP in hidden-size tiles with the norm fused in, loss in vocab/hidden tiles. auto: on "
        "only where the run would not fit without it (docs/memory.md).",
        p.parse_auto_bool,
        switch=True,
    )
    checkpointing: bool = _opt(
        True, "Activation checkpointing of every decoder layer: on or off.", p.parse_bool, style="value",
        metavar="on|off",
    )
    offload_checkpoints: Any = _opt(
        "auto",
        "Keep each layer's checkpoint in host memory (async, prefetched in backward). auto: on only where the "
        "run would not fit without it and the host holds it (docs/memory.md).",
        p.parse_auto_bool,
        switch=True,
    )
    host_mem_budget: int | None = _opt(
        None,
        "Host memory offloaded checkpoints may use, e.g. 64G; layers beyond it stay on the device or are "
        "recomputed. Default: the host's RAM per local rank less what else the run keeps there.",
        p.parse_bytes,
        metavar="BYTES",
    )
    checkpoint_device_budget: int | None = _opt(
        None,
        "Device memory checkpoints may use, e.g. 8G; past it (host budget full) layers are recomputed from the "
        "one below (MEMO). Default with offload: the estimate's headroom (docs/memory.md).",
        p.parse_bytes,
        metavar="BYTES",
    )
    attn_chunks: Any = _opt(
        "auto",
        "Attention in sequence chunks (FPDT; offloaded with --offload-checkpoints): a chunk count, 'off', or "
        "'auto' = the fewest that fit, only where needed (docs/memory.md).",
        p.parse_auto_off_int,
        metavar="auto|off|N",
    )
    recompute_attention: str = _opt(
        "auto",
        "'on': backward re-runs each layer's attention; 'off': its output and log-sum-exp are kept instead "
        "(saves O(seq²) work); 'auto': off where they fit (docs/memory.md).",
        partial(p.parse_choice, choices=("auto", "on", "off")),
        metavar="auto|on|off",
    )

    def problems(self) -> list[str]:
        problems = [
            f"{flag_name(name)} must be {TILE_SETTING_HINT}, not {value!r}."
            for name, value in (("tiled_mlp", self.tiled_mlp), ("tiled_loss", self.tiled_loss),
                                ("attn_chunks", self.attn_chunks))
            if not valid_tile_setting(value)
        ]
        budget = self.host_mem_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            problems.append(f"--host-mem-budget must be a number of bytes >= 0, not {budget!r}.")
        if self.mini_sequence is True and self.tiled_mlp == "off":
            problems.append("--mini-sequence tiles the MLP: drop --tiled-mlp off, or drop --mini-sequence.")
        if self.offload_checkpoints is True and not self.checkpointing:
            problems.append(
                "--offload-checkpoints moves activation checkpoints to host memory: it needs --checkpointing on."
            )
        if budget is not None and self.offload_checkpoints is False:
            problems.append("--host-mem-budget caps offloaded checkpoints: add --offload-checkpoints, or drop it.")
        problems += _device_budget_problems(self.checkpoint_device_budget, self.checkpointing)
        if self.recompute_attention not in ("auto", "on", "off"):
            problems.append(f"--recompute-attention must be auto, on or off, not {self.recompute_attention!r}.")
        elif self.recompute_attention == "off" and not self.checkpointing:
            problems.append("--recompute-attention off keeps attention's output beside each layer's checkpoint: it "
                            "needs --checkpointing on (without checkpointing nothing is recomputed), or drop it.")
        return problems


def _device_budget_problems(budget, checkpointing: bool) -> list[str]:
    if budget is None:
        return []
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        return [f"--checkpoint-device-budget must be a number of bytes >= 0 (e.g. 8G), not {budget!r}."]
    if not checkpointing:
        return ["--checkpoint-device-budget places activation checkpoints: it needs --checkpointing on, or drop it."]
    return []


def zero_problems(stage: str | int, *, processes: int, offload_optimizer: bool, offload_params: bool,
                  offload_ratio: float = 1.0) -> list[str]:
    """The ZeRO stage rules, for a config ("auto" or "0"-"3") and for the stage an engine is built with."""
    stage = str(stage)
    problems = []
    if offload_ratio < 1 and (stage != "3" or not offload_optimizer):
        problems.append(f"--offload-ratio {offload_ratio:g} splits the optimizer state DeepSpeed offloads: it needs "
                        "--zero-stage 3 --offload-optimizer (or drop it: 1 keeps all of it on the host).")
    if stage == "0" and (processes > 1 or offload_optimizer or offload_params):
        problems.append(
            "--zero-stage 0 is plain single-device AdamW: with several processes or host offload use 1, 2 or 3."
        )
    if offload_params and stage not in ("auto", "3"):
        problems.append("--offload-params needs --zero-stage 3 (only stage 3 shards the weights).")
    return problems


@dataclass
class ParallelSection:
    """Processes, sequence parallelism and ZeRO (lstune.parallel; docs/parallel.md)."""

    title: ClassVar[str] = "Parallelism"

    gpus: int = _opt(
        1,
        "Processes per node, launched by lstune (one per GPU; without CUDA, CPU processes with gloo). Under "
        "torchrun / deepspeed / accelerate launch: the launcher's world.",
        _pos_int,
    )
    sp: Any = _opt(
        "auto",
        "Sequence-parallel degree, in all (Ulysses × ring): 'auto' picks it from the processes and attention heads, "
        "or a number dividing the process count; past the head count with --sp-ring.",
        p.parse_auto_int,
    )
    sp_ring: Any = _opt(
        1,
        "The ring-attention part of --sp (METP), to pass the head count: 1 = Ulysses alone; 'auto' = Ulysses "
        "as far as the heads allow, the ring the rest. Divides --sp (docs/parallel.md).",
        p.parse_auto_int,
    )
    metp_mlp: bool = _opt(
        False,
        "METP's MLP: each rank stores 1/SP of the MLP weights, rotated rank to rank instead of gathered (needs "
        "SP > 1; docs/parallel.md).",
        p.parse_bool,
    )
    zero_stage: Any = _opt(
        "auto",
        "DeepSpeed ZeRO stage 0-3; 'auto' chooses from model size and device memory (0 = plain single-device "
        "AdamW).",
        partial(p.parse_choice, choices=("auto", "0", "1", "2", "3")),
    )
    offload_optimizer: bool | None = _opt(
        None, "Keep Adam state in host memory (DeepSpeed); default: decided with --zero-stage auto.", p.parse_bool
    )
    offload_params: bool | None = _opt(
        None, "Keep weights in host memory (ZeRO-3); default: decided with --zero-stage auto.", p.parse_bool
    )
    offload_ratio: float = _opt(
        1.0,
        "With --zero-stage 3 --offload-optimizer: the fraction of the optimizer state on the host, the rest "
        "stepped on the GPU; --zero-stage auto lowers it for a small host (docs/parallel.md).",
        partial(p.parse_float, above=0.0, maximum=1.0),
    )
    hostfile: str | None = _opt(
        None, "DeepSpeed hostfile for multi-node runs (one line per node: `node-1 slots=8`).",
        p.parse_optional_str, metavar="FILE",
    )

    def problems(self) -> list[str]:
        problems = []
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            problems.append(f"--gpus {self.gpus}: give at least 1 process per node.")
            processes = 1
        else:
            processes = self.gpus
        problems += zero_problems(
            self.zero_stage, processes=processes, offload_optimizer=bool(self.offload_optimizer),
            offload_params=bool(self.offload_params), offload_ratio=self.offload_ratio,
        )
        if self.hostfile is not None and not Path(self.hostfile).is_file():
            problems.append(f"--hostfile {self.hostfile!r} does not exist; write one line per node: `node-1 slots=8`.")
        return problems


@dataclass
class OptimSection:
    """How long to train, the optimizer and its schedule, batch and seed."""

    title: ClassVar[str] = "Optimisation"

    max_steps: int | None = _opt(None, "Optimizer steps to train (default: one epoch over the data).", _pos_int)
    epochs: float | None = _opt(
        None, "Epochs to train when --max-steps is not given (default 1).", partial(p.parse_float, above=0.0)
    )
    lr: float = _opt(2e-5, "Peak learning rate.", partial(p.parse_float, minimum=0.0))
    min_lr_ratio: float = _opt(
        0.1, "Final learning rate of the cosine schedule, as a fraction of --lr.",
        partial(p.parse_float, minimum=0.0, maximum=1.0),
    )
    schedule: str = _opt(
        "cosine", "Learning-rate schedule after warmup: cosine, linear or constant.",
        partial(p.parse_choice, choices=("cosine", "linear", "constant")),
    )
    warmup_steps: int | None = _opt(
        None,
        "Linear warmup steps, rising from lr 0 (default: 3% of the steps, never all of them, so a 1-step run "
        "trains at --lr; a value >= --max-steps keeps the whole run in warmup).",
        _nonneg_int,
    )
    weight_decay: float = _opt(0.0, "AdamW weight decay.", partial(p.parse_float, minimum=0.0))
    # Adam divides by (1 - beta^t) and by sqrt(v) + eps: beta = 1 or eps = 0 divide by zero.
    adam_beta1: float = _opt(0.9, "AdamW beta1, in [0, 1).", partial(p.parse_float, minimum=0.0, below=1.0))
    adam_beta2: float = _opt(0.95, "AdamW beta2, in [0, 1).", partial(p.parse_float, minimum=0.0, below=1.0))
    adam_eps: float = _opt(1e-8, "AdamW epsilon (> 0).", partial(p.parse_float, above=0.0))
    max_grad_norm: float = _opt(
        1.0, "Clip the gradient norm to this (0 = no clipping).", partial(p.parse_float, minimum=0.0)
    )
    micro_batch_size: int = _opt(1, "Samples per forward/backward.", _pos_int)
    grad_accum: int = _opt(
        1, "Micro-batches per optimizer step; the loss is normalised over the whole window's tokens.", _pos_int
    )
    seed: int = _opt(42, "Random seed (weights init, data order).", _nonneg_int)

    def problems(self) -> list[str]:
        if self.max_steps is not None and self.epochs is not None:
            return ["--max-steps and --epochs both given; keep one."]
        return []


@dataclass
class RunSection:
    """Where the run writes, when it saves, resuming, and how it reports."""

    title: ClassVar[str] = "Run"

    output_dir: str | None = _opt(
        None, "Where checkpoints, metrics and the final model go (default: runs/MODEL-TIMESTAMP).",
        p.parse_optional_str, metavar="DIR",
    )
    save_every: int | None = _opt(None, "Save a checkpoint every N steps (always at the end).", _pos_int)
    keep_last: int | None = _opt(2, "Keep the newest N checkpoints (0 = keep all).", _nonneg_int)
    resume: str | None = _opt(
        None, "Resume: 'latest' (newest checkpoint in --output-dir) or a checkpoint path.",
        p.parse_optional_str, flag_value="latest", metavar="[PATH]",
    )
    overwrite: bool = _opt(
        False,
        "Allow an existing --output-dir; the files its previous run recorded as lstune's are removed once this run "
        "has passed every check (nothing else is touched).",
        p.parse_bool,
    )
    stop_at_step: int | None = _opt(
        None,
        "Stop after this step with a checkpoint, keeping the schedule planned for --max-steps; continue later "
        "with --resume (for jobs with a time limit).",
        _pos_int,
    )
    eval_every: int | None = _opt(
        None, "Evaluate on the validation data every N steps (and always at the end); needs --eval-data or "
        "--eval-split.", _pos_int,
    )
    report_to: Any = _opt(
        "none",
        "Experiment trackers for the config and every metric: comma-separated tensorboard, wandb, mlflow, or none "
        "(each an optional extra: pip install 'lstune[tensorboard]').",
        _parse_trackers, accepts_list=True, metavar="TRACKERS",
    )
    log_every: int = _opt(
        1, "Print a progress line every N steps (in a terminal, N > 1 also keeps a line every N steps above the bar).",
        _pos_int,
    )
    skip_self_check: bool = _opt(
        False,
        "Skip the startup self-check (the prepared model's loss and input gradient against the plain model on a "
        "short probe; docs/models.md).",
        p.parse_bool,
    )
    skip_nonfinite_steps: bool = _opt(
        False,
        "Skip (not apply) a step whose loss or gradient norm is NaN/inf instead of stopping; 10 such steps in a "
        "row still stop the run.",
        p.parse_bool,
    )
    force: bool = _opt(
        False,
        "Train even when the estimate predicts the run will not fit this GPU, the output disk cannot hold a "
        "checkpoint, or --gpus on CPU asks more processes than cores.",
        p.parse_bool,
    )
    trust_checkpoint: bool = _opt(
        False,
        "Resume from a DeepSpeed checkpoint whose files hold Python objects (loading runs them): only for "
        "checkpoints you wrote or trust.",
        p.parse_bool,
    )

    def trackers(self) -> list[str]:
        names = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        return [n for n in names if n != "none"]

    def problems(self) -> list[str]:
        problems = []
        unknown = [n for n in self.trackers() if n not in _TRACKER_NAMES]
        if unknown:
            problems.append(f"--report-to {', '.join(unknown)}: use {_TRACKERS_HINT}.")
        if self.resume and self.overwrite:
            problems.append(
                "--resume and --overwrite contradict each other; resume keeps the run, overwrite erases it. Pick one."
            )
        if self.resume and self.resume != "latest" and self.output_dir is None and not Path(self.resume).exists():
            problems.append(
                f"--resume {self.resume!r} does not exist; give a checkpoint folder or 'latest' with --output-dir."
            )
        if self.resume == "latest" and self.output_dir is None:
            problems.append(
                "--resume needs --output-dir (the run to continue), or a checkpoint path: --resume runs/x/checkpoint-100."
            )
        if self.output_dir is not None:
            problems += self.output_dir_problems(Path(self.output_dir))
        return problems

    def output_dir_problems(self, output_dir: Path) -> list[str]:
        """Nothing is overwritten unasked: an existing folder holding a run needs --resume or --overwrite (one
        holding only a failed attempt's record and log does not: see lstune.config.record)."""
        if output_dir.exists() and not output_dir.is_dir():
            return [f"--output-dir {str(output_dir)!r} is {path_kind(output_dir)}; give a folder (a new one, or a run's "
                    "to resume)."]
        if self.resume or self.overwrite or not output_dir.exists():
            return []
        if not holds_a_run(output_dir):
            return []
        return [
            f"--output-dir {str(output_dir)!r} already exists and is not empty; nothing is overwritten unasked. "
            "Use --resume to continue that run, --overwrite to replace it, or another --output-dir."
        ]


# (attribute of TrainConfig, section class), in the order flags, recipes and resolved configs list them.
SECTIONS: tuple[tuple[str, type], ...] = (
    ("model", ModelSection),
    ("data", DataSection),
    ("memory", MemorySection),
    ("parallel", ParallelSection),
    ("optim", OptimSection),
    ("run", RunSection),
)


@dataclass
class TrainConfig:
    """Everything `lstune train` needs. Only `data.source` has no default: nothing trains on data not asked for
    (the demo recipe, recipes/tiny-llama/4k-cpu-demo.yaml, names builtin:passkey)."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    memory: MemorySection = field(default_factory=MemorySection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    optim: OptimSection = field(default_factory=OptimSection)
    run: RunSection = field(default_factory=RunSection)

    @classmethod
    def from_flat(cls, values: dict[str, Any]) -> "TrainConfig":
        """A config from typed values under flat keys (`seq_len`, `model`, ...); the rest keep their defaults."""
        by_section: dict[str, dict[str, Any]] = {name: {} for name, _ in SECTIONS}
        for key, value in values.items():
            section, f = FLAT_FIELDS[key]
            by_section[section][f.name] = value
        return cls(**{name: section_type(**by_section[name]) for name, section_type in SECTIONS})

    def to_dict(self) -> dict[str, Any]:
        """The flat view: every key a recipe or a flag names, in option order."""
        return {key: getattr(getattr(self, section), f.name) for key, (section, f) in FLAT_FIELDS.items()}

    def problems(self) -> list[str]:
        """Every section's problems, then the rules that span two sections."""
        problems = [problem for name, _ in SECTIONS for problem in getattr(self, name).problems()]
        parallel = self.parallel
        if self.model.load_in_4bit and (parallel.gpus != 1 or parallel.hostfile or parallel.zero_stage not in ("auto", "0")):
            problems.append("--load-in-4bit runs in one process with plain AdamW: DeepSpeed ZeRO cannot shard 4-bit "
                            "weights. Drop --gpus / --hostfile / --zero-stage, or drop --load-in-4bit.")
        save_every, max_steps = self.run.save_every, self.optim.max_steps
        if save_every is not None and max_steps is not None and save_every > max_steps:
            problems.append(
                f"--save-every {save_every} is more than --max-steps {max_steps}: no checkpoint would be saved "
                "before the end; lower it."
            )
        if self.run.eval_every is not None and not self.data.has_eval():
            problems.append("--eval-every needs validation data: add --eval-data SOURCE or --eval-split 0.01.")
        if parallel.metp_mlp and (self.memory.tiled_mlp not in ("auto", "off") or self.memory.mini_sequence is True):
            problems.append("--metp-mlp runs each MLP itself, on (s/SP)×(I/SP) per step: it does not combine with "
                            "--tiled-mlp N or --mini-sequence; use --tiled-mlp off and --no-mini-sequence.")
        return problems

    def training_problems(self) -> list[str]:
        """The rules of a run that trains (`lstune train`; `lstune data` and `estimate` read no step count)."""
        if self.data.data_streaming and self.optim.max_steps is None:
            return ["--data-streaming needs --max-steps: a stream's length is unknown until it is read, so epochs "
                    "cannot be counted."]
        return []


def flat_key(f: Field) -> str:
    """The recipe key of a section field (its flag is `flag_name(flat_key(f))`)."""
    return f.metadata.get("key", f.name)


def _flat_fields() -> dict[str, tuple[str, Field]]:
    found: dict[str, tuple[str, Field]] = {}
    for name, section_type in SECTIONS:
        for f in fields(section_type):
            key = flat_key(f)
            if key in found:
                raise TypeError(f"config key {key!r} is declared by two sections")
            found[key] = (name, f)
    return found


# flat key -> (section attribute, field), for every field of every section, in option order.
FLAT_FIELDS: dict[str, tuple[str, Field]] = _flat_fields()


def field_default(f: Field) -> Any:
    return f.default if f.default is not MISSING else None
