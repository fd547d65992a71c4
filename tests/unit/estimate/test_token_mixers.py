"""The estimate's per-layer token mixers (lstune.estimate.shapes): softmax attention pairs only in attention layers
(hybrids), chunked attention (Llama-4), the linear mixers' recurrence FLOPs (linear in length) and recurrent-state
bytes, sinks; and the presets that let users estimate Qwen3-Next and gpt-oss without a download."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lstune.estimate.flops import step_flops
from lstune.estimate.memory import Engine, Settings, _layer_parts
from lstune.estimate.shapes import ModelShape, count_parameters
from lstune.models.presets import preset_config

S = 65536
STATE_PART = "layer backward: a linear-attention / state-space mixer's recurrent states (fp32, one per 64-token chunk)"


@pytest.mark.parametrize("preset,billions", [("qwen3-next-80b-a3b", 79.67), ("gpt-oss-20b", 20.91),
                                             ("qwen3.5-27b", 26.90),  # its text decoder: no vision tower, no MTP
                                             ("qwen3.5-35b-a3b", 34.66)])  # the same: 256 experts top-8
def test_the_presets_build_the_published_models(preset, billions):
    """80B / 21B parameters on a meta build, as their model cards say."""
    assert count_parameters(preset_config(preset)).total / 1e9 == pytest.approx(billions, abs=0.01)


def test_qwen3_next_attention_pairs_are_its_12_attention_layers_and_its_recurrence_is_linear():
    shape = ModelShape.from_config(preset_config("qwen3-next-80b-a3b"))
    assert shape.mixers.count("attention") == 12 and shape.linear_layers == 36
    assert shape.attention_pairs(S) == 12 * S * (S + 1) // 2
    assert shape.state_elements == 32 * 128 * 128  # value heads · key dim · value dim
    assert shape.linear_mixer_flops(2 * S) == 2 * shape.linear_mixer_flops(S) == 2 * 4 * 32 * 128 * 128 * S * 36
    dense = replace(shape, mixers=("attention",) * 48)
    assert step_flops(preset_config("qwen3-next-80b-a3b"), S, lora=True, checkpointing=True).model < \
        _flops_as_if_all_attention(dense)


def _flops_as_if_all_attention(shape: ModelShape) -> float:
    """Attention FLOPs alone, had all 48 layers been softmax attention: more than the hybrid's whole step."""
    return 4 * shape.head_dim * shape.heads * shape.attention_pairs(S) * 3


def test_the_recurrent_states_are_in_the_layer_backward_of_a_hybrid_only():
    settings = Settings(seq_len=S, micro_batch=1, sp=1, world=1, engine=Engine("torch"), lora_r=16, on_cuda=True,
                        dtype="auto", tiled_mlp="auto", tiled_loss="auto", mini_sequence=False, checkpointing=True,
                        offload_checkpoints=True, host_mem_budget=None)
    hybrid = ModelShape.from_config(preset_config("qwen3-next-80b-a3b"))
    parts = dict(_layer_parts(hybrid, count_parameters(preset_config("qwen3-next-80b-a3b"), lora_r=16), settings, 2, 2))
    assert parts[STATE_PART] == 4 * 32 * 128 * 128 * (S // 64)  # 2 GiB at 64K tokens
    dense = ModelShape.from_config(preset_config("llama-3.2-1b"))
    assert STATE_PART not in dict(_layer_parts(dense, count_parameters(preset_config("llama-3.2-1b")), settings, 2, 2))


def test_gpt_oss_has_sinks_and_alternating_windows():
    shape = ModelShape.from_config(preset_config("gpt-oss-20b"))
    assert shape.sinks and shape.linear_layers == 0
    assert shape.windows[:2] == (128, None)
    assert shape.attention_pairs(S) == 12 * (128 * 129 // 2 + (S - 128) * 128) + 12 * S * (S + 1) // 2


def test_chunked_attention_layers_count_pairs_within_their_chunks():
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama4_text", num_hidden_layers=2, attention_chunk_size=8192,
                                  layer_types=["chunked_attention", "full_attention"])
    shape = ModelShape.from_config(config)
    assert shape.chunks == (8192, None)
    assert shape.attention_pairs(S) == 8 * 8192 * 8193 // 2 + S * (S + 1) // 2


def _saved_by_a_linear_mixer(model_type: str, seq: int, views: bool = True, **extra):
    """Trace one linear mixer's forward (fp32, tiny): (its shape, the bytes backward keeps of its short convolution's
    input and output — the [1, channels, S] tensors saved: the output in its padded storage, the input at its own
    size where it is a view of a wider projection, kept anyway (`views`: False where such views are gates, LFM2's B
    and C, not the convolution's input) — and every storage saved, with its shape)."""
    import torch

    from lstune.models.introspect import find_parts
    from lstune.models.mixers import mixer_sites
    from tests.support.archs import tiny_model

    model = tiny_model(model_type, **extra)
    shape = ModelShape.from_config(model.config)
    _, mixer = mixer_sites(find_parts(model).layers)[0]
    storages, conv = {}, {}
    padded = shape.conv_channels * (seq + shape.conv_kernel - 1) * 4

    def pack(t):
        key = t.untyped_storage().data_ptr()
        storages.setdefault(key, (tuple(t.shape), t.untyped_storage().nbytes()))
        if t.dim() == 3 and t.shape[1] == shape.conv_channels:
            stored = t.untyped_storage().nbytes()
            own = t.numel() * t.element_size()
            if stored in (own, padded) or views:
                conv.setdefault(key, stored if stored == padded else own)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mixer(torch.randn(1, seq, model.config.hidden_size))
    return shape, sum(conv.values()), storages


def test_a_linear_mixers_conv_and_state_bytes_are_what_its_forward_saves():
    """Qwen3.5's Gated DeltaNet (transformers' torch path, what the trace runs): the convolution keeps its input and
    its padded output (exact), and the chunked recurrence one fp32 state per 64-token chunk (exact); key and value
    head dims differ so that a state is told apart from the other per-chunk tensors."""
    seq = 256
    shape, conv, storages = _saved_by_a_linear_mixer("qwen3_5_text", seq, linear_key_head_dim=8,
                                                     linear_value_head_dim=16)
    assert shape.conv_channels == 2 * 6 * 8 + 12 * 16 and shape.conv_kernel == 4
    assert conv == shape.linear_conv_bytes(seq, 4)
    states = sum(n for dims, n in storages.values() if dims == (12, 8, 16))  # heads, key dim, value dim
    assert states == shape.linear_state_bytes(seq) == 4 * 12 * 8 * 16 * (seq // 64)


@pytest.mark.parametrize("model_type,channels,views", [
    ("bamba", 6 * 8 + 2 * 2 * 8, True),  # Mamba-2: heads · head dim + B and C of each group; input sliced from in_proj
    ("nemotron_h", 6 * 8 + 2 * 2 * 8, True),
    ("lfm2", 32, False),  # the hidden width; the convolution's input is B · x, its own tensor
])
def test_other_families_conv_bytes_are_what_their_forward_saves(model_type, channels, views):
    shape, conv, _ = _saved_by_a_linear_mixer(model_type, 96, views)
    assert shape.conv_channels == channels
    assert conv == shape.linear_conv_bytes(96, 4)


def test_the_conv_and_state_rows_are_separate_in_a_hybrids_layer_backward():
    settings = Settings(seq_len=S, micro_batch=1, sp=1, world=1, engine=Engine("torch"), lora_r=16, on_cuda=True,
                        dtype="auto", tiled_mlp="auto", tiled_loss="auto", mini_sequence=False, checkpointing=True,
                        offload_checkpoints=True, host_mem_budget=None)
    shape = ModelShape.from_config(preset_config("qwen3.5-27b"))
    assert (shape.conv_channels, shape.conv_kernel, shape.state_elements) == (2 * 16 * 128 + 48 * 128, 4,
                                                                              48 * 128 * 128)
    parts = dict(_layer_parts(shape, count_parameters(preset_config("qwen3.5-27b", num_hidden_layers=4), lora_r=16),
                              settings, 2, 2))
    conv = [value for name, value in parts.items() if "short convolution" in name]
    assert conv == [10240 * (2 * S + 3) * 2] and parts[STATE_PART] == 4 * 48 * 128 * 128 * (S // 64)


def _delta_rule_kernel():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    kernel = modeling_qwen3_5.torch_chunk_gated_delta_rule  # transformers' torch path (what runs without fla)
    return getattr(kernel, "__wrapped__", kernel)


def _delta_rule_inputs(seq, k_heads, v_heads, k_dim, v_dim, dtype):
    import torch

    q, k = (torch.randn(1, seq, k_heads, k_dim, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(1, seq, v_heads, v_dim, dtype=dtype, requires_grad=True)
    decay = -torch.rand(1, seq, v_heads, requires_grad=True)
    beta = torch.rand(1, seq, v_heads, dtype=dtype, requires_grad=True)
    return q, k, v, decay, beta


def _saved_storages(kernel, *args, **kwargs) -> dict[int, int]:
    """{storage: bytes} of every storage `kernel(*args, **kwargs)` saves for backward, its tensor arguments' aside."""
    import torch

    given = {t.untyped_storage().data_ptr() for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in given:
            saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kernel(*args, **kwargs)
    return saved


def _delta_shape(v_heads, k_dim, v_dim):
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3_5_text", num_hidden_layers=2, linear_num_key_heads=2,
                                  linear_num_value_heads=v_heads, linear_key_head_dim=k_dim,
                                  linear_value_head_dim=v_dim, layer_types=["linear_attention", "full_attention"])
    return ModelShape.from_config(config)


@pytest.mark.parametrize("seq", [192, 200])
@pytest.mark.parametrize("dtype_name,act", [("bfloat16", 2), ("float32", 4)])
def test_the_torch_delta_rule_kernel_saves_what_the_estimate_counts(dtype_name, act, seq):
    """Every storage transformers' torch Gated DeltaNet kernel saves for backward (inputs aside), on grouped heads
    (2 key / 4 value heads, as Qwen3-Next and Qwen3.5 group them): the estimate's kernel row plus its chunk-edge
    states, plus the kernel's 64 × 64 mask and one decay per head and chunk — exactly on whole chunks; on a
    sequence padded to them the estimate counts the padding in the few tensors saved before padding too (and, with
    fp32 inputs, four key-wide fp32 copies the kernel then keeps only when it needs no padding)."""
    import torch

    heads, k_dim, v_dim = 4, 8, 16
    q, k, v, decay, beta = _delta_rule_inputs(seq, 2, heads, k_dim, v_dim, getattr(torch, dtype_name))
    saved = _saved_storages(_delta_rule_kernel(), q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    shape = _delta_shape(heads, k_dim, v_dim)
    assert (shape.delta_heads, shape.delta_key_dim, shape.delta_value_dim) == (heads, k_dim, v_dim)
    chunks = -(-seq // 64)
    predicted = shape.delta_rule_saved_bytes(seq, act) + shape.linear_state_bytes(seq) + 64 * 64 + 4 * heads * chunks
    if seq % 64 == 0:
        assert sum(saved.values()) == predicted
    else:
        assert predicted == pytest.approx(sum(saved.values()), rel=0.1) and predicted > sum(saved.values())


@pytest.mark.parametrize("k_dim,v_dim", [(128, 128), (256, 128), (32, 32)])
def test_the_torch_delta_rule_kernels_backward_holds_what_the_estimate_counts(k_dim, v_dim):
    """The live bytes of the kernel's backward above what its forward left (fake tensors, bf16 inputs): the
    estimate's moment within 0.1 % at the head dims of the published models (128) and wider (eight chunks; 1.6 %
    over with four), never below it (narrow heads: the measured moment is smaller; the estimate counts the larger)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lstune.memory.measure import LiveBytes

    seq, heads = 512, 4
    with FakeTensorMode():
        q, k, v, decay, beta = _delta_rule_inputs(seq, 2, heads, k_dim, v_dim, torch.bfloat16)
        live = LiveBytes()
        with live:
            out, _ = _delta_rule_kernel()(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
            after_forward = live.current
            out.backward(torch.ones_like(out))
    measured = live.peak - after_forward
    predicted = _delta_shape(heads, k_dim, v_dim).delta_rule_backward_bytes(seq, 2)
    assert predicted > measured * (1 - 1e-3)  # never below it (by more than a few scalars)
    if k_dim >= 128:
        assert predicted == pytest.approx(measured, rel=1e-3)


def test_the_torch_delta_rule_rows_leave_with_flash_linear_attention():
    """Qwen3.5-27B at 64K: the torch kernel's row and its backward moment are in the layer's backward (the moment is
    the largest there); with flash-linear-attention's kernels neither is, and the conv and state rows stay."""
    settings = Settings(seq_len=S, micro_batch=1, sp=1, world=1, engine=Engine("torch"), lora_r=16, on_cuda=True,
                        dtype="auto", tiled_mlp="auto", tiled_loss="auto", mini_sequence=False, checkpointing=True,
                        offload_checkpoints=True, host_mem_budget=None)
    shape = ModelShape.from_config(preset_config("qwen3.5-27b"))
    counts = count_parameters(preset_config("qwen3.5-27b", num_hidden_layers=4), lora_r=16)
    torch_path = dict(_layer_parts(shape, counts, settings, 2, 2))
    kernel = [value for name, value in torch_path.items() if "torch kernel (no flash-linear-attention)" in name]
    assert kernel == [4 * 48 * S * (5 * 64 + 8 * 128 + 3 * 128 + 6)]
    assert torch_path["layer backward: peak moment, Gated DeltaNet's torch kernel's (its fp32 gradients)"] == \
        48 * S * (20 * 64 + 8 * 128 + 128 * 128 // 32 + 19 * 128 // 2) + S * 2 * 5120
    fla = dict(_layer_parts(shape, counts, replace(settings, fla_kernels=True), 2, 2))
    assert not [name for name in fla if "Gated DeltaNet" in name]
    assert STATE_PART in fla and set(fla) - set(torch_path) == {next(n for n in fla if "peak moment" in n)}


def test_the_estimate_takes_the_torch_kernel_unless_fla_runs_on_cuda(monkeypatch):
    import importlib

    from lstune.config.schema import TrainConfig
    from lstune.estimate.hardware import resolve_hardware
    from lstune.estimate.memory import Engine as E

    estimate_settings = importlib.import_module("lstune.estimate.settings")  # the module (the package has a function)
    config = TrainConfig.from_flat({"model": "qwen3.5-27b", "seq_len": 4096})
    gpu = resolve_hardware(gpu="h100-80gb", gpus=1, host_mem=1 << 40)
    cpu = resolve_hardware(gpus=1, host_mem=1 << 40, detect=False)
    for installed in (False, True):
        monkeypatch.setattr(estimate_settings, "installed", lambda package: installed)
        assert estimate_settings.settings(config, gpu, 1, E("torch")).fla_kernels is installed
        assert estimate_settings.settings(config, cpu, 1, E("torch")).fla_kernels is False
        traced = replace(gpu, traced=True)  # the trace runs on CPU: the torch kernel whatever is installed
        assert estimate_settings.settings(config, traced, 1, E("torch")).fla_kernels is False


def test_kdas_conv_and_state_bytes_are_what_its_forward_saves():
    """Kimi-Linear's KDA (transformers' torch path): q, k and v each convolved (3 · heads · head dim channels; input
    and padded output, exact) and one fp32 heads × dim × dim state per 64-token chunk (exact). Its torch kernel's
    per-channel intra-chunk tensors: the next two tests."""
    seq = 128
    shape, conv, storages = _saved_by_a_linear_mixer("kimi_linear", seq)
    heads, dim = 6, 8  # tests.support.archs: kimi_linear's tiny config
    assert shape.conv_channels == 3 * heads * dim and conv == shape.linear_conv_bytes(seq, 4)
    states = sum(n for dims, n in storages.values() if dims == (heads, dim, dim))
    assert states == shape.linear_state_bytes(seq) == 4 * heads * dim * dim * (seq // 64)


def test_mamba1s_torch_scan_keeps_a_state_per_token_and_its_conv_bytes():
    """Jamba's Mamba-1 on transformers' torch scan (no mamba-ssm): the state after every token (and the zero one it
    starts from) and the discretised A and B·u, fp32 — the estimate's scan bytes exactly; its short convolution over
    the expanded width, its output padded by kernel − 1 (other [1, width, S] tensors there are gates and steps, so the
    padded output is what pins channels and kernel)."""
    seq = 128
    shape, _, storages = _saved_by_a_linear_mixer("jamba", seq)
    width, state = shape.conv_channels, shape.mamba1_scan_elements // shape.conv_channels
    assert width == 2 * 32 and state == 8 and shape.state_elements == width * state
    per_token = sum(n for dims, n in storages.values() if dims == (1, width, state))
    whole = sum(n for dims, n in storages.values() if dims == (1, width, seq, state))
    assert per_token + whole == shape.mamba1_scan_bytes(seq) == 4 * width * state * (3 * seq + 1)
    padded = [dims for dims, n in storages.values() if n == width * (seq + shape.conv_kernel - 1) * 4]
    assert padded == [(1, width, seq)]


def test_mamba1s_scan_row_leaves_with_mamba_ssm():
    from transformers import AutoConfig

    config = AutoConfig.for_model("jamba", num_hidden_layers=2, hidden_size=64, attn_layer_period=2,
                                  attn_layer_offset=1, num_experts=1)
    shape = ModelShape.from_config(config)
    settings = Settings(seq_len=4096, micro_batch=1, sp=1, world=1, engine=Engine("torch"), lora_r=16, on_cuda=True,
                        dtype="auto", tiled_mlp="auto", tiled_loss="auto", mini_sequence=False, checkpointing=True,
                        offload_checkpoints=False, host_mem_budget=None)
    counts = count_parameters(config, lora_r=16)
    scan = [v for name, v in _layer_parts(shape, counts, settings, 2, 2) if "Mamba-1's torch scan" in name]
    assert scan == [shape.mamba1_scan_bytes(4096) - shape.linear_state_bytes(4096)] and scan[0] > 0
    with_kernels = dict(_layer_parts(shape, counts, replace(settings, mamba_kernels=True), 2, 2))
    assert not [name for name in with_kernels if "Mamba-1" in name] and STATE_PART in with_kernels


@pytest.mark.parametrize("dtype_name,act", [("float32", 4), ("bfloat16", 2)])
def test_lightning_attentions_states_are_what_its_forward_saves(dtype_name, act):
    """MiniMax's lightning attention (transformers' torch loop): its heads × dim × dim K·V state and its decayed
    heads × block × block intra-block scores once per block of `block_size` tokens, in the activation dtype; no
    convolution."""
    import torch

    from lstune.models.introspect import find_parts
    from lstune.models.mixers import mixer_sites
    from tests.support.archs import tiny_model

    seq, dtype = 128, getattr(torch, dtype_name)
    model = tiny_model("minimax")
    shape = ModelShape.from_config(model.config)
    _, mixer = mixer_sites(find_parts(model).layers)[0]
    mixer.to(dtype)
    heads, dim = 6, 8  # tests.support.archs: minimax's tiny config (block_size 16)
    assert shape.lightning_block == 16 and shape.state_elements == heads * dim * dim and shape.conv_channels == 0
    saved = {}

    def pack(t):
        saved.setdefault(t.untyped_storage().data_ptr(), (tuple(t.shape), t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mixer(torch.randn(1, seq, model.config.hidden_size, dtype=dtype), None, None)
    states = sum(n for dims, n in saved.values() if dims == (heads, dim, dim))
    assert states == shape.saved_state_bytes(seq, act) == act * heads * dim * dim * (seq // 16)
    scores = sum(n for dims, n in saved.values() if dims == (heads, 16, 16))
    assert scores == shape.lightning_scores_bytes(seq, act) == act * heads * 16 * 16 * (seq // 16)


def test_an_attention_free_model_has_a_byte_model_now():
    """Issue 34 changed this pin: a pure state-space model was refused with a ModelError (no byte model of a model
    without attention heads); it now has its own rows (tests/unit/estimate/test_attention_free.py)."""
    from transformers import MambaConfig

    shape = ModelShape.from_config(MambaConfig(hidden_size=32, num_hidden_layers=2))
    assert shape.attention_free and shape.mamba1_scan_elements == 64 * 16 and shape.conv_channels == 64


def _kda_inputs(seq, heads, dim, dtype):
    import torch

    q, k, v = (torch.randn(1, seq, heads, dim, dtype=dtype, requires_grad=True) for _ in range(3))
    g = (-torch.rand(1, seq, heads, dim)).to(dtype).requires_grad_()
    beta = torch.rand(1, seq, heads, dtype=dtype, requires_grad=True)
    return q, k, v, g, beta


def _kda_shape(heads, dim):
    from transformers import AutoConfig

    config = AutoConfig.for_model("kimi_linear", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                  linear_attn_config={"num_heads": heads, "head_dim": dim, "short_conv_kernel_size": 4,
                                                      "kda_layers": [1], "full_attn_layers": [2]})
    return ModelShape.from_config(config)


@pytest.mark.parametrize("seq,heads,dim", [(128, 2, 8), (256, 2, 8), (128, 4, 16), (128, 2, 32)])
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_the_torch_kda_kernel_saves_what_the_estimate_counts(seq, heads, dim, dtype_name):
    """Every storage transformers' torch KDA kernel saves for backward (inputs aside): the estimate's row within
    0.5 % — three [chunk, chunk, dim] fp32 tensors per chunk and head among them (KDA decays per key channel), 3.6 MB
    per token and layer at Kimi-Linear-48B's 32 heads of 128, which the estimate had left out."""
    import torch
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    q, k, v, g, beta = _kda_inputs(seq, heads, dim, getattr(torch, dtype_name))
    saved = _saved_storages(chunk_kimi_delta_attention, q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    shape = _kda_shape(heads, dim)
    assert (shape.kda_heads, shape.kda_head_dim) == (heads, dim)
    assert shape.kda_saved_bytes(seq) == pytest.approx(sum(saved.values()), rel=5e-3)
    assert _kda_shape(32, 128).kda_saved_bytes(1) == 4 * 32 * 64 * ((3 * 64 + 15) * 128 + 47 * 32)


@pytest.mark.parametrize("seq,dim", [(1024, 32), (1024, 64)])
def test_the_torch_kda_kernels_backward_holds_what_the_estimate_counts(seq, dim):
    """The live bytes of the kernel's backward above what its forward left (fake tensors, bf16 inputs, 16 chunks):
    the estimate's moment never under it by more than 0.5 % and at most 2 % over (narrow heads: the measured moment
    still grows towards it with the chunk count)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    from lstune.memory.measure import LiveBytes

    heads = 2
    with FakeTensorMode():
        q, k, v, g, beta = _kda_inputs(seq, heads, dim, torch.bfloat16)
        live = LiveBytes()
        with live:
            out, _ = chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
            after_forward = live.current
            out.backward(torch.ones_like(out))
    measured, predicted = live.peak - after_forward, _kda_shape(heads, dim).kda_backward_bytes(seq)
    assert measured * (1 - 5e-3) < predicted < measured * 1.02


def test_the_torch_kda_rows_are_in_the_layer_backward_and_leave_with_flash_linear_attention():
    settings = Settings(seq_len=4096, micro_batch=1, sp=1, world=1, engine=Engine("torch"), lora_r=16, on_cuda=True,
                        dtype="auto", tiled_mlp="auto", tiled_loss="auto", mini_sequence=False, checkpointing=True,
                        offload_checkpoints=True, host_mem_budget=None)
    shape = _kda_shape(32, 128)
    from transformers import AutoConfig

    config = AutoConfig.for_model("kimi_linear", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                  linear_attn_config={"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4,
                                                      "kda_layers": [1], "full_attn_layers": [2]})
    counts = count_parameters(config, lora_r=16)
    torch_path = dict(_layer_parts(shape, counts, settings, 2, 2))
    row = [v for name, v in torch_path.items() if name.startswith("layer backward: KDA's torch kernel")]
    assert row == [shape.kda_saved_bytes(4096)]
    assert torch_path["layer backward: peak moment, KDA's torch kernel's (its fp32 gradients)"] == \
        shape.kda_backward_bytes(4096) + 4096 * 2 * 64
    fla = dict(_layer_parts(shape, counts, replace(settings, fla_kernels=True), 2, 2))
    assert not [name for name in fla if "KDA" in name]


@pytest.mark.parametrize("seq", [512])
def test_a_kimi_linear_steps_traced_peak_is_the_estimates(seq):
    """A whole LoRA step of a small Kimi-Linear (2 layers: KDA with 8 heads of 32, then MLA attention; bf16, an
    H100 target) traced on fake tensors: the analytic peak within 3 % (−0.6 % at 4K; −97 % before the KDA rows —
    the kernel's per-channel intra-chunk tensors dominate the step)."""
    from lstune.config.schema import TrainConfig
    from lstune.estimate import estimate, traced_settings_estimate
    from lstune.estimate.hardware import resolve_hardware
    from lstune.train.trace import trace_step
    from tests.support.archs import tiny_config

    model_config = tiny_config("kimi_linear", linear_num_heads=8, linear_head_dim=32, hidden_size=128)
    config = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": seq, "lora_r": 8, "attn_chunks": "off"})
    hardware = resolve_hardware(gpu="h100-80gb", host_mem=1 << 50)
    analytic = estimate(config, hardware, model_config=model_config, suggest=False)
    comparable = traced_settings_estimate(config, hardware, model_config, analytic)
    traced = trace_step(config, model_config=model_config, target_cuda=True, sp=1)
    assert comparable.device_peak_bytes == pytest.approx(traced.device_peak_bytes, rel=0.03)


@pytest.mark.parametrize("model_type", ["mamba2", "bamba", "nemotron_h", "falcon_h1", "granitemoehybrid"])
def test_every_mamba2_layer_has_the_one_chunked_scan_row(model_type):
    """The attention-free Mamba-2 and the hybrids' Mamba-2 layers run the same torch `mamba_chunk_scan_combined`:
    one row (ModelShape.mamba2_chunk_bytes) from each config's own names for heads, chunk and state size."""
    from tests.support.archs import tiny_config

    shape = ModelShape.from_config(tiny_config(model_type))
    assert (shape.mamba2_heads, shape.mamba2_chunk, shape.mamba2_state) == (6, 16, 8)
    assert shape.mamba2_chunk_bytes(2048) > shape.linear_state_bytes(2048) > 0


def test_a_falcon_h1_steps_traced_peak_has_its_mamba2_scan():
    """A whole LoRA step of a tiny Falcon-H1 (bf16, an H100 target) traced on fake tensors: the analytic peak within
    6 % (−3.1 % at 512 tokens, −2.7 % at 2K, −3.2 % at 8K; −10.9 / −15.1 / −30.4 % without the chunked-scan row)."""
    from lstune.config.schema import TrainConfig
    from lstune.estimate import estimate, traced_settings_estimate
    from lstune.estimate.hardware import resolve_hardware
    from lstune.train.trace import trace_step
    from tests.support.archs import tiny_config

    model_config = tiny_config("falcon_h1")
    config = TrainConfig.from_flat({"model": "tiny-llama", "seq_len": 512, "lora_r": 8, "attn_chunks": "off"})
    hardware = resolve_hardware(gpu="h100-80gb", host_mem=1 << 50)
    analytic = estimate(config, hardware, model_config=model_config, suggest=False)
    comparable = traced_settings_estimate(config, hardware, model_config, analytic)
    traced = trace_step(config, model_config=model_config, target_cuda=True, sp=1)
    assert comparable.device_peak_bytes == pytest.approx(traced.device_peak_bytes, rel=0.06)


@pytest.mark.parametrize("model_type", ["granitemoehybrid", "qwen2_moe"])
def test_the_shared_experts_width_counts_the_weights_each_token_always_passes(model_type):
    """A token passes through the top-k experts and the always-on shared MLP: GraniteMoeHybrid's `shared_mlp`
    (`shared_intermediate_size`, missed before: its FLOPs and MLP row left out a width 16× the experts' here),
    Qwen2-MoE's shared expert (`shared_expert_intermediate_size`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lstune.estimate.shapes import ModelShape
    from tests.support.archs import tiny_config

    config = tiny_config(model_type)
    torch.manual_seed(0)
    layer = AutoModelForCausalLM.from_config(config).model.layers[0]
    shared = layer.shared_mlp if model_type == "granitemoehybrid" else layer.mlp.shared_expert
    shape = ModelShape.from_config(config)
    assert shape.shared_intermediate > 0
    assert shape.mlp_matrices * shape.hidden * shape.shared_intermediate == sum(
        p.numel() for p in shared.parameters() if p.dim() == 2)
