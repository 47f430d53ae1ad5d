"""Tools for multi-turn episodes: the JSON schema a chat template's `tools` variable takes, from a Python function.

`tool_schema(fn)` reads the signature (annotations give the types) and the docstring (its first paragraph
describes the tool, a Google-style `Args:` section each parameter). A parameter that cannot be described to
the model is refused before any work, as a `ConfigError` naming the function and the parameter.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from typing import Any, Literal, Union

from parity.config import ConfigError

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean"}
_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?)\s*:\s*$")
_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _is_optional(annotation: Any) -> tuple[bool, Any]:
    """(whether `annotation` admits None, the annotation without None)."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) < len(typing.get_args(annotation)):
            return True, args[0] if len(args) == 1 else Union[tuple(args)]  # noqa: UP007 (built at run time)
    return False, annotation


def _json_type(annotation: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one annotation; `where` names the parameter for the error."""
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is list or origin is list:
        return {"type": "array", "items": _json_type(args[0], where)} if args else {"type": "array"}
    if annotation is dict or origin is dict:
        return {"type": "object"}
    if origin is Literal:
        kinds = {type(a) for a in args}
        if len(kinds) != 1 or next(iter(kinds)) not in _SCALARS:
            raise ConfigError(f"{where}: a Literal's values must be of one type: int, float, str or bool")
        return {"type": _SCALARS[next(iter(kinds))], "enum": list(args)}
    if origin in (Union, types.UnionType):
        return {"anyOf": [_json_type(a, where) for a in args]}
    raise ConfigError(
        f"{where}: the annotation {annotation!r} has no JSON type (use int, float, str, bool, list[...], dict, "
        "Literal[...] or X | None)"
    )


def _docstring(fn) -> tuple[str, dict[str, str]]:
    """(the description: the docstring's first paragraph as one line, {parameter: its description})."""
    doc = inspect.getdoc(fn) or ""
    first = re.split(r"\n\s*\n", doc, maxsplit=1)[0]
    if first and _SECTION.match(first.splitlines()[0]):  # no summary: the docstring opens with Args:
        first = ""
    description = " ".join(first.split())
    params: dict[str, str] = {}
    section, current, params_indent = None, None, 0
    for line in doc.splitlines():
        heading = _SECTION.match(line)
        if heading:
            section, current = heading.group(1), None
            continue
        if section not in ("Args", "Arguments", "Parameters") or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        entry = _ARG_LINE.match(line)
        if entry and (current is None or indent <= params_indent):
            current, params_indent = entry.group(1).lstrip("*"), indent
            params[current] = entry.group(2).strip()
        elif current is not None:  # a description continued on the next line
            params[current] = f"{params[current]} {line.strip()}".strip()
    return description, params


def tool_schema(fn) -> dict[str, Any]:
    """The JSON schema of `fn` as a tool: `{"type": "function", "function": {"name", "description",
    "parameters": {"type": "object", "properties", "required"}}}`. Annotations give the types (int → integer,
    float → number, str → string, bool → boolean, list[X] → array of X, dict → object, Literal → enum);
    `X | None` (or Optional[X]) and a parameter with a default are not required. A parameter without an
    annotation, *args, **kwargs and positional-only parameters are refused: a model calls tools by name."""
    name = getattr(fn, "__name__", None)
    if not callable(fn) or not isinstance(name, str):
        raise ConfigError(f"tool {fn!r}: not a named function")
    if isinstance(fn, type):  # calling it makes an object, which is no answer (task.tools=m:Class was taken)
        raise ConfigError(f"tool {name}: a class, not a function; an environment is task.environment")
    try:
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError) as e:
        raise ConfigError(f"tool {name}: its signature cannot be read ({e})") from None
    description, docs = _docstring(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in signature.parameters.values():
        where = f"tool {name}, parameter {param.name}"
        if param.kind is param.VAR_POSITIONAL or param.kind is param.VAR_KEYWORD:
            raise ConfigError(f"{where}: *args and **kwargs cannot be described to a model; name each parameter")
        if param.kind is param.POSITIONAL_ONLY:
            raise ConfigError(f"{where}: positional-only; a model passes arguments by name")
        if param.name not in hints:
            raise ConfigError(f"{where}: no type annotation (a model needs the parameter's type)")
        optional, annotation = _is_optional(hints[param.name])
        schema = _json_type(annotation, where)
        if param.name in docs and docs[param.name]:
            schema["description"] = docs[param.name]
        properties[param.name] = schema
        if not optional and param.default is param.empty:
            required.append(param.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
