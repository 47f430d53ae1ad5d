"""The `parity` command's stop signals where its command's own handler is not yet or no longer in place: as the
commands are imported (a second or more), and as the interpreter exits; and a signal ignored where it starts
(nohup's SIGHUP) stays ignored. Each signal is sent by the process to itself at a chosen point, not timed."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

MISSING_RUN = "/nonexistent/parity-run"  # `parity report` of it: refused in one line, exit 2


def _parity(hook: str, sig: signal.Signals, ignored: signal.Signals | None = None) -> subprocess.CompletedProcess:
    """`parity report MISSING_RUN` through `parity.__main__.main`, sending itself `sig` at `hook`: as the commands
    start to be imported ("import"), or once the command has returned ("exit"); `ignored` is ignored before."""
    script = textwrap.dedent(
        f"""
        import atexit, builtins, os, signal, sys
        if {int(ignored or 0)}:
            signal.signal({int(ignored or 0)}, signal.SIG_IGN)
        sys.argv = ["parity", "report", {MISSING_RUN!r}]
        send = lambda: os.kill(os.getpid(), {int(sig)})
        if {hook!r} == "import":
            real = builtins.__import__
            def hooked(name, *args, **kwargs):
                if name == "parity.cli":
                    send()
                return real(name, *args, **kwargs)
            builtins.__import__ = hooked
        else:
            atexit.register(send)
        from parity.__main__ import main
        raise SystemExit(main())
        """
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_as_the_commands_are_imported_is_one_line(sig):
    """It was a KeyboardInterrupt traceback of 15-70 lines (SIGINT), or a death with no line (SIGTERM, SIGHUP)."""
    done = _parity("import", sig)
    assert done.returncode == 128 + sig, done.stderr
    assert done.stderr.strip() == f"parity report: stopped by {sig.name} as it started"


def test_a_stop_signal_as_the_interpreter_exits_leaves_the_commands_exit_code():
    done = _parity("exit", signal.SIGTERM)
    assert done.returncode == 2 and done.stderr.strip().startswith("parity report: error:"), done.stderr


def test_a_signal_ignored_where_parity_starts_stays_ignored():
    """`nohup parity train ...`: the run went on past the terminal's hangup only until the hangup came."""
    done = _parity("import", signal.SIGHUP, ignored=signal.SIGHUP)
    assert done.returncode == 2 and done.stderr.strip().startswith("parity report: error:"), done.stderr


def _counted(signals: list[int]) -> subprocess.CompletedProcess:
    """A command's `StopSignals` in place, and its wakeup pipe given the bytes Python's C handler writes for
    `signals` (one each, as they arrive): what its count makes of them when Python ran no handler yet."""
    script = textwrap.dedent(
        f"""
        import os, signal, time
        from parity.stopping import StopSignals
        with StopSignals("test").installed():
            fd = signal.set_wakeup_fd(-1)
            signal.set_wakeup_fd(fd)
            os.write(fd, bytes({[int(s) for s in signals]!r}))
            time.sleep(2)
        print("went on")
        """
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)


def test_two_stop_signals_that_python_merged_stop_at_once():
    """A double Ctrl-C while the driver waited in Ray's native code ran the handler once: the run went on to the
    end of its step. Each signal is counted as it comes."""
    done = _counted([signal.SIGTERM, signal.SIGTERM])
    assert done.returncode == 128 + signal.SIGTERM and done.stdout == "", done.stderr
    assert done.stderr.strip() == "parity test: stopped by SIGTERM at once"
    done = _counted([signal.SIGALRM, signal.SIGTERM])  # a reward's time limit and one stop: not two stops
    assert done.returncode == 0 and done.stdout.strip() == "went on", done.stderr
