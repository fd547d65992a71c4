"""Chat templates render in lstune's bounded sandbox: the same text as transformers, and no template can make
lstune hold more than a small multiple of its conversation's size (lstune/data/sandbox.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from lstune.data.templates import KNOWN_TEMPLATES, render
from lstune.errors import DataError
from tests.unit.data._helpers import CHATML, make_word_tokenizer

# Templates using what real ones use (Llama 3.1, Qwen 2.5, DeepSeek-R1, Phi, Mistral templates read these): the
# special tokens, namespace, tojson (with indent), strftime_now, raise_exception, dict(), loop controls, macros,
# `~`, `%` and str.format, filters, {% generation %}, tool calls, content parts and reasoning fields.
RICH = r"""{{- bos_token }}
{%- set ns = namespace(system='', seen=0) %}
{%- macro header(role) %}{{ '<|start|>' ~ role ~ '<|sep|>' }}{% endmacro %}
{%- if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] | trim %}{% endif %}
{{- header('system') }}Today {{ strftime_now('%Y') | length }} {{ ns.system }}{{ eos_token }}
{%- for message in messages %}
  {%- if message['role'] == 'system' %}{% continue %}{% endif %}
  {%- set ns.seen = ns.seen + 1 %}
  {%- if message['role'] not in ['user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' + message['role']) }}{% endif %}
  {{- header(message['role']) }}
  {%- if message['content'] is string %}{{ message['content'] | trim }}
  {%- elif message['content'] is defined %}{{ message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('\n') }}
  {%- endif %}
  {%- if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}
  {%- if message.tool_calls is defined %}
    {%- for call in message.tool_calls %}{{ '%s(%s)' % (call.function.name, call.function.arguments | tojson(indent=2)) }}{% endfor %}
  {%- endif %}
  {%- if message['role'] == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}
  {{- '[{}:{:>3}]'.format(loop.index, ns.seen) }}{{ dict(a=1) | tojson }}
  {%- if loop.index > 50 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ header('assistant') }}{% endif %}"""
CONVERSATIONS = [
    [{"role": "user", "content": "hello there "}, {"role": "assistant", "content": "hi"}],
    [{"role": "system", "content": " be brief "}, {"role": "user", "content": "q1"},
     {"role": "assistant", "content": "a1", "reasoning_content": "think"}, {"role": "user", "content": "q2"},
     {"role": "assistant", "content": "a2", "thinking": "older name"}],
    [{"role": "user", "content": [{"type": "text", "text": "parts"}, {"type": "image"}]},
     {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f",
                                                             "arguments": {"x": [1, 2]}}}]},
     {"role": "tool", "content": "3"}, {"role": "assistant", "content": "done"}],
]


@pytest.mark.parametrize("template", [RICH, CHATML, *KNOWN_TEMPLATES.values()], ids=["rich", "chatml-test",
                                                                                   *KNOWN_TEMPLATES])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_renderings_are_transformers_own(template, generation_prompt):
    tok = make_word_tokenizer(template)
    compared = 0
    for messages in CONVERSATIONS:
        for tokenize in (False, True):
            try:
                theirs = tok.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=generation_prompt)
            except Exception as exc:  # noqa: BLE001 - then lstune fails with the same error
                with pytest.raises(DataError, match=f"{type(exc).__name__}: {re.escape(str(exc))}"):
                    render(tok, messages, 0, "", tokenize=tokenize, add_generation_prompt=generation_prompt)
                continue
            theirs = theirs["input_ids"] if tokenize else theirs
            assert render(tok, messages, 0, "", tokenize=tokenize, add_generation_prompt=generation_prompt) == theirs
            compared += 1
    assert compared >= 4


def test_a_template_error_is_transformers_own():
    tok = make_word_tokenizer(RICH)
    messages = [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]
    with pytest.raises(Exception, match="bad role robot"):
        tok.apply_chat_template(messages, tokenize=False)
    with pytest.raises(DataError, match="record 4: the tokenizer's chat template failed.*bad role robot"):
        render(tok, messages, 4, "", tokenize=False, add_generation_prompt=False)


# Each builds gigabytes (a string, a number, an output, a value through a loop or a recursion) from a tiny record.
HOSTILE = {
    "repetition": "{{ 'x' * 10**10 }}",
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{{ 'xxxxxxxxxxxxxxxx' }}{% endfor %}"
                    "{% endfor %}",
    "padding method": "{{ 'a'.center(10**10) }}",
    "doubling macro": "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('x') }}",
    "namespace": "{% set ns = namespace(s='x') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "join": "{{ range(100000) | map('string') | join('x' * 100000) }}",
    "printed list": "{{ ['x' * 100000] * 100000 }}",
    "percent width": "{{ '%1000000000s' % 'x' }}",
    "format width": "{{ '{:>1000000000}'.format('x') }}",
    "tojson indent": "{{ messages | tojson(indent=1000000000) }}",
    "power": "{{ 7 ** 1000000000 }}",
    "generator to list": "{{ range(100000) | map('center', 1000000) | list | length }}",
    "bytes": "{{ (('x' * 1000000).encode() * 10000) | length }}",
    "bytes method": "{{ 'x'.encode().center(10**10) | length }}",
    "translate": "{{ ('x' * 1000000).translate({120: 'y' * 1000000}) | length }}",
    "lipsum": "{{ lipsum(10**7) | length }}",
}


def _render_in_a_child(templates: dict[str, str]) -> dict:
    """Render each template for a tiny record in one fresh process limited to 1.5 GiB more address space than it
    has after imports (so a template that escapes the bound fails with MemoryError, not by filling this machine):
    {name: {message, seconds, grew_mib}}."""
    script = textwrap.dedent(f"""
        import json, resource, time
        from lstune.data.templates import render
        from tests.unit.data._helpers import make_word_tokenizer
        render(make_word_tokenizer(), [{{"role": "user", "content": "hi"}}], 0, "", tokenize=False,
               add_generation_prompt=False)  # imports done
        pages = int(open("/proc/self/statm").read().split()[0])
        resource.setrlimit(resource.RLIMIT_AS, (pages * resource.getpagesize() + (3 << 29),) * 2)
        results = {{}}
        for name, template in {templates!r}.items():
            tok = make_word_tokenizer(template + "{{{{ messages }}}}")
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            started = time.monotonic()
            try:
                render(tok, [{{"role": "user", "content": "hello"}}], 7, "", tokenize=False, add_generation_prompt=False)
                message = None
            except Exception as exc:
                message = str(exc)
            results[name] = {{"message": message, "seconds": time.monotonic() - started,
                              "grew_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024}}
        print(json.dumps(results))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hostile_results() -> dict:
    return _render_in_a_child(HOSTILE)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
@pytest.mark.parametrize("name", HOSTILE)
def test_a_template_that_builds_gigabytes_is_stopped_quickly_with_bounded_memory(name, hostile_results):
    result = hostile_results[name]
    assert result["message"] is not None and "MemoryError" not in result["message"], result
    assert "the tokenizer's chat template rendering record 7" in result["message"]
    assert re.search(r"(more than|passed) 1,048,\d\d\d characters", result["message"])
    assert "the limit is 4 x the record's" in result["message"]
    assert result["seconds"] < 10
    assert result["grew_mib"] < 100, result


def test_the_limit_grows_with_the_record(monkeypatch):
    from lstune.data import sandbox

    monkeypatch.setattr(sandbox, "SIZE_FLOOR", 1000)
    tok = make_word_tokenizer("{% for m in messages %}{{ m['content'] * 3 }}{% endfor %}")
    assert render(tok, [{"role": "user", "content": "x" * 5000}], 0, "", tokenize=False,
                  add_generation_prompt=False) == "x" * 15000  # 3x the record: within 4x + 1000
    with pytest.raises(DataError, match=r"record 2: '\*' would make a value of more than 21,\d+ characters \(25,000\)"):
        render(make_word_tokenizer("{% for m in messages %}{{ m['content'] * 5 }}{% endfor %}"),
               [{"role": "user", "content": "x" * 5000}], 2, "", tokenize=False, add_generation_prompt=False)


def test_a_named_template_file_is_named(tmp_path):
    tok = make_word_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ 'x' * 10**9 }}")
    tok.lstune_chat_template = str(tmp_path / "mine.jinja")
    with pytest.raises(DataError, match=r"--chat-template '.*mine.jinja' rendering record 0"):
        render(tok, [{"role": "user", "content": "q"}], 0, "", tokenize=False, add_generation_prompt=False)


def test_a_conversation_longer_than_the_floor_renders_as_transformers_does():
    # 100 turns of 24,000 characters (the same string object in each, as a dataset column can give): the limit
    # counts every turn.
    content = "hello world " * 2000
    messages = [{"role": role, "content": content} for _ in range(50) for role in ("user", "assistant")]
    tok = make_word_tokenizer(RICH)
    expected = tok.apply_chat_template(messages, tokenize=False)
    assert len(expected) > 1_100_000  # past the 1 MiB floor (RICH stops after 51 turns)
    assert render(tok, messages, 0, "", tokenize=False, add_generation_prompt=False) == expected
