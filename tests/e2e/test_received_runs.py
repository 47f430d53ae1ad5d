"""Received run folders and output folders (issue 54): a link anywhere below a run folder is refused in one line
naming it, before anything is written, deleted or read through it; an output folder's mark authorises
overwriting only the bytes Parity wrote; a FIFO or an over-long line is refused, not waited on or held."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import copy_run
from parity.cli import main
from parity.outdir import MARK

SECRET = "PARITY-TEST-SECRET-7f3a"


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode() + (p.read_bytes() if p.is_file() and not p.is_symlink() else b"/"))
    return h.hexdigest()


def _one_line(argv: list[str], capsys, *expected: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("parity ")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert all(e in lines[0] for e in expected), lines[0]
    return lines[0]


def _holding_secret(root: Path, secret_file: Path) -> list[Path]:
    """Files under `root`, other than the secret itself, that hold its bytes."""
    return [
        p
        for p in root.rglob("*")
        if p.is_file() and not p.is_symlink() and p != secret_file and SECRET.encode() in p.read_bytes()
    ]


@pytest.fixture
def home(tmp_path) -> Path:
    """The user's own folder beside the received run: a private key, and a folder of results."""
    folder = tmp_path / "home"
    (folder / "results" / "step_000001").mkdir(parents=True)
    (folder / "results" / "step_000001" / "table.csv").write_text("mine\n")
    (folder / "id_rsa").write_text(f"{SECRET}\n")
    return folder


# Each entry of a run folder that Parity writes, prunes or reads, replaced by a link to the user's ({newest}: the
# newest checkpoint's step). benchmarks/faults.py tries them too.
LINKED = {
    "checkpoints": "results",
    ".lock": "id_rsa",
    "completions": "results",
    "checkpoints/corrupt": "results",
    "tensorboard": "results",
    "metrics.jsonl": "id_rsa",
    "config.yaml": "id_rsa",
    "numerics.json": "id_rsa",
    "completions/{newest}.jsonl": "id_rsa",
    "checkpoints/{newest}/model/model.safetensors": "id_rsa",
}


def link_in(run: Path, entry: str, target: Path) -> None:
    """Replace `entry` of the run folder `run` (whatever it is, or nothing) with a link to `target`."""
    if (run / entry).is_dir():
        shutil.rmtree(run / entry)
    elif (run / entry).exists():
        (run / entry).unlink()
    (run / entry).parent.mkdir(parents=True, exist_ok=True)
    (run / entry).symlink_to(target)


def _received(tiny_run: Path, tmp_path: Path, home: Path, entry: str) -> tuple[Path, str]:
    run = copy_run(tiny_run, tmp_path / "received")
    name = entry.format(newest="step_000002")
    link_in(run, name, home / LINKED[entry])
    return run, name


@pytest.mark.parametrize("entry", sorted(LINKED))
def test_a_received_run_holding_a_link_is_refused_by_resume_eval_and_report(entry, tiny_run, tmp_path, home, capsys):
    run, entry = _received(tiny_run, tmp_path, home, entry)
    before, theirs = _digest(run), _digest(home)
    out = tmp_path / "out"
    _one_line(["train", "--resume", str(run), "steps=3", "keep_checkpoints=1"], capsys, f"{entry} is a symbolic link")
    if entry != "config.yaml":  # without its config.yaml the folder is no run that eval or report take
        _one_line(["eval", str(run), "num_prompts=2", "samples=1", f"out={out}"], capsys, f"{entry} is a symbolic")
        _one_line(["report", str(run), "--out", str(out)], capsys, f"{entry} is a symbolic link")
    assert _digest(home) == theirs and _digest(run) == before and not out.exists()
    assert _holding_secret(tmp_path, home / "id_rsa") == []


def test_a_linked_completions_file_is_never_copied_into_a_report(tiny_run, tmp_path, home, capsys):
    run = copy_run(tiny_run, tmp_path / "received")
    (newest := sorted((run / "completions").iterdir())[-1]).unlink()
    newest.symlink_to(home / "id_rsa")
    _one_line(["report", str(run), "--out", str(tmp_path / "out")], capsys, f"completions/{newest.name} is a")
    assert _holding_secret(tmp_path, home / "id_rsa") == [] and not (tmp_path / "out").exists()


def test_the_run_folder_itself_may_be_a_link_the_user_made(tiny_run, tmp_path, capsys):
    run = copy_run(tiny_run, tmp_path / "disks" / "big" / "run")
    link = tmp_path / "run"
    link.symlink_to(run)
    assert main(["train", "--resume", str(link), "steps=3", "keep_checkpoints=1"]) == 0
    assert main(["report", str(link), "--out", str(tmp_path / "out")]) == 0
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000003"]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("name", ["metrics.jsonl", "completions/step_000002.jsonl"])
def test_a_fifo_in_a_run_is_refused_not_waited_on(name, tiny_run, tmp_path, capsys):
    run = copy_run(tiny_run, tmp_path / "run")
    (run / name).unlink()
    os.mkfifo(run / name)
    _one_line(["report", str(run), "--out", str(tmp_path / "out")], capsys, "not a regular file")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["metrics.jsonl", "completions/step_000002.jsonl"])
def test_an_over_long_line_in_a_run_is_refused_by_its_length(name, tiny_run, tmp_path, capsys):
    run = copy_run(tiny_run, tmp_path / "run")
    with open(run / name, "ab") as f:
        f.write(b"1" * (17 * 2**20) + b"\n")
    _one_line(["report", str(run), "--out", str(tmp_path / "out")], capsys, "17,825,792 bytes")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- output folders


def _users_results(out: Path) -> None:
    out.mkdir()
    for name in ("report.md", "summary.json", "notes.md"):
        (out / name).write_text(f"the user's {name}\n")


@pytest.mark.parametrize(
    "mark",
    [
        {"written_by": "parity", "names": ["report.md", "summary.json", "notes.md"]},  # the old form, names only
        {"written_by": "parity", "files": {n: ["0" * 64] for n in ("report.md", "summary.json", "notes.md")}},
        {"written_by": "parity", "files": {}, "folders": ["report.md", "summary.json", "notes.md"]},
    ],
    ids=["names", "wrong hashes", "files as folders"],
)
def test_a_forged_mark_authorises_nothing(mark, tiny_run, tmp_path, capsys):
    out = tmp_path / "out"
    _users_results(out)
    (out / MARK).write_text(json.dumps(mark))
    before = _digest(out)
    _one_line(["report", str(tiny_run), "--out", str(out)], capsys, "holds files Parity did not write")
    assert _digest(out) == before


def test_a_file_changed_since_parity_wrote_it_is_not_overwritten(tiny_run, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["report", str(tiny_run), "--out", str(out)]) == 0
    assert main(["report", str(tiny_run), "--out", str(out)]) == 0  # its own files, unchanged: written again
    (out / "report.md").write_text("my edits\n")
    _one_line(["report", str(tiny_run), "--out", str(out)], capsys, "holds files Parity did not write (report.md)")
    assert (out / "report.md").read_text() == "my edits\n"


@pytest.mark.parametrize("planted", [".accuracy.png.fig.tmp", ".report.md.0badc0de.tmp", "runs"])
def test_a_link_planted_in_an_output_folder_is_refused(planted, tiny_run, tmp_path, home, capsys):
    out = tmp_path / "out"
    assert main(["report", str(tiny_run), "--out", str(out)]) == 0
    (out / planted).symlink_to(home / "id_rsa")
    theirs = _digest(home)
    _one_line(["report", str(tiny_run), "--out", str(out)], capsys, f"{planted} is a symbolic link")
    assert _digest(home) == theirs
