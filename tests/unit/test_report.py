"""`parity report` on runs that were killed, corrupted or never logged a step."""

from __future__ import annotations

import json

import pytest
import torch

from parity.cli import main


def metrics_line(step: int) -> str:
    return json.dumps(
        {
            "step": step,
            "reward/accuracy": step / 20,
            "time/step": 1.5,
            "mismatch/k3": 1e-4,
            "mismatch/seq_abs_log_ratio": 1e-3,
            "mismatch/token_abs_log_ratio_max": 2e-3,
            "precision/skipped_steps": 0,
        }
    )


def make_run(tmp_path, metrics: str | None):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("steps: 20\n")
    if metrics is not None:
        (run / "metrics.jsonl").write_text(metrics)
    return run


def report(tmp_path, run, capsys) -> tuple[int, list[str]]:
    code = main(["report", str(run), "--out", str(tmp_path / "out")])
    return code, capsys.readouterr().err.splitlines()


def test_killed_run_skips_the_cut_short_last_line(tmp_path, capsys):
    lines = "".join(metrics_line(s) + "\n" for s in range(1, 13))
    run = make_run(tmp_path, lines + metrics_line(13)[:25])
    code, err = report(tmp_path, run, capsys)
    assert code == 0
    cut = "incomplete last line (the run is writing it, or was killed mid-write)"
    assert err == [f"{run}/metrics.jsonl:13: {cut}; reporting steps 1-12"]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["run"]["steps"] == 12
    assert (tmp_path / "out" / "report.md").is_file()


def test_corrupt_middle_line_is_an_error(tmp_path, capsys):
    run = make_run(tmp_path, metrics_line(1) + "\n" + metrics_line(2)[:25] + "\n" + metrics_line(3) + "\n")
    code, err = report(tmp_path, run, capsys)
    assert code == 2
    assert err == [
        f"parity report: error: {run}/metrics.jsonl:2: corrupt line (not valid JSON); "
        "only a killed run's last line may be cut short"
    ]
    assert not (tmp_path / "out" / "report.md").exists()


def test_run_without_steps_is_an_error(tmp_path, capsys):
    run = make_run(tmp_path, None)
    code, err = report(tmp_path, run, capsys)
    assert (code, err) == (2, [f"parity report: error: {run}: no metrics.jsonl; the run has logged no step yet"])
    (run / "metrics.jsonl").write_text(metrics_line(1)[:25])  # killed while writing its first step
    code, err = report(tmp_path, run, capsys)
    assert (code, err) == (2, [f"parity report: error: {run}/metrics.jsonl: no complete step yet"])
    code, err = report(tmp_path, tmp_path / "elsewhere", capsys)
    assert code == 2 and err[0].endswith("no metrics.jsonl; is this a `parity train` run directory?")


def _completion_row(**changes) -> dict:
    row = {"step": 12, "prompt": "1+1=", "completion": "2", "length": 1, "truncated": False, "reward": 1.0}
    return row | {"reward/score": 1.0} | changes


def _hostile_completions() -> dict[str, tuple[int, list]]:
    """completions files `parity report` must refuse, by name: (the line to name, the rows). Each field the
    table reads goes missing or takes a value of each wrong kind, a row is not an object, or a later row lacks
    a score of the first's."""
    from parity.rl.completions import ROW_FIELDS

    kinds = {"string": "x", "true": True, "null": None, "list": [1], "object": {"a": 1}, "fraction": 0.5}
    kinds["past a float"] = 10**400
    cases = {}
    for key, _, ok in ROW_FIELDS:
        base = _completion_row()
        cases[f"no {key}"] = (2, [base, {k: v for k, v in base.items() if k != key}])
        for name, value in kinds.items():
            if not ok(value):
                cases[f"{key}={name}"] = (1, [_completion_row(**{key: value})])
    for name, value in kinds.items():
        cases[f"a row that is {name}"] = (2, [_completion_row(), value])
    without = {k: v for k, v in _completion_row().items() if k != "reward/score"}
    cases["a later row without a score of the first's"] = (2, [_completion_row(), without])
    cases["a later row with a score that is no number"] = (
        3,
        [_completion_row()] * 2 + [_completion_row(**{"reward/score": "x"})],
    )
    return cases


HOSTILE_COMPLETIONS = _hostile_completions()


@pytest.mark.parametrize("case", HOSTILE_COMPLETIONS)
def test_a_completions_file_with_bad_rows_is_one_line_before_anything_is_written(tmp_path, capsys, case):
    """Rows missing keys used to end `parity report` in a KeyError, after its plots were written."""
    lineno, rows = HOSTILE_COMPLETIONS[case]
    run = make_run(tmp_path, "".join(metrics_line(s) + "\n" for s in range(1, 13)))
    (run / "completions").mkdir()
    path = run / "completions" / "step_000012.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    code, err = report(tmp_path, run, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"parity report: error: {path}:{lineno}: not a completion row as Parity writes them (")
    assert not (tmp_path / "out").exists()


def test_a_report_shows_the_newest_completions(tmp_path, capsys):
    run = make_run(tmp_path, "".join(metrics_line(s) + "\n" for s in range(1, 13)))
    (run / "completions").mkdir()
    rows = [_completion_row(completion="the answer is 2"), _completion_row(truncated=True, reward=0)]
    (run / "completions" / "step_000012.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert report(tmp_path, run, capsys) == (0, [])
    shown = (tmp_path / "out" / "report.md").read_text()
    assert "completions of step 12" in shown and "the answer is 2" in shown and "1 (cut off)" in shown


def _history(accuracies: list[float], k3: float) -> list[dict]:
    return [
        {**json.loads(metrics_line(i + 1)), "reward/accuracy": a, "mismatch/k3": k3} for i, a in enumerate(accuracies)
    ]


def test_a_run_that_falls_after_its_best_is_called_a_collapse():
    from parity.commands.report import summarize
    from parity.commands.sanity import _verdict, reading

    rises = [0.5, 0.7, 0.9, 1.0, 1.0, 1.0, 1.0]
    runs = {
        "fp16-exact/pg_seq_is": summarize(_history([*rises, 0.3, 0.0, 0.0, 0.0, 0.0], k3=0.0)),
        "bf16/grpo": summarize(_history([*rises, 0.9, 1.0, 0.95, 1.0, 1.0], k3=1e-4)),
    }
    collapsed, steady = runs["fp16-exact/pg_seq_is"], runs["bf16/grpo"]
    # The 5-step average peaks at 0.98 (steps 3-7) and first drops below half of it at step 10: (1 + 1 + .3) / 5.
    assert collapsed["collapse_step"] == 10 and steady["collapse_step"] is None
    assert "Then it collapsed: below half its best (0.98) from step 10, 0.06 at the end." in _verdict(
        "fp16-exact/pg_seq_is", collapsed
    )
    text = "\n".join(reading({"runs": runs, "base_mismatch": {}}))
    assert "Collapsed after their best: fp16-exact/pg_seq_is" in text and "not the precision gap" in text
    assert "both converge" not in text
    runs.pop("fp16-exact/pg_seq_is")
    assert "both converge" in "\n".join(reading({"runs": runs, "base_mismatch": {}}))
    # A run that never learned (best 0.3) is not said to collapse, nor is a mean reward, which may be negative.
    assert summarize(_history([0.1, 0.3, 0.3, 0.3, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0], k3=0.0))["collapse_step"] is None
    rewards = [{k: v for k, v in m.items() if k != "reward/accuracy"} for m in _history([-0.4] * 6 + [-0.1] * 6, 0.0)]
    for m, value in zip(rewards, [-0.4] * 6 + [-0.1] * 6):
        m["reward/mean"] = value
    assert summarize(rewards)["collapse_step"] is None


def test_runs_of_one_folder_name_are_told_apart_and_the_same_run_twice_is_refused(tmp_path, capsys):
    """`report a/run b/run` reported one run: both are kept, labelled by as much of their path as differs."""
    runs = []
    for parent in ("a", "b"):
        (tmp_path / parent).mkdir()
        runs.append(make_run(tmp_path / parent, "".join(metrics_line(s) + "\n" for s in (1, 2))))
    assert main(["report", *map(str, runs), "--out", str(tmp_path / "out")]) == 0
    assert sorted(json.loads((tmp_path / "out" / "summary.json").read_text())) == ["a/run", "b/run"]
    assert main(["report", str(runs[0]), str(runs[0]), "--out", str(tmp_path / "out2")]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"{runs[0]}: the same run given twice")
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("value", ["high", None, "missing"])
def test_a_step_whose_accuracy_is_no_number_is_named_by_its_line(tmp_path, capsys, value):
    """The first step logs an accuracy, a later one holds text, null or none: one line (it was a traceback)."""
    second = json.loads(metrics_line(2))
    if value == "missing":
        del second["reward/accuracy"]
    else:
        second["reward/accuracy"] = value
    run = make_run(tmp_path, metrics_line(1) + "\n" + json.dumps(second) + "\n")
    code, err = report(tmp_path, run, capsys)
    assert code == 2 and err[-1].endswith(
        "metrics.jsonl:2: expected a JSON object of metrics with a number for 'reward/accuracy'"
    )


def test_a_best_short_of_95_percent_does_not_read_as_95():
    """A best of 0.946875 was printed 0.95 beside 'steps to 95%: —' and 'did not reach 95%'."""
    from parity.commands.report import summarize, summary_table
    from parity.commands.sanity import _verdict

    run = summarize(_history([0.9, 0.946875, 0.946875, 0.946875, 0.946875, 0.946875], k3=0.0))
    assert run["steps_to_95"] is None and "(0.946) | — |" in summary_table({"r": run})
    assert _verdict("r", run).endswith("(best 0.946).")
    # A best equal to the final reads as the final does (it was rounded down beside a final rounded up)
    done = summarize(_history([0.9890625] * 6, k3=0.0))
    assert "0.99 → 0.99 (0.99)" in summary_table({"r": done})


def test_a_mean_reward_has_no_steps_to_95_percent():
    """A reward of 0 to 5 passed 0.95 at its first step: "steps to 95%: 1" of a run that had no accuracy."""
    from parity.commands.report import summarize

    rewards = [{k: v for k, v in m.items() if k != "reward/accuracy"} for m in _history([0.0] * 6, 0.0)]
    for m in rewards:
        m["reward/mean"] = 4.0
    run = summarize(rewards)
    assert run["metric"] == "reward/mean" and run["steps_to_95"] is None and run["seconds_to_95"] is None


def test_a_signed_estimate_gets_no_ratio_to_fp16():
    """chi2_token read "-0.000526 (-14.2× fp16)": a ratio of an estimate below its mean says nothing."""
    from parity.commands.mismatch import TABLE_METRICS, PairResult, markdown_table

    def pair(precision: str, chi2: float) -> PairResult:
        metrics = {k: 1e-6 for k in TABLE_METRICS} | {"chi2_token": chi2}
        empty = torch.zeros(1, 1)
        return PairResult(precision, precision, metrics, {}, 1, 1, 0.0, empty, empty, empty.bool())

    table = markdown_table([pair("fp16", 3.7e-5), pair("bf16", -5.26e-4)])
    assert "-0.000526 |" in table and "-14.2" not in table and "(1× fp16)" in table
