"""The perfectible filter, `parity sanity --quick` end to end, and `parity report`."""

from __future__ import annotations

import json
import os
import re

import pytest
from PIL import Image

from parity import config
from parity.cli import main
from parity.commands.perfectible import filter_perfectible, format_histogram, histogram
from parity.commands.sanity import SanityOptions, parse_runs, reading, run_sanity, train_runs
from parity.config import ConfigError
from parity.engines.models.io import BUILTIN_DIR
from parity.rl.loop import TrainingError
from parity.rl.train_config import TrainConfig


def test_filter_on_known_accuracies():
    # A synthetic checker's per-problem accuracies over 16 samples: 0/16 ... 16/16.
    accuracies = [k / 16 for k in range(17)]
    keep = filter_perfectible(accuracies, 0.2, 0.8)
    assert keep == list(range(4, 13))  # 4/16 = 0.25 is the first >= 0.2; 12/16 = 0.75 the last <= 0.8
    assert filter_perfectible([0.2, 0.8, 0.19, 0.81], 0.2, 0.8) == [0, 1]  # both ends inclusive
    counts = histogram(accuracies + [0.5], 16)
    assert counts[8] == 2 and sum(counts) == 18
    text = format_histogram(counts, 0.2, 0.8)
    assert " 8/16 * " in text and " 3/16   " in text


def test_perfectible_command_on_user_data(tmp_path, monkeypatch, capsys):
    """The search goes through the cache `parity sanity` reads: run again it is read back, and an edited
    data file is searched anew."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{a}+{a + 7}=", "answer": str(2 * a + 7)}) + "\n" for a in range(100, 124))
    )
    out = tmp_path / "set.jsonl"
    args = ["perfectible", f"data={data}", "samples=8", f"out={out}", "lo=0", "hi=1"]
    assert main(args) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 24 and all(0 <= r["base_accuracy"] <= 1 for r in rows)
    assert "kept 24 of 24 problems (measured now)" in capsys.readouterr().out
    out.unlink()
    assert main(args) == 0 and [json.loads(x) for x in out.read_text().splitlines()] == rows
    assert "kept 24 of 24 problems (the search of " in capsys.readouterr().out
    # Other bounds filter the same search.
    assert main([*args[:-2], "lo=0.5", "hi=1"]) == 0
    kept = [json.loads(x) for x in out.read_text().splitlines()]
    assert kept == [r for r in rows if r["base_accuracy"] >= 0.5]
    assert f"kept {len(kept)} of 24 problems (the search of " in capsys.readouterr().out
    data.write_text(data.read_text().splitlines(keepends=True)[0])
    assert main(args) == 0 and "kept 1 of 1 problems (measured now)" in capsys.readouterr().out


def test_sanity_of_a_model_that_solves_nothing_says_so(tmp_path, monkeypatch, llama_dir, capsys):
    """A random model solves none of the word problems: no perfectible set, and the error says why."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = ["sanity", "--out", str(tmp_path / "s"), "--model", str(llama_dir), "--max-new-tokens", "8"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"--model {llama_dir} --task number: no perfectible problem" in err and "--max-new-tokens" in err


def test_a_bad_override_fails_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert main(["sanity", "--out", str(tmp_path / "s"), "--runs", "fp16/grpo", "trainer.lr=fast"]) == 2
    assert "trainer.lr: expected a number, got 'fast'" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "s" / "perfectible.jsonl").exists()
    with pytest.raises(ConfigError, match="only the generated word problems of task=number"):
        run_sanity(SanityOptions(tmp_path / "s", [("fp16", "grpo")], quick=True, difficulty="easy"))


def test_bad_runs_are_rejected():
    assert parse_runs("fp16/pg_seq_is, bf16/grpo") == [("fp16", "pg_seq_is"), ("bf16", "grpo")]
    with pytest.raises(ConfigError, match="'fp16-grpo' is not PRECISION/ESTIMATOR"):
        parse_runs("fp16-grpo")
    with pytest.raises(ConfigError, match="'bf16/ppo' is not"):
        parse_runs("bf16/ppo")


@pytest.mark.slow
def test_sanity_quick_end_to_end(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "sanity"
    # The built-in model named as a directory, and its task named: what `--model DIR` runs.
    model = ["--model", str(BUILTIN_DIR), "--task", "builtin"]
    runs = ["--runs", "fp16/pg_seq_is,bf16/grpo"]
    assert main(["sanity", "--quick", "--out", str(out), *runs, *model, "steps=8"]) == 0
    # What it prints: a line per run and the summary; no completions table, no run's settings line (the test
    # says the settings its runs share once), and no step "trained nothing" for being all right.
    printed = capfd.readouterr()
    text = printed.out + printed.err
    assert "| prompt |" not in text and "trained nothing" not in text and "settings: " not in text
    assert text.count("training 2 runs, ") == 1
    assert "algorithm.truncated=zero_reward at rollout.max_new_tokens=96" in text
    done = [line for line in printed.out.splitlines() if line.startswith("run ")]
    assert sorted(line.split(" done: ")[1].split(" (")[0] for line in done) == ["bf16/grpo", "fp16/pg_seq_is"]
    assert all(re.fullmatch(r"run [12]/2 done: \S+ \(8 steps, last step's accuracy \d\.\d\d\)", line) for line in done)
    for run in ("fp16-pg_seq_is", "bf16-grpo"):  # the completions stay in the files
        assert len(list((out / "runs" / run / "completions").glob("step_*.jsonl"))) == 8
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["model"] == str(BUILTIN_DIR) and summary["settings"]["task"] == "builtin"
    # The override reached every run; the built-in model named as a directory keeps its learning rate.
    assert summary["settings"]["steps"] == 8 and summary["settings"]["lr"] == 2e-4
    assert summary["perfectible"]["num_problems"] >= 64
    assert set(summary["runs"]) == {"fp16/pg_seq_is", "bf16/grpo"}
    for s in summary["runs"].values():
        assert s["steps"] == summary["settings"]["steps"]
        assert 0 <= s["final_accuracy"] <= 1 and s["final_mismatch_k3"] >= 0
        assert s["steps_to_95"] is None or 1 <= s["steps_to_95"] <= s["steps"]
        assert isinstance(s["skipped_fp16_steps"], int)
    report = (out / "report.md").read_text()
    assert "## Perfectible set" in report and "fp16/pg_seq_is" in report
    for png in ("accuracy.png", "mismatch.png", "mismatch_scatter.png", "perfectible_histogram.png"):
        with Image.open(out / png) as img:
            assert img.size[0] > 300 and img.size[1] > 200
    # A second run reuses the cached perfectible set.
    cached = list((tmp_path / "cache" / "parity").glob("perfectible-*.jsonl"))
    assert len(cached) == 1

    # `parity report` over the runs sanity made with `parity train`.
    runs = sorted((out / "runs").iterdir())
    rep = tmp_path / "report"
    assert main(["report", *map(str, runs), "--out", str(rep)]) == 0
    assert set(json.loads((rep / "summary.json").read_text())) == {r.name for r in runs}
    assert (rep / "accuracy.png").stat().st_size > 0


def test_report_rejects_a_non_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_the_reading_follows_the_measured_gap():
    def summary(seq):
        runs = {"fp16/grpo": {"steps_to_95": 30}, "bf16/grpo": {"steps_to_95": None}}
        base = {
            "fp16": {"k3": 1e-5, "token_abs_log_ratio_mean": 5e-3, "seq_abs_log_ratio": 0.01, "is_ess": 0.99},
            "bf16": {
                "k3": 7e-4,
                "token_abs_log_ratio_mean": 4e-2,
                "seq_abs_log_ratio": seq,
                "is_ess": 0.7,
            },
        }
        return "\n".join(reading({"runs": runs, "base_mismatch": base}))

    small, large = summary(0.016), summary(0.47)
    assert "Runs that did not reach 95%: bf16/grpo." in small and "No BF16 run reached 95%." in small
    assert "70× FP16's in k3" in small and "within 1.6% of 1" in small and "barely biases" in small
    assert "within 60.0% of 1" in large and "A gap that large biases the gradient" in large
    assert "barely" not in large


def test_a_training_process_that_dies_is_named_with_what_to_change(tmp_path, monkeypatch):
    """A run's process killed outright (here: its reward calls os._exit, as the OOM killer would end it)
    stops the sanity test with the runs it lost and what to change, not a BrokenProcessPool traceback."""
    (tmp_path / "dies.py").write_text("import os\n\n\ndef reward(prompt, response, answer):\n    os._exit(9)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    keys = ["steps=1", "prompts_per_step=2", "rollout.group_size=2", "checkpoint_every=-1", "tensorboard=false"]
    keys += ["task.reward_fn=dies:reward", "reward.isolate=never"]
    configs = {n: config.load(TrainConfig, None, [*keys, f"run_dir={tmp_path / 'runs' / n}"]) for n in ("a", "b")}
    with pytest.raises(TrainingError, match=r"ended abruptly .* while a, b had not finished.*--jobs 1"):
        train_runs(configs, jobs=2, log=lambda line: None)
