"""Folders Parity writes, deletes and reads in: run folders and output folders.

The folder a user names may itself be a link (their own choice), but a folder can come from someone else
(a run sent for `--resume`, `parity eval` or `parity report`), and a link inside it (`checkpoints ->
~/work`, `completions/step_000001.jsonl -> ~/.ssh/id_rsa`) would let a write, a prune or a read reach
outside. So a `Folder` holds its root open, and reaches every entry below from that descriptor one
component at a time with O_NOFOLLOW: a link is refused at the moment of use, leaving no gap between a
check and the use. A library that takes a path (safetensors, matplotlib, TensorBoard) is given one through
the open descriptor (`Folder.path`), which names the folder itself whatever is renamed or linked around it
while it is open.

`links_below` finds the links a folder holds, so that a command refuses one in a line naming the entry
before it does any work; the opens here are what keeps that promise when the folder changes afterwards.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO

from parity.config import ConfigError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
# Linux names an open descriptor by a path; another process of the same user (a tracker's service) may use
# it too while this one holds the descriptor open. Elsewhere a Folder's path is its plain one.
_FD_PATHS = Path(f"/proc/{os.getpid()}/fd").is_dir()


class LinkError(ConfigError):
    """A symbolic link where Parity writes, deletes or reads; the message names the entry."""


class NotRegularError(ConfigError):
    """A FIFO, socket or device where Parity reads a file: reading one may never end."""


def link_refusal(root: Path, entry: str, key: str) -> LinkError:
    return LinkError(
        f"{key} {root}: {entry} is a symbolic link; Parity follows no link inside a folder it writes, deletes "
        "or reads in, so that nothing outside it is touched: replace the link with what it points to, or "
        "choose another folder"
    )


def links_below(root: Path, limit: int = 6, skip: tuple[str, ...] = ()) -> list[str]:
    """Up to `limit` entries below `root` (relative paths) that are symbolic links; links are not entered, nor
    are the folders `skip` names (relative paths), though one of them that is a link is found."""
    found: list[str] = []
    stack = [PurePosixPath()]
    while stack and len(found) < limit:
        rel = stack.pop()
        try:
            with os.scandir(root / rel) as entries:
                for entry in entries:
                    if entry.is_symlink():
                        found.append(str(rel / entry.name))
                    elif entry.is_dir(follow_symlinks=False) and str(rel / entry.name) not in skip:
                        stack.append(rel / entry.name)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
    return sorted(found)[:limit]


def refuse_links(root: Path, key: str) -> None:
    """Refuse `root` (the value of `key`) in one line when it holds a link anywhere below it."""
    links = links_below(root) if root.is_dir() else []
    if links:
        raise link_refusal(root, links[0], key)


def _random_suffix() -> str:
    return os.urandom(4).hex()


_WRITING = re.compile(r"\.(.+)\.[0-9a-f]+\.tmp")  # `Folder.write_bytes`'s temporary copy of a file


def written_name(name: str) -> str | None:
    """The file that `name` is `Folder.write_bytes`'s temporary copy of (left behind by a kill), or None."""
    writing = _WRITING.fullmatch(name)
    return None if writing is None else writing[1]


class Folder:
    """An open folder: `root` as the user named it, `rel` the path below it that was walked to reach it."""

    def __init__(self, root: Path, rel: PurePosixPath, fd: int, key: str):
        self.root, self.rel, self.fd, self.key = root, rel, fd, key

    @classmethod
    def open(cls, root: str | Path, *, create: bool = False, key: str = "folder") -> Folder:
        """Open `root` (following a link there: the user named it); `create` makes it and its parents.
        `key` names the folder in errors (`run_dir`, `--out`)."""
        root = Path(root)
        try:
            if create:
                root.mkdir(parents=True, exist_ok=True)
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:  # named by its key where it has one: the folder the user gave (`--out /proc/x`)
            raise OSError(e.errno, e.strerror, str(root) if key == "folder" else f"{key} {root}") from None
        return cls(root, PurePosixPath(), fd, key)

    # -- naming ---------------------------------------------------------------

    @property
    def identity(self) -> tuple[int, int]:
        """(device, inode): the same folder whatever path reached it."""
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino

    @property
    def shown(self) -> Path:
        """The folder as the user knows it, for messages."""
        return self.root / self.rel

    def path(self, name: str = "") -> Path:
        """A path to this folder (or to `name` in it) for a library that opens by path: through the open
        descriptor, so no link above `name` is followed. Valid while the folder is open."""
        base = Path(f"/proc/{os.getpid()}/fd/{self.fd}") if _FD_PATHS else self.shown
        return base / name if name else base

    def _error(self, entry: str, fd: int, leaf: str, e: OSError) -> OSError:
        """`e`, of an open of `leaf` in the folder `fd` (the entry `entry` below this one), as a LinkError when
        `leaf` is a link (O_NOFOLLOW says ELOOP, or ENOTDIR with O_DIRECTORY)."""
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            with contextlib.suppress(OSError):
                if stat.S_ISLNK(os.stat(leaf, dir_fd=fd, follow_symlinks=False).st_mode):
                    return link_refusal(self.root, str(self.rel / entry), self.key)
        return self._named(entry, e)

    def _named(self, entry: str, e: OSError) -> OSError:
        """`e` naming the entry by its whole path (an OS error through a descriptor names only the leaf, or a
        temporary file of it)."""
        return OSError(e.errno, e.strerror, str(self.shown / entry)) if e.errno else e

    # -- descending -----------------------------------------------------------

    def sub(self, name: str | PurePosixPath, *, create: bool = False) -> Folder:
        """The folder `name` below this one (a relative path), each component reached without following a
        link; `create` makes what is missing. Close it (or use `with`)."""
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts:
            raise ValueError(f"{name}: not a path inside {self.shown}")
        fd = self.fd
        try:
            for i, part in enumerate(rel.parts):
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o777, dir_fd=fd)
                try:
                    opened = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    raise self._error(str(PurePosixPath(*rel.parts[: i + 1])), fd, part, e) from None
                if fd != self.fd:
                    os.close(fd)
                fd = opened
        except BaseException:
            if fd != self.fd:
                os.close(fd)
            raise
        return Folder(self.root, self.rel / rel, fd if rel.parts else os.dup(self.fd), self.key)

    @contextlib.contextmanager
    def _parent(self, name: str) -> Iterator[tuple[int, str]]:
        """The open folder holding `name` (a relative path) and its last component."""
        rel = PurePosixPath(name)
        if len(rel.parts) == 1:
            yield self.fd, rel.name
            return
        with self.sub(rel.parent) as parent:
            yield parent.fd, rel.name

    # -- reading --------------------------------------------------------------

    def lstat(self, name: str) -> os.stat_result | None:
        """`name`'s own status (a link's, not its target's), or None when it does not exist."""
        try:
            with self._parent(name) as (fd, leaf):
                return os.stat(leaf, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def is_file(self, name: str) -> bool:
        st = self.lstat(name)
        return st is not None and stat.S_ISREG(st.st_mode)

    def is_dir(self, name: str) -> bool:
        st = self.lstat(name)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def names(self, name: str = "") -> list[str]:
        """The entries of this folder, or of the folder `name` below it; none when there is no such folder."""
        if not name:
            return sorted(os.listdir(self.fd))
        try:
            with self.sub(name) as folder:
                return sorted(os.listdir(folder.fd))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def open_read(self, name: str) -> IO[bytes]:
        """`name` opened for reading: a regular file reached without following a link, or a one-line error
        (a FIFO is never waited on: it is opened without blocking and refused)."""
        with self._parent(name) as (fd, leaf):
            try:
                opened = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                raise self._error(name, fd, leaf, e) from None
        if not stat.S_ISREG(os.fstat(opened).st_mode):
            os.close(opened)
            raise NotRegularError(
                f"{self.shown / name}: not a regular file (a FIFO, a socket or a device), which Parity does not read"
            )
        os.set_blocking(opened, True)
        return os.fdopen(opened, "rb")

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        """The bytes of `name`; past `limit` bytes, a ValueError naming the file (nothing more is read)."""
        with self.open_read(name) as f:
            data = f.read() if limit is None else f.read(limit + 1)
        if limit is not None and len(data) > limit:
            raise ValueError(f"{self.shown / name}: more than {limit:,} bytes")
        return data

    def sha256(self, name: str) -> str:
        """The SHA-256 of `name`'s bytes, read as `open_read` reads."""
        with self.open_read(name) as f:
            return hashlib.file_digest(f, "sha256").hexdigest()

    # -- writing --------------------------------------------------------------

    def write_bytes(self, name: str, data: bytes) -> None:
        """Replace `name` with `data` atomically: a temporary file created here exclusively (never through a
        link) and renamed over it (a rename replaces a link rather than writing through it)."""
        with self._parent(name) as (fd, leaf):
            tmp = f".{leaf}.{_random_suffix()}.tmp"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                out = os.open(tmp, flags, 0o666, dir_fd=fd)
            except OSError as e:
                raise self._named(name, e) from None
            try:
                with os.fdopen(out, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, leaf, src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException as e:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=fd)
                if isinstance(e, OSError):  # no space, a file-size limit: named by the file, not by no name at all
                    raise self._named(name, e) from None
                raise

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode("utf-8"))

    def append_text(self, name: str, text: str) -> None:
        """Add `text` to the end of `name` (made if missing), never through a link."""
        with self._parent(name) as (fd, leaf):
            try:
                out = os.open(leaf, _APPEND_FLAGS, 0o666, dir_fd=fd)
            except OSError as e:
                raise self._error(name, fd, leaf, e) from None
            if not stat.S_ISREG(os.fstat(out).st_mode):
                os.close(out)
                raise NotRegularError(f"{self.shown / name}: not a regular file, which Parity does not append to")
            try:
                with os.fdopen(out, "a", encoding="utf-8") as f:
                    f.write(text)
            except OSError as e:
                raise self._named(name, e) from None

    def open_lock(self, name: str) -> int:
        """A descriptor of `name` for a lock file: read, written in place, made if missing; never through a link,
        and never a file with another name too (a hard link: writing the pid would write that file)."""
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(name, flags, 0o644, dir_fd=self.fd)
        except OSError as e:
            raise self._error(name, self.fd, name, e) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} names"
            raise NotRegularError(f"{self.shown / name}: {what}, which Parity never makes; remove it")
        return fd

    @contextlib.contextmanager
    def new_dir(self, name: str) -> Iterator[Folder]:
        """A fresh folder, made here exclusively, that replaces `name` only if the block succeeds: an older
        `name` is swapped out as `.NAME.old` just before (`rundir.clean_leftovers` puts it back after a kill
        between the two renames) and deleted after."""
        tmp = f".{name}.{_random_suffix()}.tmp"
        try:
            os.mkdir(tmp, 0o777, dir_fd=self.fd)
        except OSError as e:
            raise self._named(name, e) from None
        try:
            with self.sub(tmp) as folder:
                yield folder
            if self.lstat(name) is not None:
                old = f".{name}.old"
                if self.lstat(old) is not None:
                    self.remove(old)
                self.replace(name, old)
                self.replace(tmp, name)
                self.remove(old)
            else:
                self.replace(tmp, name)
        except BaseException:
            with contextlib.suppress(OSError):
                self.remove(tmp)
            raise

    # -- changing -------------------------------------------------------------

    def replace(self, src: str, dst: str) -> None:
        """Rename `src` to `dst`, both paths below this folder; a link on the way to either is refused."""
        with self._parent(src) as (sfd, sleaf), self._parent(dst) as (dfd, dleaf):
            os.replace(sleaf, dleaf, src_dir_fd=sfd, dst_dir_fd=dfd)

    def remove(self, name: str) -> None:
        """Delete the file or folder `name`: a folder's contents are removed through descriptors, never
        following a link inside it; `name` itself being a link is refused."""
        with self._parent(name) as (fd, leaf):
            st = os.stat(leaf, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise link_refusal(self.root, str(self.rel / name), self.key)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(leaf, dir_fd=fd)
            else:
                os.unlink(leaf, dir_fd=fd)

    def mkdir(self, name: str) -> None:
        """Make the folder `name` (and what is missing above it) unless it exists as a folder."""
        self.sub(name, create=True).close()

    # -- lifetime -------------------------------------------------------------

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace the file `path` with `text` atomically (`Folder.write_bytes`), making its folder if missing."""
    path = Path(path)
    with Folder.open(path.parent, create=True) as folder:
        folder.write_text(path.name, text)


def atomic_write_json(path: str | Path, obj: object) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """A fresh folder (its path through the open descriptor) that replaces `path` only if the block succeeds."""
    path = Path(path)
    with Folder.open(path.parent, create=True) as parent, parent.new_dir(path.name) as folder:
        yield folder.path()
