"""How a command stops on a signal, and how the worker processes it started stop with it.

Every `parity` command runs under `StopSignals` (`parity.cli.main`): SIGINT (Ctrl-C), SIGTERM and
SIGHUP. The first is noted and the command stops cleanly: by `Stopped` raised where it is, which
unwinds through the `finally` blocks that stop its workers, or, inside `deferred` (a training run:
Ray's driver code cannot take an exception raised into it), after the run's step under way;
`parity train` always stops there, with a checkpoint (`parity.cli.train`). It ends with one line
and exit code 128 + the signal. A second signal stops the process at once.

Every worker process Parity starts calls `worker_started` first. It dies with the process that
started it, however that ends, SIGKILL included (Linux's parent-death signal). And it leaves the
stop signals to its command, which stops it: a terminal's Ctrl-C or hangup, `timeout` and systemd
signal the whole process group, and a worker that died of it mid-call would look to its command
like a crash (a lost training run, a failed reward). Ray's processes are the reaper's
(`parity.distributed.cluster`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def taken_signals() -> list[int]:
    """The stop signals a command takes: those not ignored (SIG_IGN) where it runs."""
    return [s for s in STOP_SIGNALS if signal.getsignal(s) != signal.SIG_IGN]


class Stopped(BaseException):
    """A stop signal, raised where the command was. A BaseException, as KeyboardInterrupt is: no
    `except Exception` that handles a failure takes it for one."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """The stop signals of one command, once `installed`. The first is noted (`signum`) and `first` acts
    on it: here it raises `Stopped`, or inside `deferred` says when the command will stop. A second prints
    `stopped_line(at_once=True)` and ends the process at once; its workers die with it."""

    def __init__(self, command: str):
        self.command = command
        self.signum: int | None = None
        self.deferred_until: str | None = None  # inside `deferred`: when the command stops
        self._at_once = threading.Lock()  # the handler and `_count` may both see a second signal

    def __call__(self, signum: int, _frame) -> None:
        first = self.signum is None
        self.signum = signum
        if first:
            self.first()
            return
        self._stop_at_once(signum)

    def _stop_at_once(self, signum: int) -> None:
        with self._at_once:
            self.signum = self.signum or signum
            print(f"\nparity {self.command}: {self.stopped_line(at_once=True)}", file=sys.stderr, flush=True)
            os._exit(128 + signum)

    def _count(self, read_fd: int) -> None:
        """Count the stop signals as they come: `signal.set_wakeup_fd` writes a byte per signal, where Python
        runs its handler once for two of a kind that come before it can (a double Ctrl-C while the driver waits
        in Ray's native code). The second stops the process at once. Ends at a 0 byte (`installed`'s end: a
        forked worker holds the pipe open, so its end would come only as the interpreter exits, too late for a
        thread to wake in) or at the pipe's end."""
        seen = 0
        with open(read_fd, "rb", buffering=0) as pipe:
            while (chunk := pipe.read(64)) and 0 not in chunk:
                seen += sum(byte in STOP_SIGNALS for byte in chunk)
                if seen >= 2:
                    self._stop_at_once(next(byte for byte in reversed(chunk) if byte in STOP_SIGNALS))

    def first(self) -> None:
        if self.deferred_until is None:
            raise Stopped(self.signum)
        name = signal.Signals(self.signum).name
        print(
            f"\nparity {self.command}: {name}: stopping {self.deferred_until}; send it again to stop at once",
            file=sys.stderr,
        )

    def stopped_line(self, at_once: bool = False) -> str:
        return f"stopped by {signal.Signals(self.signum).name}{' at once' if at_once else ''}"

    @contextlib.contextmanager
    def installed(self):
        """Take the stop signals for the block; one ignored as the command started stays so (`nohup`'s SIGHUP:
        a run meant to outlive its terminal)."""
        previous = {s: signal.signal(s, self) for s in taken_signals()}
        _installed.append(self)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        counter = threading.Thread(target=self._count, args=(read_fd,), name="stop-signals", daemon=True)
        try:
            previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:  # not the main thread, whose handlers these are not either
            previous_fd = None
            os.close(read_fd)
        else:
            counter.start()
        try:
            yield self
        finally:
            _installed.remove(self)
            for s, handler in previous.items():
                signal.signal(s, handler)
            if previous_fd is not None:
                signal.set_wakeup_fd(previous_fd)
                with contextlib.suppress(OSError):  # a full pipe: the counter is reading it
                    os.write(write_fd, b"\0")
                counter.join(timeout=5)
            os.close(write_fd)


_installed: list[StopSignals] = []  # the handlers in place, the one in force last


def _uncounted() -> None:
    """In a forked child, at once: its signals are not its command's to count (`StopSignals._count`), which a
    Ctrl-C to the process group, reaching a reward worker as it forked, made two and a stop at once."""
    with contextlib.suppress(ValueError):  # forked from another thread than the main one: Python set none
        signal.set_wakeup_fd(-1)


os.register_at_fork(after_in_child=_uncounted)


def requested() -> bool:
    """A stop signal has come (and was noted, inside `deferred`)."""
    return bool(_installed) and _installed[-1].signum is not None


@contextlib.contextmanager
def deferred(until: str):
    """A block that a stop signal must not be raised into (a training run: raised into Ray's driver code, it
    ends in Ray's SystemError and a traceback). A first signal is only noted there, said to stop the command
    `until` (the block asks `requested()` at its safe points), and raised as `Stopped` when the block ends."""
    handler = _installed[-1] if _installed else None
    if handler is None or handler.deferred_until is not None:  # no command's handler, or deferred already
        yield
        return
    handler.deferred_until = until
    try:
        yield
    finally:
        handler.deferred_until = None
    if handler.signum is not None:
        raise Stopped(handler.signum)


def _left_to_the_command(_signum: int, _frame) -> None:
    """A worker's stop signals: its command stops it. A handler that does nothing, not SIG_IGN, which the
    programs a worker runs (a reward's sandbox) would inherit."""


def worker_started(parent_pid: int, die_with_parent: bool = True) -> None:
    """The first call of a worker process started by `parent_pid`: leave the stop signals to the command
    (a forked worker would otherwise run the command's handler), and with `die_with_parent`, die with it."""
    for s in STOP_SIGNALS:
        signal.signal(s, _left_to_the_command)
    if die_with_parent:
        _die_with(parent_pid)


def _die_with(parent_pid: int) -> None:
    """Have Linux SIGKILL this process when the thread that started it exits (elsewhere a no-op), and
    end it now if `parent_pid` is gone already, before the signal was asked for."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL))
    except (OSError, AttributeError):  # no usable libc
        return
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)  # as the death signal would have
