"""`parity report` on runs that were killed, corrupted or never logged a step."""

from __future__ import annotations

import json

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
    assert err == [f"{run}/metrics.jsonl:13: incomplete last line (the run was killed mid-write); reporting steps 1-12"]
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
