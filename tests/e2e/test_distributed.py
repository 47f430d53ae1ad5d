"""Distributed training on real Ray actors and a real torch.distributed (gloo) FSDP2 learner group."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ONE_RAY_AT_A_TIME, SMALL, metrics, reseal
from parity import config
from parity.cli import main
from parity.distributed.driver import RayBackend
from parity.engines import kernels
from parity.engines.models.io import load_model, resolve_model_dir
from parity.engines.trainer import OptimConfig, Trainer
from parity.rl.checkpoint import CheckpointError, load_checkpoint, save_shards
from parity.rl.loop import Run, TrainingError
from parity.rl.train_config import TrainConfig

pytestmark = ONE_RAY_AT_A_TIME  # tests/conftest.py

UNTIMED = ("time/", "perf/", "async/", "sync/", "faults/")
ROUND_OFF = ("mismatch/", "gap/", "kappa/", "beta/", "alpha/", "full_vocab/")  # μ − π in FP32 is itself round-off


def _driver_models(run: Run) -> list[str]:
    """The models and trainers the Ray driver's run, backend and run parts hold, by attribute."""
    held = {f"run.{k}": v for k, v in vars(run).items()}
    held.update({f"backend.{k}": v for k, v in vars(run.backend).items()})
    held.update({f"parts.{k}": v for k, v in vars(run.backend.parts).items()})
    return sorted(k for k, v in held.items() if isinstance(v, (torch.nn.Module, Trainer)))


def _trained(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(UNTIMED)} for m in metrics]


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.parametrize(
    "kl", [[], ["algorithm.kl_coef=0.1", "eval.precisions=[bf16]"]], ids=["", "kl-to-the-reference-and-deploy-gap"]
)
def test_two_fsdp2_learners_match_one_process(tmp_path, kl, ray_cluster):
    """Synchronous, FP32, same seed: 1 worker + 2 FSDP2 learners (gloo) against one process, 10 steps and the
    evaluation after them; with a KL loss, the learners hold their own sharded reference model, and the
    deployment gap's KL to the trainer's policy is scored by a model the driver loads for it."""
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
            if key.startswith(("deploy/", "eval/bf16/")):
                continue  # BF16 rounds the FP32 weights: their round-off flips a rounding, and a sampled token
            if key.startswith(ROUND_OFF):  # differences of FP32 log-probs: round-off on both sides
                assert abs(a[key] - b[key]) <= 5e-5, (a["step"], key, a[key], b[key])
                continue
            worst = max(worst, abs(a[key] - b[key]) / max(abs(a[key]), 1e-6))
            # The KL term's gradient, a difference of nearby log-probs, carries more of the round-off over 10 steps;
            # loss/kl itself (about 5e-4) is such a difference, FP32's round-off of log-probs near 1 in size
            # (2e-8 apart on an AMD EPYC, 3.9e-5 of it).
            # Both sides carry round-off of their own, too: FSDP2's learners sum their gradients across processes
            # (1.1e-5 of grad/norm by step 4 on an AMD EPYC, when their matmul kernels also differed).
            abs_tol = 1e-7 if key == "loss/kl" else 1e-8
            assert a[key] == pytest.approx(b[key], rel=3e-5, abs=abs_tol), (a["step"], key)
    print(f"largest relative difference over 10 steps (losses, grad norms, rewards, clip, IS): {worst:.2e}")
    assert "eval/accuracy" in dist[-1]
    if kl:
        assert all(m["loss/kl"] > 0 for m in dist[1:])  # the policy has moved from the reference
        assert dist[-1]["deploy/kl_bf16"] > 0


EXACT = ["exact=true", "precision=fp16", "distributed.rollout_workers=1", "distributed.learners=2"]


@pytest.mark.parametrize("staleness", [0, 1])
def test_exact_mode_with_a_worker_and_two_learners(tmp_path, staleness, ray_cluster):
    """μ = π_old for every token and every checked distribution on the worker; at staleness 0 the learners'
    first π_θ pass is π_old's bits too (checked before they step: the run would stop). Micro-batches of 100
    tokens: the learners' shares pack into different numbers of them, which each learner evens out (one with
    fewer left the other waiting in an FSDP2 gather for ever)."""
    overrides = [f"run_dir={tmp_path / 'run'}", *SMALL, *EXACT, f"async.max_staleness={staleness}", "steps=3"]
    overrides.append("trainer.micro_batch_tokens=100")
    history = Run.create(config.load(TrainConfig, None, overrides), progress=False, backend=RayBackend).train()
    assert [m["mismatch/exact_tokens_frac"] for m in history] == [1.0] * 3
    assert all(m["full_vocab/max_abs_log_ratio"] == 0.0 and m["sync/verified"] == 1 for m in history)
    assert [m["async/staleness_max"] for m in history] == ([0, 0, 0] if staleness == 0 else [0, 1, 1])


def test_episodes_on_a_worker_exact_with_two_learners(tmp_path, ray_cluster):
    """The built-in tool task's episodes run on the rollout worker (its environment imported there): μ =
    π_old for every sampled token of every turn, one step ahead (async.max_staleness=1)."""
    overrides = [
        f"run_dir={tmp_path / 'run'}",
        "model=builtin-agent",
        "task.name=lookup",
        "prompts_per_step=8",
        "rollout.group_size=4",
        *EXACT,
        "async.max_staleness=1",
        "steps=3",
    ]
    history = Run.create(config.load(TrainConfig, None, overrides), progress=False, backend=RayBackend).train()
    assert [m["mismatch/exact_tokens_frac"] for m in history] == [1.0] * 3
    assert all(m["episode/turns_mean"] > 1.5 and m["mismatch/k3_turn1"] == 0.0 for m in history)
    assert [m["async/staleness_max"] for m in history] == [0, 1, 1]


def _break(numerics_of):
    """A closure for `__ray_call__` that puts an actor's engine or model on the non-exact numerics."""
    from parity.engines import kernels

    def run(actor):
        numerics_of(actor).numerics = kernels.numerics()

    return run


@pytest.mark.parametrize("where", ["worker", "learner"])
def test_exact_mode_fails_closed_on_a_worker_or_a_learner(tmp_path, where, ray_cluster):
    """A worker's engine or one learner's model forced off exact mode: the step stops before any learner's
    optimizer steps, naming where, and every learner still holds the weights it started with. (The learners
    also take trainer.activation_checkpointing from the config.)"""
    import ray

    overrides = [f"run_dir={tmp_path / 'run'}", *SMALL, *EXACT, "steps=2", "eval.every=-1"]
    overrides.append("trainer.activation_checkpointing=true")
    run = Run.create(config.load(TrainConfig, None, overrides), progress=False, backend=RayBackend)
    try:
        flag = [
            learner.__ray_call__.remote(lambda a: a.trainer.model.activation_checkpointing)
            for learner in run.backend.learners
        ]
        assert ray.get(flag) == [True, True] and _driver_models(run) == []
        start, version = run.backend.learner_weights()
        assert version == 0
        if where == "worker":
            ray.get(run.backend.workers[0].__ray_call__.remote(_break(lambda w: w.sampler.engine)))
            message = "sampled tokens have μ != π_old on rollout worker 0"
        else:
            ray.get(run.backend.learners[1].__ray_call__.remote(_break(lambda learner: learner.trainer.model)))
            message = "first π_θ pass differs from π_old"
        with pytest.raises(TrainingError, match=f"step 1: exact=true, but .*{message}"):
            run.step()
        weights, version = run.backend.learner_weights()
        assert version == 0 and weights.keys() == start.keys()
        assert all(torch.equal(t, start[n]) for n, t in weights.items())
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
def test_a_killed_rollout_worker_is_restarted_and_no_sample_is_lost(tmp_path, hogs, ray_cluster):
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
def test_a_worker_still_restarting_after_the_limit_stops_the_run_and_names_the_key(tmp_path, ray_cluster):
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
def test_a_dead_learner_stops_the_run_and_resume_reproduces_it(tmp_path, numerics, ray_cluster):
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
        # The learner read its shards in place (the driver holds no model); gathered they are the checkpoint's.
        assert _driver_models(run) == []
        base = load_model(resolve_model_dir("builtin"), kernels.numerics()).state_dict()
        saved = Trainer(load_model(resolve_model_dir("builtin"), kernels.numerics()), "fp32", OptimConfig())
        load_checkpoint(tmp_path / "cut" / "checkpoints" / "step_000002", saved)
        restored = saved.model.state_dict()
        weights, version = run.backend.learner_weights()
        assert version == 2 and all(torch.equal(w, restored[n]) for n, w in weights.items())
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


def _poison_shards(ckpt) -> None:
    """Rewrite a sharded checkpoint's shards with a NaN in the weights, its manifest matching them."""
    trainer = Trainer(load_model(resolve_model_dir("builtin"), kernels.numerics()), "fp32", OptimConfig())
    load_checkpoint(ckpt, trainer)
    with torch.no_grad():
        trainer.model.model.norm.weight[0] = float("nan")
    shutil.rmtree(ckpt / "sharded")
    save_shards(trainer, ckpt / "sharded")
    reseal(ckpt)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_shards_holding_nan_are_set_aside_or_the_resume_refused(tmp_path, capsys, ray_cluster):
    """Step 2's shards hold NaN (its manifest matching): the learners read them in place, the resume sets the
    checkpoint aside and the learners continue from step 1's weights. With step 1's poisoned too, no checkpoint
    is usable: the resume is refused in one line, nothing moved, metrics.jsonl as it was."""
    common = SMALL + ["precision=fp32", "steps=2", "checkpoint_every=1", "eval.every=-1"]
    common += ["distributed.rollout_workers=1", "distributed.learners=2"]
    assert main(["train", f"run_dir={tmp_path / 'r'}", *common]) == 0
    shutil.copytree(tmp_path / "r", tmp_path / "all")
    _poison_shards(tmp_path / "r" / "checkpoints" / "step_000002")
    capsys.readouterr()

    run = Run.resume(tmp_path / "r", backend=RayBackend)
    try:
        err = capsys.readouterr().err
        assert "checkpoint step_000002 is unusable" in err and "inf/NaN in model.norm.weight" in err
        assert "continuing from step 1" in err and run.step_count == 1
        assert (tmp_path / "r" / "checkpoints" / "corrupt" / "step_000002").is_dir()
        saved = Trainer(load_model(resolve_model_dir("builtin"), kernels.numerics()), "fp32", OptimConfig())
        load_checkpoint(tmp_path / "r" / "checkpoints" / "step_000001", saved)
        weights, version = run.backend.learner_weights()
        assert version == 1 and all(torch.equal(w, saved.model.state_dict()[n]) for n, w in weights.items())
    finally:
        run.close()

    for step in (1, 2):
        _poison_shards(tmp_path / "all" / "checkpoints" / f"step_00000{step}")
    logged = (tmp_path / "all" / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError, match="no checkpoint of the run is usable") as refused:
        Run.resume(tmp_path / "all", backend=RayBackend)
    assert "step_000002: inf/NaN in model.norm.weight" in str(refused.value)
    assert "step_000001: inf/NaN in model.norm.weight" in str(refused.value)
    assert sorted(p.name for p in (tmp_path / "all" / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert (tmp_path / "all" / "metrics.jsonl").read_text() == logged


def test_a_cluster_that_cannot_start_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """Ray failing to start this machine's cluster (here: socket paths over the 107 bytes Unix allows; a machine
    too busy for Ray's 30 s start window fails the same way) is tried once more, then ends the run in one line,
    exit 1, nothing written, no Ray process left."""
    ray_tmp = tmp_path / ("x" * 110)
    ray_tmp.mkdir()
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    run_dir = tmp_path / "run"
    assert main(["train", f"run_dir={run_dir}", *SMALL, "steps=1", "distributed.rollout_workers=1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2].startswith("Ray's cluster did not start (") and err[-2].endswith("; trying once more")
    assert err[-1].startswith("parity train: error: Ray could not start a cluster on this machine in 2 tries (")
    assert f"its logs are in {ray_tmp / 'ray' / 'session_latest' / 'logs'}" in err[-1]
    assert "Traceback" not in "\n".join(err) and not run_dir.exists()
    left = subprocess.run(["pgrep", "-f", str(ray_tmp)], capture_output=True, text=True).stdout  # Ray's name it
    assert left.strip() == ""


def test_a_trainer_on_ray_fires_the_events_and_saves_the_sharded_model_whole(tmp_path, ray_cluster):
    """parity.Trainer on the Ray backend: transformers' events fire as in one process, the control stops the
    run, and save_model gathers the sharded checkpoint into a folder transformers loads."""
    import transformers

    import parity

    class Events(parity.TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_step_end(self, args, state, control, metrics=None, **kwargs):
            self.seen.append(("step_end", state.global_step, metrics["sync/verified"]))

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.append(("log", state.global_step))
            control.should_training_stop = state.global_step == 2

        def on_save(self, args, state, control, checkpoint=None, **kwargs):
            self.seen.append(("save", checkpoint.name))

    events = Events()
    keys = dict(prompts_per_step=8, rollout__group_size=4, rollout__max_new_tokens=32, tensorboard=False)
    trainer = parity.Trainer(
        callbacks=events, run_dir=tmp_path / "r", progress=False, steps=4, eval__every=-1,
        distributed__rollout_workers=1, **keys,
    )  # fmt: skip
    result = trainer.train()
    assert [m["step"] for m in result.history] == [1, 2] and result.model_dir is None  # sharded: no model/ folder
    assert events.seen == [("step_end", 1, 1), ("log", 1), ("step_end", 2, 1), ("log", 2), ("save", "step_000002")]
    out = trainer.save_model(tmp_path / "whole")
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    base = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_dir("builtin"))
    ids = torch.tensor([[1, 3, 4, 5, 6]])
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, base(ids).logits)
    assert (out / "README.md").read_text().startswith("---\n")
