"""`parity train`: config errors, a short real run, checkpoints, and exact resume after SIGKILL."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import TIMING, metrics
from conftest import TINY as TINY_RUN
from parity import config
from parity.cli import main
from parity.rl.data import DataError
from parity.rl.loop import Run
from parity.rl.rewards import score_rollouts
from parity.rl.step import prepare, resolve_old, trained_rewards
from parity.rl.train_config import TrainConfig

TINY = [*TINY_RUN, "rollout.max_new_tokens=48", "steps=4"]


def test_run_writes_config_metrics_and_loadable_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    assert main(["train", f"run_dir={run_dir}", "checkpoint_every=2", *TINY]) == 0
    cfg = config.load(TrainConfig, run_dir / "config.yaml")
    assert cfg.steps == 4 and cfg.run_dir == str(run_dir)
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for key in (
        "reward/accuracy",
        "mismatch/k3",
        "mismatch/seq_abs_log_ratio",
        "precision/loss_scale",
        "time/rollout",
        "time/train",
        "perf/tokens_per_s",
        "groups/zero_variance_frac",
        "is/weight_mean",
    ):
        assert key in lines[-1], key
    assert lines[-1]["train/old_logprob_pass"] == 0  # one update per rollout: no extra π_old forward
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000004"]
    assert AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step_000004" / "model") is not None
    # The weights are as readable as the files beside them (safetensors wrote them 0600)
    step = run_dir / "checkpoints" / "step_000004"
    modes = {p.name: p.stat().st_mode & 0o777 for p in (step / "state.json", *step.rglob("*.safetensors"))}
    assert len(modes) == 3 and len(set(modes.values())) == 1, modes
    # A second run into the same directory is refused rather than overwriting it.
    assert main(["train", f"run_dir={run_dir}", *TINY]) == 2


def test_a_completed_run_resumed_says_so_and_trains_nothing(tmp_path, capsys):
    run_dir = tmp_path / "r"
    assert main(["train", *TINY_RUN, "rollout.max_new_tokens=16", "steps=2", f"run_dir={run_dir}"]) == 0
    before, config = ((run_dir / name).read_text() for name in ("metrics.jsonl", "config.yaml"))
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"the run already completed its 2 steps; go further with `parity train --resume {run_dir} steps=N`" in out
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert main(["train", "--resume", str(run_dir)]) == 0  # the first resume released the run directory
    # Fewer steps than the run took: refused (config.yaml was rewritten to say steps: 1 beside step 2's checkpoint)
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "steps=1"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("steps=1: the run has taken 2 steps; give steps >= 2")
    assert (run_dir / "config.yaml").read_text() == config and (run_dir / "metrics.jsonl").read_text() == before


def test_several_updates_run_the_old_logprob_pass(tmp_path):
    run = Run.create(
        config.load(TrainConfig, None, [f"run_dir={tmp_path}", "algorithm.name=grpo", "algorithm.ppo_epochs=2", *TINY]),
        progress=False,
    )
    metrics = run.step()
    assert metrics["train/old_logprob_pass"] == 1 and metrics["train/updates"] == 2
    assert metrics["weights/version"] == 2
    run.rewards.close()


def test_a_rejection_rule_gets_old_before_the_update_and_the_prepared_batch_is_frozen(tmp_path):
    """One update per rollout would take π_old from the first π_θ pass, but a rejection shapes the loss
    mask before it: `resolve_old` asks the learner for π_old; `prepare` applies the rule once."""
    cfg = config.load(TrainConfig, None, [f"run_dir={tmp_path}", "algorithm.name=grpo_seq_max_k2", *TINY])
    run = Run.create(cfg, progress=False)
    try:
        problems, batch = run.backend.rollouts(run.step_count, {})
        old, source = resolve_old(batch, run.plan, run.backend.trainer)
        assert source == "learner_pass" and old.shape == batch.rollout_logprobs.shape
        result = score_rollouts(batch, problems, run.tokenizer, run.rewards)
        trained = trained_rewards(batch, result, "drgrpo", "zero_reward")
        prepared = prepare(batch, trained, run.plan, "zero_reward", (old, source))
        assert prepared.rejected is not None and not prepared.loss_mask[prepared.rejected].any()
        with pytest.raises(dataclasses.FrozenInstanceError):
            prepared.old_logprobs = None
        metrics = run.step()
        assert metrics["train/old_logprob_pass"] == 1 and "is/rejected_seq_frac" in metrics
    finally:
        run.rewards.close()


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_reproduces_metrics(tmp_path):
    args = [
        "steps=8",
        "prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=48",
        "tensorboard=false",
        "checkpoint_every=1",
        "algorithm.name=grpo",
        "algorithm.ppo_epochs=2",
    ]
    reference = tmp_path / "reference"
    assert main(["train", f"run_dir={reference}", *args]) == 0

    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "parity", "train", f"run_dir={killed}", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        done = (killed / "metrics.jsonl").read_text().count("\n") if (killed / "metrics.jsonl").exists() else 0
        if done >= 4:
            break
        time.sleep(0.05)
    time.sleep(0.15)  # land somewhere inside a later step
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(metrics(killed)) < 8, "the run finished before it could be killed"

    assert main(["train", "--resume", str(killed)]) == 0
    assert metrics(killed, drop=TIMING) == metrics(reference, drop=TIMING)


def test_loop_contains_a_hanging_user_reward_and_runs_math(tmp_path, monkeypatch):
    """A user reward that hangs on some samples, run in a worker (reward.isolate=always), costs its batch
    reward 0 and is counted as timed out; the run goes on."""
    (tmp_path / "slow_reward.py").write_text(
        "import time\n"
        "def score(prompt, response, answer):\n"
        "    if response.endswith('0'):\n"
        "        time.sleep(30)\n"
        "    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(10, 30)))
    base = [
        f"task.data={data}",
        "prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=24",
        "tensorboard=false",
        "reward.timeout_s=0.5",
    ]
    run = Run.create(
        config.load(
            TrainConfig,
            None,
            [f"run_dir={tmp_path / 'a'}", "task.reward_fn=slow_reward:score", "reward.isolate=always", *base],
        ),
        progress=False,
    )
    metrics = [run.step() for _ in range(3)]
    run.rewards.close()
    assert sum(m["reward/timeouts"] for m in metrics) > 0
    assert all(m["reward/errors"] == 0 for m in metrics)
    run = Run.create(
        config.load(TrainConfig, None, [f"run_dir={tmp_path / 'b'}", "task.name=math", *base]), progress=False
    )
    m = run.step()
    run.rewards.close()
    assert m["reward/errors"] == 0 and m["reward/timeouts"] == 0 and "reward/accuracy" in m


def test_math_without_boxed_answers_warns_once(tmp_path, capsys):
    """The built-in model never writes \\boxed{}: task.name=math says so once instead of scoring 0 in silence."""
    run = Run.create(config.load(TrainConfig, None, [f"run_dir={tmp_path}", "task.name=math", *TINY]), progress=False)
    first, second = run.step(), run.step()
    run.rewards.close()
    assert first["reward/mean"] == second["reward/mean"] == 0.0
    err = capsys.readouterr().err
    assert err.count("task.name=math found no \\boxed{...} answer in any of the step's 16 responses") == 1
    assert "use task.name=number" in err


def test_generated_problems_must_fit_the_model(tmp_path):
    """task.name=number's word problems are longer than the built-in model's 128 positions allow."""
    cfg = config.load(TrainConfig, None, [f"run_dir={tmp_path / 'r'}", "task.name=number", *TINY])
    message = (
        r"task.data=builtin: generated problem 0: prompt is \d+ tokens; at most 80 fit "
        r"\(model max_position_embeddings 128 minus rollout.max_new_tokens 48\)"
    )
    with pytest.raises(DataError, match=message):
        Run.create(cfg, progress=False)
    assert not (tmp_path / "r").exists()


def test_kl_penalty_to_reference(tmp_path):
    run = Run.create(
        config.load(TrainConfig, None, [f"run_dir={tmp_path}", "algorithm.kl_coef=0.1", *TINY]), progress=False
    )
    first, second = run.step(), run.step()
    run.rewards.close()
    assert first["loss/kl"] == 0.0  # the policy starts at the reference
    assert second["loss/kl"] > 0.0


def test_tensorboard_events_written(tmp_path):
    pytest.importorskip("tensorboard")
    run_dir = tmp_path / "tb"
    assert main(["train", f"run_dir={run_dir}", *TINY, "tensorboard=true", "steps=1"]) == 0
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def _mean_last(history: list[dict], key: str, n: int = 5) -> float:
    return sum(m[key] for m in history[-n:]) / n


@pytest.mark.slow
def test_fp16_pg_seq_is_raises_accuracy(tmp_path):
    run = Run.create(
        # 30 steps: accuracy +0.27 on AVX-512, +0.28 on AVX2 (the test asks for +0.2)
        config.load(TrainConfig, None, [f"run_dir={tmp_path}", "steps=30", "checkpoint_every=0", "tensorboard=false"]),
        progress=False,
    )
    history = run.train()
    first = sum(m["reward/accuracy"] for m in history[:5]) / 5
    assert _mean_last(history, "reward/accuracy") > first + 0.2


@pytest.mark.slow
def test_fp16_length_task_converges_to_eos(tmp_path):
    run = Run.create(
        config.load(
            TrainConfig,
            None,
            [f"run_dir={tmp_path}", "steps=50", "checkpoint_every=0", "task.name=length", "tensorboard=false"],
        ),
        progress=False,
    )
    history = run.train()
    assert history[0]["response/length_mean"] > 20
    assert _mean_last(history, "response/length_mean") <= 2.0


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_runs_are_bitwise_reproducible(tmp_path, precision):
    """Same config, same seed: identical metrics (the basis of exact resume), in every precision."""
    histories = []
    for name in ("a", "b"):
        cfg = config.load(
            TrainConfig,
            None,
            [f"run_dir={tmp_path / name}", f"precision={precision}", *TINY, "steps=3", "checkpoint_every=-1"],
        )
        run = Run.create(cfg, progress=False)
        histories.append([{k: v for k, v in m.items() if not k.startswith(("time/", "perf/"))} for m in run.train()])
    assert histories[0] == histories[1]


def test_a_run_logged_to_a_file_prints_lines_not_a_bars_redraws(tmp_path):
    """stderr to a file (nohup, a batch job): the bar's redraws were one line of carriage returns; a line a step
    now (about 50 in a run)."""
    out = subprocess.run(
        [sys.executable, "-m", "parity", "train", *TINY, "log.completions=0", f"run_dir={tmp_path / 'r'}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0 and "\r" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("step ") and "/4: reward " in line]
    assert [line.split(":")[0] for line in lines] == ["step 1/4", "step 2/4", "step 3/4", "step 4/4"]
