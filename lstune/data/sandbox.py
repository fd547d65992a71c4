"""Chat templates rendered with bounded memory: transformers' Jinja sandbox, with every value a template makes capped.

transformers renders a chat template (a program from the model's files or `--chat-template`) in Jinja's
`ImmutableSandboxedEnvironment`: no host code runs, but nothing bounds what it allocates — `{{ 'x' * 10**10 }}`
asks for 10 GB at once, two nested loops stream gigabytes of output. lstune renders every Jinja template itself,
in an environment built as transformers 5's `_cached_compile_jinja_template` builds its own (same options,
extensions — `{% generation %}`, loop controls — globals and the `tojson` filter; its data preparation as in
`render_jinja_template`: keys whose value is None dropped, reasoning fields aliased), so the text is the same
(tests/unit/data/test_sandbox.py compares them), and with sizes checked where a template can grow a value:

- the output, streamed (`Template.generate`) and stopped past the limit;
- binary operators `*`, `**`, `+`, `%` (`intercepted_binops`) and `~` (a code generator that measures its
  operands), checked before they allocate when the result size is known from the operands (repetition, powers,
  format widths), after otherwise;
- every call (methods, macros, globals) and every filter: widths (`center`, `ljust`, `indent`, `format`, ...),
  joins, replacements, `translate` and `lipsum` checked before they run, every result after (text and bytes);
- every `{{ }}` value before it is turned into text (`finalize`), every namespace attribute set;
- `range` (Jinja's own `MAX_RANGE`, 100,000 items).

The limit (`limit_for`) is relative to the conversation: `SIZE_FACTOR` × its characters + `SIZE_FLOOR`. A value's
size is its text length (containers: the sum of their items', measured without building the text), so what a
rendering holds stays within a small multiple of the limit. Time is bounded by the caller (`templates.render`).
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache, wraps
from typing import Any

from jinja2.utils import Namespace

# A rendering may hold SIZE_FACTOR x the conversation's characters + SIZE_FLOOR (real templates render a
# conversation once, plus a few hundred characters a turn and sometimes a long default system prompt).
SIZE_FACTOR = 4
SIZE_FLOOR = 1 << 20

_LIMIT: ContextVar[int] = ContextVar("lstune_template_limit", default=SIZE_FLOOR)
# Names a message's reasoning is passed under (transformers' _REASONING_FIELDS); the first is what templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_PERCENT_WIDTH = re.compile(r"%[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


class TemplateTooLarge(Exception):
    """A chat template made a value or an output larger than the rendering's limit."""


def limit_for(messages: Any) -> int:
    """The most characters a rendering of `messages` may make."""
    return SIZE_FLOOR + SIZE_FACTOR * measure(messages, 1 << 62)


def limit_words(messages: list) -> str:
    """How a message states the limit of a rendering of `messages` (as the template sees them)."""
    size = measure(_template_messages(messages), 1 << 62)
    return f"{SIZE_FACTOR} x the record's {size:,} characters + {SIZE_FLOOR:,}"


def render_bounded(template: str, messages: list, variables: Mapping[str, Any], add_generation_prompt: bool) -> str:
    """The text of `template` rendered for `messages` as transformers renders it (`variables`: the special tokens),
    or TemplateTooLarge past `limit_for(messages)`."""
    messages = _template_messages(messages)
    limit = limit_for(messages)
    token = _LIMIT.set(limit)
    try:
        compiled = _compile(template)
        pieces, size = [], 0
        for piece in compiled.generate(messages=messages, tools=None, documents=None,
                                       add_generation_prompt=add_generation_prompt, **_plain(dict(variables))):
            size += len(piece)
            if size > limit:
                raise TemplateTooLarge(f"its output passed {limit:,} characters")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _LIMIT.reset(token)


def measure(value: Any, limit: int | None = None) -> int:
    """About the length of `value`'s text (containers: their items' plus 2 each), counted without building it;
    the count stops once past `limit` (the current rendering's by default)."""
    limit = _LIMIT.get() if limit is None else limit
    total, stack, seen = 0, [value], set()
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, (str, bytes, bytearray)):
            total += len(item)
        elif isinstance(item, bool) or item is None or isinstance(item, float):
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 1
        elif isinstance(item, (dict, list, tuple, set, frozenset, Namespace)):
            if id(item) in seen:
                continue
            seen.add(id(item))
            item = getattr(item, "_Namespace__attrs", item)
            total += 2 * len(item) + 2
            # keys and values, not items(): a temporary pair's id would be reused by the next one (`seen`)
            stack.extend(item.keys() if isinstance(item, dict) else item)
            if isinstance(item, dict):
                stack.extend(item.values())
        else:
            total += 16
    return total


def _check(value: Any, what: str) -> Any:
    limit = _LIMIT.get()
    if measure(value, limit) > limit:
        raise TemplateTooLarge(f"{what} made a value of more than {limit:,} characters")
    return value


def _refuse_past(size: int, what: str) -> None:
    limit = _LIMIT.get()
    if size > limit:
        raise TemplateTooLarge(f"{what} would make a value of more than {limit:,} characters ({size:,})")


def _template_messages(messages: list) -> list:
    """The conversation as transformers' apply_chat_template gives it to the template: plain JSON data, keys
    whose value is None dropped, reasoning aliased under each name templates read."""
    out = []
    for message in messages:
        message = {key: _plain(value) for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _plain(value: Any) -> Any:
    """JSON data only (transformers' `_plain_template_data`: what a template sees has no methods of the host)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():  # numpy scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


# --- predicted sizes of operations that allocate their result at once ------------------------------------------


_ESCAPING = ("escape", "e", "forceescape", "urlize")
_GROWING = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "replace", "translate", "format",
                      "format_map", "%", "string", "pprint", "xmlattr", "wordwrap", "tojson", *_ESCAPING})


def _width_of_percent(fmt: str, args: Any) -> int:
    """An upper bound of the widths/precisions a %-format string asks for (a `*` takes them from the arguments)."""
    stars = "*" in fmt and [a for a in (args if isinstance(args, tuple) else (args,)) if isinstance(a, int)]
    total = 0
    for width, precision in _PERCENT_WIDTH.findall(fmt):
        for part in (width, precision):
            total += (max(stars) if stars else 0) if part == "*" else int(part or 0)
    return total


def _width_of_format(fmt: str, args: tuple, kwargs: dict) -> int:
    """An upper bound of the widths/precisions a str.format string asks for (nested fields take arguments)."""
    total = 0
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return 0  # str.format raises the same error
    for _literal, _name, spec, _conversion in fields:
        if not spec:
            continue
        total += sum(int(d) for d in _DIGITS.findall(spec))
        if "{" in spec:
            total += max((a for a in (*args, *kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)),
                         default=0)
    return total


def _predicted(name: str, args: tuple, kwargs: dict) -> int:
    """About the size of the result of filter or str method `name` (its value first in `args`), before it runs;
    0 when the result is no larger than its arguments."""
    if name not in _GROWING:
        return 0
    value = args[0] if args else ""
    arg = (lambda i, key, default: args[i] if len(args) > i else kwargs.get(key, default))
    size = measure(value)
    if size > _LIMIT.get():
        return size  # a growing operation's result is at least its input's text (and str(value) is not built)
    if name in ("center", "ljust", "rjust", "zfill"):
        width = arg(1, "width", 80)
        return max(size, width) if isinstance(width, int) else 0
    if name == "expandtabs":
        tabsize = arg(1, "tabsize", 8)
        return size + str(value).count("\t") * tabsize if isinstance(tabsize, int) else 0
    if name == "indent":
        width = arg(1, "width", 4)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        return size + (str(value).count("\n") + 1) * width
    if name == "replace":
        old, new = arg(1, "old", ""), arg(2, "new", "")
        if all(isinstance(v, str) for v in (value, old, new)) or all(isinstance(v, bytes) for v in (value, old, new)):
            times = value.count(old) if old else len(value) + 1
            return size + times * len(new)
        return 0
    if name == "translate":  # each character to at most the longest text of the table
        table = arg(1, "table", None)
        values = table.values() if isinstance(table, dict) else ()
        return size * max([1, *(len(v) for v in values if isinstance(v, (str, bytes)))])
    if name in ("format", "format_map", "%"):  # Jinja's format filter is %-style, str.format is {}-style: both
        if not isinstance(value, str):
            return 0
        rest = tuple(args[1:])
        width = 0 if name == "format_map" else _width_of_percent(value, rest[0] if name == "%" and rest else rest)
        if name != "%":
            width = max(width, _width_of_format(value, rest, kwargs))
        return size + width + measure((rest, kwargs))
    indent = arg(2, "indent", None) if name == "tojson" else None
    nested = measure_items(value) * indent if isinstance(indent, int) and indent > 0 else 0
    return size * (6 if name in _ESCAPING else 2) + nested


def measure_items(value: Any) -> int:
    """How many items (at every depth) `value` has, times their depth: the lines indented by an indented JSON."""
    total, stack = 0, [(value, 1)]
    limit = _LIMIT.get()
    while stack and total <= limit:
        item, depth = stack.pop()
        if isinstance(item, dict):
            total += len(item) * depth
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            total += len(item) * depth
            stack.extend((v, depth + 1) for v in item)
    return total


def _bounded_items(items: Iterator, what: str) -> Iterator:
    """`items`, lazily, stopped once their sizes add up past the limit (a generator's items, each within the
    limit, could otherwise fill a list or a join: `range(100000) | map('center', 10**6) | list`)."""
    limit, total = _LIMIT.get(), 0
    for item in items:
        total += measure(item, limit) + 2
        if total > limit:
            raise TemplateTooLarge(f"{what} would make a value of more than {limit:,} characters")
        yield item


def _join_size(items: list, separator: Any) -> int:
    return sum(measure(item) for item in items) + measure(separator) * max(len(items) - 1, 0)


# --- the environment ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=16)
def _compile(template: str):
    return _environment().from_string(template)


@lru_cache(maxsize=1)
def _environment():
    """transformers 5's chat-template environment (utils/chat_template_utils.py, `_cached_compile_jinja_template`),
    as a bounded subclass."""
    import jinja2
    import jinja2.ext
    from jinja2.compiler import CodeGenerator
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedGenerator(CodeGenerator):
        def visit_Concat(self, node, frame):  # jinja's, with the operands measured before they are joined
            if frame.eval_ctx.volatile:
                func_name = "(markup_join if context.eval_ctx.volatile else str_join)"
            elif frame.eval_ctx.autoescape:
                func_name = "markup_join"
            else:
                func_name = "str_join"
            self.write(f"{func_name}(environment.lstune_measured((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write(")))")

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers' AssistantTracker, which also
        records where: lstune locates assistant tokens by prefix renderings instead)."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedGenerator
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                if isinstance(left, int) and not isinstance(right, int):
                    left, right = right, left
                if isinstance(right, int) and isinstance(left, (str, bytes, bytearray, list, tuple)):
                    _refuse_past(measure(left) * max(right, 0), "'*'")
                elif isinstance(left, int) and isinstance(right, int):
                    _refuse_past((left.bit_length() + right.bit_length()) // 3, "'*'")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
                _refuse_past(left.bit_length() * right // 3, "'**'")
            elif operator == "%" and isinstance(left, str):
                _refuse_past(_predicted("%", (left, right), {}), "'%'")
            return _check(super().call_binop(context, operator, left, right), f"'{operator}'")

        def lstune_measured(self, operands):
            _refuse_past(sum(measure(o) for o in operands), "'~'")
            return operands

        def call(self, context, obj, /, *args, **kwargs):
            owner = getattr(obj, "__self__", None)
            if getattr(obj, "__name__", "") == "generate_lorem_ipsum":  # the lipsum global: n paragraphs
                n, most = (args[0] if args else kwargs.get("n", 5)), (args[3] if len(args) > 3 else kwargs.get("max", 100))
                if isinstance(n, int) and isinstance(most, int):
                    _refuse_past(n * most * 16, "lipsum")
            if isinstance(owner, (str, bytes, bytearray)):
                name = getattr(obj, "__name__", "")
                if name == "join":
                    items = list(_bounded_items(iter(args[0]), "str.join")) if args else []
                    _refuse_past(_join_size(items, owner), f"{type(owner).__name__}.join")
                    args = (items, *args[1:])
                else:
                    _refuse_past(_predicted(name, (owner, *args), kwargs), f"{type(owner).__name__}.{name}")
            return _check(super().call(context, obj, *args, **kwargs), f"calling {_name_of(obj)}")

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            fmt, name = value.__self__, value.__name__

            @wraps(wrapped)
            def checked(*args, **kwargs):
                _refuse_past(_predicted(name, (fmt, *args), kwargs), f"str.{name}")
                return _check(wrapped(*args, **kwargs), f"str.{name}")

            return checked

    def finalize(value):
        return _check(value, "an expression printed")

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' own: Jinja's escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        # transformers': a limited `dict` so templates cannot reach the type
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # transformers': no dunder attributes (CPython internals); and here, no attribute past the limit
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, _check(value, f"namespace attribute {name!r}"))

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute."
                )

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, finalize=finalize,
                             extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def _bounded_filter(name: str, function):
    """`function` with its result's size predicted before it runs (when it can grow) and checked after."""
    passes = getattr(function, "jinja_pass_arg", None)

    @wraps(function)
    def bounded(*args, **kwargs):
        leading, rest = (args[:1], args[1:]) if passes is not None else ((), args)
        if rest and isinstance(rest[0], Iterator):
            rest = (_bounded_items(rest[0], f"filter {name}"), *rest[1:])
        if name == "join" and rest:
            items = list(rest[0])
            _refuse_past(_join_size(items, rest[1] if len(rest) > 1 else kwargs.get("d", "")), "filter join")
            rest = (items, *rest[1:])
        else:
            _refuse_past(_predicted(name, rest, kwargs), f"filter {name}")
        return _check(function(*leading, *rest, **kwargs), f"filter {name}")

    return bounded


def _name_of(function: Any) -> str:
    return getattr(function, "__name__", None) or type(function).__name__
