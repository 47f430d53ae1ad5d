"""Output folders (`--out` of mismatch, eval, doctor, report, sanity and phantom): Parity writes into a
folder only when it is new, empty, or one Parity wrote.

A command replaces the files it writes, so a folder of the user's holding a result of the same name (or
a thesis beside it) is refused before any work, as a run directory is (`rundir.py`). Each folder Parity
writes carries a mark, `.parity-out`, listing every name any Parity command wrote there; a folder is
Parity's when it holds the mark and nothing the mark does not list (a crash's temporary files aside).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from parity.config import ConfigError
from parity.files import JSONError, atomic_write_json, parse_json

MARK = ".parity-out"
MAX_MARK_BYTES = 2**20


def _marked_names(out: Path) -> set[str] | None:
    """The names the mark lists, or None when `out` holds no usable mark (then it is not Parity's)."""
    mark = out / MARK
    if mark.is_symlink() or not mark.is_file() or mark.stat().st_size > MAX_MARK_BYTES:
        return None
    try:
        names = parse_json(mark.read_text(encoding="utf-8")).get("names")
    except (JSONError, UnicodeDecodeError, AttributeError):
        return None
    return set(names) if isinstance(names, list) and all(isinstance(n, str) for n in names) else None


def _foreign(out: Path, names: set[str]) -> list[str]:
    """Entries of `out` that are neither listed nor a temporary file of a listed name (`files.atomic_write_text`)."""
    temporary, ours = re.compile(r"\.(.+)\.[^.]+\.tmp"), names | {MARK}
    return sorted(
        p.name
        for p in out.iterdir()
        if p.name not in ours and not ((m := temporary.fullmatch(p.name)) and m[1] in ours)
    )


def check_output_dir(out: Path, key: str = "--out") -> None:
    """Refuse `out` (the value of `key`) unless Parity may write there; writes nothing."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{key} {out}: a file, not a folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    names = _marked_names(out)
    foreign = _foreign(out, names or set())
    if names is None or foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ConfigError(
            f"{key} {out}: holds files Parity did not write ({shown}); it writes only into a new or empty folder, "
            "or one it wrote before, so that none of yours is overwritten; choose another folder"
        )


def mark_output_dir(out: Path, names: Iterable[str]) -> None:
    """Add `names` to the mark of `out`, an existing folder of Parity's."""
    atomic_write_json(out / MARK, {"written_by": "parity", "names": sorted((_marked_names(out) or set()) | set(names))})


def claim_output_dir(out: Path, names: Iterable[str], key: str = "--out") -> Path:
    """Check `out` again (it may have changed during the work), create it and mark `names` as Parity's:
    call it just before writing them."""
    check_output_dir(out, key)
    out.mkdir(parents=True, exist_ok=True)
    mark_output_dir(out, names)
    return out
