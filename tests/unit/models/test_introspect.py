"""Structural discovery of decoder layers, MLPs, final norm, output embedding and body, through wrappers."""

from __future__ import annotations

import pytest
import torch

from lstune.errors import ModelError
from lstune.models.introspect import (
    decoder_body,
    decoder_layers,
    final_norm,
    layer_mlp,
    output_embedding,
    unwrap_model,
)
from lstune.models.presets import build_model
from tests.conftest import TINY_ARCHS

MOE = {"tiny-qwen3-moe", "tiny-mixtral"}


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_parts_of_every_tiny_architecture(arch):
    model = build_model(arch)
    layers = decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    parent, name = layer_mlp(layers[0])
    block = getattr(parent, name)
    assert parent is layers[0] and name == "mlp"
    assert ("Moe" in type(block).__name__) == (arch in MOE)
    assert final_norm(model) is decoder_body(model).norm
    assert output_embedding(model) is model.lm_head
    out = decoder_body(model)(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False)
    assert out.last_hidden_state.shape == (1, 3, model.config.hidden_size)


def test_tied_embeddings_share_the_weight():
    model = build_model("tiny-qwen3")
    assert output_embedding(model).weight is model.model.embed_tokens.weight


def test_parts_are_found_through_peft():
    from peft import LoraConfig, get_peft_model

    base = build_model("tiny-llama")
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules="all-linear"))
    assert unwrap_model(peft_model) is base
    assert decoder_layers(peft_model) is base.model.layers
    assert output_embedding(peft_model) is base.lm_head
    assert decoder_body(peft_model) is base.model


def test_engine_wrappers_with_a_module_attribute_are_unwrapped():
    base = build_model("tiny-llama")
    engine = torch.nn.Module()
    engine.module = base
    assert unwrap_model(engine) is base


def test_a_layer_with_two_unnamed_per_token_blocks_is_refused():
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    layer.self_attn.head_dim = 4
    layer.first = torch.nn.Linear(4, 4)
    layer.second = torch.nn.Linear(4, 4)
    with pytest.raises(ModelError, match="cannot tell which part"):
        layer_mlp(layer)
    layer.mlp = torch.nn.Linear(4, 4)  # a conventional name breaks the tie
    assert layer_mlp(layer) == (layer, "mlp")


def test_a_model_without_a_body_is_refused():
    with pytest.raises(ModelError, match="cannot find the decoder body"):
        decoder_body(build_model("tiny-llama").model)


def test_attention_heads_of_a_model_without_attention_and_of_per_layer_heads():
    """Mamba has no heads (None, so chunking and SP have nothing to split); a config whose head dim varies per
    layer refuses the global attribute, and the widest layer's shape is used."""
    from transformers import CONFIG_MAPPING, MambaConfig

    from lstune.models.introspect import attention_heads

    assert attention_heads(MambaConfig(hidden_size=32, num_hidden_layers=2)) is None
    assert attention_heads(CONFIG_MAPPING["llama"](hidden_size=64, num_attention_heads=4,
                                                   num_key_value_heads=2)) == (4, 2, 16)
    if "gemma4_unified" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no per-layer attention configs")
    config = CONFIG_MAPPING["gemma4_unified"]().get_text_config()
    widest = max((layer.num_attention_heads * layer.head_dim, layer.head_dim) for layer in config.per_layer_config)
    heads, _, head_dim = attention_heads(config)
    assert heads * head_dim == widest[0] and head_dim == widest[1]
