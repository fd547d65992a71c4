"""The shapes an estimate needs, read from a transformers config (and parameter counts from a meta-device model).

`ModelShape.from_config` reads widths from the config alone (hidden, heads, kv heads, head dim, intermediate,
experts, vocab, tied embeddings, sliding windows) — enough for FLOPs. `count_parameters` builds the model on the
meta device (no weights, no memory) and counts what a run holds: frozen and trainable parameters with LoRA applied
by peft on the meta model, the largest layer, the norms per layer.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

from lstune.errors import ModelError
from lstune.models.introspect import attention_heads, is_norm

# Architectures whose MLP is a plain up/act/down (two matrices); every other one is gated (SwiGLU/GeGLU: three).
_UNGATED_MLP = frozenset({"gpt2", "gpt_neox", "gpt_bigcode", "opt", "falcon", "bloom", "phi", "starcoder2", "gptj",
                          "codegen", "mpt"})


def text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


@dataclass(frozen=True)
class ModelShape:
    """Widths of one decoder (per token), from the config."""

    layers: int
    hidden: int
    q_width: int  # heads · head_dim
    kv_width: int  # kv heads · head_dim
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width, or one expert's for MoE
    experts: int  # 0 for dense
    top_k: int
    shared_intermediate: int  # MoE shared experts' total width
    vocab: int
    tied: bool
    gated: bool
    windows: tuple[int | None, ...]  # per layer: sliding window in tokens, None = full causal
    # Per layer: "attention" (softmax), "linear" (linear attention, state-space, short convolution: O(S)),
    # "hybrid" (both side by side, Falcon-H1) or "none" (an MLP-only block, Nemotron-H), from `layer_types`.
    mixers: tuple[str, ...] = ()
    chunks: tuple[int | None, ...] = ()  # per layer: chunked attention's chunk (Llama-4), None = not chunked
    state_elements: int = 0  # one linear layer's recurrent state per sequence (heads · key dim · value dim)
    conv_channels: int = 0  # one linear layer's short causal convolution: its channels (0: none, MiniMax)
    conv_kernel: int = 0  # and its width in tokens
    sinks: bool = False  # learned attention sinks (gpt-oss): the block kernel, O(S) like SDPA's flash kernel
    # Gated DeltaNet (Qwen3-Next, Qwen3.5): value heads, key and value head dims (0: no such layers), for the bytes
    # of transformers' torch kernel (`delta_rule_saved_bytes`, `delta_rule_backward_bytes`)
    delta_heads: int = 0
    delta_key_dim: int = 0
    delta_value_dim: int = 0
    # KDA (Kimi-Linear): heads and head dim (0: no such layers), for the bytes of transformers' torch kernel
    # (`kda_saved_bytes`, `kda_backward_bytes`)
    kda_heads: int = 0
    kda_head_dim: int = 0
    lightning_block: int = 0  # MiniMax's lightning attention: tokens per block (its state is saved once per block)
    mamba1_scan_elements: int = 0  # Mamba-1 (Jamba): expanded width · state size, for its torch scan's bytes
    # An attention-free model (Mamba, FalconMamba, Mamba-2: no attention heads, no MLP; `attention_free`): per layer,
    # its mixer's projection weights one token multiplies, and the mixer's values per token its torch path keeps
    # for backward beyond the conv, state and scan rows (`ssm_mixer_widths`)
    mixer_params: int = 0
    mixer_saved: int = 0
    # and the widths its Ulysses all-to-alls move per token (lstune.models.mixers: the in-projection's streams to the
    # rank's heads / channels, the scan's output back): the in-projection's width + the inner width
    mixer_exchanged: int = 0
    # How many fp32 expanded width · state size tensors per token Mamba-1's torch scan keeps (`mamba1_scan_bytes`):
    # Jamba's `slow_forward` 3; Mamba's and FalconMamba's reference `selective_scan_fn` (what runs without
    # mamba-ssm) 7, fitted to the trace (tests/unit/estimate/test_attention_free.py)
    mamba1_scan_copies: int = 3
    # Mamba-2 (attention-free, and the hybrids' Mamba-2 layers: Bamba, Nemotron-H, Falcon-H1, GraniteMoeHybrid): its
    # heads, chunk and state, for the torch chunked scan's per-chunk matrices (`mamba2_chunk_bytes`, `_mamba2_scan`)
    mamba2_heads: int = 0
    mamba2_chunk: int = 0
    mamba2_state: int = 0

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        c = text_config(config)
        hidden = _first(c, "hidden_size", "n_embd", "d_model")
        shape = attention_heads(c)  # the widest layer's where heads vary per layer
        if shape is None:
            return cls._attention_free(c, hidden)
        heads, kv_heads, head_dim = shape
        experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or 0
        moe_width = getattr(c, "moe_intermediate_size", None)
        intermediate = (moe_width if experts and moe_width else None) or getattr(c, "intermediate_size", None) \
            or getattr(c, "n_inner", None) or 4 * hidden
        layers = _first(c, "num_hidden_layers", "n_layer")
        return cls(
            layers=layers, hidden=hidden, q_width=heads * head_dim, kv_width=kv_heads * head_dim, heads=heads,
            kv_heads=kv_heads, head_dim=head_dim, intermediate=intermediate, experts=experts,
            top_k=(getattr(c, "num_experts_per_tok", None) or 1) if experts else 0,
            shared_intermediate=_shared_width(c) if experts else 0,
            vocab=c.vocab_size, tied=bool(getattr(config, "tie_word_embeddings", getattr(c, "tie_word_embeddings", False))),
            gated=getattr(c, "model_type", "") not in _UNGATED_MLP, windows=_windows(c, layers),
            mixers=_mixers(c, layers), chunks=_chunks(c, layers), state_elements=_state_elements(c, hidden),
            **_conv(c, hidden), **_delta(c), **_kda(c), mamba1_scan_elements=_mamba1_elements(c, hidden),
            lightning_block=(getattr(c, "block_size", None) or 256) if getattr(c, "model_type", "") == "minimax" else 0,
            **_mamba2_scan(c), sinks=getattr(c, "model_type", "") in _SINK_MODELS,
        )

    @classmethod
    def _attention_free(cls, c: Any, hidden: int) -> "ModelShape":
        """A pure state-space model (Mamba, FalconMamba, Mamba-2): every layer a norm and a mixer, no attention heads
        and no MLP; the mixer's projections, short conv, states and scan in their own rows."""
        model_type = getattr(c, "model_type", "?")
        if model_type not in ATTENTION_FREE_TYPES:
            raise ModelError(f"lstune's estimate has no byte model of {model_type}, a model without attention heads "
                             f"that is not one of {', '.join(sorted(ATTENTION_FREE_TYPES))}; `lstune estimate` and "
                             "`lstune train` plan every run with it (this is lstune's limitation).")
        layers = _first(c, "num_hidden_layers", "n_layer")
        params, saved = ssm_mixer_widths(c, hidden)
        return cls(
            layers=layers, hidden=hidden, q_width=0, kv_width=0, heads=0, kv_heads=0, head_dim=0, intermediate=0,
            experts=0, top_k=0, shared_intermediate=0, vocab=c.vocab_size,
            tied=bool(getattr(c, "tie_word_embeddings", False)), gated=False, windows=(None,) * layers,
            mixers=("linear",) * layers, chunks=(None,) * layers, state_elements=_state_elements(c, hidden),
            **_conv(c, hidden), mamba1_scan_elements=_mamba1_elements(c, hidden), mixer_params=params,
            mixer_saved=saved, mixer_exchanged=_ssm_exchanged(c), mamba1_scan_copies=7, **_mamba2_scan(c))

    @property
    def attention_free(self) -> bool:
        """No attention heads (a pure state-space model): attention-only techniques do not apply."""
        return self.heads == 0

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated else 2

    @property
    def active_intermediate(self) -> int:
        """MLP width one token passes through: the dense width, or top-k experts plus shared experts."""
        if not self.experts:
            return self.intermediate
        return self.top_k * self.intermediate + self.shared_intermediate

    def layer_matmul_params(self) -> int:
        """Weights one token multiplies in one layer (attention projections + active MLP + router)."""
        attention = self.hidden * (self.q_width + 2 * self.kv_width) + self.q_width * self.hidden
        router = self.hidden * self.experts
        return attention + self.mlp_matrices * self.hidden * self.active_intermediate + router + self.mixer_params

    def attention_pairs(self, seq_len: int) -> int:
        """(query, key) pairs over all layers of one causal sequence: S(S+1)/2 per full layer, fewer in windows and
        chunks, none in a hybrid's linear / MLP-only layers."""
        mixers = self.mixers or ("attention",) * self.layers
        chunks = self.chunks or (None,) * self.layers
        return sum(_chunked_pairs(seq_len, chunk) if chunk else _causal_pairs(seq_len, window)
                   for window, chunk, mixer in zip(self.windows, chunks, mixers) if mixer in ("attention", "hybrid"))

    @property
    def linear_layers(self) -> int:
        """Layers with a linear-attention / state-space mixer (hybrids' "hybrid" layers included)."""
        return sum(m in ("linear", "hybrid") for m in self.mixers)

    def linear_mixer_flops(self, seq_len: int) -> int:
        """One forward of every linear mixer's recurrence over one sequence: per token the state update (k ⊗ v)
        and its read-out (q · state), 2 FLOPs per state element each — linear in length. The mixers' projections
        and convolutions are not in it (their weights are not in `layer_matmul_params`' attention formula either:
        an estimate of the same order, labelled predicted)."""
        return 4 * self.state_elements * seq_len * self.linear_layers

    def linear_state_bytes(self, seq_len: int, chunk: int = 64) -> int:
        """What one linear layer's chunked recurrent kernel keeps for backward over one sequence: the fp32 state at
        every chunk edge (chunk_gated_delta_rule, Mamba-2's chunked scan: 64-token chunks)."""
        return 4 * self.state_elements * -(-seq_len // chunk)

    def saved_state_bytes(self, seq_len: int, act_bytes: int) -> int:
        """One linear layer's saved recurrent states over one sequence: `linear_state_bytes`, except for lightning
        attention (MiniMax), whose torch loop keeps its K·V state once per block (`block_size` tokens) in the
        activation dtype (checked against the tensors its forward saves, tests/unit/estimate/test_token_mixers.py)."""
        if self.lightning_block:
            return act_bytes * self.state_elements * -(-seq_len // self.lightning_block)
        return self.linear_state_bytes(seq_len)

    def lightning_scores_bytes(self, seq_len: int, act_bytes: int) -> int:
        """Lightning attention's (MiniMax) decayed intra-block scores, which its torch loop keeps for backward: one
        heads × block × block matrix per block (the last one as long as the rest of the sequence), in the activation
        dtype (checked against the tensors its forward saves)."""
        if not self.lightning_block:
            return 0
        full, rest = divmod(seq_len, self.lightning_block)
        return act_bytes * self.heads * (full * self.lightning_block ** 2 + rest ** 2)

    def linear_conv_bytes(self, seq_len: int, act_bytes: int) -> int:
        """What one linear layer's short causal convolution keeps for backward over one sequence, in the activation
        dtype: its input (the projected channels) and its output before the activation, which the convolution
        computes over the sequence padded by kernel − 1 (transformers' torch path and causal-conv1d alike)."""
        if not self.conv_channels:
            return 0
        return self.conv_channels * (2 * seq_len + self.conv_kernel - 1) * act_bytes


    def delta_rule_saved_bytes(self, seq_len: int, act_bytes: int, chunk: int = 64) -> int:
        """What transformers' torch Gated DeltaNet kernel (`torch_chunk_gated_delta_rule`: what runs without
        flash-linear-attention, and what `--trace` runs) keeps for backward over one sequence of one layer, beyond
        the chunk-edge states (`linear_state_bytes`), all fp32 per value head and token of the sequence padded to
        whole chunks: five chunk-wide matrices (the pairwise decays, k·β·kᵀ, the UT system it solves, q·kᵀ and the
        intra-chunk attention), eight key-wide tensors (q and k in fp32, l2-normalised, scaled and decayed, k·β
        and its UT solve; twelve when the inputs are fp32 already: the copies are then kept as well), three
        value-wide ones (v·β, its UT solve, each chunk's corrected values) and six scalars (β, the decay and its
        cumulative sums). Counted from the tensors its forward saves (tests/unit/estimate/test_token_mixers.py)."""
        if not self.delta_heads:
            return 0
        tokens = -(-seq_len // chunk) * chunk
        key_wide = 8 if act_bytes == 2 else 12
        return 4 * self.delta_heads * tokens * (5 * chunk + key_wide * self.delta_key_dim
                                                + 3 * self.delta_value_dim + 6)

    def mamba1_scan_bytes(self, seq_len: int, act_bytes: int = 2) -> int:
        """What transformers' torch selective scan of one Mamba-1 layer (Jamba's, without mamba-ssm) keeps for
        backward over one sequence, fp32: the state after every token (and the zero state it starts from), which
        its per-token loop saves, and the discretised A and B·u, each expanded width · state size per token
        (counted from the tensors its forward saves, tests/unit/estimate/test_token_mixers.py)."""
        # The reference scan casts its inputs to fp32: one copy fewer when they are fp32 already (fitted, traced)
        copies = self.mamba1_scan_copies - (1 if act_bytes == 4 and self.mamba1_scan_copies > 3 else 0)
        return 4 * self.mamba1_scan_elements * (copies * seq_len + 1)

    def mamba2_chunk_bytes(self, seq_len: int, act_bytes: int = 2) -> int:
        """What the torch chunked scan of one attention-free Mamba-2 layer (the reference `mamba_chunk_scan_combined`,
        what runs without mamba-ssm) keeps for backward beyond the chunk-edge states, per token of the sequence
        padded to whole chunks: two and a half fp32 chunk-wide matrices per head (the segment sums' decays, the
        decayed C·Bᵀ scores) and 7.5 fp32 inner-wide tensors (its fp32 copies of x and dt·x, the intra- and
        inter-chunk outputs; 3 in an fp32 run), and the states' passing between chunks: two fp32 chunks × chunks
        decay matrices per head (quadratic in the chunk count). Fitted to the trace (tiny-mamba2, 512 to 8K tokens,
        chunks of 16 and 32: tests/unit/estimate/test_attention_free.py), predicted, not counted tensor by tensor."""
        if not self.mamba2_chunk:
            return 0
        tokens = -(-seq_len // self.mamba2_chunk) * self.mamba2_chunk
        inner = self.state_elements // max(1, self.mamba2_state)
        inner_wide = 7.5 if act_bytes == 2 else 3  # fp32 inputs: four of its fp32 casts are the inputs themselves
        chunks = tokens // self.mamba2_chunk
        passing = 2 * 4 * self.mamba2_heads * (chunks + 1) ** 2  # the states' passing: decays between every two chunks
        return int(4 * tokens * (5 * self.mamba2_heads * self.mamba2_chunk / 2 + inner_wide * inner)) + passing

    def kda_saved_bytes(self, seq_len: int, chunk: int = 64) -> int:
        """What transformers' torch KDA kernel (`chunk_kimi_delta_attention`: what runs without
        flash-linear-attention, and what `--trace` runs) keeps for backward over one sequence of one layer, beyond
        the chunk-edge states, fp32 per head and token of the sequence padded to whole chunks, whatever the inputs'
        dtype (it casts them): three chunk × key-dim tensors per token — KDA's decay is per key channel, so the
        pairwise decays, k·β·kᵀ before its sum and each chunk's q·kᵀ before its sum are [chunk, chunk, key dim] per
        chunk, where Gated DeltaNet's are [chunk, chunk] — plus ~12 key-wide and 3 value-wide tensors and ~23.5
        chunk-wide rows (the UT solve's row-by-row clones among them). Fitted to the storages its forward saves
        (heads 2-4, head dims 8-32, 128-256 tokens: within 0.1 %, tests/unit/estimate/test_token_mixers.py); at
        Kimi-Linear-48B's 32 heads of 128 it is 3.6 MB per token and layer."""
        if not self.kda_heads:
            return 0
        tokens = -(-seq_len // chunk) * chunk
        per = (3 * chunk + 12) * self.kda_head_dim + 3 * self.kda_head_dim + 47 * chunk // 2
        return 4 * self.kda_heads * tokens * per

    def kda_backward_bytes(self, seq_len: int, chunk: int = 64) -> int:
        """The torch KDA kernel's backward at its peak beyond what its forward saved: three fp32 chunk × key-dim
        gradients per head and token (those of the saved tensors above) and a few chunk- and value-wide ones.
        Fitted to the live bytes of its backward (fake tensors, head dims 32-128, 256-2,048 tokens: −0.2 % at head
        dim 128 and 16 chunks, +0.4 % at head dim 32 and 32 chunks, up to +1.5 % at 16 and +9 % at 4 chunks;
        tests/unit/estimate/test_token_mixers.py)."""
        if not self.kda_heads:
            return 0
        tokens = -(-seq_len // chunk) * chunk
        return 4 * self.kda_heads * tokens * (3 * chunk * self.kda_head_dim + 2 * chunk + self.kda_head_dim)

    def delta_rule_backward_bytes(self, seq_len: int, act_bytes: int, chunk: int = 64) -> int:
        """The torch Gated DeltaNet kernel's backward at its peak, beyond what its forward saved, per value head and
        token of the padded sequence: the larger of its two highest moments, fitted to the live bytes of its backward
        (`LiveBytes` on fake tensors, key and value head dims 32-256, tests/unit/estimate/test_token_mixers.py) —
        early on, three fp32 chunk-wide, three key-wide and two value-wide gradients and the value input's gradient
        in the activation dtype (12·C + 12·dk + (8 + act)·dv bytes); with wide heads, later, five chunk-wide ones,
        two key-wide, a dk × dk matrix per chunk in 16-bit and (7.5 + act)·dv (20·C + 8·dk + dk²/32 + ...)."""
        if not self.delta_heads:
            return 0
        tokens = -(-seq_len // chunk) * chunk
        dk, dv = self.delta_key_dim, self.delta_value_dim
        early = 12 * chunk + 12 * dk + (8 + act_bytes) * dv
        late = 20 * chunk + 8 * dk + dk * dk // 32 + (15 + 2 * act_bytes) * dv // 2
        return self.delta_heads * tokens * max(early, late)


def _first(config: Any, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value:
            return value
    raise ValueError(f"the model config has none of {', '.join(names)}")


def _shared_width(c: Any) -> int:
    """The width of an MoE layer's always-on shared experts: Qwen2-MoE's `shared_expert_intermediate_size`,
    Granite-MoE-Shared's and GraniteMoeHybrid's `shared_intermediate_size` (their `shared_mlp`), DeepSeek's
    `n_shared_experts` experts of `moe_intermediate_size`."""
    width = getattr(c, "shared_expert_intermediate_size", None) or getattr(c, "shared_intermediate_size", None)
    if width:
        return width
    shared = getattr(c, "n_shared_experts", None) or 0
    return shared * (getattr(c, "moe_intermediate_size", None) or 0)


def _windows(c: Any, layers: int) -> tuple[int | None, ...]:
    window = getattr(c, "sliding_window", None)
    types = getattr(c, "layer_types", None)
    if types and len(types) == layers:
        return tuple(window if t == "sliding_attention" and window else None for t in types)
    if window and getattr(c, "use_sliding_window", True):
        return (window,) * layers
    return (None,) * layers


_SINK_MODELS = frozenset({"gpt_oss"})
# Pure state-space models (no attention heads): `ModelShape._attention_free`. Mamba-1's are mamba and falcon_mamba.
ATTENTION_FREE_TYPES = frozenset({"mamba", "falcon_mamba", "mamba2"})


def _ssm_dims(c: Any) -> dict[str, int]:
    """A pure state-space model's mixer dims from its config (transformers' MambaConfig, FalconMambaConfig,
    Mamba2Config names): inner width, state size, conv kernel; Mamba-1's dt rank; Mamba-2's heads, head dim and
    groups. {} for any other model."""
    model_type = getattr(c, "model_type", "")
    if model_type not in ATTENTION_FREE_TYPES:
        return {}
    get = functools.partial(_get_any, c)
    dims = {"state": get("state_size"), "kernel": get("conv_kernel")}
    if model_type == "mamba2":
        return {**dims, "heads": get("num_heads"), "inner": get("num_heads") * get("head_dim"),
                "groups": get("n_groups")}
    inner = get("intermediate_size") or get("expand") * c.hidden_size
    return {**dims, "inner": inner, "rank": get("time_step_rank")}


def _mamba2_scan(c: Any) -> dict[str, int]:
    """Mamba-2's heads, chunk and state size for the torch chunked scan's row (ModelShape.mamba2_chunk_bytes): the
    attention-free Mamba-2 and the hybrids' Mamba-2 layers (Bamba, Nemotron-H, Falcon-H1, GraniteMoeHybrid), which
    run the same reference `mamba_chunk_scan_combined`; {} for a model without Mamba-2 layers."""
    get = functools.partial(_get_any, c)
    if getattr(c, "model_type", "") == "mamba2":
        heads, chunk, state = get("num_heads"), get("chunk_size"), get("state_size")
    else:
        heads = get("mamba_num_heads", "mamba_n_heads")
        chunk, state = get("mamba_chunk_size", "chunk_size"), get("ssm_state_size", "mamba_d_state")
    if not (heads and chunk and state):
        return {}
    return {"mamba2_heads": heads, "mamba2_chunk": chunk, "mamba2_state": state}


def _ssm_exchanged(c: Any) -> int:
    """Per token, the widths a pure state-space layer's Ulysses all-to-alls move: its in-projection's output (Mamba-2:
    2·inner + 2·groups·state + heads; Mamba-1: x and z, 2·inner) to the rank's heads or channels, and the scan's
    output (inner) back."""
    d = _ssm_dims(c)
    projected = 2 * d["inner"] + (2 * d["groups"] * d["state"] + d["heads"] if "heads" in d else 0)
    return projected + d["inner"]


def ssm_mixer_widths(c: Any, hidden: int) -> tuple[int, int]:
    """(projection weights one token multiplies, values per token the torch path keeps for backward) of one layer
    of a pure state-space model, beyond the conv, state and scan rows. Mamba-1 (transformers' `slow_forward`):
    in_proj (hidden → 2·inner: x and the gate z), x_proj (inner → dt rank + 2 state: dt, B, C), dt_proj (dt rank →
    inner) and out_proj (inner → hidden); it keeps x and z, the conv's activation, dt before and after softplus, B,
    C, the scan's output and the gated output. Mamba-2 (`torch_forward`): in_proj (hidden → 2·inner + 2·groups·state
    + heads) and out_proj; it keeps the projection, the conv's activation, dt, the chunked scan's output and the
    gated norm's input and output."""
    d = _ssm_dims(c)
    inner, state = d["inner"], d["state"]
    if "heads" in d:
        bc = 2 * d["groups"] * state
        projected = 2 * inner + bc + d["heads"]
        return hidden * projected + inner * hidden, projected + (inner + bc) + 2 * d["heads"] + 4 * inner
    rank = d["rank"]
    params = hidden * 2 * inner + inner * (rank + 2 * state) + rank * inner + inner * hidden
    return params, 2 * inner + inner + rank + 2 * state + 2 * inner + 2 * inner
_ATTENTION_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
_LINEAR_TYPES = frozenset({"linear_attention", "mamba", "conv", "mamba2"})
_MLP_ONLY_TYPES = frozenset({"mlp", "moe"})


def _mixers(c: Any, layers: int) -> tuple[str, ...]:
    """Each layer's token mixer from `layer_types` (transformers 5 names every hybrid's layers there); an unknown
    type counts as attention (the larger estimate)."""
    types = getattr(c, "layer_types", None) or getattr(c, "layers_block_type", None)
    if not types or len(types) != layers:
        return ("attention",) * layers

    def kind(t: str) -> str:
        if t == "hybrid":
            return "hybrid"
        if t in _LINEAR_TYPES:
            return "linear"
        return "none" if t in _MLP_ONLY_TYPES else "attention"

    return tuple(kind(t) for t in types)


def _chunks(c: Any, layers: int) -> tuple[int | None, ...]:
    chunk = getattr(c, "attention_chunk_size", None)
    types = getattr(c, "layer_types", None)
    if not chunk or not types or len(types) != layers:
        return (None,) * layers
    return tuple(chunk if t == "chunked_attention" else None for t in types)


def _state_elements(c: Any, hidden: int) -> int:
    """One linear layer's recurrent state (heads · key dim · value dim), from the families' config names: Gated
    DeltaNet (Qwen3-Next / Qwen3.5), KDA (Kimi-Linear), Mamba-2 (Nemotron-H, Bamba, GraniteMoeHybrid, Falcon-H1),
    Mamba-1 (Jamba), lightning attention (MiniMax); 0 for short convolutions only (LFM2)."""
    get = functools.partial(_get_any, c)
    if ssm := _ssm_dims(c):  # a pure state-space model: Mamba-2's heads · head dim · state, Mamba-1's inner · state
        return ssm["inner"] * ssm["state"]
    if get("linear_num_value_heads"):
        return get("linear_num_value_heads") * get("linear_key_head_dim") * get("linear_value_head_dim")
    if get("linear_num_heads") and get("linear_head_dim"):  # KDA
        return get("linear_num_heads") * get("linear_head_dim") ** 2
    heads = get("mamba_num_heads", "mamba_n_heads")
    state = get("ssm_state_size", "mamba_d_state", "state_size")
    if heads and state:
        return heads * (get("mamba_head_dim", "mamba_d_head") or 64) * state
    if get("mamba_expand") and state:
        return get("mamba_expand") * hidden * state
    if getattr(c, "model_type", "") == "minimax":
        head_dim = get("head_dim") or hidden // c.num_attention_heads
        return c.num_attention_heads * head_dim * head_dim
    return 0


def _mamba1_elements(c: Any, hidden: int) -> int:
    """Mamba-1's expanded width · state size (Jamba's `mamba_expand`, `mamba_d_state`); 0 for other families."""
    get = functools.partial(_get_any, c)
    if (ssm := _ssm_dims(c)) and "rank" in ssm:  # Mamba, FalconMamba
        return ssm["inner"] * ssm["state"]
    if get("mamba_num_heads", "mamba_n_heads") or not (get("mamba_expand") and get("mamba_d_state")):
        return 0
    return get("mamba_expand") * hidden * get("mamba_d_state")


def _delta(c: Any) -> dict[str, int]:
    """Gated DeltaNet's value heads and head dims (`linear_num_value_heads`: Qwen3-Next, Qwen3.5), else none."""
    get = functools.partial(_get_any, c)
    if not get("linear_num_value_heads"):
        return {}
    return {"delta_heads": get("linear_num_value_heads"), "delta_key_dim": get("linear_key_head_dim"),
            "delta_value_dim": get("linear_value_head_dim")}


def _kda(c: Any) -> dict[str, int]:
    """KDA's heads and head dim (`linear_num_heads`, `linear_head_dim`: Kimi-Linear), else none."""
    get = functools.partial(_get_any, c)
    if get("linear_num_value_heads") or not (get("linear_num_heads") and get("linear_head_dim")):
        return {}
    return {"kda_heads": get("linear_num_heads"), "kda_head_dim": get("linear_head_dim")}


def _conv(c: Any, hidden: int) -> dict[str, int]:
    """One linear layer's short convolution (`conv_channels`, `conv_kernel`), from the families' config names: Gated
    DeltaNet's q, k and v channels, KDA's three convolutions, Mamba-2's inner width and B, C groups, Mamba-1's
    expanded width, LFM2's hidden width; none for lightning attention (MiniMax) or a model without linear layers."""
    get = functools.partial(_get_any, c)
    kernel = get("linear_conv_kernel_dim", "mamba_d_conv", "conv_kernel", "conv_L_cache")
    if ssm := _ssm_dims(c):  # Mamba-2: x, B and C convolved; Mamba-1: x
        channels = ssm["inner"] + (2 * ssm["groups"] * ssm["state"] if "groups" in ssm else 0)
    elif get("linear_num_value_heads"):
        channels = (2 * get("linear_num_key_heads") * get("linear_key_head_dim")
                    + get("linear_num_value_heads") * get("linear_value_head_dim"))
    elif get("linear_num_heads") and get("linear_head_dim"):  # KDA: q, k and v each convolved
        channels = 3 * get("linear_num_heads") * get("linear_head_dim")
    elif heads := get("mamba_n_heads", "mamba_num_heads"):
        inner = get("mamba_d_ssm") or heads * get("mamba_d_head", "mamba_head_dim")
        channels = inner + 2 * get("mamba_n_groups", "n_groups") * get("mamba_d_state", "ssm_state_size")
    elif get("mamba_expand") and get("mamba_d_state"):  # Mamba-1 (Jamba)
        channels = get("mamba_expand") * hidden
    elif getattr(c, "model_type", "") in ("lfm2", "lfm2_moe"):
        channels = hidden
    else:
        return {"conv_channels": 0, "conv_kernel": 0}
    return {"conv_channels": channels, "conv_kernel": kernel} if kernel else {"conv_channels": 0, "conv_kernel": 0}


def _get_any(c: Any, *names: str) -> int:
    for name in names:
        value = getattr(c, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def _chunked_pairs(n: int, chunk: int) -> int:
    full, rest = divmod(n, chunk)
    return full * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2


def _causal_pairs(n: int, window: int | None) -> int:
    if window is None or window >= n:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the model as a run holds them (from a meta-device build)."""

    total: int  # every parameter (tied weights once), adapters included
    trainable: int  # adapters with LoRA, everything without
    adapters: int  # LoRA adapter parameters (0 without LoRA)
    adapted_linears: int  # linear layers LoRA adapts
    largest_layer: int  # parameters of the largest decoder layer (ZeRO-3 gathers one at a time)
    norms_per_layer: int
    embeddings: int  # input embedding (+ output head when not tied)
    lora_wrapped: int = 0  # parameters peft adapts directly (MoE's 3-D expert weights): it materialises B·A for them
    lora_wrapped_largest: int = 0  # the largest of those parameters
    # The trainable tensors' sizes in the order model.parameters() yields them (each once), which is the order
    # DeepSpeed cuts its optimizer sub-groups in (lstune.estimate.memory.ds_sub_groups); () where not known.
    trainable_tensors: tuple[int, ...] = ()
    # Per token, the input width of each norm of a decoder layer (`norm_widths`); () where not known: every norm
    # then counts at the hidden width.
    norm_widths: tuple[int, ...] = ()

    @property
    def frozen(self) -> int:
        return self.total - self.trainable

    def layer_norm_widths(self, hidden: int) -> tuple[int, ...]:
        """`norm_widths`, or `norms_per_layer` norms of `hidden` where they are not known."""
        return self.norm_widths or (hidden,) * self.norms_per_layer

    def to_dict(self) -> dict:
        return {"total": self.total, "trainable": self.trainable, "frozen": self.frozen, "adapters": self.adapters,
                "adapted_linears": self.adapted_linears, "largest_layer": self.largest_layer,
                "norms_per_layer": self.norms_per_layer, "norm_widths": list(self.norm_widths),
                "embeddings": self.embeddings,
                "lora_wrapped": self.lora_wrapped, "lora_wrapped_largest": self.lora_wrapped_largest}


def count_parameters(config: Any, *, lora_r: int = 0, lora_targets: Any = "auto",
                     trust_remote_code: bool = False) -> ParamCounts:
    """Count on a meta-device build of `config` (nothing is allocated), with LoRA applied by peft itself
    (lstune.models.loading.apply_lora), so adapters are counted wherever peft puts them (MoE experts too)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lstune.models.introspect import decoder_layers
    from lstune.models.loading import apply_lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    base = _unique_numel(model.parameters())
    layers = decoder_layers(model)
    largest = max(_unique_numel(layer.parameters()) for layer in layers)
    widths = norm_widths(layers[0], ModelShape.from_config(config))
    norms = len(widths)
    embeddings = _unique_numel([*model.get_input_embeddings().parameters(), *model.get_output_embeddings().parameters()])
    if not lora_r:
        return ParamCounts(base, base, 0, 0, largest, norms, embeddings, trainable_tensors=_numels(model.parameters()),
                           norm_widths=widths)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecations peft trips; noise here
        peft_model = apply_lora(model, r=lora_r, alpha=None, dropout=0.0, targets=lora_targets)
    adapters = _unique_numel(p for p in peft_model.parameters() if p.requires_grad)
    adapted = sum(1 for m in peft_model.modules() if hasattr(m, "lora_A") and len(getattr(m, "lora_A")) > 0)
    wrapped = _wrapped(peft_model)
    return ParamCounts(base + adapters, adapters, adapters, adapted, largest, norms, embeddings,
                       _unique_numel(wrapped), max((p.numel() for p in wrapped), default=0),
                       _numels(p for p in peft_model.parameters() if p.requires_grad), widths)


def norm_widths(layer, shape: ModelShape) -> tuple[int, ...]:
    """Per token, the input width of each norm in `layer` (found structurally, lstune.models.introspect.is_norm): a
    norm's weight spans what it normalises, so a norm of `head_dim` is a per-head one (Qwen3's, Gemma-3's q_norm and
    k_norm) over every query head or every key head — the key's when its name says k (the one naming convention this
    relies on: nothing in the module tells a query norm from a key norm). Any other norm spans its own width (hidden;
    OLMo-2's q_norm and k_norm over the whole q and k widths)."""
    widths = []
    for name, module in layer.named_modules():
        if module is layer or not is_norm(module):
            continue
        width = max(p.numel() for p in module.parameters())
        if width == shape.head_dim and width != shape.hidden:
            key = name.rsplit(".", 1)[-1].startswith("k")
            width = shape.kv_width if key else shape.q_width
        widths.append(width)
    return tuple(widths)


def _wrapped(peft_model) -> list:
    """Parameters peft adapts as parameters, not through a Linear (`ParamWrapper`: MoE's stacked expert weights);
    its forward builds the weight-sized delta B·A for each of them."""
    return [m.get_param() for m in peft_model.modules()
            if type(m).__name__ == "ParamWrapper" and m.get_param().dim() == 3]


def _unique_numel(params) -> int:
    return sum(_numels(params))


def _numels(params) -> tuple[int, ...]:
    """Each parameter's size once (a tied weight at its first place), in order."""
    seen: dict[int, int] = {}
    for p in params:
        seen.setdefault(id(p), p.numel())
    return tuple(seen.values())


def ceil_div(a: int, b: int) -> int:
    return -(-a // b) if b else a

