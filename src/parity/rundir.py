"""The run directory: one process owns it at a time, and it holds nothing but a run.

A run directory holds `config.yaml`, `numerics.json`, `metrics.jsonl`, `checkpoints/`,
`tensorboard/` and `.lock`. The owner keeps an exclusive POSIX lock on `.lock`
for the run's life; the kernel drops it when the process dies, however it dies,
so a crashed run never leaves a stale lock. POSIX locks belong to a process and
are not inherited by `fork`, so the reward worker never holds the run's lock.

Parity deletes files in a run directory (pruned checkpoints, a crash's
half-written ones), so it refuses a directory that holds anything else: `.`, a
home folder, a source tree. A run directory may come from someone else: one
holding a symbolic link anywhere below it is refused, and every write, delete
and read inside goes through `folders.Folder`, which follows no link.
"""

from __future__ import annotations

import fcntl
import fnmatch
import os
import re
import stat
import struct
import sys
from pathlib import Path
from typing import IO

from parity.config import ConfigError
from parity.folders import Folder, link_refusal, links_below, written_name

LOCK_NAME = ".lock"
CHECKPOINTS_DIR = "checkpoints"
# A checkpoint folder is checkpoints/step_NNNNNN (six digits or more); `Folder.new_dir` writes it as
# .step_NNNNNN.*.tmp and swaps an older one out as .step_NNNNNN.old. No other name under checkpoints/ is
# Parity's: a user's step_best or step_000002.bak is neither read, nor pruned, nor cleaned.
_CHECKPOINT = re.compile(r"step_(\d{6,})")
_CHECKPOINT_TMP = re.compile(r"\.step_\d{6,}\..+\.tmp")
_CHECKPOINT_OLD = re.compile(r"\.(step_\d{6,})\.old")
RUN_ENTRIES = {
    "config.yaml",
    "numerics.json",
    "metrics.jsonl",
    CHECKPOINTS_DIR,
    "tensorboard",
    "completions",  # each step's completions with their rewards (`rl/completions.py`)
    "data",  # datasets the Python API was given in memory
    "wandb",  # log.to=wandb's files
    "mlruns",  # log.to=mlflow's store, unless MLFLOW_TRACKING_URI names another
    LOCK_NAME,
}
RUN_FILES = {"config.yaml", "numerics.json", "metrics.jsonl", LOCK_NAME}  # the rest of RUN_ENTRIES are folders
# Folders of a run that a tracker writes in through its own library, with links of its own (W&B links its logs,
# some to its cache outside the run). Parity reads, writes and deletes nothing below them (a run removed whole
# goes without following a link), so links there are let through when they point where the tracker itself
# keeps files (`tracker_roots`): the tracker resumed on a received run writes through them. The folder itself
# being a link is refused.
TRACKER_DIRS = ("wandb",)


def tracker_roots(run_dir: Path) -> list[Path]:
    """Where a link below a tracker's folder may lead: that folder, and W&B's own cache and data folders."""
    home = Path.home()
    cache = os.environ.get("WANDB_CACHE_DIR") or home / ".cache" / "wandb"
    data = os.environ.get("WANDB_DATA_DIR") or home / ".local" / "share" / "wandb"
    return [(run_dir / d).resolve() for d in TRACKER_DIRS] + [Path(cache).resolve(), Path(data).resolve()]


# Temporary files of `Folder.write_bytes` that a kill can leave behind.
TEMP_PATTERNS = (".config.yaml.*.tmp", ".numerics.json.*.tmp", ".metrics.jsonl.*.tmp")


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint folder's name, or None when Parity does not write that name."""
    match = _CHECKPOINT.fullmatch(name)
    return int(match[1]) if match and checkpoint_name(int(match[1])) == name else None


def enclosing_run(path: Path) -> Path | None:
    """The run directory that `path` (which need not exist) is, or lies in: a folder holding a run's config.yaml
    beside its lock, metrics or checkpoints; None if there is none."""
    for folder in (path.resolve(), *path.resolve().parents):
        if (folder / "config.yaml").is_file() and any((folder / n).exists() for n in (LOCK_NAME, "metrics.jsonl")):
            return folder
    return None


def foreign_entries(run_dir: Path) -> list[str]:
    """Names in `run_dir` that no run writes."""
    return sorted(
        p.name for p in run_dir.iterdir() if p.name not in RUN_ENTRIES and not any(p.match(t) for t in TEMP_PATTERNS)
    )


def refuse_run_links(run_dir: Path, key: str) -> None:
    """Refuse a run directory holding a link anywhere below it, but inside a tracker's folder (`TRACKER_DIRS`),
    where a link may lead to `tracker_roots` only."""
    links = links_below(run_dir, limit=1, skip=TRACKER_DIRS)
    roots = tracker_roots(run_dir)
    for folder in TRACKER_DIRS:
        if links or not (run_dir / folder).is_dir() or (run_dir / folder).is_symlink():
            break
        for link in links_below(run_dir / folder, limit=10_000):
            target = (run_dir / folder / link).resolve()
            if not any(target == root or target.is_relative_to(root) for root in roots):
                links = [f"{folder}/{link}"]
                break
    if links:
        raise link_refusal(run_dir, links[0], key)


def check_run_dir(run_dir: Path) -> None:
    """Refuse a directory that is not a run's own: the working directory, one with other files, or one holding
    a link."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir: {run_dir} is a file, not a directory")
    if run_dir.resolve() == Path.cwd().resolve():
        raise ConfigError(
            f"run_dir={run_dir}: the working directory cannot be a run directory (Parity prunes and cleans files "
            "there); use a folder of its own, e.g. run_dir=runs/NAME"
        )
    if run_dir.is_dir():
        refuse_run_links(run_dir, "run_dir")
        for name in sorted(RUN_ENTRIES):  # links are refused above: lstat is what the run would meet
            try:
                mode = (run_dir / name).lstat().st_mode
            except FileNotFoundError:
                continue
            if not (stat.S_ISREG(mode) if name in RUN_FILES else stat.S_ISDIR(mode)):
                kind = "a regular file" if name in RUN_FILES else "a folder"
                raise ConfigError(f"run_dir: {run_dir / name} is not {kind}, as a run's {name} is; not a run's own")
        foreign = foreign_entries(run_dir)
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise ConfigError(
                f"run_dir: {run_dir} holds files that are not a run's ({shown}); Parity prunes and cleans files "
                "in its run directory, so it only uses a new or empty folder"
            )


_held: set[tuple[int, int]] = set()  # POSIX locks never conflict within one process: track ours by folder


class RunLock:
    """An exclusive lock on a run directory, held until `release` or the process's end."""

    def __init__(self, run_dir: Path):
        with Folder.open(run_dir, key="run_dir") as folder:
            self.folder_id = folder.identity
            if self.folder_id in _held:
                raise ConfigError(f"run_dir: {run_dir} is in use by a run in this process (pid {os.getpid()})")
            self._fd: int | None = folder.open_lock(LOCK_NAME)
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = lock_holder(self._fd)
            os.close(self._fd)
            self._fd = None
            raise ConfigError(
                f"run_dir: {run_dir} is in use by another Parity process (pid {holder}); wait for it to end, "
                "or choose another run_dir"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
        _held.add(self.folder_id)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock; the file stays (others may be waiting on it)
            self._fd = None
            _held.discard(self.folder_id)


def in_use_by(run_dir: Path, held: list[IO[bytes]] | None = None) -> str | None:
    """The pid of the process that holds `run_dir` (a run going on), or None; writes nothing. `held`: where the
    run is free, its lock file is appended there, open under a shared lock until it is closed: no run starts
    there meanwhile (a `--resume` would prune the checkpoints being read)."""
    with Folder.open(run_dir, key="run_dir") as folder:
        if folder.identity in _held:  # ours: closing a descriptor of .lock would drop this process's lock
            return str(os.getpid())
        if not folder.is_file(LOCK_NAME):
            return None
        lock = folder.open_read(LOCK_NAME)  # a link or a FIFO is refused, never followed
        try:
            fcntl.lockf(lock.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts with a run's exclusive lock
        except OSError:
            holder = lock_holder(lock.fileno())
            lock.close()
            return holder
        if held is None:
            lock.close()
        else:
            held.append(lock)
    return None


def lock_holder(fd: int) -> str:
    """The pid of a process holding a lock that conflicts with an exclusive one on `fd`, as the kernel records
    it: a run's, or a `parity eval`'s reading the run (a POSIX lock on `.lock`, whose pid is the last run's), or
    an `--out` folder's holder (a flock of the folder, `outdir._hold`, which F_GETLK does not see and /proc/locks
    lists by device and inode). Elsewhere than on Linux, whose `struct flock` layout this reads, the pid a lock
    file holds."""
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        try:  # "1: FLOCK  ADVISORY  WRITE PID MAJOR:MINOR:INODE 0 EOF"; a waiter's line reads "1: -> FLOCK ..."
            with open("/proc/locks") as locks:
                return next((f[4] for f in map(str.split, locks) if f[1:2] == ["FLOCK"] and f[5] == where), "unknown")
        except OSError:  # no /proc/locks: not Linux
            return "unknown"
    if not sys.platform.startswith("linux"):
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
    layout = "hhqqi4x"  # struct flock: l_type, l_whence, l_start, l_len, l_pid
    probe = struct.pack(layout, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    kind, _, _, _, pid = struct.unpack(layout, fcntl.fcntl(fd, fcntl.F_GETLK, probe))
    return "unknown" if kind == fcntl.F_UNLCK else str(pid)


def clean_leftovers(run_dir: Path) -> list[str]:
    """Remove what a killed run left half-written; return what was done, one line each.

    `Folder.new_dir` swaps an existing checkpoint out as `.step_N.old` just before
    moving the new one in; a kill between the two renames leaves only the old one,
    which is put back.
    """
    done = []
    with Folder.open(run_dir, key="run_dir") as run:
        names = run.names(CHECKPOINTS_DIR)
        for name in [n for n in names if _CHECKPOINT_TMP.fullmatch(n)]:
            run.remove(f"{CHECKPOINTS_DIR}/{name}")
            done.append(f"removed {name}, a checkpoint left half-written by a crash")
        for old in [n for n in names if _CHECKPOINT_OLD.fullmatch(n)]:
            target = _CHECKPOINT_OLD.fullmatch(old)[1]
            if run.lstat(f"{CHECKPOINTS_DIR}/{target}") is not None:
                run.remove(f"{CHECKPOINTS_DIR}/{old}")
            else:
                run.replace(f"{CHECKPOINTS_DIR}/{old}", f"{CHECKPOINTS_DIR}/{target}")
                done.append(f"restored {target}, swapped out by a crash during a save")
        for name in run.names():
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in TEMP_PATTERNS):
                run.remove(name)
        for name in [n for n in run.names("completions") if written_name(n)]:
            run.remove(f"completions/{name}")  # a step's completions, cut off as they were written
    return done


def remove_run(run_dir: Path) -> None:
    """Delete a finished run directory that a command is about to redo (`parity sanity`, `parity
    phantom`); refused while a run holds it, and when it holds anything but a run's files."""
    if run_dir.exists():
        check_run_dir(run_dir)
        lock = RunLock(run_dir)
        with Folder.open(run_dir.parent) as parent:
            parent.remove(run_dir.name)  # the lock file goes with it; our descriptor keeps the lock until closed
        lock.release()
