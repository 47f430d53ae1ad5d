"""What a run says as it trains, for someone coming from TRL's GRPOTrainer: the settings it trains with, on
one line at its start; a step that zeroed most of its rewards for being cut off, said so; the reward each
completion trained on, its advantage and its data row, printed and in `completions/step_N.jsonl`; and no
"trained nothing" for a step whose every answer is right."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import parity
from conftest import TINY
from parity.cli import main
from parity.rl.loop import summary_line
from parity.rl.train_config import TrainConfig

# The built-in model writes its working, then `>ANSWER` and EOS: 31 tokens for this problem, so at a limit of
# 31 every right answer is cut off before its EOS (tests/unit/test_rewards.py).
CUT_OFF = {"prompt": "954+4302=", "answer": 5256, "level": 2}
# Problems the built-in model answers right when it samples greedily (rollout.top_k=1).
SOLVED = [("0+456=", 456), ("4392+0=", 4392), ("15+413=", 428), ("3+713=", 716), ("4470+66=", 4536)]


def _rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_run_starts_with_the_settings_it_trains_with(tmp_path, capsys):
    defaults = TrainConfig()
    defaults.validate()
    a = defaults.algorithm
    assert (defaults.precision, a.name, a.advantage, a.truncated) == ("fp16", "pg_seq_is", "drgrpo", "zero_reward")
    assert main(["train", f"run_dir={tmp_path / 'cli'}", "steps=1", "log.completions=0", *TINY]) == 0
    err = capsys.readouterr().err
    line = (
        "settings: precision=fp16, algorithm.name=pg_seq_is, algorithm.advantage=drgrpo, "
        "algorithm.truncated=zero_reward (a response cut off at rollout.max_new_tokens=32 scores 0)"
    )
    assert err.count("settings: ") == 1 and line in err.splitlines()
    # From Python alike, with what was set; a resumed run says it again.
    keys = dict(steps=1, prompts_per_step=4, rollout__group_size=4, log__completions=0, tensorboard=False)
    keys.update(precision="bf16", algorithm__name="grpo", algorithm__truncated="keep", rollout__max_new_tokens=24)
    parity.train("builtin", None, run_dir=tmp_path / "api", progress=False, **keys)
    line = (
        "settings: precision=bf16, algorithm.name=grpo, algorithm.advantage=drgrpo, algorithm.truncated=keep "
        "(a response cut off at rollout.max_new_tokens=24 keeps its reward)"
    )
    assert line in capsys.readouterr().err.splitlines()
    parity.train("builtin", None, resume=tmp_path / "api", progress=False, steps=2)
    assert line in capsys.readouterr().err.splitlines()


def test_rewards_zeroed_for_being_cut_off_are_said_and_shown(tmp_path, capsys):
    """Under algorithm.truncated=zero_reward the step says that truncation zeroed its rewards, naming both
    keys, and every completion shows the reward it trained on (0) beside the score the checker gave it."""
    keys = dict(steps=2, prompts_per_step=1, rollout__group_size=8, rollout__max_new_tokens=31, tensorboard=False)
    keys.update(log__completions=8, eval__every=-1)
    parity.train("builtin", [CUT_OFF], run_dir=tmp_path / "zero", progress=False, **keys)
    out, err = capsys.readouterr()
    warnings = [line for line in err.splitlines() if "were cut off" in line]
    assert warnings == [
        "WARNING step 1: 8 of 8 responses were cut off at rollout.max_new_tokens=31 and algorithm.truncated="
        "zero_reward scored them 0; raise rollout.max_new_tokens, or set algorithm.truncated=keep to train on "
        "their rewards"
    ]  # once per streak of such steps, not every step
    rows = _rows_of(tmp_path / "zero" / "completions" / "step_000001.jsonl")
    right = [r for r in rows if r["completion"].endswith(">5256")]
    assert right, "the model answers this problem right some of the time"
    assert all(r["truncated"] and r["reward"] == 0 and r["advantage"] == 0 for r in rows)
    assert all(r["score"] == 1 for r in right) and all(r["score"] == 0 for r in rows if r not in right)
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0] == "| prompt | completion | length | reward | advantage | score |"
    assert "| 954+4302= | 4+2=6,5+0=5,9+3=12,0+4+1=5>5256 | 31 (cut off) | 0 | 0 | 1 |" in table

    # keep: the score is the reward, and the step has nothing to say of it
    parity.train("builtin", [CUT_OFF], run_dir=tmp_path / "keep", progress=False, algorithm__truncated="keep", **keys)
    assert "were cut off" not in capsys.readouterr().err
    rows = _rows_of(tmp_path / "keep" / "completions" / "step_000001.jsonl")
    assert all(r["reward"] == r["score"] for r in rows) and any(r["reward"] == 1 for r in rows)


def test_completions_hold_each_advantage_and_the_data_row(tmp_path):
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b, "level": a % 3} for a in range(100, 140) for b in range(10, 13)]
    keys = dict(steps=1, prompts_per_step=4, rollout__max_new_tokens=40, tensorboard=False, log__completions=0)
    for advantage in ("drgrpo", "grpo"):
        run = tmp_path / advantage
        parity.train("builtin", rows, run_dir=run, progress=False, algorithm__advantage=advantage, **keys)
        written = _rows_of(run / "completions" / "step_000001.jsonl")
        assert len(written) == 4 * 8
        for i in range(0, len(written), 8):  # a group: one prompt's 8 samples, one after another
            group = written[i : i + 8]
            data = next(r for r in rows if r["prompt"] == group[0]["prompt"])
            assert all(r["columns"] == {"answer": data["answer"], "level": data["level"]} for r in group)
            rewards = [r["reward"] for r in group]
            mean = sum(rewards) / 8
            std = (sum((x - mean) ** 2 for x in rewards) / 7) ** 0.5
            for r in group:
                want = r["reward"] - mean if advantage == "drgrpo" else (r["reward"] - mean) / (std + 1e-6)
                assert r["advantage"] == pytest.approx(want, abs=1e-5)
        assert any(r["advantage"] != 0 for r in written)
    # `parity report` reads them and shows the advantage beside the reward
    assert main(["report", str(tmp_path / "grpo"), "--out", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert "| prompt | completion | length | reward | advantage | score |" in report


def test_a_step_whose_every_answer_is_right_does_not_say_it_trained_nothing(tmp_path, capsys):
    rows = [{"prompt": p, "answer": a} for p, a in SOLVED]
    keys = dict(steps=1, prompts_per_step=4, rollout__group_size=4, rollout__top_k=1, eval__every=-1)
    result = parity.train("builtin", rows, run_dir=tmp_path / "r", progress=False, tensorboard=False, **keys)
    metrics = result.history[0]
    assert metrics["reward/accuracy"] == 1 and metrics["groups/zero_variance_frac"] == 1
    assert "trained nothing" not in capsys.readouterr().err
    # all wrong (a checker's answer no response gives): said, as before
    rows = [{"prompt": p, "answer": a + 1} for p, a in SOLVED]
    result = parity.train("builtin", rows, run_dir=tmp_path / "w", progress=False, tensorboard=False, **keys)
    assert result.history[0]["reward/accuracy"] == 0
    assert "every advantage is 0 and the step trained nothing" in capsys.readouterr().err


def test_the_last_line_names_a_resumed_runs_first_step():
    def step(n, acc):
        return {"step": n, "reward/accuracy": acc, "response/length_mean": 30.0, "mismatch/k3": 1e-7}

    fresh = summary_line([step(1, 0.5), step(2, 0.75)])
    assert fresh == "step 2: reward/accuracy 0.500 -> 0.750, response length 30.0, mismatch k3 1.00e-07"
    resumed = summary_line([step(32, 0.8), step(33, 0.9)])
    assert resumed.startswith("step 33: reward/accuracy 0.800 (step 32) -> 0.900, ")
