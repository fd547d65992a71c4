"""Tiny random-init configs of many Hugging Face architectures, for the exact-or-refused matrix (no network).

Each entry: model_type -> (config overrides, expectation). Expectation None means exact (loss and every gradient equal
plain HF with its own attention and mask); otherwise {case: substring of the refusal message}, where case is
"attention" (refused when lstune's attention is installed), "pack" (refused with packed documents), "sp" (refused under
sequence parallelism), "tiled_mlp" (MLP tiling refused). Shared by tests/unit/models/test_model_matrix.py,
tests/distributed/test_model_matrix_sp.py and docs/models.md.
"""

from __future__ import annotations

from typing import Any

BASE = dict(
    vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0,
)
NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, hidden_dropout=0.0, resid_pdrop=0.0,
                  embd_pdrop=0.0, attn_pdrop=0.0, layerdrop=0.0)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
WINDOW = 16  # shorter than the test sequences, so every windowed layer really cuts

ARCHS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "llama": ({}, {}),
    "mistral": (dict(sliding_window=WINDOW, head_dim=8), {}),
    "qwen2": (dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
              {}),
    "qwen3": (dict(head_dim=8), {}),
    "gemma3_text": (dict(head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]), {}),
    "phi3": (dict(num_key_value_heads=4), {}),
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW), {}),
    "qwen3_moe": ({**MOE, "head_dim": 8}, {}),
    "qwen2_moe": ({**MOE, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2,
                   "shared_expert_intermediate_size": 32}, {}),
    "olmoe": (dict(MOE), {}),
    "gpt2": (dict(n_embd=32, n_layer=2, n_head=4, n_positions=512), {}),
    "phi": (dict(num_key_value_heads=4), {}),
    "olmo2": ({}, {}),
    "cohere": ({}, {}),
    "starcoder2": (dict(sliding_window=WINDOW), {}),
    "stablelm": (dict(num_key_value_heads=4), {}),
    "glm4": (dict(head_dim=8), {}),
    "smollm3": (dict(no_rope_layer_interval=2), {}),
    "exaone4": (dict(sliding_window=WINDOW, sliding_window_pattern=2), {}),
    "deepseek_v3": (dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=24,
                         n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                         n_group=1, topk_group=1, num_key_value_heads=4), {}),
    "opt": (dict(ffn_dim=64, word_embed_proj_dim=32),
            {"tiled_mlp": "cannot tell which part of OPTDecoderLayer is its MLP"}),
    # learned attention sinks, alternating 16-token windows: lstune's block kernel (memory/block_attention.py)
    "gpt_oss": (dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=WINDOW), {}),
    # softcapped logits: the block kernel on CPU
    "gemma2": (dict(head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]), {}),
    "lfm2": (dict(layer_types=["conv", "full_attention"], block_dim=32, block_ff_dim=64, conv_L_cache=3), {}),
    "bloom": (dict(n_layer=2, n_head=4), {"attention": "does not route attention through", "tiled_mlp": "residual"}),
    # chunked attention (16-token chunks) beside a NoPE layer whose attention temperature steps every 8 positions
    # (lstune.models.llama4: positions handed to attention, the temperature from them)
    "llama4_text": (dict(attention_chunk_size=WINDOW, head_dim=8, num_local_experts=2, intermediate_size_mlp=64,
                         interleave_moe_layer_step=1, no_rope_layers=[1, 0], layer_types=["chunked_attention",
                         "full_attention"], floor_scale=8, attn_scale=1.0), {}),
}

# Token mixers that are not attention (lstune.models.mixers), sized so that their heads split unevenly on 4 ranks
# (6 key heads / 6 SSM heads in 2 groups) and their Mamba-2 chunks (16 tokens) are crossed. Exact with packing and
# under SP (tests/unit/models/test_mixers.py, tests/distributed/test_mixers_sp.py).
_GDN = dict(head_dim=8, linear_num_key_heads=6, linear_num_value_heads=12, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])
_MAMBA2 = dict(hidden_size=48, mamba_n_heads=6, mamba_d_head=8, mamba_expand=1, mamba_n_groups=2, mamba_d_state=8,
               mamba_chunk_size=16, mamba_d_conv=4)
_MAMBA1 = dict(intermediate_size=30, state_size=8, time_step_rank=8, conv_kernel=4, num_attention_heads=None,
               num_key_value_heads=None)
MIXER_ARCHS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "qwen3_next": ({**_GDN, **MOE, "shared_expert_intermediate_size": 32}, {}),
    "qwen3_5_text": (dict(_GDN), {}),
    "qwen3_5_moe_text": ({**_GDN, **MOE, "shared_expert_intermediate_size": 32}, {}),
    "bamba": ({**_MAMBA2, "attn_layer_indices": [1]}, {}),
    # Its decoder layers do not pass position_ids to attention: lstune's attention hands them on
    # (models.attention.POSITIONS_DROPPED), so packed documents and Ulysses are exact in its attention layer too.
    "granitemoehybrid": ({**_MAMBA2, "layer_types": ["mamba", "attention"]}, {}),
    # mamba_rms_norm off: the gate multiplies on the rank's heads (bamba and nemotron_h cover the deferred gated norm)
    "falcon_h1": ({**_MAMBA2, "mamba_d_ssm": 48, "mamba_rms_norm": False, "head_dim": 8}, {}),
    "nemotron_h": (dict(mamba_num_heads=6, mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=16,
                        conv_kernel=4, hybrid_override_pattern="M*", head_dim=8), {}),
    "lfm2": ARCHS["lfm2"],
    # KDA beside multi-head latent attention
    "kimi_linear": (dict(num_key_value_heads=4, linear_num_heads=6, linear_head_dim=8, linear_conv_kernel_dim=4,
                         kv_lora_rank=16,
                         qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, num_experts=4, num_experts_per_token=2,
                         moe_intermediate_size=32, mlp_layer_types=["dense", "sparse"],
                         layer_types=["linear_attention", "full_attention"]), {}),
    # Mamba-1: x_proj summed over the ranks' channels
    "jamba": (dict(mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, attn_layer_period=2,
                   attn_layer_offset=1, num_experts=2, num_experts_per_tok=1, expert_layer_period=2,
                   expert_layer_offset=1, use_mamba_kernels=False), {}),
    # attention-free: the SP cap from the mixers' units (introspect.mixer_units), blocks of a mixer alone (MLP tiling
    # skips them). Mamba-1 by channel, 30 channels (8, 8, 7, 7 on 4 ranks); FalconMamba's RMS norms on dt, B and C
    "mamba": (dict(_MAMBA1), {}),
    "falcon_mamba": (dict(_MAMBA1), {}),
    "mamba2": (dict(hidden_size=48, expand=1, num_heads=6, head_dim=8, n_groups=2, state_size=8, chunk_size=16,
                    conv_kernel=4, num_attention_heads=None, num_key_value_heads=None), {}),
    # lightning attention (no convolution), 6 heads as the mixers above; blocks of 16 tokens are crossed
    "minimax": ({**MOE, "num_local_experts": 4, "head_dim": 8, "num_attention_heads": 6, "num_key_value_heads": 2,
                 "layer_types": ["full_attention", "linear_attention"], "block_size": 16}, {}),
}

# Architectures only the startup self-check (tests/unit/train/test_self_check.py) stands between and a wrong run, so
# not in the matrix (which applies lstune's techniques without it): minimax's lightning layers carried a state across
# packed documents (lstune.models.mixers resets it now; MIXER_ARCHS's config comes first), phimoe samples its routing
# in training mode, BART's causal-LM decoder reads positions from the token index and takes its labels already shifted.
SELF_CHECK_ARCHS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "minimax": ({**MOE, "num_local_experts": 4, "head_dim": 8, "layer_types": ["full_attention", "linear_attention"],
                 "block_size": 16}, {"pack": "train without --pack"}),
    "phimoe": (dict(num_local_experts=4, num_experts_per_tok=2), {}),
    "bart": (dict(d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64, encoder_layers=1,
                  encoder_attention_heads=4, encoder_ffn_dim=64, is_decoder=True, is_encoder_decoder=False),
             {"pack": "train without --pack"}),
}


def tiny_config(model_type: str, **extra: Any):
    from transformers import AutoConfig

    tables = (ARCHS, MIXER_ARCHS, SELF_CHECK_ARCHS)
    overrides, _ = next(table[model_type] for table in tables if model_type in table)
    kwargs = {**BASE, **NO_DROPOUT, **overrides, **extra}
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(model_type: str, *, seed: int = 0, attn: str | None = "eager", **extra: Any):
    """A fp32 random-init model of `model_type` in training mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **extra), dtype=torch.float32,
                                             attn_implementation=attn)
    model.train()
    return model


def refusal(model_type: str, case: str) -> str | None:
    return ARCHS[model_type][1].get(case)
