"""Typed configs: dataclasses filled from YAML plus `key=value` overrides.

Every key is checked against the dataclass before any work starts: an unknown
key, a wrong type or a bad value is a `ConfigError` naming the key (and, for
YAML, the file and line) and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from parity.files import regular_file_problem

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the key."""


# Bounds on a YAML text (a config file, or an override's value): its size, how deep it nests, and how many
# values it expands to once aliases are followed (a few lines of anchors can name 10**9 values).
MAX_CONFIG_BYTES = 2**20
MAX_YAML_DEPTH = 32
MAX_YAML_VALUES = 100_000
# The longest integer a YAML text may write: a 64-bit value takes at most 20 digits, and PyYAML builds
# `1:1:1:...` (base 60) in time quadratic in its length, or refuses 4,300 digits with a ValueError.
MAX_YAML_INT_CHARS = 64
# Config integers end up in torch tensors and seeds, which hold 64 bits.
INT_RANGE = (-(2**63), 2**63 - 1)


class _SafeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, where a value it cannot build is a MarkedYAMLError at that value's line: a tag
    it refuses (`!!python/object/apply:os.system`), or a scalar its constructor refuses (`!!int abc`, the
    date 2001-13-45, an integer past MAX_YAML_INT_CHARS) would otherwise raise a ValueError of no line."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except yaml.MarkedYAMLError:
            raise
        except Exception as e:  # noqa: BLE001 - any constructor's failure is the text's
            raise yaml.constructor.ConstructorError(None, None, str(e), node.start_mark) from None

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        if len(node.value) > MAX_YAML_INT_CHARS:
            raise ValueError(f"an integer written with {len(node.value):,} characters; at most {MAX_YAML_INT_CHARS}")
        if ":" in node.value:  # YAML 1.1's base 60: steps=1:0 would be 60
            value = super().construct_yaml_int(node)
            raise ValueError(f"{node.value} is the base-60 number {value} to YAML 1.1; quote it, or write the number")
        return super().construct_yaml_int(node)


_SafeLoader.add_constructor("tag:yaml.org,2002:int", _SafeLoader.construct_yaml_int)


def _parse_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    """The value of a YAML text and its node tree, within the bounds above; a one-line ConfigError naming
    `source` (and the line) otherwise: "invalid YAML" for text that does not parse, "cannot load" for a
    value the safe loader does not build."""
    loader = _SafeLoader(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as e:
        raise ConfigError(f"{_where(source, e)}: invalid YAML ({getattr(e, 'problem', e)})") from None
    except RecursionError:
        raise ConfigError(f"{source}: YAML nested more than {MAX_YAML_DEPTH} deep") from None
    values, stack = 0, [(node, 1)] if node is not None else []
    while stack:
        n, depth = stack.pop()
        values += 1
        if depth > MAX_YAML_DEPTH:
            raise ConfigError(f"{source}:{n.start_mark.line + 1}: YAML nested more than {MAX_YAML_DEPTH} deep")
        if values > MAX_YAML_VALUES:
            raise ConfigError(
                f"{source}: YAML expands to more than {MAX_YAML_VALUES:,} values (an alias repeats all it names)"
            )
        if isinstance(n, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key, _ in n.value:
                if isinstance(key, yaml.ScalarNode) and key.value != "<<":  # `<<` merges a mapping in
                    line = key.start_mark.line + 1
                    if key.value in seen:  # YAML keeps the last silently: the first block would be lost
                        raise ConfigError(
                            f"{source}:{line}: {key.value!r} is given twice (first on line {seen[key.value]})"
                        )
                    seen[key.value] = line
            stack.extend((child, depth + 1) for pair in n.value for child in pair)
        elif isinstance(n, yaml.SequenceNode):
            stack.extend((child, depth + 1) for child in n.value)
    try:
        return (loader.construct_document(node) if node is not None else None), node
    except yaml.YAMLError as e:
        raise ConfigError(f"{_where(source, e)}: cannot load this YAML value ({getattr(e, 'problem', e)})") from None


def _where(source: str, error: yaml.YAMLError) -> str:
    """`source:LINE` for a YAML error that has a place, else `source`."""
    mark = getattr(error, "problem_mark", None)
    return f"{source}:{mark.line + 1}" if mark else source


def _yaml_lines(text: str, source: str) -> tuple[Any, dict[str, int]]:
    """Parse YAML and remember the line of every mapping key, by dotted path."""
    data, node = _parse_yaml(text, source)
    lines: dict[str, int] = {}

    def walk(n: Any, prefix: str) -> None:
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                path = f"{prefix}{k.value}"
                lines[path] = k.start_mark.line + 1
                walk(v, path + ".")

    walk(node, "")
    return data, lines


def shown(value: Any, width: int = 80) -> str:
    """`repr(value)` on one line, cut to `width` characters: a message that quotes a value stays one line
    whatever it was given (an array, a long text, an object whose repr raises)."""
    try:
        text = " ".join(repr(value).split())
    except Exception:  # a hostile __repr__: the type says enough
        text = f"<{type(value).__name__}>"
    return text if len(text) <= width else text[: width - 3] + "..."


def definition_name(qualname: str) -> str:
    """A function's or class's `__qualname__` as its definition reads (`Stop`, `Stop.on_step_end`): without the
    `<locals>` path of one defined inside a function."""
    return qualname.rsplit("<locals>.", 1)[-1]


def described(value: Any) -> str:
    """A value given where another kind was expected, on one line: its type and what it is (`str 'yes'`,
    `int 5`, `function score`, `the class Stop`)."""
    if isinstance(value, type):
        return f"the class {definition_name(value.__qualname__)}"
    name = getattr(value, "__qualname__", None)  # a function or method: its name, not its address
    if isinstance(name, str):
        name = definition_name(name)
    else:  # an object without a repr of its own: its address says nothing
        name = "object" if type(value).__repr__ is object.__repr__ else shown(value, 60)
    return f"{type(value).__name__} {name}"


_PLAIN_NAMES = {float: "a number", int: "an integer", str: "a string", bool: "true or false", type(None): "null"}


def _type_name(tp: Any) -> str:
    return _PLAIN_NAMES.get(tp) or getattr(tp, "__name__", str(tp)).replace("typing.", "")


def config_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of the config dataclass `cls`, its sections' keys included."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys += config_keys(tp, f"{prefix}{_key(f)}.")
        else:
            keys.append(f"{prefix}{_key(f)}")
    return keys


def unknown_key(root: type, dotted: str, allowed: list[str]) -> str:
    """The one line for an unknown key `dotted` of the config `root`: the key it is most likely a misspelling
    of (difflib, on the whole key and on its last part), or the key another library's name maps to (the
    root's `FOREIGN_NAMES`: name -> (key, whose)); else the keys allowed at its place."""
    foreign = getattr(root, "FOREIGN_NAMES", {})
    last = dotted.rsplit(".", 1)[-1]
    for name in (dotted, last):
        if name in foreign:
            key, whose = foreign[name]
            return f"unknown config key {dotted}; did you mean {key} ({whose} {name})?"
    keys = config_keys(root)
    close = difflib.get_close_matches(dotted, keys, n=1, cutoff=0.75)
    if not close:
        by_last = {k.rsplit(".", 1)[-1]: k for k in keys}
        names = difflib.get_close_matches(last, list(by_last), n=1, cutoff=0.75)
        close = [by_last[n] for n in names]
    if close:
        return f"unknown config key {dotted}; did you mean {close[0]}?"
    return f"unknown config key {dotted}; allowed keys here: {', '.join(sorted(allowed))}"


def closed_keys(root: type) -> None:
    """Make the config dataclass `root` and each of its sections refuse an attribute that is none of its keys,
    with the unknown key's line: `config.output_dir = ...` (TRL's name) or `config.trainer.lrr = ...` would
    otherwise set an attribute that nothing reads."""

    def set_key(self: Any, name: str, value: Any) -> None:
        if name not in self.__dataclass_fields__ and not name.startswith("_"):
            raise ConfigError(unknown_key(type(self), name, [_key(f) for f in dataclasses.fields(self)]))
        object.__setattr__(self, name, value)

    for tp in {root, *(t for t in typing.get_type_hints(root).values() if dataclasses.is_dataclass(t))}:
        if not tp.__dataclass_params__.frozen:
            tp.__setattr__ = set_key


def coerce(value: Any, tp: Any, key: str, root: type | None = None) -> Any:
    """`value` as the config type `tp` of the key `key` (a section's dataclass from a dict), or a one-line
    ConfigError naming the key; `root`: the config whose key it is (for an unknown key's message)."""
    return _coerce(value, tp, key, root)


def _coerce(value: Any, tp: Any, key: str, root: type | None = None) -> Any:
    if isinstance(value, dict) and value and root is not None and not dataclasses.is_dataclass(tp):
        # `task.answer_column=x` where `task` is a key, not a section: the dotted key is unknown here
        raise ConfigError(unknown_key(root, f"{key}.{next(iter(value))}", config_keys(root)))
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        given = [o for o in options if o is not type(None)]
        if len(given) == 1:  # an optional key: the type's own message ("expected a finite number")
            return _coerce(value, given[0], key, root)
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _coerce(value, opt, key, root)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {' or '.join(_type_name(o) for o in options)}, got {shown(value)}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        elif isinstance(value, tuple):  # from Python: a tuple is as good a list
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {shown(value)}")
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {shown(value)}")
    # Numbers from Python may be NumPy's (`steps=np.int64(3)`): taken as the plain int or float they hold,
    # which is what config.yaml can record.
    if tp is int:
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {shown(value)}")
        value = int(value)
        if not INT_RANGE[0] <= value <= INT_RANGE[1]:  # said by its size: past 4,300 digits `repr` itself fails
            raise ConfigError(f"{key}: expected an integer of at most 64 bits, got one of {value.bit_length():,} bits")
        return value
    if tp is float:
        number = None
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            # YAML 1.1 reads `2e-4` (no dot in the mantissa) as a string.
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {shown(value)}")
        # No key means anything by inf or NaN; either would only stall or poison a run.
        if not math.isfinite(number):
            raise ConfigError(f"{key}: expected a finite number, got {shown(value)}")
        return number
    if tp is str:
        if isinstance(value, os.PathLike):  # a path given from Python
            return os.fspath(value)
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {shown(value)}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {key}.* keys, got {shown(value)}")
        return _build(tp, value, f"{key}.", root)
    raise ConfigError(f"{key}: unsupported config type {tp!r}")


def _key(f: dataclasses.Field) -> str:
    """The config key of a dataclass field: its name, or `metadata["key"]` where the key is a
    Python keyword (`async`, held in the field `async_`)."""
    return f.metadata.get("key", f.name)


def to_dict(obj: Any) -> Any:
    """A config dataclass as nested dicts under its config keys (what config.yaml holds)."""
    if dataclasses.is_dataclass(obj):
        return {_key(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return obj


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict (`to_dict`'s) as one level of dotted keys: {"trainer": {"lr": 1}} -> {"trainer.lr": 1}."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def get_key(obj: Any, dotted: str) -> Any:
    """The value of the dotted config key `dotted` (for example `async.max_staleness`)."""
    for part in dotted.split("."):
        obj = getattr(obj, next(f.name for f in dataclasses.fields(obj) if _key(f) == part))
    return obj


def _build(cls: type[T], data: dict[str, Any], prefix: str = "", root: type | None = None) -> T:
    root = root or cls
    hints = typing.get_type_hints(cls)
    fields = {_key(f): f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(unknown_key(root, f"{prefix}{key!s}", list(fields)))
        name = fields[key].name
        kwargs[name] = _coerce(value, hints[name], f"{prefix}{key}", root)
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if check is not None:
        check()
    return obj


def one_of(key: str, value: str, allowed) -> None:
    """Raise a ConfigError naming `key` unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ConfigError(f"{key}: unknown value {shown(value)}; allowed: {', '.join(sorted(allowed))}")


def check_range(key: str, value: float, ok: bool, expected: str) -> None:
    """Raise a ConfigError naming `key` unless `ok`; `expected` says what is allowed."""
    if not ok:
        raise ConfigError(f"{key}: must be {expected}, got {shown(value)}")


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {p} is not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["a.b=3", "c=fp16"]` -> nested dict with YAML-parsed values."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(
                f"override {item!r}: expected KEY=VALUE (for example precision=fp16); a command's own argument (a run "
                "or model to evaluate) comes before the KEY=VALUE ones"
            )
        key, raw = item.split("=", 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"override {key.strip()}: a value of {len(raw):,} characters; at most {MAX_CONFIG_BYTES:,}"
            )
        try:
            value = _parse_yaml(raw, f"override {key.strip()}")[0] if raw != "" else ""
        except ConfigError as e:
            if "invalid YAML" not in str(e) and "cannot load this YAML value" not in str(e):
                raise
            value = raw  # taken as the text it is (`run_dir=2001-13-45`), which the key's type then checks
        given: dict[str, Any] = {}
        _set_dotted(given, key.strip(), value)
        out = _merge(out, given)  # `rollout={temperature: 0.5}` adds to an earlier `rollout.group_size=2`
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load(
    cls: type[T],
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    values: dict[str, Any] | None = None,
) -> T:
    """Build `cls` from an optional YAML file, `key=value` overrides, and `values` (Python values by
    dotted key or nested dicts, as the Python API takes them); overrides and values win over the file."""
    data: dict[str, Any] = {}
    lines: dict[str, int] = {}
    source = ""
    if path is not None:
        path = Path(path)
        problem = regular_file_problem(path)
        if problem is not None:
            raise ConfigError(f"config file {str(path)!r} {problem}")
        source = str(path)
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{source}: {path.stat().st_size:,} bytes; a config file holds at most {MAX_CONFIG_BYTES:,}"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{source}: not UTF-8 text (invalid byte at offset {e.start})") from None
        loaded, lines = _yaml_lines(text, source)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{source}:1: the top level must be a mapping of config keys")
        data = loaded or {}
    override_data = parse_overrides(overrides or [])
    given: dict[str, Any] = {}
    for key, value in (values or {}).items():
        _set_dotted(given, key, value)
    override_data = _merge(override_data, given)
    renamed = getattr(cls, "RENAMED_KEYS", {})
    for tree in (data, override_data):
        _rename(tree, renamed, lines)
    data = _merge(data, override_data)
    try:
        return _build(cls, data)
    except ConfigError as e:
        # Point at the YAML line, unless the offending value came from an override.
        msg = str(e)
        named = re.match(r"(?:unknown config key )?([A-Za-z_][\w.]*)", msg)  # the key the message starts with
        key = named[1] if named else ""
        if key in lines and not _has_path(override_data, key):
            raise ConfigError(f"{source}:{lines[key]}: {msg}") from None
        raise


def _rename(data: dict[str, Any], renamed: dict[str, str], lines: dict[str, int]) -> None:
    """Keys a later version renamed (old dotted key -> new), moved to their new names, so that a config
    file written before the rename still loads (and a resumed run still matches its checkpoints)."""
    for old, new in renamed.items():
        if _has_path(data, old):
            *parents, last = old.split(".")
            node = data
            for part in parents:
                node = node[part]
            _set_dotted(data, new, node.pop(last))
            if old in lines:
                lines[new] = lines[old]


def _has_path(data: dict[str, Any], dotted: str) -> bool:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


class _Dumper(yaml.SafeDumper):
    """YAML's safe dumper, writing a `str` subclass (a `Precision`) as the string it is."""


_Dumper.add_multi_representer(str, _Dumper.represent_str)


def dump_yaml(obj: Any) -> str:
    return yaml.dump(to_dict(obj), Dumper=_Dumper, sort_keys=False)
