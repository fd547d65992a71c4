"""`lstune train` runs the self-check before training: a mismatch stops the run with exit code 2 and a message,
`--skip-self-check` skips it; structural refusals (a loss HF would add to) are user errors too."""

from __future__ import annotations

from tests.support.archs import tiny_config

ARGS = ["--seq-len", "128", "--max-steps", "1", "--init", "random", "--lr", "1e-3", "--warmup-steps", "0"]


def _model_folder(tmp_path, model_type: str):
    folder = tmp_path / model_type
    tiny_config(model_type).save_pretrained(folder)
    return folder


def test_a_failing_self_check_stops_the_run(cli, tmp_path, text_data, monkeypatch):
    from lstune.models import attention

    monkeypatch.setattr(attention, "window_from_mask", lambda *args: None)  # an injected bug: windows dropped
    model = _model_folder(tmp_path, "qwen2_moe")
    result = cli("train", "--model", model, "--data", text_data, "--output-dir", tmp_path / "a", *ARGS)
    assert result.code == 2, (result.out, result.err)
    assert "self-check failed" in result.err and "sliding_attention" in result.err
    assert "Traceback" not in result.err
    skipped = cli("train", "--model", model, "--data", text_data, "--output-dir", tmp_path / "b", "--skip-self-check",
                  *ARGS)
    assert skipped.code == 0, skipped.err
    assert "self-check skipped" in skipped.out + skipped.err


def test_packing_a_convolutional_model_trains_with_each_document_alone(cli, tmp_path, text_data):
    """LFM2's short convolutions used to leak across packed documents (refused); they now restart at every document
    (lstune.models.mixers): the self-check, whose reference runs each document alone, passes and the run trains."""
    from transformers.utils import logging as hf_logging

    model = _model_folder(tmp_path, "lfm2")
    # transformers' own warning about its conv fallback goes to the stderr of an earlier test (its handler is
    # created once per process), which pytest has closed by now.
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        result = cli("train", "--model", model, "--data", text_data, "--output-dir", tmp_path / "o", "--pack", *ARGS)
    finally:
        hf_logging.set_verbosity(level)
    assert result.code == 0, (result.out, result.err)
    assert "self-check passed" in result.out + result.err
    assert (tmp_path / "o" / "final").exists()


def test_a_model_whose_own_loss_adds_the_router_loss_is_refused(cli, tmp_path, text_data):
    """lstune's loss is token cross-entropy; a config asking HF to add the routers' load-balancing loss is refused
    (exit 2, the key to change named) instead of training on a different objective."""
    folder = tmp_path / "mixtral"
    config = tiny_config("mixtral")
    config.output_router_logits = True
    config.save_pretrained(folder)
    result = cli("train", "--model", folder, "--data", text_data, "--output-dir", tmp_path / "o", *ARGS)
    assert result.code == 2, (result.out, result.err)
    assert "load-balancing loss" in result.err and '"output_router_logits": false' in result.err
    assert "Traceback" not in result.err and not (tmp_path / "o" / "final").exists()


def test_llama4_trains_packed_with_chunked_attention(cli, tmp_path, text_data):
    """Llama-4 used to be refused with --pack (its decoder layer passes no position_ids to attention) and with
    --attn-chunks; lstune.models.llama4 hands the positions on and computes the NoPE temperature from them: the
    self-check (each document alone, crossing the 16-token chunk and the temperature step) passes and the run trains."""
    model = _model_folder(tmp_path, "llama4_text")
    result = cli("train", "--model", model, "--data", text_data, "--output-dir", tmp_path / "o", "--pack",
                 "--attn-chunks", "2", *ARGS)
    assert result.code == 0, (result.out, result.err)
    assert "self-check passed" in result.out + result.err
    assert (tmp_path / "o" / "final").exists()
