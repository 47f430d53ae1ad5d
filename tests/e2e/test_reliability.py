"""No run can destroy, fake or silently stall another: locks, non-finite values, exact resume,
damaged checkpoints, leftovers, clean errors and hostile run directories (issue 13)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import (
    ONE_RAY_AT_A_TIME,
    TIMING,
    TINY,
    copy_run,
    metrics,
    processes_with,
    reseal,
    run_dir_held,
    started_workers,
)
from parity import config
from parity.cli import main
from parity.config import ConfigError
from parity.engines import kernels
from parity.engines.models.io import load_model, resolve_model_dir
from parity.engines.trainer import OptimConfig, Trainer
from parity.rl.checkpoint import CheckpointError, RunState, checkpoints, load_shards, save_checkpoint, save_shards
from parity.rl.loop import Run, TrainingError
from parity.rl.train_config import TrainConfig
from parity.rundir import RunLock, in_use_by


def _train(run_dir: Path, *overrides: str) -> int:
    return main(["train", f"run_dir={run_dir}", *TINY, *overrides])


def _steps(run_dir: Path) -> list[int]:
    return [m["step"] for m in metrics(run_dir)]


def _parity(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parity", *args], capture_output=True, text=True, timeout=300, cwd=cwd)


# ----------------------------------------------------------------------------- 1. one run per directory


def test_a_locked_run_dir_is_refused_naming_the_holder(trained_run, tmp_path):
    """Two real processes: one holds the run directory, `parity train` and `--resume` are refused."""
    run_dir = tmp_path / "run"
    copy_run(trained_run(*TINY, "steps=1"), run_dir)
    with run_dir_held(run_dir) as holder:
        resumed = _parity("train", "--resume", str(run_dir), "steps=2")
        assert resumed.returncode == 2
        assert f"in use by another Parity process (pid {holder.pid})" in resumed.stderr
        assert "Traceback" not in resumed.stderr
        assert _steps(run_dir) == [1]  # untouched
    # The kernel dropped the dead holder's lock: the run continues.
    assert main(["train", "--resume", str(run_dir), "steps=2"]) == 0
    assert _steps(run_dir) == [1, 2]


def test_asking_whether_a_run_is_in_use_from_its_own_process_keeps_its_lock(tmp_path):
    """`parity.evaluate` of a run from a callback of its own training asks whether the run is in use: opening and
    closing `.lock` there dropped the run's POSIX lock, and a second process could then take the run."""
    lock = RunLock(tmp_path)
    try:
        assert in_use_by(tmp_path) == str(os.getpid())
        code = f"from pathlib import Path; from parity.rundir import RunLock; RunLock(Path({str(tmp_path)!r}))"
        second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert second.returncode != 0 and f"in use by another Parity process (pid {os.getpid()})" in second.stderr
    finally:
        lock.release()


def test_a_run_that_parity_eval_reads_is_not_resumed_meanwhile(tmp_path):
    """`parity eval` of a run checked that no run held it, then read its checkpoints: a `--resume` started
    meanwhile pruned them, and the evaluation ended in `No such file or directory` after minutes of work."""
    (tmp_path / ".lock").write_text("999999\n")  # the last run's pid, long gone
    held = []
    assert in_use_by(tmp_path, held) is None and len(held) == 1  # eval's hold, as resolve_target keeps it
    code = f"from pathlib import Path; from parity.rundir import RunLock; RunLock(Path({str(tmp_path)!r}))"
    try:
        second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert second.returncode != 0 and f"in use by another Parity process (pid {os.getpid()})" in second.stderr
    finally:
        held[0].close()
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_two_runs_started_on_one_dir_at_once(tmp_path):
    """Two real `parity train` processes on one new directory: exactly one runs."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "parity", "train", f"run_dir={run_dir}", "steps=2", *TINY]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert "in use by another Parity process" in loser or "already holds a run" in loser
    assert _steps(run_dir) == [1, 2]


# ----------------------------------------------------------------------------- 2. non-finite weights


def test_non_finite_weights_stop_the_run_and_are_never_saved(tmp_path):
    run = Run.create(config.load(TrainConfig, None, [f"run_dir={tmp_path / 'r'}", "precision=fp32", *TINY]), False)
    run.step()
    run.checkpoint()
    run.backend.trainer.optimizer.param_groups[0]["lr"] = float("inf")  # a divergence, past the config's checks
    with pytest.raises(TrainingError, match=r"step 2: the weights hold inf/NaN .* newest checkpoint is step_000001"):
        run.step()
    assert run.step_count == 1  # the bad step is not counted, synced or logged
    with pytest.raises(CheckpointError, match="not saving a checkpoint: inf/NaN in "):
        run.checkpoint()
    assert [p.name for p in (run.run_dir / "checkpoints").iterdir()] == ["step_000001"]
    run.rewards.close()


def test_a_learning_rate_that_blows_up_stops_before_saving(tmp_path, capsys):
    assert _train(tmp_path / "r", "precision=fp32", "steps=3", "trainer.lr=1e38", "checkpoint_every=1") == 1
    err = capsys.readouterr().err
    assert "the run stopped: step 1: the weights hold inf/NaN after the optimizer step (trainer.lr=1e+38)" in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists() and not (tmp_path / "r" / "checkpoints").exists()


def test_non_finite_loss_stops_fp32_at_once(tmp_path, monkeypatch, capsys):
    # Rewards near FP32's maximum: the Dr.GRPO advantages (not divided by the std) overflow the loss.
    (tmp_path / "rel_huge_reward.py").write_text(
        "def score(prompt, response, answer):\n    return 3e38 if len(response) % 2 else 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _train(tmp_path / "r", "precision=fp32", "steps=3", "task.reward_fn=rel_huge_reward:score") == 1
    err = capsys.readouterr().err
    assert "the run stopped: step 1: non-finite loss (" in err and "no checkpoint was written" in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_fp16_stops_after_max_skipped_steps(tmp_path, capsys):
    # A loss scale that overflows every FP16 backward: the scaler skips and halves, for too long.
    assert _train(tmp_path / "r", "steps=5", "trainer.loss_scale_init=1e30", "health.max_skipped_steps=2") == 1
    err = capsys.readouterr().err
    assert "step 2: the FP16 loss scaler skipped every update of 2 steps in a row" in err
    assert _steps(tmp_path / "r") == [1]


def test_a_nan_checkpoint_is_set_aside_and_the_last_good_one_kept(tmp_path, capsys):
    run_dir = tmp_path / "r"
    assert _train(run_dir, "steps=2", "checkpoint_every=1", "keep_checkpoints=2") == 0
    # A checkpoint whose weights are NaN but whose manifest matches (written by a careless tool).
    bad = run_dir / "checkpoints" / "step_000002"
    weights = load_file(str(bad / "model" / "model.safetensors"))
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, str(bad / "model" / "model.safetensors"), metadata={"format": "pt"})
    reseal(bad)
    assert main(["train", "--resume", str(run_dir), "steps=4"]) == 0
    err = capsys.readouterr().err
    assert "checkpoint step_000002 is unusable (" in err and "inf/NaN in model.norm.weight" in err
    assert "continuing from step 1" in err
    assert (run_dir / "checkpoints" / "corrupt" / "step_000002").is_dir()
    assert _steps(run_dir) == [1, 2, 3, 4]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000003", "step_000004"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_shards_holding_nan_or_another_model_are_refused(tmp_path, llama_dir):
    """The shard reader that sharded learners call in place (one process here): it names the non-finite
    tensors it read, and a checkpoint of another model is a CheckpointError naming the folder."""
    builtin = resolve_model_dir("builtin")
    trainer = Trainer(load_model(builtin, kernels.numerics()), "fp32", OptimConfig())
    with torch.no_grad():
        trainer.model.model.norm.weight[0] = float("nan")
    save_shards(trainer, tmp_path / "nan")
    assert load_shards(tmp_path / "nan", Trainer(load_model(builtin, kernels.numerics()), "fp32", OptimConfig())) == [
        "model.norm.weight"
    ]
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "nan"))):
        load_shards(tmp_path / "nan", Trainer(load_model(llama_dir, kernels.numerics()), "fp32", OptimConfig()))


def test_pruning_keeps_the_checkpoint_just_written(tmp_path):
    run = Run.create(config.load(TrainConfig, None, [f"run_dir={tmp_path / 'r'}", *TINY]), False)
    ckpts = tmp_path / "r" / "checkpoints"
    for step in (1, 2, 3):
        run.step_count = step
        save_checkpoint(run.run_dir, run.backend.trainer, RunState(step, 0, 0), run.model_dir, keep=1)
        assert [p.name for p in ckpts.glob("step_*")] == [f"step_{step:06d}"]
    run.rewards.close()


# ----------------------------------------------------------------------------- 3. bad values


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.loss_scale_init=inf", "trainer.loss_scale_init: expected a finite number, got 'inf'"),
        ("trainer.loss_scale_init=nan", "trainer.loss_scale_init: expected a finite number"),
        ("trainer.loss_scale_init=0.5", r"trainer.loss_scale_init: must be >= 1"),
        ("reward.timeout_s=0", r"reward.timeout_s: must be in \(0, 86400\] seconds, got 0.0"),
        ("algorithm.cap=-1", r"algorithm.cap_low=0.0, algorithm.cap=-1.0: need 0 <= cap_low < cap"),
        ("algorithm.clip_high=nan", "algorithm.clip_high: expected a finite number"),
        ("trainer.lr=nan", "trainer.lr: expected a finite number"),
        ("trainer.lr=-1e-4", r"trainer.lr: must be > 0, got -0.0001"),
        ("trainer.lr=inf", "trainer.lr: expected a finite number"),
        ("trainer.beta2=1", r"trainer.beta2: must be in \[0, 1\)"),
        ("trainer.eps=0", r"trainer.eps: must be > 0"),
        ("trainer.grad_clip=-1", r"trainer.grad_clip: must be >= 0"),
        ("reward.warn_error_rate=0", r"reward.warn_error_rate: must be in \(0, 1\]"),
        ("reward.max_failed_steps=-1", r"reward.max_failed_steps: must be in \[0, 1,000,000\]"),
        ("health.alarm_factor=-1", r"health.alarm_factor: must be >= 0"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("algorithm.kl_coef=inf", "algorithm.kl_coef: expected a finite number"),
    ],
)
def test_values_that_would_stall_training_are_refused(override, message):
    name = "grpo_token_tis" if override.startswith("algorithm.cap") else "pg_seq_is"
    with pytest.raises(ConfigError, match=message):
        config.load(TrainConfig, None, [override, f"algorithm.name={name}"])


def _numeric_keys(obj, prefix=""):
    import dataclasses

    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f.metadata.get("key", f.name)  # `async` lives in `async_`
        if dataclasses.is_dataclass(value):
            yield from _numeric_keys(value, f"{prefix}{key}.")
        elif f.type in ("int", "float", "float | None", "int | None"):
            yield f"{prefix}{key}", f.type


def test_every_numeric_key_is_range_checked():
    """Far out of range, every numeric key but the seed is refused, naming itself."""
    keys = list(_numeric_keys(TrainConfig()))
    assert len(keys) > 30
    for key, kind in keys:
        if key == "seed":
            continue
        name = "grpo_token_tis" if key.startswith("algorithm.cap") else "grpo"
        for bad in ["-1000000000"] + (["nan", "-inf"] if "float" in kind else []):
            with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
                config.load(TrainConfig, None, [f"{key}={bad}", f"algorithm.name={name}"])


# Integer keys whose size is checked once the model is known, before anything is allocated or written (each has
# a case in tests/unit/test_config.py, HUGE), and the two for which any size past the model's means "all": a top_k
# of the whole vocabulary samples unfiltered, a micro-batch larger than the batch is the batch.
CHECKED_AGAINST_THE_MODEL = {
    "prompts_per_step",
    "rollout.group_size",
    "rollout.max_new_tokens",
    "eval.samples",
    "eval.max_new_tokens",
    "diagnostics.full_vocab_positions",
    "lora.rank",
}
ALL_PAST_THE_MODEL = {"rollout.top_k", "trainer.micro_batch_tokens"}


def test_every_integer_key_is_bounded_above():
    """Past 64 bits every integer key is refused, naming itself; and 10**12 (a count that would run for ever,
    or past any machine's memory) by its range, unless the model's sizes bound it (and 10**12 is refused then)."""
    keys = [key for key, kind in _numeric_keys(TrainConfig()) if kind.startswith("int")]
    assert len(keys) > 25 and CHECKED_AGAINST_THE_MODEL | ALL_PAST_THE_MODEL <= set(keys)
    for key in keys:
        name = re.escape(key)
        with pytest.raises(ConfigError, match=f"{name}: expected an integer of at most 64 bits, got one of 70 bits"):
            config.load(TrainConfig, None, [f"{key}={10**21}"])
        if key in CHECKED_AGAINST_THE_MODEL | ALL_PAST_THE_MODEL:
            continue
        workers = ["distributed.rollout_workers=2"] if key.startswith("async.") else []  # asynchronous keys need them
        with pytest.raises(ConfigError, match=name):
            config.load(TrainConfig, None, [f"{key}={10**12}", *workers])


# ----------------------------------------------------------------------------- 4. resume exactly


def test_resume_refuses_an_edited_config_and_changes_outside_the_allow_list(trained_run, tmp_path, capsys):
    run_dir = tmp_path / "r"
    copy_run(trained_run(*TINY, "steps=1"), run_dir)
    cfg = run_dir / "config.yaml"
    original = cfg.read_text()
    cfg.write_text(original.replace("lr: 0.0002", "lr: 0.001"))
    assert main(["train", "--resume", str(run_dir), "steps=2"]) == 2
    assert "trainer.lr: 0.0002 when saved, 0.001 now" in capsys.readouterr().err
    cfg.write_text(original)
    assert main(["train", "--resume", str(run_dir), "precision=bf16"]) == 2
    assert "precision cannot change on resume" in capsys.readouterr().err
    assert _steps(run_dir) == [1]
    # steps may change, and the trainer's memory keys (a run that ran out of memory): logged and recorded.
    memory = ["trainer.micro_batch_tokens=64", "trainer.activation_checkpointing=true", "trainer.chunked_head=always"]
    assert main(["train", "--resume", str(run_dir), "steps=2", *memory]) == 0
    err = capsys.readouterr().err
    assert "resume: steps 1 -> 2" in err and "trainer.chunked_head 'auto' -> 'always'" in err
    saved = config.load(TrainConfig, cfg)
    assert saved.steps == 2 and _steps(run_dir) == [1, 2]
    assert (saved.trainer.micro_batch_tokens, saved.trainer.activation_checkpointing) == (64, True)


def test_resume_accepts_a_run_saved_before_a_key_existed(trained_run, tmp_path, capsys):
    """A run saved by an earlier version has no entry for a key added since (here `exact`): at its
    default the key changes nothing, so the run resumes."""
    import json

    from parity.rl.checkpoint import checkpoints

    run_dir = tmp_path / "r"
    copy_run(trained_run(*TINY, "steps=1"), run_dir)
    cfg = run_dir / "config.yaml"
    cfg.write_text("".join(line for line in cfg.read_text().splitlines(True) if not line.startswith("exact:")))
    state_file = checkpoints(run_dir)[-1] / "state.json"
    state = json.loads(state_file.read_text())
    del state["config"]["exact"]
    state_file.write_text(json.dumps(state))
    reseal(state_file.parent)  # as that version wrote it: else the checkpoint is damaged, and the resume refused
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "steps=2"]) == 0
    assert "continuing from step 1" in capsys.readouterr().err
    assert _steps(run_dir) == [1, 2]


# ----------------------------------------------------------------------------- 5. silent stalls


def test_a_reward_that_always_fails_stops_the_run(tmp_path, monkeypatch, capsys):
    # It passes the first batch's check, then fails on every sample of every step.
    (tmp_path / "rel_failing_reward.py").write_text(
        "calls = 0\n\n\ndef score(prompt, response, answer):\n    global calls\n    calls += 1\n"
        "    if calls > 16:\n        raise ZeroDivisionError('division by zero')\n    return 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code = _train(
        tmp_path / "r",
        "steps=10",
        "task.reward_fn=rel_failing_reward:score",
        "reward.max_failed_steps=2",
        "eval.every=-1",
    )
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("ZeroDivisionError: division by zero") >= 2  # the first failure, then the stop
    assert "every reward failed in 2 consecutive steps" in err
    assert _steps(tmp_path / "r") == [1, 2]


def test_a_reward_that_fails_its_first_batch_stops_before_training(tmp_path, monkeypatch, capsys):
    (tmp_path / "rel_broken_reward.py").write_text("def score(prompt, response, answer):\n    return 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _train(tmp_path / "r", "steps=10", "task.reward_fn=rel_broken_reward:score") == 2
    err = capsys.readouterr().err
    assert (
        "parity train: error: reward score (per-sample) on the first batch of 16 completions: failed on every "
        "sample: sample 0: ZeroDivisionError: division by zero" in err
    )
    assert not (tmp_path / "r").exists()  # nothing was trained, nothing is left


def test_zero_reward_variance_is_warned_with_the_reason(tmp_path, monkeypatch, capsys):
    (tmp_path / "rel_flat_reward.py").write_text("def score(prompt, response, answer):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _train(tmp_path / "r", "steps=2", "task.reward_fn=rel_flat_reward:score") == 0
    err = capsys.readouterr().err
    assert err.count("groups/zero_variance_frac = 1") == 1  # once per streak, not every step
    assert "every advantage is 0" in err


# ----------------------------------------------------------------------------- 7, 8. crash leftovers


def test_resume_cleans_half_written_checkpoints_and_restores_a_swapped_one(trained_run, tmp_path, capsys):
    run_dir = tmp_path / "r"
    copy_run(trained_run(*TINY, "steps=2", "checkpoint_every=1"), run_dir)
    ckpts = run_dir / "checkpoints"
    (ckpts / ".step_000003.x1y2.tmp" / "model").mkdir(parents=True)
    (run_dir / ".metrics.jsonl.abc.tmp").write_text("half")
    (run_dir / "completions" / ".step_000003.jsonl.0badc0de.tmp").write_text("half")
    # Killed between atomic_dir's two renames: only `.step_000002.old` is left.
    os.replace(ckpts / "step_000002", ckpts / ".step_000002.old")
    assert main(["train", "--resume", str(run_dir), "steps=3"]) == 0
    err = capsys.readouterr().err
    assert "removed .step_000003.x1y2.tmp" in err and "restored step_000002" in err
    assert "continuing from step 2" in err
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000003"]
    assert not list(run_dir.glob(".*.tmp")) and not list(run_dir.glob("completions/.*.tmp"))


def test_resume_drops_the_completions_of_steps_past_its_checkpoint(trained_run, tmp_path, capsys):
    run_dir = tmp_path / "r"
    copy_run(trained_run(*TINY, "steps=2", "checkpoint_every=1"), run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_000002")  # killed after step 2's completions, before its save
    assert main(["train", "--resume", str(run_dir), "steps=1"]) == 0
    assert sorted(p.name for p in (run_dir / "completions").iterdir()) == ["step_000001.jsonl"]
    assert main(["report", str(run_dir), "--out", str(tmp_path / "rep")]) == 0
    assert "completions of step 1" in (tmp_path / "rep" / "report.md").read_text()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact(trained_run, tmp_path, capsys, damage):
    run_dir = tmp_path / "r"
    copy_run(trained_run(*TINY, "steps=3", "checkpoint_every=1", "keep_checkpoints=3"), run_dir)
    reference = metrics(run_dir, drop=TIMING)
    latest = run_dir / "checkpoints" / "step_000003"
    target = latest / "optimizer.safetensors"
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x10
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:100])
    elif damage == "delete":
        (latest / "model" / "model.safetensors").unlink()
    else:
        (latest / "manifest.json").write_text("{")
    assert main(["train", "--resume", str(run_dir)]) == 0
    err = capsys.readouterr().err
    assert "checkpoint step_000003 is unusable" in err and "continuing from step 2" in err
    assert (run_dir / "checkpoints" / "corrupt" / "step_000003").is_dir()
    assert metrics(run_dir, drop=TIMING) == reference


def _files(run_dir: Path) -> dict[str, bytes]:
    """Every file of the run but its lock (whose pid a refused resume rewrites), by relative path."""
    files = (p for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock")
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in files}


def test_a_run_whose_every_checkpoint_is_damaged_is_refused_and_left_as_it_was(trained_run, tmp_path, capsys):
    """Every checkpoint damaged: the resume set each aside, started again from step 0 and cut metrics.jsonl back,
    so the run's history was lost; now one line names each checkpoint and its damage, exit 2, nothing moved."""
    run_dir = tmp_path / "r"
    copy_run(trained_run(*TINY, "steps=2", "checkpoint_every=1"), run_dir)
    (run_dir / "checkpoints" / "step_000002" / "manifest.json").write_text("{")
    (run_dir / "checkpoints" / "step_000001" / "model" / "model.safetensors").unlink()
    before = _files(run_dir)
    capsys.readouterr()
    # tensorboard=true: its writer, opened before the checkpoints were read, left an events file in the run
    assert main(["train", "--resume", str(run_dir), "steps=3", "tensorboard=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"parity train: error: --resume {run_dir}: no checkpoint of the run is usable (")
    assert "step_000002: manifest.json is unreadable" in err[-1]
    assert "step_000001: model/model.safetensors is missing" in err[-1]
    assert "nothing was moved or cut back" in err[-1] and not any("moved it to" in line for line in err)
    assert _files(run_dir) == before and not (run_dir / "checkpoints" / "corrupt").exists()
    assert not (run_dir / "tensorboard").exists()


def test_a_run_stopped_before_its_first_checkpoint_starts_again_from_step_0(trained_run, tmp_path, capsys):
    """No checkpoint at all (killed before the first save, or checkpoint_every=-1), steps logged: no weights hold
    them, so the resume takes them again from step 0 and logs them as they were."""
    run_dir = tmp_path / "r"
    copy_run(trained_run(*TINY, "steps=2", "checkpoint_every=1"), run_dir)
    reference = metrics(run_dir, drop=TIMING)
    shutil.rmtree(run_dir / "checkpoints")
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir)]) == 0
    assert "no checkpoint (the run stopped before its first); starting again from step 0" in capsys.readouterr().err
    assert metrics(run_dir, drop=TIMING) == reference


def test_a_checkpoint_write_that_fails_for_space_keeps_the_earlier_ones(trained_run, tmp_path):
    """A file-size limit (as a full disk would) fails the step-3 save: one line, exit 2, step 2 intact."""
    import resource

    run_dir = tmp_path / "r"
    copy_run(trained_run(*TINY, "steps=2", "checkpoint_every=1"), run_dir)
    limit = 4 * 2**20  # the model file (3 MB) fits, the optimizer state (6 MB) does not

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    full = subprocess.run(
        [sys.executable, "-m", "parity", "train", "--resume", str(run_dir), "steps=4"],
        capture_output=True,
        text=True,
        preexec_fn=small_files,
        timeout=300,
    )
    assert full.returncode == 2 and "Traceback" not in full.stderr
    assert "step_000003: could not be written (" in full.stderr and "earlier checkpoints are intact" in full.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert main(["train", "--resume", str(run_dir), "steps=4"]) == 0
    assert _steps(run_dir) == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- 10. clean errors


def _damaged_model(tmp_path: Path, how: str) -> Path:
    from parity.engines.models.io import BUILTIN_DIR

    out = tmp_path / f"model-{how}"
    shutil.copytree(BUILTIN_DIR, out)
    weights = out / "model.safetensors"
    if how == "cut":
        weights.write_bytes(weights.read_bytes()[:5000])
    elif how == "shape":
        cfg = json.loads((out / "config.json").read_text())
        cfg["intermediate_size"] += 8
        (out / "config.json").write_text(json.dumps(cfg))
    else:
        (out / "config.json").write_text("{not json")
    return out


@pytest.mark.parametrize(
    "how, message",
    [
        ("cut", "model.safetensors: not a readable safetensors file"),
        ("shape", "weights do not match config.json"),
        ("json", "config.json:1: invalid JSON"),
    ],
)
def test_damaged_model_files_give_one_line(tmp_path, capsys, how, message):
    model = _damaged_model(tmp_path, how)
    assert main(["mismatch", "--model", str(model), "--out", str(tmp_path / "o"), "num_prompts=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_unwritable_output_gives_one_line(tmp_path, capsys):
    if os.geteuid() == 0:
        target = Path("/sys/parity-readonly-test")  # root writes anywhere but a kernel filesystem
        if not Path("/sys").is_dir():
            pytest.skip("no read-only location for root here")
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        target = tmp_path / "ro" / "run"
    assert main(["train", f"run_dir={target}", *TINY, "steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"parity train: error: {target}") and len(err.splitlines()) == 1


# ----------------------------------------------------------------------------- 11. hostile run directories


def test_resume_with_a_reward_fn_needs_explicit_trust(tmp_path):
    """A run directory from someone else must not run code on --resume without consent."""
    run_dir = tmp_path / "received"
    run_dir.mkdir()
    cfg = config.load(TrainConfig, None, [f"run_dir={run_dir}", "task.reward_fn=payload:score", *TINY])
    (run_dir / "config.yaml").write_text(config.dump_yaml(cfg))
    (tmp_path / "payload.py").write_text(
        textwrap.dedent(
            """
            from pathlib import Path
            Path("PWNED").write_text("ran")
            def score(prompt, response, answer):
                return 0.0
            """
        )
    )
    refused = _parity("train", "--resume", str(run_dir), cwd=tmp_path)
    assert refused.returncode == 2 and "--trust-reward-fn" in refused.stderr
    assert not (tmp_path / "PWNED").exists()
    trusted = _parity("train", "--resume", str(run_dir), "steps=1", "--trust-reward-fn", cwd=tmp_path)
    assert trusted.returncode == 0, trusted.stderr
    assert (tmp_path / "PWNED").exists()


def test_a_run_killed_before_it_started_is_started_again(tmp_path, capsys):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / ".lock").write_text("12345\n")  # all a run killed while loading its model leaves
    assert main(["train", "--resume", str(run_dir)]) == 2
    assert "stopped before it started" in capsys.readouterr().err
    assert _train(run_dir, "steps=1") == 0 and _steps(run_dir) == [1]


def test_run_dir_must_be_its_own_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "run_dir=.", *TINY, "steps=1"]) == 2
    assert "the working directory cannot be a run directory" in capsys.readouterr().err
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    assert main(["train", f"run_dir={project}", *TINY, "steps=1"]) == 2
    assert "holds files that are not a run's (notes.txt)" in capsys.readouterr().err
    assert main(["train", "--resume", str(project)]) == 2  # no config.yaml: not a run
    (project / "config.yaml").write_text("steps: 1\n")
    assert main(["train", "--resume", str(project)]) == 2
    assert "notes.txt" in capsys.readouterr().err
    assert sorted(p.name for p in project.iterdir()) == ["config.yaml", "notes.txt"]
    assert torch.isfinite(torch.zeros(1)).all()


# ----------------------------------------------------------------------------- stopping a run


def _ray_processes() -> set[int]:
    """Pids of this machine's Ray processes (raylet, GCS, workers and agents). Each name is written with a
    bracket so that the pattern does not match itself: pgrep leaves out its own process, not another test
    process's pgrep running at the same moment."""
    out = subprocess.run(
        ["pgrep", "-f", "[r]ay::|[r]aylet|[g]cs_server|dashboard/[a]gent|runtime_env/[a]gent"],
        text=True,
        capture_output=True,
    ).stdout
    return {int(p) for p in out.split()}


def _start_and_wait_for_steps(run_dir: Path, extra: list[str], steps: int = 2) -> subprocess.Popen:
    """`parity train` in its own process group (as a terminal runs it), once `steps` steps are logged."""
    args = [sys.executable, "-m", "parity", "train", f"run_dir={run_dir}", "steps=500", "checkpoint_every=0", *TINY]
    proc = subprocess.Popen(
        [*args, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 240
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {steps} steps in 240 s: {proc.stderr.read()}")
        time.sleep(0.2)
    return proc


def _parent(pid: int) -> int:
    try:  # /proc/PID/stat: "pid (name) state ppid ...", the name may hold spaces and parentheses
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):  # gone meanwhile
        return 0


def _new_ray_processes(before: set[int]) -> set[int]:
    """Ray processes that appeared after `before` outside the process trees of those in it: a Ray cluster
    already running (the tests' shared one, or the last test's on its way out) starts workers at any time,
    while a run's processes left behind have lost their parent (they hang from init)."""
    new = set()
    for pid in _ray_processes() - before:
        ancestor = _parent(pid)
        while ancestor > 1 and ancestor not in before:
            ancestor = _parent(ancestor)
        if ancestor not in before:
            new.add(pid)
    return new


def _gone_within(before: set[int], seconds: float) -> dict[int, str]:
    """The run's Ray processes (`_new_ray_processes`) still running `seconds` later (at most), with their
    command lines and parents, so that a failure says whose they are."""
    import psutil

    deadline = time.monotonic() + seconds
    while (left := _new_ray_processes(before)) and time.monotonic() < deadline:
        time.sleep(0.5)
    described = {}
    for pid in left:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            described[pid] = f"{' '.join(proc.cmdline())[:200]} (parent {proc.ppid()})"
    return described


RAY = ["distributed.rollout_workers=1", "distributed.learners=1"]


@ONE_RAY_AT_A_TIME
@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, how, extra",
    [
        (signal.SIGINT, "pid", []),
        (signal.SIGTERM, "pid", []),
        (signal.SIGINT, "group", RAY),  # Ctrl-C in a terminal: the whole process group, Ray's processes too
        (signal.SIGTERM, "pid", [*RAY, "async.max_staleness=1"]),
    ],
    ids=["sigint", "sigterm", "ctrl-c-ray", "sigterm-ray-async"],
)
def test_a_signal_stops_the_run_after_its_step_with_a_checkpoint(tmp_path, sig, how, extra):
    """SIGINT (Ctrl-C) and SIGTERM: the step under way ends, a checkpoint of it is written (here
    checkpoint_every=0 writes none otherwise), one line names it and the resume command, the exit is
    128 + the signal, no Ray process of the run is left, and `--resume` continues from it."""
    run_dir = tmp_path / "run"
    before = _ray_processes()
    proc = _start_and_wait_for_steps(run_dir, extra)
    try:
        os.killpg(proc.pid, sig) if how == "group" else proc.send_signal(sig)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    last = err.strip().splitlines()[-1]
    assert code == 128 + sig, err
    assert "Traceback" not in err, err
    stopped_at = _steps(run_dir)[-1]
    assert last == (
        f"parity train: stopped by {signal.Signals(sig).name} after step {stopped_at}; the newest checkpoint is "
        f"step_{stopped_at:06d}; continue with `parity train --resume {run_dir}`"
    ), err
    assert [c.name for c in checkpoints(run_dir)] == [f"step_{stopped_at:06d}"]
    assert _gone_within(before, 10) == {}
    assert main(["train", "--resume", str(run_dir), f"steps={stopped_at + 1}"]) == 0
    assert _steps(run_dir) == list(range(1, stopped_at + 2))


@ONE_RAY_AT_A_TIME
@pytest.mark.slow
@pytest.mark.parametrize("how", ["twice", "sigkill"])
def test_a_run_stopped_at_once_leaves_no_ray_process_and_resumes(tmp_path, how):
    """A second signal stops the driver at once, and SIGKILL gives it no say at all: the run's reaper
    ends its Ray processes (agents included), and the newest intact checkpoint resumes."""
    run_dir = tmp_path / "run"
    before = _ray_processes()
    proc = _start_and_wait_for_steps(run_dir, [*RAY, "async.max_staleness=1", "checkpoint_every=1"], steps=3)
    if how == "twice":
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # two signals at once would arrive as one
        proc.send_signal(signal.SIGTERM)
    else:
        proc.kill()
    code = proc.wait(timeout=60)
    err = proc.stderr.read()
    if how == "twice":
        assert code == 128 + signal.SIGTERM and "Traceback" not in err, err
        assert re.search(r"stopped by SIGTERM (during|after) step \d+; the newest checkpoint is step_", err), err
    else:
        assert code == -signal.SIGKILL
    assert _gone_within(before, 15) == {}
    target = max(_steps(run_dir)) + 2
    assert main(["train", "--resume", str(run_dir), f"steps={target}"]) == 0
    assert _steps(run_dir) == list(range(1, target + 1))  # none missing, none twice


# ----------------------------------------------------------------------------- stopping a command with workers

STOP_MARK = "PARITY_TEST_STOP"  # set in a stopped command's environment: its processes, and theirs, inherit it


def _default_signals(*signals: int) -> None:
    for s in signals:
        signal.signal(s, signal.SIG_DFL)


def _signal_once_workers_run(
    tmp_path: Path, args: list[str], sig: int, workers: int, group: bool = False
) -> tuple[int, str, dict[int, str]]:
    """`parity ARGS` in its own session (as a terminal runs it), marked; once `workers` of its worker processes
    have started, `sig` to it, or to its whole process group as a terminal's Ctrl-C. Its exit code, its stderr
    (a file: a pipe would stay open while any process of the command holds it), and the processes of the
    command still running 15 s after it ended (at most), with their command lines; those are killed."""
    import psutil

    stderr = tmp_path / "stderr"
    env = {**os.environ, STOP_MARK: str(tmp_path)}
    with stderr.open("w") as err:
        argv = [sys.executable, "-m", "parity", *args]
        # A stop signal ignored where the tests run (a CI under nohup) would stay ignored by the command
        taken = functools.partial(_default_signals, signal.SIGINT, signal.SIGHUP)
        proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, env=env, preexec_fn=taken
        )
    try:
        deadline = time.monotonic() + 240
        while len(started_workers(proc.pid)) < workers:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no {workers} worker processes within 240 s: {stderr.read_text()[-3000:]}")
            time.sleep(0.2)
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 15
    while (left := processes_with(STOP_MARK, str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.5)
    described = {}
    for leftover in left:
        with contextlib.suppress(psutil.Error):
            described[leftover.pid] = " ".join(leftover.cmdline())[:200]
            leftover.kill()
    return code, stderr.read_text(), described


def _stopped(code: int, err: str, sig: int) -> str:
    """The stopped command's last line, once its exit code is 128 + `sig` and it wrote no traceback; a SIGKILLed
    one has nothing to say."""
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL, err
        return ""
    assert code == 128 + sig and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signal_to_sanity_stops_its_training_processes(tmp_path, monkeypatch, sig):
    """`parity sanity`'s training runs, each in a process of its own: any signal to the command, once they run,
    leaves none of its processes (multiprocessing's resource tracker included) running; SIGINT, SIGTERM and
    SIGHUP end it in one line, with 128 + the signal. A SIGTERM used to leave both runs training, for ever."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = ["sanity", "--quick", "--out", str(tmp_path / "out"), "--runs", "fp16/grpo,bf16/grpo", "--jobs", "2"]
    args += ["--candidates", "16", "--lo", "0", "--max-new-tokens", "16"]  # the smallest search, to reach the runs
    code, err, left = _signal_once_workers_run(tmp_path, args, sig, workers=2)
    assert left == {}
    assert _stopped(code, err, sig) == ("" if sig == signal.SIGKILL else f"parity sanity: stopped by {sig.name}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, group",
    [(signal.SIGINT, True), (signal.SIGHUP, False), (signal.SIGKILL, False)],
    ids=["ctrl-c", "sighup", "sigkill"],
)
def test_a_signal_to_train_ends_its_reward_worker(tmp_path, sig, group):
    """The math reward runs in a worker process. Ctrl-C reaches the whole process group: the worker leaves it to
    the run (it used to die of it, a traceback and a failed reward); SIGHUP stops the run as SIGTERM does, after
    its step with a checkpoint; SIGKILL gives the run no say, and the worker dies with it."""
    run_dir = tmp_path / "run"
    args = ["train", f"run_dir={run_dir}", "task.name=math", "steps=500", "checkpoint_every=0", *TINY]
    code, err, left = _signal_once_workers_run(tmp_path, args, sig, workers=1, group=group)
    assert left == {}
    if sig != signal.SIGKILL:
        assert _stopped(code, err, sig).startswith(f"parity train: stopped by {sig.name} after step "), err
        assert "the worker process died" not in err
    else:
        _stopped(code, err, sig)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["eval", "perfectible"])
def test_sigterm_ends_a_command_and_its_reward_worker(tmp_path, monkeypatch, command):
    """`parity eval` and `parity perfectible` score the math task in a worker process: SIGTERM stops the
    command where it is, with one line and exit 143, and the worker with it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = {
        "eval": ["eval", "builtin", "task=math", "precisions=fp32", "num_prompts=512", f"out={tmp_path / 'out'}"],
        "perfectible": ["perfectible", "task=math", "num_candidates=2048", f"out={tmp_path / 'set.jsonl'}"],
    }[command]
    code, err, left = _signal_once_workers_run(tmp_path, args, signal.SIGTERM, workers=1)
    assert left == {}
    assert _stopped(code, err, signal.SIGTERM) == f"parity {command}: stopped by SIGTERM"


@pytest.mark.slow
def test_a_sigkilled_run_leaves_no_join_behind(tmp_path):
    """A run waiting to join a cluster where none answers tries the join in a child process, which Ray's client
    keeps retrying for ever: SIGKILLed, the run takes it along."""
    args = ["train", f"run_dir={tmp_path / 'run'}", *TINY, "distributed.rollout_workers=1"]
    args += ["distributed.address=127.0.0.1:1", "distributed.connect_timeout_s=600"]
    code, err, left = _signal_once_workers_run(tmp_path, args, signal.SIGKILL, workers=1)
    assert left == {}
    _stopped(code, err, signal.SIGKILL)


# What PyTorch raises when a CUDA allocation fails (its message as an H100 gave it, shortened).
CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 9.13 GiB. GPU 0 has a total capacity of 79.18 GiB of which 798.19 MiB "
    "is free. Including non-PyTorch memory, this process has 78.39 GiB memory in use. If reserved but unallocated "
    "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)


@pytest.mark.parametrize("phase", ["sampling", "update"])
def test_a_device_out_of_memory_stops_the_run_in_one_line_naming_the_sizes(tmp_path, monkeypatch, capsys, phase):
    """No GPU here: the allocation failure is raised where the GPU would raise it (the rollout engine's
    generate, the trainer's backward); the run stops with exit 1 and one line that says how much was asked
    and which keys set it, and the checkpoint written before it stays whole."""
    from parity.engines.rollout import RolloutEngine

    calls = {"n": 0}

    def fail_from_step_2(original):
        def wrapped(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] > 1:
                raise torch.OutOfMemoryError(CUDA_OOM)
            return original(*args, **kwargs)

        return wrapped

    if phase == "sampling":  # one generate a step: the second step's fails
        monkeypatch.setattr(RolloutEngine, "generate", fail_from_step_2(RolloutEngine.generate))
    else:  # one backward a step at this size
        monkeypatch.setattr(Trainer, "backward", fail_from_step_2(Trainer.backward))
    run_dir = tmp_path / "run"
    assert _train(run_dir, "steps=3", "checkpoint_every=1", "eval.every=-1", "trainer.micro_batch_tokens=4096") == 1
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("parity")]  # beside the progress bar
    assert len(said) == 1 and "Traceback" not in err, err
    assert said[0].startswith("parity train: the run stopped: step 2: the device ran out of memory")
    assert "Tried to allocate 9.13 GiB" in said[0] and "Including non-PyTorch" not in said[0]
    key = "rollout.max_new_tokens=32" if phase == "sampling" else "trainer.micro_batch_tokens=4096"
    assert key in said[0]
    assert [c.name for c in checkpoints(run_dir)] == ["step_000001"]
