"""Validation loss: the plain HF model's exact mean over the same samples, whatever techniques are applied,
in long and packed mode; train mode restored; blank samples count nothing."""

from __future__ import annotations

import math

import pytest
import torch

from lstune.config.load import build_config
from lstune.models.presets import build_model
from lstune.train.evaluate import Evaluator, eval_due
from lstune.train.prepare import prepare_model
from lstune.train.runtime import Runtime
from tests.unit.memory._helpers import hf_loss_sum, long_batch, packed_batch

CPU = Runtime(torch.device("cpu"), None)


def _samples() -> list[dict]:
    """Samples as a dataset yields them (1-D), of different label counts: long documents and a packed row."""
    rows = [long_batch(96, seed=s, ignore_every=3 + s) for s in range(3)] + [packed_batch([40, 30, 26], seed=5)]
    return [{k: v[0] for k, v in row.items()} for row in rows]


def _reference(model, samples) -> float:
    sums, counts = zip(*(hf_loss_sum(model, {k: v[None] for k, v in s.items()}) for s in samples))
    return float(sum(sums) / sum(counts))


@pytest.mark.parametrize("flags", [
    {},
    {"tiled_mlp": "3", "tiled_loss": "4", "offload_checkpoints": True},
    {"mini_sequence": True, "checkpointing": "off"},
])
def test_eval_loss_equals_plain_hf_on_the_same_samples(flags):
    model = build_model("tiny-llama", attn_implementation="sdpa")
    samples = _samples()
    with torch.no_grad():
        expected = _reference(model, samples)
    prepared = prepare_model(model, build_config({}, {"seq_len": "96", **flags}), CPU)
    assert prepared.model.training
    result = Evaluator(samples, prepared.eval_sums, CPU).run(prepared.model)
    assert result["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert result["eval_ppl"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert result["eval_tokens"] == sum(int((s["shift_labels"] != -100).sum()) for s in samples)
    assert result["eval_samples"] == 4
    assert prepared.model.training, "evaluation must give the model back in train mode"


def test_eval_runs_lora_in_eval_mode_dropout_off():
    model = build_model("tiny-llama", attn_implementation="sdpa")
    samples = _samples()
    config = build_config({}, {"seq_len": "96", "lora_r": "4", "lora_dropout": "0.5", "tiled_loss": "3"})
    prepared = prepare_model(model, config, CPU)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in prepared.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a trained adapter: its dropout now changes the output in train mode
    result = Evaluator(samples, prepared.eval_sums, CPU).run(prepared.model)
    prepared.undo()
    prepared.model.eval()
    with torch.no_grad():
        expected = _reference(prepared.model, samples)
    assert result["eval_loss"] == pytest.approx(expected, rel=1e-5)


def test_max_samples_takes_the_first_samples_and_builds_no_graph():
    model = build_model("tiny-llama", attn_implementation="sdpa")
    samples = _samples()
    with torch.no_grad():
        expected = _reference(model, samples[:2])
    prepared = prepare_model(model, build_config({}, {"seq_len": "96"}), CPU)
    evaluator = Evaluator(samples, prepared.eval_sums, CPU, max_samples=2)
    result = evaluator.run(prepared.model)
    assert result["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert result["eval_samples"] == 2
    assert all(p.grad is None for p in prepared.model.parameters())


class _Ranks:
    """A runtime of `world` processes seen from `rank`, with sums done by the test."""

    def __init__(self, rank, world):
        self.rank, self.world_size, self.sp, self.device, self.autocast_dtype = rank, world, 1, torch.device("cpu"), None
        self.seen = []

    def sum(self, values):
        self.seen.append(values)
        return values


def test_ranks_split_the_samples_and_pad_the_short_share_with_blank_samples():
    """3 samples on 2 ranks: rank 0 takes samples 0 and 2, rank 1 sample 1 and a blank one; every sample
    counts once and both ranks run 2 forwards (ZeRO-3 gathers weights in each)."""
    samples = _samples()[:3]

    def sums(batch, model, misses):
        n = (batch["shift_labels"] != -100).sum()
        return n.float(), n, None

    forwards, tokens = [], 0.0
    for rank in range(2):
        runtime = _Ranks(rank, 2)
        evaluator = Evaluator(samples, sums, runtime)
        forwards.append(len(list(evaluator._batches())))
        evaluator.run(torch.nn.Linear(1, 1))
        tokens += runtime.seen[0][1]
    assert forwards == [2, 2]
    assert tokens == sum(int((s["shift_labels"] != -100).sum()) for s in samples)


def test_eval_is_due_every_n_steps_and_at_the_end():
    assert [s for s in range(1, 8) if eval_due(s, 7, 3)] == [3, 6, 7]
    assert [s for s in range(1, 8) if eval_due(s, 7, None)] == [7]


def answer_samples(model, seq: int = 96, spans=((60, 66), (20, 25), (44, 52))) -> list[dict]:
    """Samples whose labels are an answer span only (as builtin:passkey-eval's): the first and last answers are the
    model's own greedy prediction (right), the middle one has one token changed (wrong)."""
    samples = []
    for i, (start, end) in enumerate(spans):
        sample = {k: v[0] for k, v in long_batch(seq, seed=10 + i).items()}
        with torch.no_grad():
            logits = model(input_ids=sample["input_ids"][None], position_ids=sample["position_ids"][None]).logits[0]
        labels = torch.full((seq,), -100)
        labels[start:end] = logits[start:end].argmax(-1)
        if i == 1:
            labels[start + 2] = (labels[start + 2] + 1) % logits.shape[-1]
        sample["shift_labels"] = labels
        samples.append(sample)
    return samples


@pytest.mark.parametrize("flags", [{}, {"tiled_loss": "4", "tiled_mlp": "3", "offload_checkpoints": True}])
def test_passkey_accuracy_counts_a_sample_right_only_when_every_answer_token_is_the_argmax(flags):
    from lstune.memory.loss import argmax_misses, final_hidden_states

    model = build_model("tiny-llama", attn_implementation="sdpa")
    samples = answer_samples(model)
    with torch.no_grad():
        expected_loss = _reference(model, samples)
    prepared = prepare_model(model, build_config({}, {"seq_len": "96", **flags}), CPU)
    with torch.no_grad():
        misses = [int(argmax_misses(prepared.model, final_hidden_states(prepared.model, {k: v[None] for k, v in s.items()}),
                                    s["shift_labels"][None])) for s in samples]
    assert misses == [0, 1, 0]
    result = Evaluator(samples, prepared.eval_sums, CPU, passkey=True).run(prepared.model)
    assert result["eval_passkey_acc"] == pytest.approx(2 / 3)
    assert result["eval_loss"] == pytest.approx(expected_loss, rel=1e-5)  # the same forward gives both
    assert "eval_passkey_acc" not in Evaluator(samples, prepared.eval_sums, CPU).run(prepared.model)


def test_argmax_misses_never_builds_full_logits():
    """Only the labelled rows reach the LM head (here 5 of 4096 tokens), the head called once per loss tile."""
    from lstune.memory.loss import argmax_misses
    from lstune.models.introspect import find_parts

    model = build_model("tiny-llama", attn_implementation="sdpa")
    parts = find_parts(model)
    rows = []
    handle = parts.output_embedding.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    labels = torch.full((1, 4096), -100)
    labels[0, 4000:4005] = 7
    with torch.no_grad():
        argmax_misses(model, torch.randn(1, 4096, model.config.hidden_size), labels, parts=parts)
    handle.remove()
    assert sum(rows) == 5 and len(rows) == 1


def test_sp_ranks_run_their_groups_samples_in_the_adapters_order():
    """World 4 as DP 2 × SP 2: the group of ranks 2 and 3 runs samples 2, 3 (round 0), then 6, 7 (round 1), each as a
    shard on both ranks, so their per-sample counts meet at the same index."""
    from lstune.parallel.dims import ParallelDims

    class _Rank(_Ranks):
        def __init__(self, rank):
            super().__init__(rank, 4)
            self.dims = ParallelDims(4, 2, rank=rank)
            self.sp = 2

    orders = [Evaluator(list(range(7)), None, _Rank(r))._sample_order() for r in range(4)]
    assert orders == [[0, 1, 4, 5], [0, 1, 4, 5], [2, 3, 6, 7], [2, 3, 6, 7]]


def test_passkey_accuracy_is_judged_on_answer_records_only_and_not_when_packed():
    from lstune.train.run import _passkey_accuracy

    def judged(**flags):
        return _passkey_accuracy(build_config({}, {"data": ["builtin:passkey"], **flags}))

    assert judged(eval_data="builtin:passkey-eval") == (True, ", with passkey accuracy")
    assert judged(data=["builtin:passkey-answer"], eval_split="0.1")[0]
    passkey, note = judged(eval_split="0.1")
    assert not passkey and "--eval-data builtin:passkey-eval" in note, "text records: no answer span to judge"
    assert judged(data=["x.jsonl"], eval_split="0.1") == (False, "")
    passkey, note = judged(eval_data="builtin:passkey-eval", pack=True)
    assert not passkey and "--pack" in note
