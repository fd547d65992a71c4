"""DoRA and rsLoRA (--lora-dora, --lora-rslora): lstune's adapters, with every memory technique on, give the loss
and every gradient of a plain peft model built with the same options (fp32, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from lstune.models.loading import apply_lora
from lstune.models.presets import build_model
from tests.unit.memory._helpers import assert_grads_match, hf_loss_sum, long_batch, nonzero_lora_B, run_grads, run_with_plan

SEQ = 100
ALL = dict(tiled_mlp=3, tiled_loss=3, mini_sequence=True, offload_checkpoints=True)
VARIANTS = {"dora": dict(dora=True), "rslora": dict(rslora=True), "dora+rslora": dict(dora=True, rslora=True)}


def _peft_reference(base, r: int, alpha: int, dora: bool = False, rslora: bool = False):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules="all-linear", task_type="CAUSAL_LM", use_dora=dora,
                        use_rslora=rslora)
    return nonzero_lora_B(get_peft_model(base, config)).train()


def _lstune(base, r: int, alpha: int, **variant):
    torch.manual_seed(3)
    return nonzero_lora_B(apply_lora(base, r=r, alpha=alpha, dropout=0.0, targets="auto", **variant)).train()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lora_variant_with_every_technique_matches_plain_peft(variant):
    base = build_model("tiny-llama", seed=0)
    reference = _peft_reference(copy.deepcopy(base), 4, 8, **VARIANTS[variant])
    ours = _lstune(copy.deepcopy(base), 4, 8, **VARIANTS[variant])
    batches = [long_batch(SEQ)]
    ref_loss, ref_grads = run_grads(reference, hf_loss_sum, batches)
    _, loss, grads = run_with_plan(ours, ALL, SEQ, batches)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_match(grads, ref_grads)
    if VARIANTS[variant].get("dora"):
        assert any("lora_magnitude_vector" in name for name in grads), "DoRA's magnitudes are trained"


def test_the_variants_change_the_model():
    """The options reach peft: DoRA adds magnitude parameters, rsLoRA changes the scale (alpha/sqrt(r))."""
    base = build_model("tiny-llama", seed=0)
    plain, rs = _lstune(copy.deepcopy(base), 4, 8), _lstune(copy.deepcopy(base), 4, 8, rslora=True)
    batch = long_batch(SEQ)
    assert run_grads(plain, hf_loss_sum, [batch])[0] != pytest.approx(run_grads(rs, hf_loss_sum, [batch])[0], rel=1e-6)
    layer = rs.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == pytest.approx(8 / 4 ** 0.5)
    dora = _lstune(copy.deepcopy(base), 4, 8, dora=True)
    assert any("lora_magnitude_vector" in n for n, _ in dora.named_parameters())
    assert not any("lora_magnitude_vector" in n for n, _ in plain.named_parameters())


@pytest.mark.parametrize("variant", ["lora_dora", "lora_rslora"])
def test_the_startup_self_check_passes_with_the_variant(variant, monkeypatch):
    """The self-check prepares a copy of the model as the run does (the adapters from the config, then every
    technique) and compares it with the unmodified model."""
    from lstune.config.schema import MemorySection, ModelSection, TrainConfig
    from lstune.train import prepare, self_check
    from lstune.train.runtime import Runtime

    asked = []
    monkeypatch.setattr(prepare, "apply_lora", lambda model, **kw: asked.append(kw) or apply_lora(model, **kw))

    config = TrainConfig(model=ModelSection(lora_r=4, **{variant: True}),
                         memory=MemorySection(tiled_mlp=2, tiled_loss=2, offload_checkpoints=True))
    result = self_check.run_self_check(build_model("tiny-llama", seed=0), config, Runtime(torch.device("cpu"), None))
    assert result.ok and result.loss_rel < 1e-5
    assert asked and all(kw[variant.removeprefix("lora_")] for kw in asked)
