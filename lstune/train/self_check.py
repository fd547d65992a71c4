"""Startup self-check: the prepared model against the unmodified model, before training starts.

Why: lstune reads what a model's attention and blocks mean from its structure and config, and the structure does not
say everything (a window applied only through the mask, positions that do not come from `position_ids`, a token
mixer that is not attention). So before the run, on a short probe, it compares the model as lstune prepared it with
the unmodified model running its own attention implementation (eager) and its own mask:

1. probe model: a copy of the loaded model when it is small (<= 100M parameters) and names no window / attention
   chunk longer than 16 tokens; else a random-init copy, built on the run's device, of a prefix of its layers long
   enough to hold every layer type the config lists per layer (a layer or a few), with a vocabulary of 512 and
   windows / attention chunks (and Llama-4's temperature step) cut to 16 tokens — exactness is a property of the code
   path, not of the weights or the window's size;
2. probe batch: one sequence longer than every window/chunk the config names (at least 64 tokens), with two packed
   documents when the run packs; labels pre-shifted as the data pipeline makes them;
3. reference: the probe model with `attn_implementation="eager"`, fp32, dropout off, each packed document run alone
   (so a model whose own code lets packed documents see each other is caught); prepared: a copy put through
   `prepare_model` with the run's settings (LoRA, attention backend, SP, every memory technique, tiles forced to 2
   where tiling is on so that tile edges are crossed);
4. compare the mean loss (rel 1e-5) and the gradient at the input embeddings (rel 1e-4 of its largest entry). On
   a mismatch, the first decoder layer whose output differs is named, and the techniques are tried one by one to
   name the one to turn off. Under SP every rank of the group takes part (the reference runs whole on each rank).

Cost: two forward/backward passes of the probe model on about 64 tokens (seconds on CPU). The check runs in fp32 on
the run's device with the sdpa kernel where the configured kernel cannot run fp32 training (FlashAttention-2):
kernel-level equivalence of flash/flex is covered by the GPU tests. `--skip-self-check` turns it off.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from lstune.data.batch import IGNORE_INDEX
from lstune.errors import ModelError

log = logging.getLogger("lstune")

_SMALL_MODEL = 100_000_000
_PROBE_VOCAB = 512
_PROBE_WINDOW = 16
_MIN_PROBE = 64
_LOSS_RTOL = 1e-5
_GRAD_RTOL = 1e-4


@dataclass
class SelfCheckResult:
    ok: bool
    tokens: int
    documents: int
    layers: int
    copy_kind: str  # "copy" | "truncated"
    loss_rel: float
    grad_rel: float
    sampling: bool = False  # the model's training forward samples: compared in eval mode (`_compare`)

    def note(self) -> str:
        mode = (" in eval mode (its training forward samples at random, so two passes cannot be compared there)"
                if self.sampling else "")
        return (
            f"self-check passed: loss and input-embedding gradient equal the unmodified model's (eager attention, "
            f"its own mask) on a {self.tokens}-token probe ({self.documents} document"
            f"{'s' if self.documents > 1 else ''}) of a {self.layers}-layer {self.copy_kind}{mode} "
            f"(loss rel {self.loss_rel:.1e}, gradient rel {self.grad_rel:.1e})"
        )


def run_self_check(model: Any, config: Any, runtime: Any) -> SelfCheckResult:
    """Compare `prepare_model(copy of model)` with the unmodified model; ModelError naming the layer and technique
    on a mismatch. `model` itself is not changed."""
    import torch

    probe, kind = probe_model(model, trust_remote_code=config.model.trust_remote_code, device=runtime.device)
    check_config = _check_config(config, probe, runtime)
    batch = probe_batch(probe.config, pack=config.data.pack, sp=runtime.sp, vocab=_text(probe.config).vocab_size)
    # The check seeds its passes (`_compare`): the run's own random streams, CPU and device, are left as they were.
    with torch.random.fork_rng(devices=_cuda_ids(runtime.device)):
        result = _compare(probe, check_config, runtime, batch)
        result.copy_kind, result.layers = kind, _layer_count(probe)
        if not result.ok:
            raise ModelError(_diagnose(probe, check_config, runtime, batch, result))
    log.info("%s", result.note())
    return result


def _cuda_ids(device: Any) -> list[int]:
    """The CUDA device index whose random stream the check must leave as it was ([] off CUDA)."""
    import torch

    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


# --------------------------------------------------------------------------------------------------------------------
# probe model and batch
# --------------------------------------------------------------------------------------------------------------------


def probe_model(model: Any, *, trust_remote_code: bool = False, device: Any = "cpu") -> tuple[Any, str]:
    """(fp32 copy with dropout off, "copy" or "truncated random-init copy") of `model` on `device`."""
    import torch

    from lstune.models.introspect import unwrap_model

    lm = unwrap_model(model)
    if sum(p.numel() for p in lm.parameters()) <= _SMALL_MODEL and not _long_windows(lm.config):
        # A 4-bit base (--load-in-4bit) is checked as it is: transformers refuses to cast it, and its quantized
        # layers are part of what the check compares.
        as_loaded = getattr(lm, "is_loaded_in_4bit", False)
        probe = copy.deepcopy(lm) if as_loaded else copy.deepcopy(lm).to(device=device, dtype=torch.float32)
        kind = "copy"
        if as_loaded:
            _fp32_compute(probe)
    else:
        probe, kind = _truncated_copy(lm.config, trust_remote_code, device), "truncated random-init copy"
    _drop_dropout(probe)
    probe.config.use_cache = False
    return probe, kind


def _long_windows(config: Any) -> bool:
    """Whether `config` names a window a copy of the model could not be probed across cheaply.

    The probe must be longer than every window (`probe_batch`), and the eager reference builds an [L, L] mask: a copy
    keeping tiny-gemma2's 1M-token window asked for 1.1 TB. A built model's window cannot be cut afterwards (layers
    copy it from the config at init, e.g. Gemma-2's `self.sliding_window`), so such a model is probed on a truncated
    copy built from a config with its windows cut, like a big one."""
    return any(length > (_PROBE_ROPE if key == _ROPE_THRESHOLD else _PROBE_WINDOW)
               for key, length in probe_lengths(config).items())


def _fp32_compute(model: Any) -> None:
    """The probe's 4-bit layers compute in fp32 on their dequantized weights, and its unquantized parts (embeddings,
    norms, head: bf16 on CUDA, lstune.train.plan.dtypes_of) are cast to fp32 one tensor at a time (transformers
    refuses `.to(dtype)` on a quantized model; the packed 4-bit weights are uint8 and stay as they are): the check
    compares lstune's techniques with the plain model at fp32's tolerance, which bf16's rounding would swamp (a bf16
    base failed it with every technique off on the H200 of 2026-11-26, gradient rel 6.5e-3)."""
    import torch

    for module in model.modules():
        if hasattr(module, "compute_type_is_set") and hasattr(module, "compute_dtype"):
            module.compute_dtype, module.compute_type_is_set = torch.float32, True
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point() and tensor.dtype != torch.float32:
            tensor.data = tensor.data.float()


def _truncated_copy(config: Any, trust_remote_code: bool, device: Any) -> Any:
    """Built on the run's device: random init of a few full-width layers is most of the check's cost on a CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    small = truncated_config(config)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(small, dtype=torch.float32, trust_remote_code=trust_remote_code)


def truncated_config(config: Any) -> Any:
    """`config` with the shortest prefix of layers holding every value of its per-layer lists, and a small vocab
    (all in its text config, for a multimodal model's)."""
    whole = copy.deepcopy(config)
    small = _text(whole)
    layers = getattr(small, "num_hidden_layers", 1)
    per_layer = {k: v for k, v in vars(small).items() if isinstance(v, list) and len(v) == layers and layers > 1}
    keep = 1
    for values in per_layer.values():
        firsts = {}
        for index, value in enumerate(values):
            firsts.setdefault(repr(value), index)
        keep = max(keep, max(firsts.values()) + 1)
    small.num_hidden_layers = min(layers, max(keep, 2))
    for key, values in per_layer.items():
        setattr(small, key, values[: small.num_hidden_layers])
    for key, window in named_windows(small).items():  # a short window is as good a test, on a short probe
        setattr(small, key, min(window, _PROBE_WINDOW))
    if _temperature_step(small) is not None:  # and a short temperature step
        small.floor_scale = min(int(small.floor_scale), _PROBE_WINDOW)
    if _ROPE_THRESHOLD in probe_lengths(small):  # so is a short original context for length-dependent RoPE
        original = min(probe_lengths(small)[_ROPE_THRESHOLD], _PROBE_ROPE)
        small.rope_parameters = {**small.rope_parameters, "original_max_position_embeddings": original}
        if isinstance(getattr(small, "original_max_position_embeddings", None), int):  # Phi-3 keeps it here too
            small.original_max_position_embeddings = original
    if getattr(small, "vocab_size", 0) > _PROBE_VOCAB:
        small.vocab_size = _PROBE_VOCAB
        if (getattr(small, "pad_token_id", None) or 0) >= _PROBE_VOCAB:
            small.pad_token_id = None
    return whole


def _text(config: Any) -> Any:
    """The config of the language model: a multimodal config's text config, else the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _drop_dropout(model: Any) -> None:
    """Dropout draws differ between the two models' code paths; the check compares the deterministic function."""
    from torch import nn

    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    for config in {id(c): c for c in (model.config, _text(model.config))}.values():
        for name, value in list(vars(config).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(config, name, 0.0)


def named_windows(config: Any) -> dict[str, int]:
    """Integer (text) config entries that limit how far attention reaches (sliding windows, attention chunks)."""
    return {
        key: value for key, value in vars(_text(config)).items()
        if ("window" in key or "attention_chunk" in key)
        and "pattern" not in key and "layers" not in key  # a layer pattern or count (max_window_layers) is no length
        and isinstance(value, int) and not isinstance(value, bool) and value > 0
    }


_ROPE_THRESHOLD = "rope: original_max_position_embeddings"
# Llama-4's attention temperature steps every `floor_scale` positions (lstune.models.llama4): a probe that stays
# below it sees a temperature of 1 everywhere, so a rank or chunk computing it from its own token index would pass.
_TEMPERATURE_STEP = "attention temperature: floor_scale"
# The original context a probe model keeps for length-dependent RoPE: the 64-token probe crosses it, while each
# rank's shard under SP (32 tokens at SP 2) stays within it, so a rank choosing from its shard differs and is caught.
_PROBE_ROPE = 48


def probe_lengths(config: Any) -> dict[str, int]:
    """The lengths past which the model behaves otherwise, which the probe must cross: its named windows, and the
    original context of RoPE that picks its frequencies from the length (LongRoPE's short and long factors,
    dynamic NTK; lstune.models.rope.length_dependent_rope). A 64-token probe never crossed Phi-3's 4K: a run whose
    ranks chose other factors than the whole sample passed the check."""
    from lstune.models.rope import length_dependent_rope

    lengths = dict(named_windows(config))
    found = length_dependent_rope(config)
    if found is not None:
        lengths[_ROPE_THRESHOLD] = found[1]
    step = _temperature_step(config)
    if step is not None:
        lengths[_TEMPERATURE_STEP] = step
    return lengths


def _temperature_step(config: Any) -> int | None:
    """Llama-4's `floor_scale` when its NoPE layers tune the attention temperature, else None."""
    text = _text(config)
    step = getattr(text, "floor_scale", None)
    if not getattr(text, "attn_temperature_tuning", False) or not isinstance(step, (int, float)) or step <= 0:
        return None
    if all(getattr(text, "no_rope_layers", None) or [1]):  # every layer has RoPE: the temperature is never applied
        return None
    return int(step)


def probe_batch(config: Any, *, pack: bool, sp: int, vocab: int) -> dict[str, Any]:
    """One row crossing every length past which the model changes (`probe_lengths`); two documents (an odd split)
    when packing. Length a multiple of 2·sp."""
    import torch

    windows = probe_lengths(config)
    length = max([_MIN_PROBE, *(w + 16 for w in windows.values())])
    length += -length % (2 * sp)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(vocab, 320) if vocab > 3 else vocab, (1, length), generator=gen)
    # Packed in one process past a length-dependent RoPE's original context: a first document past it and a second
    # within it, which the model runs with other frequencies (lstune.models.rope_documents).
    threshold = windows.get(_ROPE_THRESHOLD) if sp == 1 else None
    middle = threshold + 8 if threshold is not None else length // 2 + 3
    cuts = [0, middle, length] if pack else [0, length]
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])])[None]
    labels = torch.full_like(ids, IGNORE_INDEX)
    for a, b in zip(cuts, cuts[1:]):
        labels[0, a : b - 1] = ids[0, a + 1 : b]
    return {"input_ids": ids, "position_ids": positions, "shift_labels": labels}


def _layer_count(model: Any) -> int:
    from lstune.models.introspect import decoder_layers

    return len(decoder_layers(model))


# --------------------------------------------------------------------------------------------------------------------
# comparison
# --------------------------------------------------------------------------------------------------------------------


def _check_config(config: Any, probe: Any, runtime: Any) -> Any:
    """The run's settings for the probe: tiles forced to 2 where tiling is on, a kernel that trains in fp32 here."""
    from lstune.errors import UserError
    from lstune.models.attention import resolve_backend

    import torch

    softcap = getattr(probe.config, "attn_logit_softcapping", None)
    attn = config.model.attn
    try:
        resolve_backend(attn, device_type=runtime.device.type, dtype=torch.float32, softcap=softcap)
    except UserError:
        attn = "sdpa"
    memory = config.memory
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, attn=attn, dtype="fp32"),
        memory=dataclasses.replace(
            memory,
            tiled_mlp="off" if memory.tiled_mlp == "off" else 2,
            tiled_loss="off" if memory.tiled_loss == "off" else 2,
        ),
    )


def _compare(probe: Any, config: Any, runtime: Any, batch: dict) -> SelfCheckResult:
    """Compare in training mode; where that fails because the model's training forward samples at random (PhiMoE's
    Gumbel routing: packing and tiling draw the same distribution in another order), compare in eval mode instead,
    where the model is a deterministic function."""
    result = _compare_in_mode(probe, config, runtime, batch, training=True)
    if not result.ok and _samples_in_training(probe, batch, runtime.device):
        result = _compare_in_mode(probe, config, runtime, batch, training=False)
        result.sampling = True
    return result


def _compare_in_mode(probe: Any, config: Any, runtime: Any, batch: dict, *, training: bool) -> SelfCheckResult:
    import torch

    prepared_input = copy.deepcopy(probe)
    _set_eager(probe)  # the probe is lstune's own copy: it serves as the reference
    # Both passes draw the same random numbers (callers fork the generators: the run's own streams are untouched).
    torch.manual_seed(0)
    ref_loss, ref_grad, ref_layers = _reference_step(probe, batch, runtime.device, training=training)
    probe.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss, grad, layers = _prepared_step(prepared_input, config, runtime, batch, training=training)
    loss_rel = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
    grad_rel = float((grad - ref_grad).abs().max() / ref_grad.abs().max().clamp_min(1e-12))
    ok = _all_ranks_agree(loss_rel <= _LOSS_RTOL and grad_rel <= _GRAD_RTOL, runtime)
    result = SelfCheckResult(ok, batch["input_ids"].shape[1], len(_doc_starts(batch)), 0, "", loss_rel, grad_rel)
    result.first_bad_layer = _first_difference(layers, ref_layers)  # type: ignore[attr-defined]
    return result


def _samples_in_training(probe: Any, batch: dict, device: Any) -> bool:
    """Whether the unmodified model's training forward depends on the random seed (dropout is off in the probe)."""
    import torch

    _set_eager(probe)
    runs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        runs.append(_reference_step(probe, batch, device, training=True))
        probe.zero_grad(set_to_none=True)
    (loss_a, grad_a, _), (loss_b, grad_b, _) = runs
    return loss_a != loss_b or not torch.equal(grad_a, grad_b)


def _set_eager(model: Any) -> None:
    try:
        model.set_attn_implementation("eager")
    except (ValueError, AttributeError):
        pass  # models that have only their own attention already run it


def _embedding_capture(model: Any, store: list) -> Any:
    """Forward hook making the input embeddings a leaf whose gradient is kept (also with frozen embeddings)."""

    def hook(module, args, output):
        leaf = output.detach().requires_grad_()
        store.append(leaf)
        return leaf

    from lstune.models.introspect import unwrap_model

    return unwrap_model(model).get_input_embeddings().register_forward_hook(hook)


def _layer_capture(model: Any, store: dict) -> list:
    from lstune.models.introspect import decoder_layers

    def hook(index, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        store.setdefault(index, hidden.detach())

    return [
        layer.register_forward_hook(lambda m, a, o, i=i: hook(i, m, a, o))
        for i, layer in enumerate(decoder_layers(model))
    ]


def _reference_step(model: Any, batch: dict, device: Any, *, training: bool = True) -> tuple[float, Any, dict]:
    """The unmodified model's mean loss, input-embedding gradient and per-layer outputs on `batch`, each packed
    document run alone: that is what packing means. A model whose own code lets documents see each other (a
    linear-attention or recurrent state, positions counted from the row's start) differs from it, where the model
    run on the whole packed row would err exactly as its prepared copy does."""
    import torch
    import torch.nn.functional as F

    model.to(device).train(training)
    batch = {k: v.to(device) for k, v in batch.items()}
    starts = _doc_starts(batch)
    embeds, logits, layers = [], [], []
    handle = _embedding_capture(model, embeds)
    try:
        for start, end in zip(starts, [*starts[1:], batch["input_ids"].shape[1]]):
            doc_logits, doc_layers = _reference_forward(model, {k: v[:, start:end] for k, v in batch.items()})
            logits.append(doc_logits)
            layers.append(doc_layers)
        loss = F.cross_entropy(torch.cat(logits, 1).flatten(0, 1), batch["shift_labels"].flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
    finally:
        handle.remove()
    grad = torch.cat([leaf.grad[0].detach() for leaf in embeds])
    return loss.item(), grad, {i: torch.cat([doc[i] for doc in layers]) for i in layers[0]}


def _reference_forward(model: Any, doc: dict) -> tuple[Any, dict]:
    """(fp32 logits, {layer index: output}) of one document; ModelError when the model's own loss is not token
    cross-entropy (lstune computes that only)."""
    from lstune.memory.loss import check_own_loss, own_loss_candidates

    layers: dict = {}
    handles = _layer_capture(model, layers)
    try:
        unshifted = _unshifted(doc["shift_labels"])
        out = model(input_ids=doc["input_ids"], position_ids=doc["position_ids"], labels=unshifted, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    check_own_loss(model, out.loss, own_loss_candidates(out.logits.detach(), unshifted), rtol=_LOSS_RTOL)
    return out.logits.float(), {i: h[0] for i, h in layers.items()}


def _unshifted(shift_labels: Any) -> Any:
    """Labels for the model's own loss, which shifts them by one itself (the last pre-shifted label is -100)."""
    import torch

    return torch.cat([torch.full_like(shift_labels[:, :1], IGNORE_INDEX), shift_labels[:, :-1]], dim=1)


def _prepared_step(model: Any, config: Any, runtime: Any, batch: dict, *, training: bool = True
                   ) -> tuple[float, Any, dict]:
    from lstune.models.chunk_layout import sequence_layout
    from lstune.parallel.sp_data import count_tokens, shard_batch
    from lstune.train.prepare import prepare_model

    prepared = prepare_model(model, config, runtime)
    prepared.model.train(training)
    embeds, layers = [], {}
    handles = [_embedding_capture(prepared.model, embeds), *_layer_capture(prepared.model, layers)]
    chunks = prepared.memory.attn_chunking
    ring = runtime.dims.ring if runtime.sp > 1 else 1
    layout = sequence_layout(batch["input_ids"].shape[1], runtime.sp, chunks, ring)
    try:
        shard = shard_batch(batch, runtime.sp, runtime.dims.sp_rank if runtime.sp > 1 else 0, chunks, ring)
        shard = {k: v.to(runtime.device) for k, v in shard.items()}
        loss_sum, _ = prepared.loss_sum(shard)
        (loss_sum / count_tokens(batch)).backward()
        total = _sp_sum(loss_sum.detach(), runtime)
    finally:
        for handle in handles:
            handle.remove()
        prepared.undo()  # the copy is thrown away; undo also drops its attention registration
    seq = batch["input_ids"].shape[1]
    grad = _gather_tokens(embeds[0].grad[0].detach(), runtime, layout, seq)
    return total / count_tokens(batch), grad, {i: _gather_tokens(h[0], runtime, layout, seq) for i, h in layers.items()}


def _sp_sum(value: Any, runtime: Any) -> float:
    if runtime.sp == 1:
        return float(value)
    import torch.distributed as dist

    value = value.clone()
    dist.all_reduce(value, group=runtime.dims.sp_group)
    return float(value)


def _gather_tokens(local_SD: Any, runtime: Any, layout: Any, seq: int) -> Any:
    """This rank's token shard → the probe's `seq` tokens in their order (SP; `layout`: how the probe was sharded,
    padding included)."""
    if runtime.sp == 1:
        return local_SD
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(local_SD) for _ in range(runtime.sp)]
    dist.all_gather(parts, local_SD.contiguous(), group=runtime.dims.sp_group)
    return layout.unshard(parts, dim=0)[:seq]


def _all_ranks_agree(ok: bool, runtime: Any) -> bool:
    if runtime.sp == 1:
        return ok
    import torch
    import torch.distributed as dist

    flag = torch.tensor([0.0 if ok else 1.0], device=runtime.device)
    dist.all_reduce(flag, group=runtime.dims.sp_group)
    return bool(flag.item() == 0)


def _doc_starts(batch: dict) -> list[int]:
    positions = batch["position_ids"][0].tolist()
    return [i for i, p in enumerate(positions) if p == 0]


def _first_difference(layers: dict, reference: dict) -> int | None:
    for index in sorted(reference):
        if index not in layers:
            continue
        ref, got = reference[index], layers[index].to(reference[index].device)
        if ref.shape != got.shape or float((got - ref).abs().max()) > 1e-4 * float(ref.abs().max().clamp_min(1e-12)):
            return index
    return None


# --------------------------------------------------------------------------------------------------------------------
# diagnosis
# --------------------------------------------------------------------------------------------------------------------

_TECHNIQUES = {  # setting: (value that turns it off, the flag)
    "tiled_mlp": ("off", "--tiled-mlp off"),
    "mini_sequence": (False, "--no-mini-sequence"),
    "tiled_loss": ("off", "--tiled-loss off"),
    "recompute_attention": ("on", "--recompute-attention on"),
    "checkpointing": (False, "--checkpointing off"),
    "offload_checkpoints": (False, "--no-offload-checkpoints"),
}


def _diagnose(probe: Any, config: Any, runtime: Any, batch: dict, result: SelfCheckResult) -> str:
    """The message of a failed check: where it differs, and which technique (if any) to turn off."""
    where = _describe_layer(probe, getattr(result, "first_bad_layer", None))
    culprit = _find_culprit(probe, config, runtime, batch)
    if culprit is None and result.documents > 1 and _matches_unpacked(probe, config, runtime):
        fix = (
            "it matches on one document, so this model lets packed documents see each other in a way lstune cannot "
            "separate by position_ids (a linear-attention or recurrent state, or positions counted from the row's "
            "start rather than read from position_ids); train without --pack"
        )
    elif culprit is None and runtime.sp > 1:
        fix = (
            f"it differs with every memory technique off under sequence parallelism (--sp {runtime.sp}): this model "
            "mixes positions outside what lstune shards (a linear-attention or recurrent state lstune does not run "
            "head-parallel); train with --sp 1 (the other processes then split the data), where this check runs again"
        )
    elif culprit is None:
        fix = (
            "it differs with every memory technique off, so lstune's attention gets this model wrong; this model "
            "cannot be trained exactly by lstune (please report it)"
        )
    elif culprit == "all":
        flags = ", ".join(flag for _, flag in _TECHNIQUES.values())
        fix = f"it matches only with every memory technique off ({flags})"
    else:
        fix = f"it matches with {_TECHNIQUES[culprit][1]}: turn that technique off for this model"
    return (
        f"self-check failed: lstune's prepared model differs from the unmodified model (eager attention, its own "
        f"mask) on a {result.tokens}-token probe with {result.documents} document(s): loss rel "
        f"{result.loss_rel:.1e}, input-embedding gradient rel {result.grad_rel:.1e}; first differing layer: "
        f"{where}. {fix[0].upper()}{fix[1:]}. (--skip-self-check skips this check at your own risk.)"
    )


def _describe_layer(probe: Any, index: int | None) -> str:
    if index is None:
        return "none in the forward (the difference is in backward or the loss head)"
    from lstune.models.introspect import decoder_layers

    layer = decoder_layers(probe)[index]
    layer_types = getattr(probe.config, "layer_types", None)
    kind = f", layer type {layer_types[index]!r}" if layer_types and index < len(layer_types) else ""
    return f"layer {index} ({type(layer).__name__}{kind})"


def _matches_unpacked(probe: Any, config: Any, runtime: Any) -> bool:
    """Whether the check passes on a one-document probe with the run's other settings."""
    batch = probe_batch(probe.config, pack=False, sp=runtime.sp, vocab=_text(probe.config).vocab_size)
    return _compare(probe, dataclasses.replace(config, data=dataclasses.replace(config.data, pack=False)), runtime,
                    batch).ok


def _find_culprit(probe: Any, config: Any, runtime: Any, batch: dict) -> str | None:
    """The first technique whose removal alone makes the check pass; "all" when only all off passes; None when even
    all off fails."""
    def with_memory(**changes):
        # A technique turned off takes the settings that only it reads along, or the variant is no valid config
        # (--host-mem-budget without offload) and the run stops on that instead of the real mismatch.
        if changes.get("offload_checkpoints") is False:
            changes.setdefault("host_mem_budget", None)
        if changes.get("checkpointing") is False:  # kept attention outputs live beside checkpoints (schema)
            changes.setdefault("checkpoint_device_budget", None)
            changes.setdefault("recompute_attention", "on")
        return dataclasses.replace(config, memory=dataclasses.replace(config.memory, **changes))

    if not _compare(probe, with_memory(**{k: off for k, (off, _) in _TECHNIQUES.items()}), runtime, batch).ok:
        return None
    for name, (off, _) in _TECHNIQUES.items():
        if getattr(config.memory, name) == off:
            continue
        changes = {name: off}
        if name == "checkpointing":
            changes["offload_checkpoints"] = False
        if name == "tiled_mlp":
            changes["mini_sequence"] = False
        if _compare(probe, with_memory(**changes), runtime, batch).ok:
            return name
    return "all"
