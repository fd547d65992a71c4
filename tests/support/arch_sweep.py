"""Every causal-LM architecture transformers ships, through lstune: exact, refused, or a defect (no network).

    OMP_NUM_THREADS=1 python -m tests.support.arch_sweep [--only TYPE ...] [--jsonl FILE]

The test matrix (tests/unit/models/test_model_matrix.py) pins ~25 hand-made tiny configs in CI. This sweep asks the
same question of every model type in transformers' causal-LM mapping, with a tiny config shrunk from each config
class's defaults, to find the architectures lstune gets wrong that nobody has put in the matrix:

1. build a tiny fp32 random-init model (2+ layers, hidden 32; every per-layer type kept; windows cut to 16 tokens);
   a type whose tiny model cannot be built or whose own eager forward fails is "not built" (not lstune's problem);
2. lstune's config-time checks (`check_attention_support`), then, on one long sample and on packed documents, lstune's
   attention alone, with every memory technique (tiles of 3) and with those and chunked attention (3 chunks,
   FPDT), against plain HF — eager attention on the long
   sample, each document run alone on the packed one — comparing the loss and every parameter's gradient;
   A model whose training forward samples at random (PhiMoE's routing) is compared in eval mode, as the self-check
   does;
3. a case that is neither exact nor refused with lstune's own error is then put through the startup self-check
   (`run_self_check`), which is what stands between such a model and a user's run.

Outcomes per case: exact; refused (lstune's ModelError/UserError, first line kept); WRONG (caught by the self-check) —
refused at startup, with the self-check's message; WRONG (self-check passes) and CRASH (another exception inside
lstune's path) — defects. The summary line counts each.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import traceback
from typing import Any

SEQ = 70
DOCS = [29, 24, 17]
WINDOW = 16
TECHNIQUES = {
    "attention": None,
    "all": dict(tiled_mlp=3, tiled_loss=3, mini_sequence=True, offload_checkpoints=True),
    "chunked": dict(attn_chunks=3, tiled_mlp=3, tiled_loss=3, mini_sequence=True, offload_checkpoints=True),
    # every memory technique on a LoRA-wrapped model (peft, r=4, every linear layer), against HF with the same LoRA:
    # lstune's shared LoRA inputs (lstune.memory.lora_inputs) on each architecture's linear layers
    "lora": dict(tiled_mlp=3, tiled_loss=3, mini_sequence=True, offload_checkpoints=True),
}
LORA_R = 4
_SIZES = dict(vocab_size=320, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512)
_MAX_PARAMS = 100_000_000


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# --------------------------------------------------------------------------------------------------------------------
# tiny configs
# --------------------------------------------------------------------------------------------------------------------


def tiny_generic_config(model_type: str, *, extended: bool = False) -> Any:
    """The config class's defaults, shrunk: the matrix's hand-made config where there is one. `extended` also
    shrinks the less common widths (latent attention, Mamba-2 heads, per-layer inputs), which some types need and
    others break on: `build` tries without first."""
    from tests.support.archs import ARCHS, tiny_config

    if model_type in ARCHS:
        return tiny_config(model_type)
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    _shrink(text, extended)
    if text is not config:
        _shrink_sub_configs(config, text, extended)
    return config


def _set(config: Any, key: str, value: Any) -> None:
    try:
        setattr(config, key, value)
    except (AttributeError, ValueError, TypeError):
        pass  # best effort: a config that refuses one width keeps its default (and may then not build)


def _shrink(config: Any, extended: bool = False) -> None:
    from lstune.train.self_check import truncated_config

    for key, value in _SIZES.items():
        if hasattr(config, key):
            _set(config, key, value)
    if "head_dim" in vars(config) and vars(config)["head_dim"] is None:  # "derive it" in some configs, read as-is in others
        _set(config, "head_dim", _SIZES["hidden_size"] // _SIZES["num_attention_heads"])
    for key, value in list(vars(config).items()):
        if isinstance(value, bool) or key.startswith("_"):
            continue
        lower = key.lower()
        if isinstance(value, float) and ("dropout" in lower or "pdrop" in lower or lower == "layerdrop"):
            _set(config, key, 0.0)
        elif not isinstance(value, int):
            continue
        elif "intermediate" in lower or "ffn" in lower or "ff_dim" in lower or lower in ("n_inner", "d_ff"):
            _set(config, key, 32 if "moe" in lower or "expert" in lower else 64)
        elif lower in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts"):
            _set(config, key, 4)
        elif lower in ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token", "moe_k"):
            _set(config, key, min(value, 2))
        elif lower in ("head_dim", "rotary_dim"):
            _set(config, key, 8)
        elif not extended:
            continue
        elif lower in ("v_head_dim", "mamba_d_head", "mamba_head_dim",
                       "index_head_dim", "linear_key_head_dim", "linear_value_head_dim"):
            _set(config, key, 8)
        elif lower in ("qk_rope_head_dim", "qk_nope_head_dim"):
            _set(config, key, 8)  # = head_dim: multi-head latent attention's rotary tables are sized from it
        elif lower in ("kv_lora_rank", "q_lora_rank"):
            _set(config, key, 16)
        elif lower.endswith("attention_heads") and lower != "num_attention_heads" or lower in (
                "mamba_n_heads", "mamba_num_heads", "index_n_heads", "linear_num_key_heads", "linear_num_value_heads"):
            _set(config, key, 4 if "mamba" not in lower else 8)
        elif lower == "num_heads" and not hasattr(config, "num_attention_heads"):  # Mamba-2: heads x head_dim = 64
            _set(config, key, 8)
        elif lower in ("n_groups", "mamba_n_groups", "n_group", "topk_group"):
            _set(config, key, 1)
        elif lower in ("state_size", "mamba_d_state", "d_state"):
            _set(config, key, 16)
        elif "vocab_size" in lower and value > 320:
            _set(config, key, 320)
        elif "hidden_size" in lower and lower != "hidden_size" and value > 32:
            _set(config, key, 16)
        elif ("window" in lower or "attention_chunk" in lower) and "pattern" not in lower:
            _set(config, key, WINDOW if value > 0 else value)
        elif lower in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id") and value >= 320:
            _set(config, key, {"pad_token_id": 0, "bos_token_id": 1}.get(lower, 2))
    if extended and getattr(config, "kv_lora_rank", None):  # multi-head latent attention: one key/value head per query head
        _set(config, "num_key_value_heads", config.num_attention_heads)
        _set(config, "qk_head_dim", config.qk_nope_head_dim + config.qk_rope_head_dim)
    _set(config, "tie_word_embeddings", False)
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > 2:
        small = truncated_config(config)  # the shortest prefix holding every per-layer value (layer type)
        for key, value in vars(small).items():
            if isinstance(value, list) and len(value) == small.num_hidden_layers:
                _set(config, key, value)
        _set(config, "num_hidden_layers", small.num_hidden_layers)
    _set(config, "use_cache", False)


def _shrink_sub_configs(config: Any, text: Any, extended: bool) -> None:
    for key, value in list(vars(config).items()):
        if value is not text and hasattr(value, "to_dict") and hasattr(value, "model_type"):
            _shrink(value, extended)


# --------------------------------------------------------------------------------------------------------------------
# one architecture
# --------------------------------------------------------------------------------------------------------------------


def build(model_type: str) -> tuple[Any, str | None]:
    """(tiny fp32 model in training mode, None), or (None, why not): the plain shrink, else the extended one."""
    problem = None
    for extended in (False, True):
        model, problem = _build(model_type, extended)
        if model is not None:
            return model, None
    return None, problem


def _build(model_type: str, extended: bool) -> tuple[Any, str | None]:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        config = tiny_generic_config(model_type, extended=extended)
        with torch.device("meta"):  # sized before any memory is spent: a default that did not shrink can be huge
            params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if params > _MAX_PARAMS:
            return None, f"not built: {params / 1e6:.0f}M parameters after shrinking"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    except Exception as exc:  # noqa: BLE001 - a sweep records whatever stops a type
        return None, f"not built: {type(exc).__name__}: {_line(exc)}"
    try:
        with torch.no_grad():
            model(input_ids=torch.arange(3, 19)[None] % _vocab(model), use_cache=False)
    except Exception as exc:  # noqa: BLE001
        return None, f"not built: the plain model's own forward fails: {type(exc).__name__}: {_line(exc)}"
    model.train()
    return model, None


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else "")[:200]


def sweep_one(model_type: str) -> dict:
    from lstune.errors import UserError

    model, problem = build(model_type)
    record: dict[str, Any] = {"model_type": model_type}
    if model is None:
        record["outcome"] = problem
        return record
    record["class"] = type(model).__name__
    pristine = copy.deepcopy(model)  # some models keep graph tensors after a forward (no deepcopy then)
    try:
        training = not _samples_in_training(pristine)
    except Exception as exc:  # noqa: BLE001
        record["outcome"] = f"not built: the plain model's own forward fails: {type(exc).__name__}: {_line(exc)}"
        return record
    if not training:
        record["compared"] = "in eval mode: the training forward samples at random (as the self-check does)"
    starts = {"plain": pristine, "lora": _with_lora(pristine)}
    for data in ("long", "packed"):
        references: dict[str, Any] = {}
        for technique in TECHNIQUES:
            key, start = f"{data}/{technique}", starts["lora" if technique == "lora" else "plain"]
            if isinstance(start, str):  # LoRA could not be applied
                record[key] = start
                continue
            try:
                kind = "lora" if technique == "lora" else "plain"
                if kind not in references:
                    references[kind] = _reference(copy.deepcopy(start).train(training), data)
                batch, reference = references[kind]
            except Exception as exc:  # noqa: BLE001
                record[key] = f"not built: the plain model's own forward fails: {type(exc).__name__}: {_line(exc)}"
                continue
            try:
                got = _lstune(copy.deepcopy(start), technique, data, batch, training)
            except UserError as exc:
                record[key] = f"refused: {_line(exc)}"
                continue
            except Exception as exc:  # noqa: BLE001
                record[key] = f"CRASH: {type(exc).__name__}: {_line(exc)}"
                record[f"{key}:trace"] = traceback.format_exc(limit=-4)
                continue
            mismatch = _mismatch(got, reference)
            if mismatch is not None and _matches_hf_sdpa(start, data, training, got):
                record[key] = "exact (to HF's own sdpa attention: HF's eager and sdpa differ here by fp32 rounding)"
            elif mismatch is not None:
                record[key] = _wrong(copy.deepcopy(pristine), data, technique, mismatch)
            else:
                record[key] = "exact"
    return record


def _matches_hf_sdpa(model: Any, data: str, training: bool, got: Any) -> bool:
    """Whether lstune's result equals plain HF running its own sdpa attention: where HF's eager and sdpa kernels
    already differ beyond the tolerance (large activations), that is the fp32 rounding of the kernel, not lstune."""
    sdpa = copy.deepcopy(model).train(training)
    try:
        sdpa.set_attn_implementation("sdpa")
        _, reference = _reference(sdpa, data)
    except Exception:  # noqa: BLE001 - a model without sdpa: the eager comparison stands
        return False
    return _mismatch(got, reference) is None


def _with_lora(model: Any) -> Any:
    """A LoRA-wrapped copy of `model` (lstune's `apply_lora`, every linear layer), its B matrices random so that
    A gets a gradient too; or lstune's refusal as a "refused: ..." string."""
    from lstune.errors import UserError
    from lstune.models.loading import apply_lora
    from tests.unit.memory._helpers import nonzero_lora_B

    try:
        wrapped = apply_lora(copy.deepcopy(model), r=LORA_R, alpha=2 * LORA_R, dropout=0.0, targets="auto")
    except UserError as exc:
        return f"refused: {_line(exc)}"
    return nonzero_lora_B(wrapped, seed=1)


def _samples_in_training(model: Any) -> bool:
    """Whether the model's training forward depends on the random seed (PhiMoE's routing)."""
    import torch

    from tests.unit.memory._helpers import hf_loss_sum, long_batch

    losses = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        with torch.no_grad():
            losses.append(float(hf_loss_sum(copy.deepcopy(model).train(), long_batch(SEQ, vocab=_vocab(model)))[0]))
    return losses[0] != losses[1]


def _vocab(model: Any) -> int:
    return min(model.config.get_text_config().vocab_size, 320)


def _reference(model: Any, data: str):
    from tests.unit.memory._helpers import hf_loss_sum, long_batch, packed_batch, run_grads, split_documents

    if data == "long":
        batch = long_batch(SEQ, vocab=_vocab(model))
        return batch, run_grads(model, hf_loss_sum, [batch])
    batch = packed_batch(DOCS, vocab=_vocab(model))
    return batch, run_grads(model, hf_loss_sum, split_documents(batch, DOCS))


def _lstune(model: Any, technique: str, data: str, batch: dict, training: bool = True):
    from lstune.config.schema import MemorySection
    from lstune.memory.apply import apply_memory_techniques
    from lstune.memory.loss import causal_lm_loss_sum
    from lstune.memory.block_attention import block_attention
    from lstune.models.attention import check_attention_support, use_lstune_attention
    from lstune.models.introspect import find_parts
    from lstune.train.mixers import install_mixers
    from tests.unit.memory._helpers import run_grads

    check_attention_support(model.config, pack=data == "packed", seq_len=SEQ, backend="sdpa", device="cpu")
    parts = find_parts(model)
    install_mixers(parts.body, parts.layers, pack=data == "packed", lm=parts.lm)
    use_lstune_attention(model, backend="sdpa", block_kernel=block_attention)
    step = causal_lm_loss_sum
    if TECHNIQUES[technique] is not None:
        step = apply_memory_techniques(model, MemorySection(**TECHNIQUES[technique]), seq_len=SEQ).loss_sum
    return run_grads(model.train(training), step, [batch])


def _mismatch(got, reference) -> str | None:
    loss, grads = got
    ref_loss, ref_grads = reference
    if abs(loss - ref_loss) > 1e-5 * abs(ref_loss):
        return f"loss {loss:.6g} vs {ref_loss:.6g}"
    if grads.keys() != ref_grads.keys():
        return f"gradient set differs: {sorted(set(grads) ^ set(ref_grads))[:3]}"
    # The self-check's and the SP matrix's measure: each parameter's largest error within 1e-4 of its largest entry
    # (floored at 1e-3 of the model's largest, for gradients that are zero in exact arithmetic). Per entry, models
    # with a wide gradient range (Gemma-4: entries up to 75) differ by more between HF's own eager and sdpa kernels.
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, ref in ref_grads.items():
        error = float((grads[name] - ref).abs().max())
        if error > 1e-4 * max(float(ref.abs().max()), 1e-3 * scale):
            return f"gradient of {name}: max error {error:.3g} (largest entry {float(ref.abs().max()):.3g})"
    return None


def _wrong(model: Any, data: str, technique: str, mismatch: str, dims: Any = None) -> str:
    """A mismatch: does the startup self-check (what a user's run goes through) catch it?"""
    import torch

    from lstune.config.schema import DataSection, MemorySection, ModelSection, TrainConfig
    from lstune.errors import UserError
    from lstune.train.runtime import Runtime
    from lstune.train.self_check import run_self_check

    memory = MemorySection(**TECHNIQUES[technique]) if TECHNIQUES[technique] else MemorySection(
        tiled_mlp="off", tiled_loss="off", checkpointing=False)
    lora = dict(lora_r=LORA_R, lora_alpha=2 * LORA_R, lora_dropout=0.0) if technique == "lora" else {}
    config = TrainConfig(model=ModelSection(attn="sdpa", **lora), data=DataSection(pack=data == "packed"),
                         memory=memory)
    runtime = Runtime(torch.device("cpu"), None)
    if dims is not None:
        from types import SimpleNamespace

        runtime = Runtime(torch.device("cpu"), None, launch=SimpleNamespace(rank=dims.rank, world_size=dims.world_size),
                          dims=dims)
    try:
        run_self_check(model, config, runtime)
    except UserError as exc:
        return f"WRONG (caught by the self-check): {mismatch} | {_line(exc)}"
    except Exception as exc:  # noqa: BLE001
        return f"WRONG (self-check crashes: {type(exc).__name__}: {_line(exc)}): {mismatch}"
    return f"WRONG (self-check passes): {mismatch}"


# --------------------------------------------------------------------------------------------------------------------
# under sequence parallelism (2 gloo processes)
# --------------------------------------------------------------------------------------------------------------------

SP_SEQ, SP_DOCS = 64, [27, 21, 16]  # windows (16) shorter than each rank's shard (32)
SP_TECHNIQUES = [t for t in TECHNIQUES if t != "lora"]  # LoRA is the same code path with or without SP


def sweep_sp(model_types: list[str], world: int = 2) -> list[dict]:
    """`sweep_one`'s question under Ulysses SP: each case against plain HF on the whole sequence (documents alone),
    a mismatch sent through the self-check under SP. Only models that build and do not sample in training."""
    from tests.support.distributed import run_distributed

    return run_distributed(_sp_worker, world, model_types, timeout=3600)[0]


def _sp_model(model_type: str) -> Any:
    """The type's tiny model; in eval mode where its training forward samples (compared there, as `sweep_one`)."""
    model, problem = build(model_type)
    if model is None:
        raise _NotBuilt(problem)
    try:
        sampling = _samples_in_training(model)
    except Exception as exc:  # noqa: BLE001
        raise _NotBuilt(f"not built: the plain model's own forward fails: {type(exc).__name__}: {_line(exc)}") from None
    return model.eval() if sampling else model


class _NotBuilt(Exception):
    """A model type whose tiny model cannot be built (the sweep's limitation, recorded as "not built")."""


def _sp_worker(rank: int, world: int, model_types: list[str]) -> list[dict]:
    from lstune.config.schema import MemorySection
    from lstune.errors import UserError
    from lstune.memory.apply import apply_memory_techniques
    from lstune.memory.loss import causal_lm_loss_sum
    from lstune.models.introspect import find_parts
    from lstune.parallel.dims import ParallelDims
    from lstune.parallel.sp_data import shard_batch
    from lstune.parallel.ulysses import SequenceExchange, apply_ulysses
    from lstune.train.mixers import install_mixers
    from tests.distributed._helpers import compare_sp_with_hf, reference_samples

    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    dims = ParallelDims(world, sp=world).build_groups()

    def variant(technique: str):
        def run(model, batch, data):
            from lstune.memory.block_attention import block_attention
            from lstune.models.attention import use_lstune_attention

            parts = find_parts(model)
            mixers = install_mixers(parts.body, parts.layers, pack=data == "packed", exchange=SequenceExchange(dims),
                                    lm=parts.lm)
            use_lstune_attention(model, backend="sdpa", block_kernel=block_attention)
            apply_ulysses(model, dims)
            step, chunks = causal_lm_loss_sum, None
            if TECHNIQUES[technique] is not None:
                plan = apply_memory_techniques(model, MemorySection(**TECHNIQUES[technique]), seq_len=SP_SEQ // world)
                if mixers is not None:  # as train's prepare: the mixers take the shards in FPDT's pieces
                    mixers.follow(plan.attn_chunking)
                step, chunks = plan.loss_sum, plan.attn_chunking  # chunks: the shards are FPDT's pieces
            shard = shard_batch(batch, dims.sp, dims.sp_rank, chunks)
            return step(model, shard)[0], shard
        return run

    records = []
    for model_type in model_types:
        record: dict[str, Any] = {"model_type": model_type, "sp": world}
        try:
            ParallelDims.for_model(world, world, _sp_model(model_type).config)
            results = compare_sp_with_hf([model_type], reference_samples(SP_SEQ, SP_DOCS),
                                         {t: variant(t) for t in SP_TECHNIQUES}, build=_sp_model)
        except _NotBuilt as exc:
            record["outcome"] = str(exc)
        except UserError as exc:
            record["outcome"] = f"refused: {_line(exc)}"
        except Exception as exc:  # noqa: BLE001
            record["outcome"] = f"CRASH: {type(exc).__name__}: {_line(exc)}"
            record["outcome:trace"] = traceback.format_exc(limit=-6)
        else:
            for (_, data, technique), (outcome, detail) in results.items():
                record[f"{data}/{technique}"] = _sp_outcome(model_type, data, technique, outcome, detail, dims)
        records.append(record)
    return records


def _sp_outcome(model_type: str, data: str, technique: str, outcome: str, detail: Any, dims: Any) -> str:
    if outcome == "refused":
        return f"refused: {_line(Exception(detail))}"
    loss, ref_loss, diff, same_keys = detail[:4]
    if same_keys and abs(loss - ref_loss) <= 2e-5 * abs(ref_loss) and diff < 1e-4:
        return "exact"
    mismatch = f"loss {loss:.6g} vs {ref_loss:.6g}, gradients rel {diff:.1e}"
    return _wrong(_sp_model(model_type), data, technique, mismatch, dims=dims)


# --------------------------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------------------------


_KINDS = {"exact": "exact", "refused": "refused", "WRONG (caught": "refused by the self-check",
          "WRONG": "WRONG", "CRASH": "CRASH", "not built": "not built"}


def _kind(value: str) -> str:
    return next((kind for prefix, kind in _KINDS.items() if value.startswith(prefix)), value)


def _summary(cases: dict[str, str]) -> str:
    """The cases grouped by outcome: `exact` once when all four are, else `case, case: outcome | ...`."""
    groups: dict[str, list[str]] = {}
    for case, value in cases.items():
        groups.setdefault(value, []).append(case)
    if len(groups) == 1:
        return next(iter(groups))[:200]
    return " | ".join(f"{', '.join(names)}: {value[:160]}" for value, names in groups.items())


def report(path: str, sp_path: str | None = None) -> str:
    """A markdown table of a sweep's records (one row per model type, its cases grouped by outcome), with the SP
    sweep's outcome beside each when `sp_path` names its records."""
    import transformers

    records = [json.loads(line) for line in open(path)]
    sp = {r["model_type"]: r for r in map(json.loads, open(sp_path))} if sp_path else {}
    counts: dict[str, dict[str, int]] = {"one process": {}, "SP 2": {}}
    rows = []
    for record in records:
        cells = [_cell(record, counts["one process"])]
        if sp:
            cells.append(_cell(sp[record["model_type"]], counts["SP 2"]) if record["model_type"] in sp else "—")
        rows.append(f"| {record['model_type']} | " + " | ".join(cells) + " |")
    totals = "; ".join(f"{name}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())) for name, c in counts.items()
                       if c)
    columns = ["one process"] + (["SP 2 (two gloo processes)"] if sp else [])
    header = [
        f"{len(records)} model types (transformers {transformers.__version__}); model types by the outcomes of their "
        f"cases — {totals}.",
        "",
        "Cases: long sample / packed documents × lstune's attention alone (`attention`) / every memory technique "
        "(`all`) / those and chunked attention, FPDT (`chunked`) / every memory technique on a LoRA-wrapped model "
        "(`lora`, one process only).",
        "",
        "| model type | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    return "\n".join(header + rows) + "\n"


def _cell(record: dict, counts: dict[str, int]) -> str:
    cases = {k: v for k, v in record.items() if "/" in k and not k.endswith(":trace")}
    outcome = record.get("outcome") or _summary(cases) or record.get("long", "")
    outcome += " (compared in eval mode: samples in training)" if "compared" in record else ""
    kinds = {_kind(outcome)} if "outcome" in record or not cases else {_kind(v) for v in cases.values()}
    kind = " / ".join(sorted(kinds))
    counts[kind] = counts.get(kind, 0) + 1
    return outcome.replace("|", "/")


def main(argv: list[str] | None = None) -> int:
    import logging
    import warnings

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="model types to sweep (default: all)")
    parser.add_argument("--jsonl", help="append one record per model type to this file")
    parser.add_argument("--report", help="print a markdown table of this --jsonl file's records and stop")
    parser.add_argument("--report-sp", help="with --report: an SP sweep's --jsonl records, as a second column")
    parser.add_argument("--sp", type=int, default=1, help="sweep under sequence parallelism of this degree (gloo)")
    args = parser.parse_args(argv)
    if args.report:
        print(report(args.report, args.report_sp), end="")
        return 0
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    counts: dict[str, int] = {}
    types = args.only or causal_lm_types()
    records = sweep_sp(types, args.sp) if args.sp > 1 else map(sweep_one, types)
    for model_type, record in zip(types, records):
        cases = {k: v for k, v in record.items() if "/" in k and not k.endswith(":trace")}
        line = record.get("outcome") or _summary(cases) or record.get("long")
        line += " (compared in eval mode: samples in training)" if "compared" in record else ""
        print(f"{model_type:28s} {line}", flush=True)
        for value in cases.values() or [record.get("outcome") or record.get("long", "")]:
            counts[_kind(value)] = counts.get(_kind(value), 0) + 1
        if args.jsonl:
            with open(args.jsonl, "a") as handle:
                handle.write(json.dumps(record) + "\n")
    print("cases: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    return 1 if any(k in ("WRONG", "CRASH") for k in counts) else 0  # defects only


if __name__ == "__main__":
    sys.exit(main())
