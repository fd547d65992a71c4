"""The startup self-check: passes on exact models, and catches injected bugs (dropped window, shifted positions, a
broken memory technique) with a message naming the layer and what to turn off."""

from __future__ import annotations

import pytest
import torch

from lstune.config.schema import DataSection, RunSection, TrainConfig
from lstune.errors import ModelError
from lstune.train import self_check
from lstune.train.runtime import Runtime
from tests.support.archs import tiny_config, tiny_model

CPU = Runtime(torch.device("cpu"), None)


def _config(pack: bool = False) -> TrainConfig:
    return TrainConfig(data=DataSection(pack=pack))


@pytest.mark.parametrize("model_type, pack", [("qwen2_moe", True), ("deepseek_v3", True), ("gemma3_text", False),
                                              ("lfm2", False)])
def test_exact_models_pass(model_type, pack):
    result = self_check.run_self_check(tiny_model(model_type), _config(pack), CPU)
    assert result.ok and result.loss_rel < 1e-5 and result.documents == (2 if pack else 1)
    assert result.tokens > 16 + 16  # crosses the 16-token windows of the test configs
    assert "self-check passed" in result.note()


def test_a_dropped_window_is_caught(monkeypatch):
    from lstune.models import attention

    monkeypatch.setattr(attention, "window_from_mask", lambda *args: None)
    with pytest.raises(ModelError, match=r"self-check failed.*layer 0 \(Qwen2MoeDecoderLayer, layer type "
                                         r"'sliding_attention'\).*every memory technique off"):
        self_check.run_self_check(tiny_model("qwen2_moe"), _config(), CPU)


def test_shifted_positions_are_caught(monkeypatch):
    """Learned absolute positions (GPT-2): positions off by one change every layer's input."""
    from lstune.memory import loss

    original = loss.final_hidden_states

    def shifted(model, batch, **kwargs):
        return original(model, {**batch, "position_ids": batch["position_ids"] + 1}, **kwargs)

    monkeypatch.setattr(loss, "final_hidden_states", shifted)
    with pytest.raises(ModelError, match="self-check failed.*first differing layer: layer 0"):
        self_check.run_self_check(tiny_model("gpt2"), _config(True), CPU)


def test_a_broken_technique_is_named(monkeypatch):
    from lstune.memory import mlp

    original = mlp.TiledForward._run_tile

    def off_by_a_little(self, x, start, end, **kwargs):
        return original(self, x, start, end, **kwargs) * 1.001

    monkeypatch.setattr(mlp.TiledForward, "_run_tile", off_by_a_little)
    with pytest.raises(ModelError, match="matches with --tiled-mlp off"):
        self_check.run_self_check(tiny_model("llama"), _config(), CPU)


def test_a_term_the_model_adds_to_its_own_loss_is_caught_in_fp32(monkeypatch):
    """The router loss of an MoE config, with the config check that names it out of the way: ~3e-4 of the loss,
    which a 16-bit probe would miss, stops the fp32 self-check."""
    from lstune.memory import loss

    monkeypatch.setattr(loss, "check_loss_config", lambda config: None)
    model = tiny_model("mixtral")
    model.config.output_router_logits = True
    with pytest.raises(ModelError, match="own loss is not token cross-entropy"):
        self_check.run_self_check(model, _config(), CPU)


def test_big_models_are_checked_on_a_truncated_copy(monkeypatch):
    monkeypatch.setattr(self_check, "_SMALL_MODEL", 0)
    result = self_check.run_self_check(tiny_model("gemma3_text"), _config(True), CPU)
    assert result.ok and result.copy_kind.startswith("truncated")


def test_the_truncated_config_keeps_every_layer_type():
    types = ["sliding_attention"] * 5 + ["full_attention"]
    config = tiny_config("gemma3_text", num_hidden_layers=12, layer_types=types * 2, vocab_size=4096)
    small = self_check.truncated_config(config)
    assert small.num_hidden_layers == 6 and small.layer_types == types and small.vocab_size == 512
    assert config.num_hidden_layers == 12  # the model's own config is untouched


def test_the_probe_crosses_every_named_window():
    config = tiny_config("mistral", sliding_window=100)
    batch = self_check.probe_batch(config, pack=True, sp=2, vocab=320)
    length = batch["input_ids"].shape[1]
    assert length > 100 and length % 4 == 0
    assert (batch["position_ids"][0] == 0).sum() == 2


@pytest.mark.parametrize("name", ["tiny-gemma2", "tiny-gemma3", "tiny-llama", "tiny-mistral", "tiny-mixtral",
                                  "tiny-phi3", "tiny-qwen2", "tiny-qwen3-moe", "tiny-qwen3"])
def test_every_tiny_preset_is_probed_on_a_short_sequence(name):
    """A copy keeps its model's windows and the probe crosses every window: tiny-gemma2's 1M-token window made a
    1M-token probe whose eager mask asked for 1.1 TB. A long window sends a small model to the truncated copy (its
    windows cut); Qwen's max_window_layers is a layer count, not a window, and keeps the copy."""
    from lstune.models.presets import build_model

    probe, kind = self_check.probe_model(build_model(name))
    batch = self_check.probe_batch(probe.config, pack=True, sp=1, vocab=probe.config.vocab_size)
    assert batch["input_ids"].shape[1] <= 64
    assert kind == ("truncated random-init copy" if name in ("tiny-gemma2", "tiny-gemma3") else "copy")


@pytest.mark.parametrize("pack", [False, True])
def test_a_small_model_with_a_million_token_window_is_checked(pack):
    from lstune.models.presets import build_model

    model = build_model("tiny-gemma2", attn_implementation="eager")
    probe, _ = self_check.probe_model(model)
    # Asserted before the run, which unfixed would ask for a 1.1 TB mask.
    assert self_check.probe_batch(probe.config, pack=pack, sp=1, vocab=320)["input_ids"].shape[1] <= 64
    result = self_check.run_self_check(model, _config(pack), CPU)
    assert result.ok and result.tokens <= 64 and result.documents == (2 if pack else 1)
    assert model.config.sliding_window == 1048576  # the model's own config is untouched


@pytest.mark.parametrize("skip", [False, True])
def test_training_setup_runs_it_unless_skipped(skip, tmp_path):
    from lstune.estimate.hardware import resolve_hardware
    from lstune.train.build import build
    from lstune.train.plan import plan

    config = TrainConfig(data=DataSection(seq_len=64), run=RunSection(skip_self_check=skip))
    loaded = build(plan(config, resolve_hardware(gpu="cpu", host_mem=16 * 2**30)), CPU).loaded
    expected = "self-check skipped" if skip else "self-check passed"
    assert any(expected in note for note in loaded.notes)


# --------------------------------------------------------------------------------------------------------------------
# what the architecture sweep (tests/support/arch_sweep.py) found
# --------------------------------------------------------------------------------------------------------------------


def _all_techniques(pack: bool) -> TrainConfig:
    from lstune.config.schema import MemorySection

    return TrainConfig(data=DataSection(pack=pack),
                       memory=MemorySection(tiled_mlp=3, tiled_loss=3, mini_sequence=True, offload_checkpoints=True))


def _without_lstune_mixers(monkeypatch):
    """An injected bug: lstune's per-document token mixers (lstune.train.mixers) left out, so MiniMax's
    lightning-attention layers carry their state across a packed row as in plain transformers."""
    from lstune.train import mixers

    monkeypatch.setattr(mixers, "install_mixers", lambda *args, **kwargs: None)


def test_packed_documents_through_a_linear_attention_state_pass_with_lstune_mixers():
    assert self_check.run_self_check(tiny_model("minimax"), _config(True), CPU).ok


def test_documents_that_see_each_other_through_a_linear_attention_state_are_caught(monkeypatch):
    """Without lstune's per-document mixers, MiniMax's lightning-attention layers carry a state across a packed row;
    the model run on the packed row errs exactly as lstune's copy does, so the reference runs each document alone."""
    _without_lstune_mixers(monkeypatch)
    assert self_check.run_self_check(tiny_model("minimax"), _config(False), CPU).ok
    with pytest.raises(ModelError, match=r"layer 1 \(MiniMaxDecoderLayer, layer type 'linear_attention'\).*"
                                         r"matches on one document.*train without --pack"):
        self_check.run_self_check(tiny_model("minimax"), _config(True), CPU)


def test_a_reference_on_the_packed_row_would_have_missed_the_leak(monkeypatch):
    """The same check with the old reference (the unmodified model on the whole packed row) passes the leaking MiniMax:
    the per-document reference is what catches it."""
    def whole_row(batch):
        return [0]

    _without_lstune_mixers(monkeypatch)
    monkeypatch.setattr(self_check, "_doc_starts", whole_row)
    assert self_check.run_self_check(tiny_model("minimax"), _config(True), CPU).ok


def test_positions_counted_from_the_row_start_are_caught_with_pack():
    """BART's causal-LM decoder embeds positions from the token index, not position_ids: exact on one document,
    refused with --pack. Its own loss takes labels already shifted, which is plain cross-entropy, not an extra term."""
    from lstune.config.schema import MemorySection

    config = TrainConfig(data=DataSection(pack=False), memory=MemorySection(tiled_mlp="off", mini_sequence=False))
    assert self_check.run_self_check(tiny_model("bart"), config, CPU).ok
    packed = TrainConfig(data=DataSection(pack=True), memory=config.memory)
    with pytest.raises(ModelError, match="positions counted from the row's start.*train without --pack"):
        self_check.run_self_check(tiny_model("bart"), packed, CPU)


@pytest.mark.parametrize("pack", [False, True])
def test_a_model_that_samples_in_training_is_compared_in_eval_mode(pack):
    """PhiMoE draws its routing at random in training mode, so tiles and documents draw in another order than the
    unmodified model; the check finds the forward depends on the seed and compares the deterministic function."""
    result = self_check.run_self_check(tiny_model("phimoe"), _all_techniques(pack), CPU)
    assert result.ok and result.sampling and "in eval mode" in result.note()


def test_a_deterministic_model_is_compared_in_training_mode():
    result = self_check.run_self_check(tiny_model("llama"), _all_techniques(True), CPU)
    assert result.ok and not result.sampling and "eval mode" not in result.note()


def test_a_mismatch_is_not_excused_as_sampling_when_the_model_is_deterministic(monkeypatch):
    """The eval-mode comparison is only for models whose own training forward depends on the seed: a broken
    technique on a deterministic model still fails."""
    monkeypatch.setattr(self_check, "_compare_in_mode", _always_failing(self_check._compare_in_mode))
    with pytest.raises(ModelError, match="self-check failed"):
        self_check.run_self_check(tiny_model("llama"), _config(), CPU)


def _always_failing(compare):
    def wrapped(*args, **kwargs):
        result = compare(*args, **kwargs)
        result.ok = False
        return result

    return wrapped


def test_the_run_s_random_streams_are_left_as_they_were():
    model = tiny_model("phimoe")
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    self_check.run_self_check(model, _config(), CPU)
    torch.testing.assert_close(torch.rand(3), expected)


def test_a_multimodal_config_is_truncated_and_probed_through_its_text_config():
    """Gemma-3's config keeps layers, windows and vocab in its text config: the truncated copy must cut those (it
    built the whole depth before), and the probe must cross the text config's window."""
    from transformers import Gemma3Config

    config = Gemma3Config()
    text = config.get_text_config()
    assert text.num_hidden_layers > 6 and text.sliding_window > 64
    small = self_check.truncated_config(config)
    small_text = small.get_text_config()
    assert small_text.num_hidden_layers == 6 and small_text.layer_types == text.layer_types[:6]
    assert small_text.sliding_window == 16 and small_text.vocab_size == 512
    assert self_check.named_windows(config) == {"sliding_window": text.sliding_window}
    assert text.num_hidden_layers > 6  # the model's own config is untouched


def test_the_diagnosis_under_a_host_budget_names_the_real_mismatch(monkeypatch):
    """Turning offload off in the diagnosis drops its --host-mem-budget too: else the variant is an invalid config
    and the run's message is a config error about the budget instead of the technique at fault."""
    from lstune.config.schema import MemorySection
    from lstune.memory import mlp

    original = mlp.TiledForward._run_tile
    monkeypatch.setattr(mlp.TiledForward, "_run_tile", lambda self, x, start, end, **kw: original(
        self, x, start, end, **kw) * 1.001)
    config = TrainConfig(memory=MemorySection(tiled_mlp=3, offload_checkpoints=True, host_mem_budget=2**30))
    with pytest.raises(ModelError, match="matches with --tiled-mlp off") as caught:
        self_check.run_self_check(tiny_model("llama"), config, CPU)
    assert "--host-mem-budget" not in str(caught.value)


def test_a_model_wrong_only_under_sp_is_told_to_use_sp_1(monkeypatch):
    """With every technique off it still differs, under SP: the fix to name is --sp 1, not a bug report."""
    from types import SimpleNamespace

    monkeypatch.setattr(self_check, "_find_culprit", lambda *args: None)
    result = SimpleNamespace(tokens=64, documents=1, loss_rel=1e-2, grad_rel=1e-1, first_bad_layer=None)
    message = self_check._diagnose(None, _config(), SimpleNamespace(sp=2), {}, result)
    assert "under sequence parallelism (--sp 2)" in message and "train with --sp 1" in message
    assert "please report" not in message
    single = self_check._diagnose(None, _config(), SimpleNamespace(sp=1), {}, result)
    assert "please report" in single and "--sp 1" not in single


def test_broken_saved_attention_is_named_and_diagnosed_without_checkpointing(monkeypatch):
    """A bug in the kept attention output's backward is named as --recompute-attention on; and the diagnosis's
    checkpointing-off variant takes recompute on with it (a kept output without checkpoints is an invalid config,
    which once replaced the real message with a config error)."""
    from lstune.config.schema import MemorySection
    from lstune.memory import attention_saved

    original = attention_saved._backward
    monkeypatch.setattr(attention_saved, "_backward", lambda *args: tuple(g * 1.01 for g in original(*args)))
    config = TrainConfig(memory=MemorySection(recompute_attention="off"))
    with pytest.raises(ModelError, match="matches with --recompute-attention on"):
        self_check.run_self_check(tiny_model("llama"), config, CPU)


def _llama4_as_published():
    """Llama-4's own chunk (8192) and temperature step (floor_scale 8192, attn_scale 0.1) on the tiny config."""
    return tiny_model("llama4_text", attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1)


def test_llama4_is_probed_across_its_chunks_and_temperature_step():
    probe, kind = self_check.probe_model(_llama4_as_published())
    assert kind == "truncated random-init copy"
    assert probe.config.attention_chunk_size == 16 and probe.config.floor_scale == 16
    batch = self_check.probe_batch(probe.config, pack=True, sp=2, vocab=320)
    assert batch["input_ids"].shape[1] > 16 + 16
    result = self_check.run_self_check(_llama4_as_published(), _config(True), CPU)
    assert result.ok and result.documents == 2


def test_a_llama4_temperature_from_the_token_index_is_caught_with_pack(monkeypatch):
    """transformers' own rule (the token's index in the row, across packed documents), with lstune's adapter probe
    off: the 64-token probe crosses the cut temperature step, so the check catches it at Llama-4's attn_scale."""
    from lstune.models import llama4

    own = llama4.temperature
    monkeypatch.setattr(llama4, "temperature", lambda positions, *rest: own(None, *rest))
    monkeypatch.setattr(llama4, "probe_llama4_attention", lambda *args: None)
    with pytest.raises(ModelError, match=r"self-check failed.*layer 1 \(Llama4TextDecoderLayer"):
        self_check.run_self_check(_llama4_as_published(), _config(True), CPU)
