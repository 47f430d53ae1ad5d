"""The Ray cluster a run computes on: one of this machine started for the run, or a user's, joined.

A run's own cluster must not outlive it, however the run ends. `ray.shutdown()` covers a run
that ends in Python; a driver killed outright (SIGKILL, the OOM killer, a second Ctrl-C) leaves
Ray's agents running, reparented to init. So a small reaper process, started before the
cluster, keeps a list of the driver's descendants (Ray's processes are all started from it) and
waits on a pipe from the driver: when the pipe closes, the driver is gone, and the reaper kills
every process on its list, and what those started. A run that stops normally shuts Ray down
and dismisses the reaper.

Joining a user's cluster (`distributed.address`) starts nothing and so reaps nothing: that
cluster is the user's and stays as it was.

Run as `python -m parity.distributed.cluster DRIVER_PID`, this module is the reaper.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading

from parity.config import ConfigError

_WATCH_EVERY_S = 1.0  # how often the reaper lists the driver's descendants
_KILL_WAIT_S = 5.0  # for killed processes to be gone


def import_ray():
    """`import ray` for a driver that handles its own signals. Ray's C++ crash handler, once installed in
    this process, takes SIGTERM (a stack dump and an abort) from the Python handler; the variable that
    turns it off is read once, at import, so it is set for this process only: the processes Ray
    starts keep their crash reports."""
    if "ray" not in sys.modules:
        with _environment(RAY_DISABLE_FAILURE_SIGNAL_HANDLER="1"):
            import ray  # noqa: F401
    return sys.modules["ray"]


@contextlib.contextmanager
def _environment(**defaults: str):
    """Environment variables the user has not set, set for the duration of the block only."""
    added = [name for name in defaults if name not in os.environ]
    os.environ.update({name: defaults[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


class LocalCluster:
    """A Ray cluster of this machine, started for one run and ended with it."""

    def __init__(self, num_cpus: int):
        ray = import_ray()

        # The reaper first, in its own session: a Ctrl-C to the terminal's process group must not
        # end it before it has done its work.
        self.reaper = subprocess.Popen(
            [sys.executable, "-m", "parity.distributed.cluster", str(os.getpid())],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            # Ray starts its workers at nice 15; the run's workers and learners are the run, and on a
            # busy machine that priority starved them (a restart took over 120 s beside two busy processes).
            with _sigterm_left_alone(ray), _environment(RAY_worker_niceness="0"):
                ray.init(
                    address="local",  # a new cluster, whatever RAY_ADDRESS says
                    num_cpus=num_cpus,
                    include_dashboard=False,
                    logging_level="ERROR",
                    log_to_driver=True,
                )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Shut Ray down and dismiss the reaper."""
        import ray

        ray.shutdown()
        if self.reaper.poll() is None:
            self.reaper.kill()  # killed, not told: a closed pipe is its signal to reap
            self.reaper.wait()


def join(address: str) -> None:
    """Connect to the user's running cluster at `address` (HOST:PORT, or "auto")."""
    ray = import_ray()
    try:
        with _sigterm_left_alone(ray):
            ray.init(address=address, logging_level="ERROR", log_to_driver=True)
    except ConnectionError as e:
        token = (
            ""
            if os.environ.get("RAY_AUTH_MODE")
            else " If it runs with token authentication (what `ray start` sets up since Ray 2.59), set "
            "RAY_AUTH_MODE=token here too (the token comes from RAY_AUTH_TOKEN or ~/.ray/auth_token)."
        )
        raise ConfigError(
            f"distributed.address={address}: cannot join a Ray cluster there ({e}). Is one running "
            f"(`ray status --address {address}`)?{token}"
        ) from None


@contextlib.contextmanager
def _sigterm_left_alone(ray):
    """`ray.init` in a driver's main thread replaces the SIGTERM handler with `sys.exit`, which unwinds the
    run from wherever it is (inside `ray.init` itself, it leaves a half-started driver that crashes at
    exit). The handler in place (`parity train`'s notes the signal and stops after the step) is kept: Ray's
    hook is skipped while `ray.init` runs, and whatever it set is undone after."""
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    hook = getattr(utils, "set_sigterm_handler", None)
    if hook is not None:
        utils.set_sigterm_handler = lambda handler: None
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if hook is not None:
            utils.set_sigterm_handler = hook
        if before is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, before)


def _reaper_main(driver_pid: int) -> None:
    import psutil

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    seen: dict[int, psutil.Process] = {}  # a Process remembers its start time: a reused pid is not it
    while True:
        try:
            for proc in psutil.Process(driver_pid).children(recursive=True):
                if proc.pid != os.getpid():
                    seen.setdefault(proc.pid, proc)
        except psutil.NoSuchProcess:
            break
        ready, _, _ = select.select([sys.stdin], [], [], _WATCH_EVERY_S)
        if ready and not os.read(sys.stdin.fileno(), 1):
            break  # the driver's end closed: it exited, however it exited
    _kill_all(list(seen.values()))


def _kill_all(procs: list) -> None:
    """SIGKILL `procs` that still run, and everything they started (the run is over: nothing of it
    has work to finish)."""
    import psutil

    alive = []
    for proc in procs:
        try:
            if proc.is_running():
                alive += [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=_KILL_WAIT_S)


if __name__ == "__main__":
    _reaper_main(int(sys.argv[1]))
