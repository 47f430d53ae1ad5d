"""Input files read with bounds: JSON (size, depth, integer length), lines (length), and regular files only
(never a FIFO)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

# Deeper than any file Parity reads needs; a value nested past it would break the code that walks it.
MAX_JSON_DEPTH = 100


class JSONError(ValueError):
    """JSON text that cannot be used, said in one line; `lineno` is its line when the syntax is wrong."""

    def __init__(self, message: str, lineno: int | None = None):
        super().__init__(message)
        self.lineno = lineno


class _KeyTwice(Exception):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object; a key given twice is refused (`json` keeps the last silently)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        names = [name for name, _ in pairs]
        raise _KeyTwice(next(name for name in names if names.count(name) > 1))
    return out


def parse_json(text: str) -> Any:
    """`json.loads`, every failure a JSONError: bad syntax, nesting past MAX_JSON_DEPTH (where the
    parser itself would overflow the stack), or an integer too long to convert."""
    try:
        value = json.loads(text, object_pairs_hook=_object)
    except _KeyTwice as e:
        raise JSONError(f"invalid JSON (the key {e.args[0]!r} is given twice in one object)") from None
    except json.JSONDecodeError as e:
        where = f"column {e.colno}" if e.lineno == 1 else f"line {e.lineno}, column {e.colno}"
        raise JSONError(f"invalid JSON ({e.msg} at {where})", e.lineno) from None
    except RecursionError:
        raise JSONError(f"JSON nested more than {MAX_JSON_DEPTH} deep") from None
    except ValueError as e:  # an integer past Python's digit limit for str -> int
        raise JSONError(f"JSON value out of range ({e})") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise JSONError(f"JSON nested more than {MAX_JSON_DEPTH} deep")
    return value


def regular_file_problem(path: Path) -> str | None:
    """Why `path` cannot be read as an input file ("does not exist", "is a directory", ...), or None. A FIFO
    or a device (/dev/zero) is refused: reading one may never end."""
    if not path.exists():
        return "does not exist"
    if path.is_dir():
        return "is a directory, not a file"
    if not path.is_file():
        return "is not a regular file (a FIFO, a socket or a device), which Parity does not read"
    return None


def _depth(value: Any) -> int:
    """How deep lists and objects nest in `value`, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, level)
            if level > MAX_JSON_DEPTH:
                break
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


_SKIP_CHUNK_BYTES = 2**20  # reading past an over-long line to measure it


class LineTooLong(ValueError):
    """Line `lineno` (1-based) is `length` bytes, past the bound it was read with."""

    def __init__(self, lineno: int, length: int, bound: int):
        super().__init__(f"line {lineno} is {length:,} bytes, more than the {bound:,} a line may hold")
        self.lineno, self.length, self.bound = lineno, length, bound


def bounded_lines(f: BinaryIO, max_line_bytes: int) -> Iterator[bytes]:
    """The lines of `f`, newline kept, none held past `max_line_bytes`: a longer line raises LineTooLong with
    its length, its rest read in chunks and never held whole (a 3 GiB line costs a chunk of memory)."""
    lineno = 0
    while line := f.readline(max_line_bytes + 1):  # room for the newline
        lineno += 1
        if len(line) > max_line_bytes and not line.endswith(b"\n"):
            length, part = len(line), line
            while not part.endswith(b"\n") and (part := f.readline(_SKIP_CHUNK_BYTES)):
                length += len(part)
            raise LineTooLong(lineno, length - 1 if part.endswith(b"\n") else length, max_line_bytes)
        yield line
