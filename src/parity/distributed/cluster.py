"""The Ray cluster a run computes on: one of this machine started for the run, or a user's, joined.

A run's own cluster must not outlive it, however the run ends. `ray.shutdown()` covers a run
that ends in Python; a driver killed outright (SIGKILL, the OOM killer, a second Ctrl-C) leaves
Ray's agents running, reparented to init. So a small reaper process, started before the
cluster, keeps a list of the driver's descendants (Ray's processes are all started from it) and
waits on a pipe from the driver: when the pipe closes, the driver is gone, and the reaper kills
every process on its list, and what those started. A run that stops normally shuts Ray down
and dismisses the reaper.

Joining a user's cluster (`distributed.address`) starts nothing and so reaps nothing: that
cluster is the user's and stays as it was. A join is bounded: Ray's client retries for ever
where no cluster answers (`127.0.0.1:1`, a host that does not resolve, `auto` with a stale
`/tmp/ray/ray_current_cluster`), inside native code that a signal cannot interrupt. So a
child process tries the join first (`python -m parity.distributed.cluster --probe ADDRESS
DRIVER_PID`, which dies with the driver) and is killed after `distributed.connect_timeout_s`;
only once it has joined does this process join, and a cluster with fewer free CPUs than the
run's processes is named, not waited on.

Run as `python -m parity.distributed.cluster DRIVER_PID`, this module is the reaper.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from parity.config import ConfigError
from parity.stopping import STOP_SIGNALS, worker_started

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
        for attempt in range(1, START_ATTEMPTS + 1):
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
                return
            except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception when its node does not come up
                if attempt == START_ATTEMPTS:
                    self.stop()
                    raise ClusterStartError(_cannot_start(e)) from None
                ray.shutdown()  # what did start of this attempt
                print(f"Ray's cluster did not start ({_first_line(e)}); trying once more", file=sys.stderr)
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


class ClusterStartError(RuntimeError):
    """Ray could not start a cluster on this machine for the run."""


# A node that misses Ray's fixed start windows on a busy machine (its agents import slowly) mostly starts
# on the next try; a RAY_TMPDIR too long for socket paths fails every time, in about a second.
START_ATTEMPTS = 2


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _cannot_start(error: Exception) -> str:
    logs = Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray" / "session_latest" / "logs"
    return (
        f"Ray could not start a cluster on this machine in {START_ATTEMPTS} tries ({_first_line(error)}); its logs "
        f"are in {logs}. A machine too busy to start Ray's processes within Ray's 30 s, or a RAY_TMPDIR whose "
        "socket paths exceed 107 bytes, causes this: try again, or run on a cluster you start "
        "(`ray start --head`, then distributed.address=HOST:PORT)"
    )


class JoinInterrupted(Exception):
    """A stop signal (SIGINT, SIGTERM, SIGHUP) came while the run waited to join a cluster: it stops before it
    starts (the signal has also been passed to the handler in place, which noted it)."""


_PROBE_POLL_S = 0.1


def join(address: str, timeout_s: float) -> None:
    """Connect to the user's running cluster at `address` (HOST:PORT, or "auto") within `timeout_s`."""
    ray = import_ray()
    target = _bootstrap_address(address)
    _probe(address, target, timeout_s)
    try:
        with _sigterm_left_alone(ray):
            ray.init(address=target, logging_level="ERROR", log_to_driver=True)
    except ConnectionError as e:
        raise _cannot_join(address, str(e)) from None


def _bootstrap_address(address: str) -> str:
    """HOST:PORT for `address`: "auto" is RAY_ADDRESS when set, else the cluster the last `ray start` on this
    machine recorded (Ray's own rule, without its fallback of joining any Ray process found running)."""
    if address != "auto":
        return address
    from ray._common.utils import get_ray_address_file

    recorded = get_ray_address_file(None)
    found = os.environ.get("RAY_ADDRESS") or (Path(recorded).read_text().strip() if Path(recorded).is_file() else "")
    if not found:
        raise ConfigError(
            f"distributed.address=auto: no cluster was started on this machine with `ray start` (Ray records it "
            f"in {recorded}) and RAY_ADDRESS is not set; give its address as HOST:PORT"
        )
    return found


def _cannot_join(address: str, why: str) -> ConfigError:
    token = (
        ""
        if os.environ.get("RAY_AUTH_MODE")
        else " If it runs with token authentication (what `ray start` sets up since Ray 2.59), set "
        "RAY_AUTH_MODE=token here too (the token comes from RAY_AUTH_TOKEN or ~/.ray/auth_token)."
    )
    return ConfigError(
        f"distributed.address={address}: cannot join a Ray cluster there ({why}). Is one running "
        f"(`ray status --address {address}`)?{token}"
    )


def _probe(address: str, target: str, timeout_s: float) -> None:
    """Join `target` (the HOST:PORT of `address`) from a child process, killed after `timeout_s`; a
    ConfigError when it does not join, JoinInterrupted when a signal comes first."""
    noted: list[int] = []
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}

    def note(signum: int, frame) -> None:
        noted.append(signum)
        if callable(previous[signum]):
            previous[signum](signum, frame)

    probe = subprocess.Popen(
        [sys.executable, "-m", "parity.distributed.cluster", "--probe", target, str(os.getpid())],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # Ray's own retry messages
        start_new_session=True,
        text=True,
    )
    main = threading.current_thread() is threading.main_thread()
    try:
        if main:
            for s in previous:
                signal.signal(s, note)
        deadline = time.monotonic() + timeout_s
        while probe.poll() is None and not noted and time.monotonic() < deadline:
            time.sleep(_PROBE_POLL_S)
    finally:
        if probe.poll() is None:
            os.killpg(probe.pid, signal.SIGKILL)
        probe.wait()
        if main:
            for s, handler in previous.items():
                signal.signal(s, handler)
    if noted:
        raise JoinInterrupted(signal.Signals(noted[0]).name)
    if probe.returncode != 0:
        why = (probe.stdout.read().strip().splitlines() or [""])[-1] if probe.returncode > 0 else ""
        if not why:
            at = f" at {target}" if target != address else ""
            why = f"no Ray cluster answered{at} within distributed.connect_timeout_s={timeout_s:g} s"
        raise _cannot_join(address, why)


def require_cpus(address: str, needed: int) -> None:
    """Refuse a joined cluster with fewer free CPUs than the run's processes (one each): Ray would queue the
    actors until CPUs free up, which may be never."""
    import ray

    free, total = ray.available_resources().get("CPU", 0), ray.cluster_resources().get("CPU", 0)
    if free < needed:
        ray.shutdown()
        raise ConfigError(
            f"distributed.address={address}: the cluster has {free:g} free CPUs ({total:g} in all), and the run "
            f"needs {needed} (one per rollout worker and learner: distributed.rollout_workers + "
            "distributed.learners); free some, or ask for fewer"
        )


def _probe_main(address: str, parent_pid: int) -> None:
    worker_started(parent_pid)  # a join that retries for ever must not outlive a killed run
    ray = import_ray()
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except Exception as e:  # noqa: BLE001 - any failure to join is the answer, in one line
        print(" ".join(f"{type(e).__name__}: {e}".split()), flush=True)
        sys.exit(3)
    ray.shutdown()


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
    if sys.argv[1] == "--probe":
        _probe_main(sys.argv[2], int(sys.argv[3]))
    else:
        _reaper_main(int(sys.argv[1]))
