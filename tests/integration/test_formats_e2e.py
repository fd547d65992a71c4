"""`lstune train` on the formats other tools write (Alpaca, ShareGPT, prompt/completion) and --chat-template."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import TINY, TINY_MODEL, read_metrics

RECORDS = {
    "alpaca": [{"instruction": f"Repeat {i}", "input": "please", "output": f"{i} {i} {i}"} for i in range(6)],
    "sharegpt": [{"conversations": [{"from": "human", "value": f"say {i}"}, {"from": "gpt", "value": f"{i}!"}]}
                 for i in range(6)],
    "prompt_completion": [{"prompt": f"Count to {i}:", "completion": " " + " ".join(map(str, range(i)))}
                          for i in range(1, 7)],
}


@pytest.mark.parametrize("kind", list(RECORDS))
def test_each_format_trains(cli, tmp_path, kind):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[kind]))
    out = tmp_path / "run"
    result = cli("train", *TINY_MODEL, "--data", data, "--max-steps", "2", "--chat-template", "chatml", "--output-dir", out)
    assert result.code == 0, result.err
    assert "chat template: chatml" in result.out
    assert len(read_metrics(out)) == 2


def test_unknown_chat_template_is_refused_before_loading(cli, tmp_path):
    result = cli("train", *TINY, "--chat-template", "vicuna", "--output-dir", tmp_path / "run")
    assert result.code == 2, result.err
    assert "--chat-template 'vicuna' is neither a known template (chatml, llama3) nor a file" in result.err
    assert "Traceback" not in result.err
    assert not (tmp_path / "run").exists()
