"""Distributed training on real Ray actors and a real torch.distributed (gloo) FSDP2 learner group."""

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
import torch

from conftest import ONE_RAY_AT_A_TIME, SMALL, metrics
from parity import config
from parity.cli import main
from parity.config import ConfigError
from parity.distributed.actors import RolloutWorker
from parity.distributed.driver import RayBackend
from parity.distributed.sync import SyncError, pack_weights
from parity.engines import kernels
from parity.engines.batch import concat_batches
from parity.engines.models.io import load_model, resolve_model_dir
from parity.engines.sampler import Sampler
from parity.engines.sampling import SamplingParams
from parity.engines.trainer import OptimConfig, Trainer
from parity.rl.checkpoint import _write_manifest, load_checkpoint, save_shards
from parity.rl.loop import Run, TrainingError
from parity.rl.train_config import TrainConfig

pytestmark = ONE_RAY_AT_A_TIME  # tests/conftest.py

UNTIMED = ("time/", "perf/", "async/", "sync/", "faults/")
ROUND_OFF = ("mismatch/", "gap/", "kappa/", "beta/", "alpha/", "full_vocab/")  # μ − π in FP32 is itself round-off


def _trained(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(UNTIMED)} for m in metrics]


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["distributed.learners=2"], "needs distributed.rollout_workers >= 1"),
        (["async.max_staleness=1"], "asynchronous training needs rollout workers"),
        (["distributed.rollout_workers=1", "distributed.learners=3"], "must divide the rows of a mini-batch"),
        (["distributed.rollout_workers=9"], "more than prompts_per_step"),
        (["async.max_staleness=-1"], r"async\.max_staleness"),
    ],
)
def test_bad_distributed_combinations_are_refused_before_any_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.load(TrainConfig, None, SMALL + overrides)


# ----------------------------------------------------------------------------- pieces


def test_concat_batches_keeps_rows_and_groups():
    model_dir = resolve_model_dir("builtin")
    model = load_model(model_dir, kernels.numerics())
    sampler = Sampler(
        model.config,
        "fp32",
        "fp32",
        (2,),
        0,
        score_old=True,
        probe=False,
        micro_batch_tokens=8192,
        numerics=kernels.numerics(),
    )
    sampler.load_weights({k: v for k, v in model.state_dict().items()}, 0)
    sampling = SamplingParams(max_new_tokens=12, top_k=8)
    a = sampler.generate([[5, 6, 7]], 2, sampling, seed=1)
    b = sampler.generate([[5, 6], [9, 9, 9, 9]], 3, sampling, seed=2)
    for part in (a, b):
        sampler.score_samples(part)
    both = concat_batches([a, b])
    assert both.response_ids.shape[0] == 2 + 6
    assert both.group_index.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert both.num_tokens == a.num_tokens + b.num_tokens
    assert torch.equal(both.rollout_logprobs[2:, : b.response_ids.shape[1]], b.rollout_logprobs)
    assert torch.equal(both.old_logprobs[:2, : a.response_ids.shape[1]], a.old_logprobs)
    assert (both.support[:2, a.support.shape[1] :] == -1).all()


def test_weight_sync_verification_names_the_damaged_tensor():
    """A worker loads a sync, checks both of its copies, and refuses one damaged in transit."""
    model_dir = resolve_model_dir("builtin")
    state = {k: v for k, v in load_model(model_dir, kernels.numerics()).named_parameters()}
    bf16 = config.load(TrainConfig, None, ["precision=bf16"])
    worker = RolloutWorker(0, str(model_dir), bf16, threads=None)
    tensors, manifest = pack_weights(state, 3, "bf16", "bf16")
    assert manifest.wire_dtype == "bfloat16" and manifest.engine == manifest.scorer
    assert worker.load_weights(tensors, manifest)["verified"] == 1.0
    assert worker.sampler.weight_version == 3

    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][3, 5] += 1.0  # one value damaged after the checksums were taken
    with pytest.raises(SyncError, match=re.escape(f"v3: {name} in rollout worker 0 (rollout engine)")):
        worker.load_weights(tensors, manifest)

    # Mixed precisions send FP32 (the π_old scorer needs the master weights) with two checksum sets.
    tensors, manifest = pack_weights(state, 4, "bf16", "fp32")
    assert manifest.wire_dtype == "float32" and manifest.engine != manifest.scorer
    mixed = ["rollout.precision=bf16", "trainer.precision=fp32", "allow_precision_mismatch=true"]
    mixed.append("algorithm.probe=true")
    worker = RolloutWorker(1, str(model_dir), config.load(TrainConfig, None, mixed), threads=None)
    assert worker.load_weights(tensors, manifest)["verified"] == 1.0


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.parametrize("kl", [[], ["algorithm.kl_coef=0.1"]], ids=["", "kl-to-the-reference"])
def test_two_fsdp2_learners_match_one_process(tmp_path, kl, ray_cluster):
    """Synchronous, FP32, same seed: 1 worker + 2 FSDP2 learners (gloo) against one process, 10 steps; with
    a KL loss, the learners hold their own sharded reference model."""
    common = SMALL + ["precision=fp32", "steps=10", "checkpoint_every=-1", "algorithm.name=grpo", *kl]
    assert main(["train", f"run_dir={tmp_path / 'one'}", *common]) == 0
    two = ["distributed.rollout_workers=1", "distributed.learners=2"]
    assert main(["train", f"run_dir={tmp_path / 'two'}", *common, *two]) == 0
    one, dist = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert len(one) == len(dist) == 10
    assert all(m["sync/verified"] == 1 and m["async/staleness_max"] == 0 for m in dist)
    worst = 0.0
    for a, b in zip(_trained(one), _trained(dist)):
        assert a.keys() == b.keys()
        for key in a:
            if key in ("train/old_logprob_pass", "mismatch/exact_tokens_frac") or key.endswith("adv_corr"):
                continue  # one process scores π_old in its first pass; counts and correlations of round-off
            if key.startswith(ROUND_OFF):  # differences of FP32 log-probs: round-off on both sides
                assert abs(a[key] - b[key]) <= 5e-5, (a["step"], key, a[key], b[key])
                continue
            worst = max(worst, abs(a[key] - b[key]) / max(abs(a[key]), 1e-6))
            # The KL term's gradient, a difference of nearby log-probs, carries more of the round-off over 10 steps.
            assert a[key] == pytest.approx(b[key], rel=3e-5 if kl else 1e-5, abs=1e-8), (a["step"], key)
    print(f"largest relative difference over 10 steps (losses, grad norms, rewards, clip, IS): {worst:.2e}")
    if kl:
        assert all(m["loss/kl"] > 0 for m in dist[1:])  # the policy has moved from the reference


EXACT = ["exact=true", "precision=fp16", "distributed.rollout_workers=1", "distributed.learners=2"]


@pytest.mark.parametrize("staleness", [0, 1])
def test_exact_mode_with_a_worker_and_two_learners(tmp_path, staleness, ray_cluster):
    """μ = π_old for every token and every checked distribution on the worker; at staleness 0 the learners'
    first π_θ pass is π_old's bits too (checked before they step: the run would stop)."""
    overrides = [f"run_dir={tmp_path / 'run'}", *SMALL, *EXACT, f"async.max_staleness={staleness}", "steps=3"]
    history = Run.create(config.load(TrainConfig, None, overrides), progress=False, backend=RayBackend).train()
    assert [m["mismatch/exact_tokens_frac"] for m in history] == [1.0] * 3
    assert all(m["full_vocab/max_abs_log_ratio"] == 0.0 and m["sync/verified"] == 1 for m in history)
    assert [m["async/staleness_max"] for m in history] == ([0, 0, 0] if staleness == 0 else [0, 1, 1])


def _break(numerics_of):
    """A closure for `__ray_call__` that puts an actor's engine or model on the non-exact numerics."""
    from parity.engines import kernels

    def run(actor):
        numerics_of(actor).numerics = kernels.numerics()

    return run


@pytest.mark.parametrize("where", ["worker", "learner"])
def test_exact_mode_fails_closed_on_a_worker_or_a_learner(tmp_path, where, ray_cluster):
    """A worker's engine or one learner's model forced off exact mode: the step stops before any learner's
    optimizer steps, naming where, and every learner still holds the weights it started with."""
    import ray

    overrides = [f"run_dir={tmp_path / 'run'}", *SMALL, *EXACT, "steps=2", "eval.every=-1"]
    run = Run.create(config.load(TrainConfig, None, overrides), progress=False, backend=RayBackend)
    try:
        start = {n: t.clone() for n, t in run.trainer.full_weights().items()}
        if where == "worker":
            ray.get(run.backend.workers[0].__ray_call__.remote(_break(lambda w: w.sampler.engine)))
            message = "sampled tokens have μ != π_old on rollout worker 0"
        else:
            ray.get(run.backend.learners[1].__ray_call__.remote(_break(lambda learner: learner.trainer.model)))
            message = "first π_θ pass differs from π_old"
        with pytest.raises(TrainingError, match=f"step 1: exact=true, but .*{message}"):
            run.step()
        run.backend.gather()
        assert run.trainer.weight_version == 0
        assert all(torch.equal(t, start[n]) for n, t in run.trainer.full_weights().items())
    finally:
        run.close()


@contextlib.contextmanager
def _cpu_hog(processes: int):
    """Busy processes beside the run, as on a loaded machine."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.mark.slow
@pytest.mark.parametrize("hogs", [0, 2], ids=["idle", "beside-2-busy-processes"])
def test_a_killed_rollout_worker_is_restarted_and_no_sample_is_lost(tmp_path, hogs):
    cfg = config.load(
        TrainConfig,
        None,
        SMALL
        + [f"run_dir={tmp_path / 'r'}", "steps=5", "checkpoint_every=-1"]
        + ["distributed.rollout_workers=1", "async.max_staleness=1"],
    )
    run = Run.create(cfg, progress=False, backend=RayBackend)
    history = []
    try:
        with _cpu_hog(hogs):
            for step in range(cfg.steps):
                if step == 2:
                    os.kill(run.backend.worker_pids[0], signal.SIGKILL)
                    time.sleep(0.5)
                history.append(run.step())
    finally:
        run.close()
    assert [m["step"] for m in history] == [1, 2, 3, 4, 5]
    assert history[-1]["faults/worker_restarts"] == 1
    assert all(m["train/samples"] == 8 * 4 for m in history)  # every step trained a whole batch, once
    assert run.backend.data_position == 5 * 8  # each step's prompts taken once: none repeated, none skipped
    assert all(m["async/staleness_max"] <= 1 and m["sync/verified"] == 1 for m in history)


@pytest.mark.slow
def test_a_worker_still_restarting_after_the_limit_stops_the_run_and_names_the_key(tmp_path):
    cfg = config.load(
        TrainConfig,
        None,
        SMALL
        + [f"run_dir={tmp_path / 'r'}", "steps=3", "checkpoint_every=-1", "distributed.restart_timeout_s=0.001"]
        + ["distributed.rollout_workers=1", "async.max_staleness=0"],
    )
    run = Run.create(cfg, progress=False, backend=RayBackend)
    try:
        run.step()
        os.kill(run.backend.worker_pids[0], signal.SIGKILL)
        with pytest.raises(TrainingError, match=r"still restarting it after \d+ s .*distributed.restart_timeout_s"):
            run.step()
    finally:
        run.close()


@pytest.mark.slow
@pytest.mark.parametrize("numerics", [["precision=fp32"], ["precision=fp16", "exact=true"]], ids=["fp32", "exact-fp16"])
def test_a_dead_learner_stops_the_run_and_resume_reproduces_it(tmp_path, numerics):
    """Staleness 0: the run resumed from its sharded checkpoint equals the uninterrupted one line for line
    (in exact mode too: every step's μ = π_old, and its metrics, the same)."""
    common = SMALL + [*numerics, "steps=4", "checkpoint_every=2"]
    common += ["distributed.rollout_workers=1", "distributed.learners=2", "async.max_staleness=0"]
    assert main(["train", f"run_dir={tmp_path / 'whole'}", *common]) == 0

    run = Run.create(
        config.load(TrainConfig, None, [*common, f"run_dir={tmp_path / 'cut'}"]), False, backend=RayBackend
    )
    try:
        for _ in range(2):
            run.log.log(run.step())
        run.checkpoint()
        learner_pid = __import__("ray").get(run.backend.learners[1].pid.remote())
        os.kill(learner_pid, signal.SIGKILL)
        with pytest.raises(TrainingError, match=r"a learner process died.*--resume"):
            run.step()
    finally:
        run.close()
    shards = sorted(p.name for p in (tmp_path / "cut" / "checkpoints" / "step_000002" / "sharded").iterdir())
    assert shards == ["__0_0.safetensors", "__1_0.safetensors", "metadata.json"]  # one per learner, and the index
    assert main(["train", "--resume", str(tmp_path / "cut")]) == 0
    assert _trained(metrics(tmp_path / "cut")) == _trained(metrics(tmp_path / "whole"))
    if "exact=true" in numerics:
        assert all(m["mismatch/exact_tokens_frac"] == 1.0 for m in metrics(tmp_path / "cut"))


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_with_another_learner_count(tmp_path, ray_cluster):
    """Saved by 2 learners, resumed by 1 (DCP reshards): the run goes on as the uninterrupted 2-learner run,
    to the round-off that splitting the gradient's sum between learners makes; one process reads it too."""
    common = SMALL + ["precision=fp32", "steps=4", "checkpoint_every=2", "algorithm.name=grpo", "eval.every=-1"]
    common += ["distributed.rollout_workers=1", "distributed.learners=2"]
    assert main(["train", f"run_dir={tmp_path / 'whole'}", *common]) == 0
    assert main(["train", f"run_dir={tmp_path / 'cut'}", *common, "steps=2"]) == 0
    run = Run.resume(tmp_path / "cut", ["steps=4", "distributed.learners=1"], backend=RayBackend)
    try:
        # The learner read its shards in place: the driver, which never read the trained weights, still
        # holds the base model's; gathered from the learner they are the checkpoint's.
        base = load_model(resolve_model_dir("builtin"), kernels.numerics()).state_dict()
        assert all(torch.equal(w, base[n]) for n, w in run.trainer.model.state_dict().items())
        run.backend.gather()
        saved = Trainer(load_model(resolve_model_dir("builtin"), kernels.numerics()), "fp32", OptimConfig())
        load_checkpoint(tmp_path / "cut" / "checkpoints" / "step_000002", saved)
        restored = saved.model.state_dict()
        assert all(torch.equal(w, restored[n]) for n, w in run.trainer.model.state_dict().items())
        assert any(not torch.equal(w, base[n]) for n, w in restored.items())
        run.train()
    finally:
        run.close()
    whole, cut = _trained(metrics(tmp_path / "whole")), _trained(metrics(tmp_path / "cut"))
    assert cut[:2] == whole[:2] and len(cut) == 4
    for a, b in zip(whole[2:], cut[2:]):
        for key in a:
            if key.startswith(ROUND_OFF) or key.endswith("adv_corr"):
                continue
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-8), (a["step"], key)

    # One process reads the shards too (parity eval, a resume into the driver's full copy).
    trainer = Trainer(load_model(resolve_model_dir("builtin"), kernels.numerics()), "fp32", OptimConfig())
    state = load_checkpoint(tmp_path / "whole" / "checkpoints" / "step_000004", trainer)
    assert state.step == 4 and trainer.weight_version == 4 and len(trainer.optimizer.state) == len(trainer.params)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_shards_holding_nan_are_set_aside_and_the_learners_start_from_the_base(tmp_path, capsys, ray_cluster):
    """A checkpoint whose shards hold NaN (its manifest matching): the learners read it in place, the resume
    sets it aside, and the run starts again from step 0 with the base weights on the learners."""
    common = SMALL + ["precision=fp32", "steps=1", "checkpoint_every=1", "eval.every=-1"]
    common += ["distributed.rollout_workers=1", "distributed.learners=2"]
    assert main(["train", f"run_dir={tmp_path / 'r'}", *common]) == 0
    ckpt = tmp_path / "r" / "checkpoints" / "step_000001"
    trainer = Trainer(load_model(resolve_model_dir("builtin"), kernels.numerics()), "fp32", OptimConfig())
    load_checkpoint(ckpt, trainer)
    with torch.no_grad():
        trainer.model.model.norm.weight[0] = float("nan")
    shutil.rmtree(ckpt / "sharded")
    save_shards(trainer, ckpt / "sharded")
    (ckpt / "manifest.json").unlink()
    _write_manifest(ckpt)
    capsys.readouterr()

    run = Run.resume(tmp_path / "r", backend=RayBackend)
    try:
        err = capsys.readouterr().err
        assert "checkpoint step_000001 is unusable" in err and "inf/NaN in model.norm.weight" in err
        assert "starting again from step 0" in err and run.step_count == 0
        assert (tmp_path / "r" / "checkpoints" / "corrupt" / "step_000001").is_dir()
        run.backend.gather()
        base = load_model(resolve_model_dir("builtin"), kernels.numerics()).state_dict()
        assert all(torch.equal(w, base[n]) for n, w in run.trainer.model.state_dict().items())
    finally:
        run.close()


# ----------------------------------------------------------------------------- a user's own cluster


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    argv += [f"distributed.address={address}", "distributed.connect_timeout_s=8"]
    start = time.monotonic()
    done = subprocess.run(argv, env=_ray_env(ray_tmp), capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - start
    lines = [x for x in done.stderr.splitlines() if x.startswith("parity ")]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"distributed.address={address}: cannot join a Ray cluster there" in lines[0]
    assert elapsed < 8 + 60 and not run_dir.exists()  # the timeout, and the model's load before it


@pytest.mark.slow
def test_sigterm_ends_a_join_at_once(tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "parity", "train", f"run_dir={run_dir}", *JOIN]
    argv += ["distributed.address=127.0.0.1:1", "distributed.connect_timeout_s=600"]
    proc = subprocess.Popen(argv, env=_ray_env(tmp_path), stderr=subprocess.PIPE, text=True)
    time.sleep(15)  # the model loaded; the run waits on the join
    assert proc.poll() is None
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 143 and time.monotonic() - sent < 10, err
    assert "stopped by SIGTERM before the run started" in err and "Traceback" not in err
    assert not run_dir.exists()
    probes = subprocess.run(["pgrep", "-f", "parity.distributed.cluster --probe 127.0.0.1:1"], capture_output=True)
    assert probes.stdout.strip() == b""  # the joining child went with it


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


def processes_with(name: str, value: str) -> list:
    """The processes whose environment sets `name` to `value`: those a process started with it started, and
    what they started (a Ray worker renames itself, but keeps its environment), nobody else's."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(name) == value:
                found.append(proc)
    return found


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
