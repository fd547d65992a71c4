"""Load a causal LM by preset name, local folder or hub id; random or pretrained weights; LoRA.

The three sources are tried in that order: a preset (shipped config, always random init), a local folder
with a config.json, then the hub (which may answer from the local cache when offline).
"""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lstune.errors import ModelError, UserError
from lstune.models.presets import get_preset, list_presets
from lstune.untrusted import describe, parser_errors



@dataclass
class ModelSource:
    kind: str  # "preset" | "local" | "hub"
    name: str  # as the user gave it
    location: str  # preset name, folder path or hub id


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    source: ModelSource
    notes: list[str] = field(default_factory=list)  # things the user should know (fallback tokenizer, ...)


@dataclass(frozen=True)
class ModelSpec:
    """A model resolved once per run: where it comes from and its transformers config (a causal LM)."""

    source: ModelSource
    config: Any


def resolve_model(name: str, *, trust_remote_code: bool = False) -> ModelSpec:
    """Resolve `name` and read its config once; everything a run derives from the model's config (attention
    checks, SP layout, tokenizer, loading) takes this. ModelError with the fix when it cannot."""
    source = resolve_source(name)
    config = load_config(source, trust_remote_code=trust_remote_code)
    _check_sizes(config.to_dict(), source)
    _check_causal_lm(config, name)
    return ModelSpec(source, config)


def _check_sizes(values: dict, source: ModelSource) -> None:
    """ModelError listing every impossible size of the model's config (lstune.models.sizes), before anything
    is built from it."""
    from lstune.models.sizes import size_problems

    where = f"{Path(source.location) / 'config.json'}" if source.kind == "local" else f"--model {source.name!r}"
    problems = size_problems(values, where)
    if problems:
        lines = problems if len(problems) == 1 else [f"{len(problems)} impossible sizes in the model's config:"] + [
            f"  - {p}" for p in problems]
        raise ModelError("\n".join(lines) + "\nFix the model's config.json (a size is a whole number of at least 1).",
                         problems=problems)


def resolve_source(name: str) -> ModelSource:
    """Where `name` comes from, without loading anything heavy. ModelError when it cannot be anything."""
    if not name.strip():
        # Path('') is the current folder: without this, an empty name reads as "a folder without config.json".
        raise ModelError("--model is empty; give a preset (`lstune presets`), a local model folder or a hub id like "
                         "meta-llama/Llama-3.1-8B.")
    if get_preset(name) is not None:
        return ModelSource("preset", name, name.lower().removeprefix("preset:"))
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(
                f"--model {name!r} is a folder without config.json; give a Hugging Face model folder "
                "(config.json, weights, tokenizer), a hub id like meta-llama/Llama-3.1-8B, or a preset "
                "(`lstune presets`)."
            )
        return ModelSource("local", name, str(path))
    if _looks_like_hub_id(name):
        return ModelSource("hub", name, name)
    raise ModelError(
        f"--model {name!r} is not a preset, a local folder or a hub id.{_did_you_mean(name)} Presets: "
        f"{', '.join(list_presets())}."
    )


# The files a Hugging Face model folder keeps its weights in (single file, sharded with an index, or legacy .bin).
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def check_local_files(source: ModelSource, init: str) -> None:
    """The cheap checks of a local model folder, before any estimate or heavy import: weights present when they are
    to be loaded (--init pretrained or auto), and its tokenizer's JSON files readable. ModelError with the fix."""
    if source.kind != "local":
        return
    folder = Path(source.location)
    problems = []
    if init != "random" and not any(next(folder.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        problems.append(f"--model {source.name!r} is a folder without weights (no *.safetensors or pytorch_model*.bin "
                        "beside its config.json); copy the weights there, or train from a random initialisation "
                        "with --init random.")
    for name in TOKENIZER_JSON:
        problem = _unreadable_json(folder / name)
        if problem:
            problems.append(f"--model {source.name!r}: its tokenizer file {name} cannot be read ({problem}); replace "
                            "it with the model's own, or remove the folder's tokenizer files to use lstune's "
                            "byte-level tokenizer.")
    if problems:
        raise ModelError(" ".join(problems), problems=problems)


def _unreadable_json(path: Path) -> str | None:
    import json

    if not path.is_file():
        return None
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    return None


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not name.startswith((".", "/", "~"))


def load_config(source: ModelSource, *, trust_remote_code: bool = False):
    """The transformers config of `source`; ModelError (with the fix) when it cannot be read."""
    from lstune.models.presets import preset_config

    if source.kind == "preset":
        return preset_config(source.location)
    from transformers import AutoConfig

    if source.kind == "hub":
        _check_hub_reachable(source)
    if source.kind == "local":  # read as untrusted JSON, and its sizes checked, before transformers builds on it
        from lstune.untrusted import read_json

        _check_sizes(read_json(Path(source.location) / "config.json", error=ModelError, what="the model's"), source)
    try:
        return AutoConfig.from_pretrained(source.location, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - transformers' own checks raise TypeError, ZeroDivisionError, ...
        where = "folder" if source.kind == "local" else "hub id"
        raise ModelError(
            f"--model {source.name!r}: could not read its config as a {where} ({describe(exc)})."
            f"{_did_you_mean(source.name)} Check the name, your network or HF_TOKEN for gated models; offline, use "
            "a local folder, a cached model, or a preset (`lstune presets`)."
        ) from None


def _did_you_mean(name: str) -> str:
    """' Did you mean PRESET?' for a name close to a preset's (a typo such as tiny-lama), else ''."""
    close = difflib.get_close_matches(name.lower(), list_presets(), n=1, cutoff=0.75)
    return f" Did you mean {close[0]!r}?" if close else ""


def _check_hub_reachable(source: ModelSource) -> None:
    """ModelError at once when the hub cannot be reached and the config is not cached.

    huggingface_hub (2.x) retries a download that fails on the network five times with backoff when no cached
    copy exists (~25 s of "Retrying in 8s" lines) and has no setting to limit that; one request without
    retries tells the same. Anything else is left to `AutoConfig.from_pretrained`, which reports it in its own
    words: a cached config, offline mode, the hub answering (404, 401), and a timeout (its retries wait longer,
    which a slow link may need).
    """
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(source.location, "config.json"), str):
        return
    try:
        get_hf_file_metadata(hf_hub_url(source.location, "config.json"), retry_on_errors=False)
    except (HfHubHTTPError, TypeError, ValueError):
        return  # the hub answered, or an older huggingface_hub (no retry_on_errors) or a malformed id
    except Exception as exc:  # the transport's errors (httpx or requests, by version): no common base class
        if "timeout" in type(exc).__name__.lower():
            return
        raise ModelError(
            f"--model {source.name!r}: the hub could not be reached to read its config ({_first_line(exc)}), and "
            f"it is not cached.{_did_you_mean(source.name)} Check the name and your network; offline, use a "
            "local folder, a cached model, or a preset (`lstune presets`)."
        ) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def load_model(
    spec: ModelSpec | str,
    *,
    init: str = "auto",
    param_dtype: Any = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    seed: int = 0,
    tokenizer: Any = None,
    notes: list[str] | None = None,
    load_in_4bit: bool = False,
    device: Any = None,
    init_device: Any = None,
) -> LoadedModel:
    """Load the model of `spec` (from `resolve_model`; a name is resolved here). `init` auto = random for
    presets, pretrained otherwise. The tokenizer (lstune.data.tokenizer.load_model_tokenizer) is the
    caller's, loaded first so a data problem is reported before minutes of weight loading; it is kept
    with the model for export. `load_in_4bit` quantizes the base while it loads, onto `device`
    (lstune.models.quant). `init_device`: where random weights are made (the caller's choice: a CUDA device that
    keeps them anyway makes an 8B model's in seconds, where the CPU took ~2 minutes; docs/benchmarks/2026-11-28-h100);
    pretrained weights always load on the CPU first."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = spec if isinstance(spec, ModelSpec) else resolve_model(spec, trust_remote_code=trust_remote_code)
    source, config = spec.source, spec.config
    if source.kind == "preset" and init == "pretrained":
        raise ModelError(
            f"--model {source.name!r} is a preset: it ships a config but no weights. Use --init random "
            f"(the default for presets){_hub_hint(source)}."
        )
    random_init = init == "random" or (init == "auto" and source.kind == "preset")
    notes = list(notes or [])
    kwargs = {
        "dtype": param_dtype or torch.float32,
        "attn_implementation": attn_implementation,
        "trust_remote_code": trust_remote_code,
    }
    if load_in_4bit:
        from lstune.models.quant import quantization_config, refuse_random_4bit, require_bitsandbytes

        if random_init:
            refuse_random_4bit(source.name)
        require_bitsandbytes(torch.device(device or "cpu").type)
        kwargs.update(quantization_config=quantization_config(), device_map={"": str(device or "cpu")})
    torch.manual_seed(seed)
    if random_init:
        with torch.device(init_device or "cpu"):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        notes.insert(0, "weights are randomly initialised (no pretrained weights loaded)")
    else:
        if source.kind == "local":
            check_weight_files(Path(source.location))
        try:
            model = AutoModelForCausalLM.from_pretrained(source.location, config=config, **kwargs)
        except OSError as exc:
            raise ModelError(
                f"--model {source.name!r}: no weights could be loaded ({describe(exc)}). Use --init random to "
                "train from a random initialisation, or point to a folder/hub id with weights."
            ) from None
        except parser_errors() as exc:  # a hub model's files, read by transformers (a local one is checked above)
            raise ModelError(f"--model {source.name!r}: its weights cannot be loaded ({describe(exc)}).") from None
    if load_in_4bit:
        from lstune.models.quant import disable_cpu_packing

        disable_cpu_packing(model)
    model.config.use_cache = False
    return LoadedModel(model, tokenizer, source, notes)


def check_weight_files(folder: Path) -> None:
    """ModelError naming the first weight file in a local model folder that is not what its format requires:
    a safetensors header that lies (sizes, offsets, JSON), a shard index of the wrong shape, a pickle payload or
    a truncated .bin (torch's restricted unpickler, as transformers loads it: nothing runs). Headers only:
    safetensors maps its files and `torch.load(mmap=True)` reads no tensor data."""
    import zipfile

    from lstune.untrusted import check_safetensors, read_json, torch_load

    for path in sorted(folder.glob("*.safetensors")):
        check_safetensors(path, error=ModelError)
    for path in sorted(folder.glob("*.index.json")):
        index = read_json(path, error=ModelError, what="the weight index")
        if not isinstance(index.get("weight_map"), dict) or not all(
                isinstance(v, str) for v in index["weight_map"].values()):
            raise ModelError(f"the weight index {path} has no weight_map of tensor names to file names (corrupt).")
    if not any(folder.glob("*.safetensors")):  # transformers prefers safetensors; else it loads these
        for path in sorted(folder.glob("*.bin")):
            torch_load(path, error=ModelError, map_location="cpu", mmap=zipfile.is_zipfile(path))


def _hub_hint(source: ModelSource) -> str:
    preset = get_preset(source.location)
    return f", or --model {preset.hub_id} for the real weights" if preset and preset.hub_id else ""


def _check_causal_lm(config, name: str) -> None:
    from lstune.models.hf_internals import is_causal_lm_config

    if not is_causal_lm_config(config):
        raise ModelError(
            f"--model {name!r} ({config.model_type}) is not a causal language model transformers can "
            "load with AutoModelForCausalLM; lstune trains decoder-only causal LMs."
        )


def _not_plain_linear(model) -> list[str]:
    """Linear layers whose model code gives them a forward of their own (PhiMoE's router returns routing tuples):
    peft's "all-linear" would wrap them as if they computed x·Wᵀ + b, and break the model's forward. Quantized
    linear layers (bitsandbytes' Linear4bit) override forward too, to compute that same projection: they stay."""
    from torch import nn

    model_code = ("transformers.models.", "transformers_modules.")  # a model's own classes, remote code included
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and type(module).forward is not nn.Linear.forward
            and type(module).__module__.startswith(model_code)]


# peft refuses LoRA on these module names in these model types (peft.tuners.tuners_utils.
# _check_lora_target_modules_mamba, peft 0.17-0.21: a Mamba mixer's out_proj / conv1d); `auto` leaves them out.
_PEFT_MAMBA_TYPES = frozenset({"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"})
_PEFT_MAMBA_REFUSED = frozenset({"out_proj", "conv1d"})


def _peft_refused(model) -> list[str]:
    """Modules peft refuses to adapt in this model (Mamba-based model types), which `auto` must not name."""
    if getattr(getattr(model, "config", None), "model_type", None) not in _PEFT_MAMBA_TYPES:
        return []
    return [name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] in _PEFT_MAMBA_REFUSED]


def apply_lora(model, *, r: int, alpha: int | None, dropout: float, targets: Any, dora: bool = False,
               rslora: bool = False):
    """Wrap `model` with LoRA adapters (peft). `targets` 'auto' adapts every linear layer but the head, those
    with a forward of their own (`_not_plain_linear`) and those peft refuses for Mamba models (`_peft_refused`).
    `dora` / `rslora`: peft's DoRA and rsLoRA variants."""
    from peft import LoraConfig, get_peft_model

    auto = targets == "auto"
    lora = LoraConfig(
        r=r,
        lora_alpha=alpha or 2 * r,
        lora_dropout=dropout,
        target_modules="all-linear" if auto else list(targets),
        exclude_modules=(_not_plain_linear(model) + _peft_refused(model) or None) if auto else None,
        task_type="CAUSAL_LM",
        use_dora=dora,
        use_rslora=rslora,
    )
    try:
        with warnings.catch_warnings():
            # peft reads the model's `is_gradient_checkpointing`, which transformers 5 deprecates (a warning per
            # process that the user can do nothing about).
            warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            peft_model = get_peft_model(model, lora)
    except ValueError as exc:
        raise UserError(f"--lora-targets: {_first_line(exc)}. Use auto, or names of linear layers like q_proj,v_proj.") from None
    return peft_model
