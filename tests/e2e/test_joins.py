"""A run on a user's Ray cluster (`distributed.address`): joining one, leaving it running, and the joins
that cannot succeed. The tests that start a cluster run ONE_RAY_AT_A_TIME; a join that fails starts no
Ray process, so those run beside anything."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ONE_RAY_AT_A_TIME, SMALL, metrics, processes_with
from parity.cli import main


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@ONE_RAY_AT_A_TIME
@pytest.mark.slow
def test_a_run_joins_a_users_cluster_and_leaves_it_running(tmp_path):
    """`ray start --head` as a user runs it (token authentication on, Ray's default since 2.59), then
    `parity train distributed.address=HOST:PORT`: the run trains on that cluster, takes nothing of it
    along when it ends, and the cluster keeps running, with all its CPUs free again."""
    import secrets

    ray_cli = str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    env.pop("RAY_ADDRESS", None)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    start = [ray_cli, "start", "--head", f"--port={port}", "--num-cpus=3", "--include-dashboard=false"]
    started = subprocess.run([*start, "--disable-usage-stats"], env=env, capture_output=True, text=True)
    assert started.returncode == 0, started.stderr
    try:
        head = subprocess.run(["pgrep", "-f", f"gcs_server.*--gcs_server_port={port}"], capture_output=True, text=True)
        gcs_pids = set(head.stdout.split())
        assert gcs_pids
        run_dir = tmp_path / "run"
        train = [sys.executable, "-m", "parity", "train", f"run_dir={run_dir}", *SMALL, "steps=2"]
        train += ["distributed.rollout_workers=1", "distributed.learners=1", f"distributed.address={address}"]
        done = subprocess.run(train, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        assert len(metrics(run_dir)) == 2
        # Without the token setting the join is refused in one line that says what to set.
        refused = subprocess.run(
            [*train[:4], f"run_dir={tmp_path / 'refused'}", *train[5:]],
            env={k: v for k, v in env.items() if not k.startswith("RAY_AUTH")},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        assert "RAY_AUTH_MODE=token" in refused.stderr.strip().splitlines()[-1]
        assert not (tmp_path / "refused").exists()
        # The user's cluster: the same head, still answering, and every CPU free once the run's actors are gone.
        deadline = time.monotonic() + 30
        while True:
            status = subprocess.run(
                [ray_cli, "status", f"--address={address}"], env=env, capture_output=True, text=True
            )
            assert status.returncode == 0, status.stderr
            if re.search(r"\b0\.0/3\.0 CPU", status.stdout) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert re.search(r"\b0\.0/3\.0 CPU", status.stdout), status.stdout
        head = subprocess.run(["pgrep", "-f", f"gcs_server.*--gcs_server_port={port}"], capture_output=True, text=True)
        assert set(head.stdout.split()) == gcs_pids
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True)


@ONE_RAY_AT_A_TIME
@pytest.mark.slow
def test_a_stray_ray_address_does_not_redirect_a_local_run(tmp_path, monkeypatch):
    """RAY_ADDRESS left in the environment (here: nothing listens there) does not change where a run
    without distributed.address computes: it starts its own cluster as always."""
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_free_port()}")
    args = [f"run_dir={tmp_path / 'run'}", *SMALL, "steps=1", "distributed.rollout_workers=1"]
    assert main(["train", *args]) == 0


# ----------------------------------------------------------------------------- joins that cannot succeed

JOIN = [*SMALL, "steps=1", "distributed.rollout_workers=1", "distributed.learners=1"]


def _ray_env(ray_tmp: Path) -> dict[str, str]:
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp)}  # where `auto` looks for the last `ray start`
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.mark.slow
@pytest.mark.parametrize("address", ["127.0.0.1:1", "not-a-host:6379", "auto"])
def test_a_join_that_cannot_succeed_is_one_line_within_the_timeout(address, tmp_path):
    """Ray's client retries for ever where no cluster answers; the join is given connect_timeout_s. `auto`
    here finds a stale record of a cluster that is gone (as `ray start` leaves it after a crash)."""
    ray_tmp = tmp_path / "raytmp"
    (ray_tmp / "ray").mkdir(parents=True)
    (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{_free_port()}\n")
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "parity", "train", f"run_dir={run_dir}", *JOIN]
    argv += [f"distributed.address={address}", "distributed.connect_timeout_s=3"]
    done = subprocess.run(argv, env=_ray_env(ray_tmp), capture_output=True, text=True, timeout=300)
    lines = [x for x in done.stderr.splitlines() if x.startswith("parity ")]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"distributed.address={address}: cannot join a Ray cluster there" in lines[0]
    assert not run_dir.exists()


@pytest.mark.slow
def test_sigterm_ends_a_join_at_once(tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "parity", "train", f"run_dir={run_dir}", *JOIN]
    argv += ["distributed.address=127.0.0.1:1", "distributed.connect_timeout_s=600"]
    proc = subprocess.Popen(argv, env=_ray_env(tmp_path), stderr=subprocess.PIPE, text=True)
    probe = ["pgrep", "-f", "parity.distributed.cluster --probe 127.0.0.1:1"]
    deadline = time.monotonic() + 120
    while subprocess.run(probe, capture_output=True).returncode != 0:  # the model loaded; the run waits on the join
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "no join began within 120 s"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]  # the join's own timeout is 600 s: ending here is ending at once
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM before the run started" in err and "Traceback" not in err
    assert not run_dir.exists()
    assert subprocess.run(probe, capture_output=True).stdout.strip() == b""  # the joining child went with it


@ONE_RAY_AT_A_TIME
@pytest.mark.slow
def test_a_cluster_with_too_few_cpus_is_named_not_waited_on(tmp_path):
    """A user's cluster of 1 CPU, joined by address and by `auto`: the run needs 2 (a worker and a learner)
    and is refused in one line; the cluster is the user's and keeps running. Only its own processes are
    stopped afterwards (they are the ones whose command line names its temporary folder)."""
    import secrets

    ray_tmp = Path(tempfile.mkdtemp(prefix="pr", dir="/tmp"))  # Ray's socket paths must stay short
    env = {**_ray_env(ray_tmp), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    ray_cli = str(Path(sys.executable).with_name("ray"))
    port = _free_port()
    start = [ray_cli, "start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false"]
    started = subprocess.run([*start, "--disable-usage-stats"], env=env, capture_output=True, text=True)
    try:
        assert started.returncode == 0, started.stderr
        for address in (f"127.0.0.1:{port}", "auto"):
            run_dir = tmp_path / f"run-{address.replace(':', '-')}"
            argv = [sys.executable, "-m", "parity", "train", f"run_dir={run_dir}", *JOIN]
            done = subprocess.run(
                [*argv, f"distributed.address={address}"], env=env, capture_output=True, text=True, timeout=300
            )
            lines = [x for x in done.stderr.splitlines() if x.startswith("parity ")]
            assert done.returncode == 2 and len(lines) == 1, done.stderr
            assert "the cluster has 1 free CPUs (1 in all), and the run needs 2" in lines[0]
            assert not run_dir.exists()
        status = subprocess.run([ray_cli, "status", f"--address=127.0.0.1:{port}"], env=env, capture_output=True)
        assert status.returncode == 0
    finally:
        stop_cluster(ray_tmp)


def stop_cluster(ray_tmp: Path) -> None:
    """End the processes of the cluster started with RAY_TMPDIR=`ray_tmp`, and only those: `ray stop`
    would end every Ray process of the machine, others' included."""
    import psutil

    ours = processes_with("RAY_TMPDIR", str(ray_tmp))
    for proc in ours:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(ours, timeout=10)
    shutil.rmtree(ray_tmp, ignore_errors=True)
