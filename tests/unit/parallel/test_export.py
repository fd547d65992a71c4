"""Streaming HF export (single process; the ZeRO-3 gathering path runs in tests/distributed)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from lstune.models.presets import build_model
from lstune.parallel.export import INDEX_FILE, export_hf


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.fixture
def ids():
    return torch.randint(0, 320, (1, 24), generator=torch.Generator().manual_seed(0))


def test_small_shards_write_an_index_and_reload(tmp_path, ids):
    model = build_model("tiny-llama", num_hidden_layers=2)
    export_hf(model, tmp_path, rank=0, shard_bytes=200_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert set(index["weight_map"]) == set(model.state_dict())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids), rtol=0, atol=0)


def test_tied_embeddings_are_written_once(tmp_path, ids):
    model = build_model("tiny-gemma3")
    export_hf(model, tmp_path, rank=0)
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(tmp_path), ids), _logits(model, ids))


def _lora_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_model("tiny-llama", num_hidden_layers=2),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # B starts at zero; make the adapter do something
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def test_lora_adapter_export_reloads_with_peft(tmp_path, ids):
    from peft import PeftModel

    model = _lora_model()
    export_hf(model, tmp_path, rank=0)
    assert (tmp_path / "adapter_model.safetensors").exists() and (tmp_path / "adapter_config.json").exists()
    reloaded = PeftModel.from_pretrained(build_model("tiny-llama", num_hidden_layers=2), tmp_path)
    torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids))


def test_merged_lora_export_is_a_plain_model_with_the_adapter_folded_in(tmp_path, ids):
    model = _lora_model()
    export_hf(model, tmp_path, rank=0, merge_lora=True)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not any("lora" in n for n, _ in reloaded.named_parameters())
    torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)
