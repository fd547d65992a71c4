"""QLoRA on CUDA (--load-in-4bit): bitsandbytes' CUDA NF4 kernels, lstune vs plain HF + peft, a training run, and
the base's bytes. Needs bitsandbytes (`pip install 'lstune[qlora]'`); skipped without CUDA."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from lstune.config.load import build_config
from lstune.models.quant import frozen_weight_bytes
from lstune.train.runtime import Runtime
from tests.unit.memory._helpers import hf_loss_sum, long_batch

pytestmark = pytest.mark.gpu
bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from lstune.models.presets import build_model

    folder = tmp_path_factory.mktemp("qlora-cuda") / "tiny-llama"
    build_model("tiny-llama").save_pretrained(folder)
    return folder


def _quantized_lora(folder, device):
    from lstune.models.loading import load_model
    from lstune.train.prepare import adapt_model

    config = build_config({}, {"model": str(folder), "lora_r": "4", "load_in_4bit": True, "seq_len": "1k"})
    model = load_model(str(folder), init="pretrained", load_in_4bit=True, device=device,
                       param_dtype=torch.bfloat16).model
    model = adapt_model(model, config.model, Runtime(device, torch.bfloat16))
    gen = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = (torch.randn(param.shape, generator=gen) * 0.05).to(param.device, param.dtype)
    return model


def test_cuda_lstune_equals_plain_hf_peft_on_the_same_4bit_model(saved_model):
    from lstune.train.prepare import apply_techniques

    device = torch.device("cuda")
    model = _quantized_lora(saved_model, device)
    assert isinstance(model.base_model.model.model.layers[0].mlp.down_proj.base_layer, bnb.nn.Linear4bit)
    assert model.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight.device.type == "cuda"
    reference = copy.deepcopy(model)
    batch = {k: v.to(device) for k, v in long_batch(1024).items()}
    ref_loss, count = hf_loss_sum(reference, batch)
    ref_loss.float().backward()
    config = build_config({}, {"seq_len": "1k", "tiled_mlp": "4", "tiled_loss": "4", "lora_r": "4"})
    prepared = apply_techniques(model, config, Runtime(device, torch.bfloat16))
    loss, _ = prepared.loss_sum(batch)
    loss.float().backward()
    # bf16 activations: the tiled loss sums in fp32 where HF's full-logits loss may not; a dropped or doubled
    # token would move the loss by ~1/1024.
    torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=2e-3, atol=0)
    for (name, ours), theirs in zip(
        ((n, p.grad) for n, p in model.named_parameters() if p.requires_grad),
        (p.grad for p in reference.parameters() if p.requires_grad),
    ):
        assert (ours.float() - theirs.float()).abs().max() <= 3e-2 * theirs.float().abs().max(), name
    prepared.undo()


def test_cuda_qlora_training_run(tmp_path, saved_model):
    from lstune.train.run import train

    out = tmp_path / "run"
    flags = {"model": str(saved_model), "data": "builtin:passkey", "load_in_4bit": True, "lora_r": "8", "seq_len": "4k",
             "max_steps": "3", "lr": "1e-3", "output_dir": str(out)}
    result = train(build_config({}, flags))
    assert result.steps_done == 3
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0 for m in metrics)
    assert (out / "final" / "adapter_config.json").is_file()


def test_cuda_4bit_base_takes_the_promised_bytes(saved_model):
    device = torch.device("cuda")
    model = _quantized_lora(saved_model, device)
    quantized = [m.base_layer if hasattr(m, "base_layer") else m for m in model.modules()
                 if isinstance(getattr(m, "base_layer", m), bnb.nn.Linear4bit)]
    numel = sum(m.in_features * m.out_features for m in quantized)
    stored = sum(m.weight.numel() * m.weight.element_size() for m in quantized)  # packed 4-bit values
    stored += sum(m.weight.quant_state.absmax.numel() * m.weight.quant_state.absmax.element_size()
                  for m in quantized)
    assert stored <= frozen_weight_bytes(numel, True) * 1.01
    assert stored < 0.3 * frozen_weight_bytes(numel, False)
