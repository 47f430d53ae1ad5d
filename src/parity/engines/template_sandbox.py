"""The Jinja sandbox a model's chat template renders in, set up as transformers sets up its own
(`_environment`), with a budget per rendering (TEMPLATE_SECONDS, TEMPLATE_CHARS): a template is code from the
checkpoint. `engines/tokenizer.Tokenizer.render_chat` renders through it."""

from __future__ import annotations

import functools
import json
import math
import re
import time
from datetime import datetime
from functools import cache
from typing import Any

# A chat template's budget per rendering: time, and characters of output (or of any string it builds).
TEMPLATE_SECONDS = 5.0
TEMPLATE_CHARS = 1_000_000
MESSAGE_CHARS = 300  # of a template's own error message (raise_exception can pass it anything)
# A field width or precision in a format string ("%1000000000d", "{:>1000000000}") builds that many
# characters: more digits than TEMPLATE_CHARS has are refused before the string is formatted.
_WIDE_FORMAT = re.compile(rf"\d{{{len(str(TEMPLATE_CHARS))},}}")


def one_line(message: str) -> str:
    """A template's error message as one line of at most MESSAGE_CHARS characters."""
    text = " ".join(message.split())
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS] + "..."


def printed_size(value: Any, limit: int = TEMPLATE_CHARS) -> int:
    """About how many characters `value` prints as (strings whole, containers item by item, anything
    else a few), counted without building it and without recursion; past `limit` it stops and returns
    more than `limit` (a list holding itself, or a list of a million references to a long string)."""
    size, seen, stack = 0, 0, [value]
    while stack and size <= limit and seen <= limit:
        item = stack.pop()
        seen += 1
        if isinstance(item, str):
            size += len(item)
        elif isinstance(item, dict):
            size += 2
            stack.extend(v for pair in item.items() for v in pair)
        elif isinstance(item, (list, tuple, set, frozenset)):
            size += 2
            stack.extend(item)
        else:
            size += 8
    return size if size <= limit and seen <= limit else limit + 1


def _growth(name: str, receiver: Any, args: tuple) -> int:
    """The size a string operation named `name` builds from `receiver` and `args`, where it grows with
    the receiver's content rather than with an argument's value (those are bounded by value)."""
    if not isinstance(receiver, str):
        return 0
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = receiver.count(args[0]) if args[0] else len(receiver) + 1
        return len(receiver) + count * max(len(args[1]) - len(args[0]), 0)
    if name == "indent" and args:
        width = args[0] if isinstance(args[0], int) else printed_size(args[0])
        return len(receiver) + (receiver.count("\n") + 1) * width
    if name == "expandtabs" and args and isinstance(args[0], int):
        return len(receiver) + receiver.count("\t") * args[0]
    if name in ("format", "format_map", "%") and _WIDE_FORMAT.search(receiver):
        return TEMPLATE_CHARS + 1
    return 0


def _check_arguments(name: str, receiver: Any, args: tuple, kwargs: dict) -> None:
    """Refuse a filter or call whose result could pass TEMPLATE_CHARS, before it runs: an integer argument
    past it (a width, a count), an argument that prints past it, or a growth `_growth` foresees."""
    import jinja2

    values = (receiver, *args, *kwargs.values())
    too_big = any(isinstance(v, int) and not isinstance(v, bool) and abs(v) > TEMPLATE_CHARS for v in values)
    if (
        too_big
        or any(printed_size(v) > TEMPLATE_CHARS for v in values)
        or _growth(name, receiver, args) > TEMPLATE_CHARS
    ):
        raise jinja2.exceptions.TemplateError(f"{name!r} would build a value beyond the template's limits")


def _check_result(name: str, value: Any) -> Any:
    import jinja2

    if printed_size(value) > TEMPLATE_CHARS:
        raise jinja2.exceptions.TemplateError(f"{name!r} built a value beyond the template's limits")
    return value


@cache
def compile_template(template: str):
    return _environment().from_string(template)


@cache
def _environment():
    """A Jinja environment set up as transformers sets up the one it renders chat templates in: sandboxed
    and immutable, blocks trimmed, loop controls, {% generation %} blocks (rendered as their body), and the
    helpers templates call (raise_exception, strftime_now, tojson without HTML escaping, dict, namespace)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        # transformers uses the block to find the assistant's tokens; here its body is all that matters.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def public(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the attribute {name!r}")

    class Namespace(jinja2.utils.Namespace):
        # Underscore attributes could reach the interpreter's internals: refused on creation and assignment.
        def __init__(self, *args, **kwargs):
            attrs = dict(*args, **kwargs)
            for name in attrs:
                public(name)
            super().__init__(attrs)

        def __setitem__(self, name, value):
            public(name)
            env.tick()  # a loop that grows a namespace value (ns.s = ns.s ~ ns.s) meets the limits here
            if isinstance(value, (str, list, tuple)) and len(value) > TEMPLATE_CHARS:
                raise jinja2.exceptions.TemplateError(f"it built a value of more than {TEMPLATE_CHARS:,} items")
            super().__setitem__(name, value)

    class Dict:
        # `dict(...)` and `dict.fromkeys(...)`, without handing templates the dict type itself.
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class Bounded(ImmutableSandboxedEnvironment):
        """A template is code from the checkpoint: it gets TEMPLATE_SECONDS (checked at every call, loop
        step over a range and operator) and strings and lists of TEMPLATE_CHARS, refused before they are built."""

        intercepted_binops = frozenset({"*", "**", "+", "%"})
        deadline = math.inf  # set before each render

        def tick(self) -> None:
            if time.monotonic() > self.deadline:
                raise jinja2.exceptions.TemplateError(f"it ran longer than {TEMPLATE_SECONDS:g} s")

        def call(self, __context, __obj, *args, **kwargs):
            self.tick()
            if __obj is bounded_range:  # its arguments count steps, each one on the clock: they size nothing
                return super().call(__context, __obj, *args, **kwargs)
            name = getattr(__obj, "__name__", "call")
            # a method's object; str.format comes wrapped by the sandbox (`wrap_str_format`)
            receiver = getattr(__obj, "__self__", getattr(getattr(__obj, "__wrapped__", None), "__self__", None))
            _check_arguments(name, receiver, args, kwargs)
            return _check_result(name, super().call(__context, __obj, *args, **kwargs))

        def call_binop(self, context, operator, left, right):
            self.tick()
            sized = [x for x in (left, right) if isinstance(x, (str, list, tuple))]
            counts = [x for x in (left, right) if isinstance(x, int) and not isinstance(x, bool)]
            too_big = (
                (operator == "*" and sized and counts and len(sized[0]) * counts[0] > TEMPLATE_CHARS)
                or (operator == "**" and len(counts) == 2 and abs(counts[1]) > 64)
                or (operator == "+" and printed_size(left) + printed_size(right) > TEMPLATE_CHARS)
                or (operator == "%" and _growth("%", left, ()) > TEMPLATE_CHARS)
            )
            if too_big:
                raise jinja2.exceptions.TemplateError(f"{operator!r} would build a value beyond the template's limits")
            return super().call_binop(context, operator, left, right)

        def concat(self, parts: tuple) -> str:
            """`a ~ b`: checked before the string is built (`BoundedCodeGenerator`)."""
            self.tick()
            if sum(printed_size(p) for p in parts) > TEMPLATE_CHARS:
                raise jinja2.exceptions.TemplateError("'~' would build a value beyond the template's limits")
            return "".join(map(str, parts))

    class BoundedCodeGenerator(CodeGenerator):
        # `~` compiles to a join of its operands in Jinja's runtime, out of the sandbox's reach: route it
        # through `Bounded.concat` (autoescape is off in chat templates, so no Markup is lost).
        def visit_Concat(self, node, frame):
            self.write("environment.concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    def bounded(name: str, fn):
        """Filter `fn` with its arguments and result held to the template's limits."""

        @functools.wraps(fn)  # keeps the pass_context/pass_environment marks Jinja reads
        def run(*args, **kwargs):
            env.tick()
            passed = (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)  # pass_* marks
            values = [a for a in args if not isinstance(a, passed)]
            _check_arguments(name, values[0] if values else None, tuple(values[1:]), kwargs)
            return _check_result(name, fn(*args, **kwargs))

        return run

    def finalize(value):
        # What `{{ ... }}` prints: a container prints item by item, so its size is checked first.
        if printed_size(value) > TEMPLATE_CHARS:
            raise jinja2.exceptions.TemplateError(f"it printed a value of more than {TEMPLATE_CHARS:,} characters")
        return value

    def bounded_range(*args):
        env.tick()
        for i in range(*args):
            env.tick()
            yield i

    Bounded.code_generator_class = BoundedCodeGenerator
    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols], finalize=finalize)
    env.filters["tojson"] = tojson
    env.filters = {name: bounded(name, fn) for name, fn in env.filters.items()}
    env.globals.update(
        range=bounded_range,
        raise_exception=raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=Dict(),
        namespace=Namespace,
    )
    return env
