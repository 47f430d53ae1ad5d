"""Output folders (`--out` of mismatch, eval, doctor, report, sanity, phantom and build-model): Parity writes
into a folder only when it is new, empty, or holds nothing but what Parity wrote there.

A command replaces the files it writes, so a folder of the user's holding a result of the same name (or
a thesis beside it) is refused before any work, as a run directory is (`rundir.py`). Each folder Parity
writes carries a mark, `.parity-out`, recording the SHA-256 of every file a command wrote there and the
sub-folders it made (a sanity run's `runs/`). A file may be replaced only while its bytes are still the bytes
Parity recorded writing: a mark someone wrote by hand, listing a user's file, authorises nothing, since the
user's file does not have the recorded bytes. A folder holding a link anywhere below it is refused, and
every file is written through `folders.Folder` (a temporary file made exclusively, then renamed), never
through a link.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from parity.config import ConfigError
from parity.files import JSONError, parse_json
from parity.folders import Folder, refuse_links, written_name
from parity.rundir import enclosing_run, lock_holder

MARK = ".parity-out"
MAX_MARK_BYTES = 2**20
_HASH = re.compile(r"[0-9a-f]{64}")
# Output folders this process has claimed, each held by a lock on a descriptor of it until the process ends (or
# `held_output_dir` ends): two commands writing one folder at once mixed their results, and each rewrote the mark
# from its own view of it, leaving files it had written recorded with the other's bytes (then refused as not Parity's).
_claimed: dict[tuple[int, int], int] = {}


class Mark:
    """What `.parity-out` records: each file's accepted SHA-256s (the bytes Parity wrote) and the folders
    Parity made."""

    def __init__(
        self, files: dict[str, list[str]] | None = None, folders: set[str] | None = None, command: str | None = None
    ):
        self.files, self.folders = files or {}, folders or set()
        self.command = command  # the command whose results these are (None: a mark of Parity before it said)

    @classmethod
    def read(cls, out: Folder) -> Mark | None:
        """The mark of `out`, or None when it holds no usable one (then nothing in it is Parity's)."""
        try:
            data = parse_json(out.read_bytes(MARK, MAX_MARK_BYTES).decode("utf-8"))
        except (OSError, ValueError, ConfigError, UnicodeDecodeError, JSONError):  # missing, a link, too big
            return None
        if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
            return None  # a mark of Parity before 0.1 listed names only: it proves nothing
        files = {
            name: hashes
            for name, hashes in data["files"].items()
            if _plain(name)
            and isinstance(hashes, list)
            and all(isinstance(h, str) and _HASH.fullmatch(h) for h in hashes)
        }
        folders = data.get("folders", [])
        command = data.get("command")
        return cls(
            files,
            {f for f in folders if isinstance(f, str) and _plain(f)} if isinstance(folders, list) else set(),
            command if isinstance(command, str) else None,
        )

    def write(self, out: Folder) -> None:
        mark = {
            "written_by": "parity",
            **({"command": self.command} if self.command else {}),
            "files": dict(sorted(self.files.items())),
            "folders": sorted(self.folders),
        }
        out.write_text(MARK, json.dumps(mark, indent=2) + "\n")


def _hashes(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(h, str) and _HASH.fullmatch(h) for h in value)


def _plain(name: str) -> bool:
    """A name of an entry directly in the folder: no path, not the mark."""
    return bool(name) and "/" not in name and name not in (".", "..", MARK)


def _leftover(out: Folder, mark: Mark, name: str) -> bool:
    """Whether `name` is a temporary file a kill left behind as Parity wrote a recorded file or the mark."""
    written = written_name(name)
    return written is not None and (written in mark.files or written == MARK) and out.is_file(name)


def _foreign(out: Folder, mark: Mark) -> list[str]:
    """Entries of `out` that are not Parity's: neither a file whose bytes the mark records, nor a folder it
    made, nor a temporary file of a recorded name (`_leftover`)."""
    foreign = []
    for name in out.names():
        st = out.lstat(name)
        if name == MARK or st is None:
            continue
        if stat.S_ISDIR(st.st_mode):
            ours = name in mark.folders
        elif stat.S_ISREG(st.st_mode):
            ours = _leftover(out, mark, name) or (name in mark.files and out.sha256(name) in mark.files[name])
        else:
            ours = False
        if not ours:
            foreign.append(name)
    return foreign


def check_output_dir(out: Path, command: str, key: str = "--out") -> None:
    """Refuse `out` (the value of `key`) unless `parity command` may write there: new, empty, or holding only
    what Parity wrote, that command's results (another's would be replaced: a sanity run's report.md by a
    report's); writes nothing."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{key} {out}: a file, not a folder")
    run = enclosing_run(out)
    if run is not None:  # a run holds only a run's files: it would not resume, and pruning would delete them
        raise ConfigError(
            f"{key} {out}: inside the run directory {run}, which holds a run's files only; choose a folder outside it"
        )
    if not out.exists():  # it is made when the work is done: a place it cannot be made is refused now
        check_writable(out, f"{key} {out}")
        return
    if not any(out.iterdir()):
        return
    refuse_links(out, key)
    with Folder.open(out, key=key) as folder:
        _hold(folder, out, key, keep=False)
        mark = Mark.read(folder) or Mark()
        foreign = _foreign(folder, mark)
    if mark.command not in (None, command) and not foreign:
        raise ConfigError(
            f"{key} {out}: holds the results of `parity {mark.command}`, which `parity {command}` would replace; "
            "choose another folder"
        )
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ConfigError(
            f"{key} {out}: holds files Parity did not write ({shown}), or that changed since it did; it writes "
            "only into a new or empty folder, or one holding only what it wrote there, so that none of yours is "
            "overwritten; choose another folder"
        )


def check_writable(folder: Path, what: str) -> None:
    """Refuse, before the work, a folder (made when it is written, where it does not exist yet) that cannot be
    written: the nearest one that exists is a file, or one this user may not write in. `what` names it."""
    there = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
    if not there.is_dir():
        raise ConfigError(f"{what}: {there} is a file, not a folder")
    if not os.access(there, os.W_OK | os.X_OK):
        raise ConfigError(f"{what}: cannot be written in {there}, where this user may not write")


def claim_output_dir(out: Path, command: str, key: str = "--out", folders: tuple[str, ...] = ()) -> Path:
    """Check `out` again (it may have changed during the work), create it, and mark it as `parity command`'s
    with the sub-folders `folders` that the command makes there: call it just before writing."""
    check_output_dir(out, command, key)
    with Folder.open(out, create=True, key=key) as folder:
        _hold(folder, out, key, keep=True)
        mark = Mark.read(folder) or Mark()
        for name in folder.names():
            if _leftover(folder, mark, name):
                folder.remove(name)
        mark.folders |= set(folders)
        mark.command = command
        mark.write(folder)
    return out


@contextlib.contextmanager
def held_output_dir(out: Path | None, command: str, key: str = "--out") -> Iterator[Path | None]:
    """Hold `out` for `parity command` from before its work to its end: checked (`check_output_dir`), made where
    it is new, and locked, so that a second command given it is refused at once, naming this process, and not
    only once it has done its own work. A command that fails (bad input found in the work, a signal) removes
    the folders made here while they are still empty: nothing is left of it. None: a command that writes no
    folder (from Python), nothing held."""
    if out is None:
        yield None
        return
    check_output_dir(out, command, key)
    made = [p for p in (out, *out.parents) if not p.exists()]
    with Folder.open(out, create=True, key=key) as folder:
        identity, ours = folder.identity, folder.identity not in _claimed  # not ours: held further out, kept
        _hold(folder, out, key, keep=True)
    try:
        yield out
    except BaseException:
        for path in made:  # deepest first, while still held: no other command has taken it meanwhile
            try:
                path.rmdir()  # only an empty folder: nothing written there
            except OSError:
                break
        raise
    finally:
        if ours:  # a command run from Python has ended: other processes may write there again
            os.close(_claimed.pop(identity))


def _hold(folder: Folder, out: Path, key: str, keep: bool) -> None:
    """Refuse `out` while another process holds it, naming it; `keep`: hold it for this one (`_claimed`)."""
    if folder.identity in _claimed:
        return
    fd = os.dup(folder.fd)  # its own descriptor: the lock outlives `folder`
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if keep else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = lock_holder(fd)
        os.close(fd)
        raise ConfigError(
            f"{key} {out}: in use by another Parity command (pid {holder}), which writes its results there; wait "
            "for it to end, or choose another folder"
        ) from None
    if keep:
        _claimed[folder.identity] = fd
    else:
        os.close(fd)


def write_output(path: Path, data: str | bytes) -> None:
    """Replace the file `path` in a claimed output folder with `data`, recording its SHA-256 in the mark first
    (beside the bytes there now), so that a kill between the two renames leaves a folder that is still Parity's."""
    data = data.encode("utf-8") if isinstance(data, str) else data
    digest = hashlib.sha256(data).hexdigest()
    with Folder.open(path.parent, key="--out") as out:
        mark = Mark.read(out) or Mark()
        if out.lstat(path.name) is not None and out.sha256(path.name) not in mark.files.get(path.name, []):
            raise ConfigError(f"{path}: appeared or changed while Parity worked, so it is not replaced")
        mark.files[path.name] = [*mark.files.get(path.name, [])[-1:], digest]
        mark.write(out)
        out.write_bytes(path.name, data)
        mark.files[path.name] = [digest]
        mark.write(out)


def write_output_json(path: Path, obj: object) -> None:
    """`obj` as strict JSON: a NaN or an infinity, which JSON has no number for, is written null."""
    write_output(path, json.dumps(_finite(obj), indent=2, allow_nan=False) + "\n")


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def mark_written(out: Path, command: str) -> None:
    """Record every file `out` holds now as written by `parity command`: for a folder Parity has just built
    whole (`parity build-model` builds it in a fresh folder, then renames it into place)."""
    with Folder.open(out) as folder:
        mark = Mark.read(folder) or Mark()
        mark.command = command
        for name in folder.names():
            if _plain(name) and folder.is_file(name):
                mark.files[name] = [folder.sha256(name)]
            elif _plain(name) and folder.is_dir(name):
                mark.folders.add(name)
        mark.write(folder)
