"""Atomic file writes (a crash mid-write never leaves a half-written result), and JSON read with bounds."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` via a temporary file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would outlive the rename
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


# Deeper than any file Parity reads needs; a value nested past it would break the code that walks it.
MAX_JSON_DEPTH = 100


class JSONError(ValueError):
    """JSON text that cannot be used, said in one line; `lineno` is its line when the syntax is wrong."""

    def __init__(self, message: str, lineno: int | None = None):
        super().__init__(message)
        self.lineno = lineno


def parse_json(text: str) -> Any:
    """`json.loads`, every failure a JSONError: bad syntax, nesting past MAX_JSON_DEPTH (where the
    parser itself would overflow the stack), or an integer too long to convert."""
    try:
        value = json.loads(text)
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


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary folder that replaces `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would outlive the rename
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
