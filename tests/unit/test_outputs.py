"""Parity writes and deletes only what it wrote: an output folder holding a user's files is refused before any
work, a folder Parity wrote is written again, and a refused command writes nothing (issue 43)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import copy_run
from parity.builtin.build import BuildConfig, build_model
from parity.cli import main
from parity.config import ConfigError
from parity.engines.models.io import BUILTIN_DIR
from parity.outdir import MARK, claim_output_dir
from parity.rundir import remove_run

QUICK_MISMATCH = ["num_prompts=2", "group_size=1", "pairs=[fp32/fp32]", "sampling.max_new_tokens=8"]


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode() + (p.read_bytes() if p.is_file() else b"/"))
    return h.hexdigest()


def _users_folder(path: Path, *names: str) -> Path:
    """A folder of the user's holding `names` (results of their own under Parity's names, say) and a thesis."""
    for name in (*names, "thesis.tex"):
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(f"the user's {name}\n")
    return path


def _refused(argv: list[str], capsys, message: str) -> None:
    assert main(argv) == 2, argv
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("parity ")]
    assert len(lines) == 1 and message in lines[0], lines


COMMANDS = {
    "mismatch": (["mismatch", *QUICK_MISMATCH, "out=OUT"], "mismatch.json"),
    "eval": (
        ["eval", "builtin", "num_prompts=2", "samples=1", "max_new_tokens=8", "precisions=[fp32]", "out=OUT"],
        "eval.json",
    ),
    "doctor": (["doctor", "--prompts", "1", "--out", "OUT"], "doctor.json"),
    "sanity": (["sanity", "--quick", "--runs", "fp16/grpo", "--out", "OUT"], "summary.json"),
    "phantom": (["phantom", "--steps", "1", "--out", "OUT"], "summary.json"),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_output_folder_of_the_users_is_refused_untouched(command, tmp_path, capsys):
    argv, result = COMMANDS[command]
    out = _users_folder(tmp_path / "mine", result, "runs/fp16-grpo/config.yaml" if command == "sanity" else "a.txt")
    before = _digest(out)
    _refused([a.replace("OUT", str(out)) for a in argv], capsys, "holds files Parity did not write")
    assert _digest(out) == before


def _users_folder_with(path: Path, relative: str) -> None:
    (path / relative).parent.mkdir(parents=True, exist_ok=True)
    (path / relative).write_text("mine\n")


def test_an_output_folder_parity_wrote_is_written_again_and_a_users_file_added_there_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["mismatch", *QUICK_MISMATCH, f"out={out}"]
    assert main(argv) == 0 and (out / MARK).is_file()
    assert main(argv) == 0  # its own folder: written again
    (out / "notes.md").write_text("mine\n")
    capsys.readouterr()
    _refused(argv, capsys, "holds files Parity did not write (notes.md)")
    assert (out / "notes.md").read_text() == "mine\n"


def test_what_a_kill_left_as_parity_wrote_its_mark_is_parity_s(tmp_path):
    """A kill while the mark was written left its temporary file, and the folder was refused from then on as
    holding a file Parity did not write; the next command takes the folder and removes what was left."""
    out = tmp_path / "out"
    claim_output_dir(out, "report")
    leftover = out / f".{MARK}.65b189ca.tmp"
    leftover.write_text("{")
    (out / ".notes.65b189ca.tmp").write_text("mine: not a file the mark records\n")
    with pytest.raises(ConfigError, match=r"holds files Parity did not write \(\.notes\.65b189ca\.tmp\)"):
        claim_output_dir(out, "report")
    (out / ".notes.65b189ca.tmp").unlink()
    claim_output_dir(out, "report")
    assert not leftover.exists() and (out / MARK).is_file()


def test_an_output_folder_another_process_writes_is_refused_until_it_ends(tmp_path, capsys):
    """Two commands writing one folder at once mixed their results and rewrote the mark each from its own view,
    recording files with the other's bytes: the folder was then refused as holding files Parity did not write."""
    out = tmp_path / "out"
    claim = f"import parity.outdir as o, pathlib; o.claim_output_dir(pathlib.Path({str(out)!r}), 'report'); input()"
    writer = subprocess.Popen(
        [sys.executable, "-c", claim],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")},
    )
    try:
        while not (out / MARK).exists():
            assert writer.poll() is None
            time.sleep(0.05)
        before = _digest(out)
        _refused(["report", "x", "--out", str(out)], capsys, f"in use by another Parity command (pid {writer.pid})")
        with pytest.raises(ConfigError, match=rf"in use by another Parity command \(pid {writer.pid}\)"):
            claim_output_dir(out, "report")
        assert _digest(out) == before
    finally:
        writer.communicate(b"\n")
    claim_output_dir(out, "report")  # the writer ended: its lock went with it


# Each command's input that only its work finds bad: a run with no metrics.jsonl, a model that is not there.
BAD_WORK = {
    "report": ["report", "NOWHERE", "--out", "OUT"],
    "eval": ["eval", "NOWHERE", "out=OUT"],
    "mismatch": ["mismatch", "model=NOWHERE", "out=OUT"],
    "doctor": ["doctor", "--model", "NOWHERE", "--out", "OUT"],
    "sanity": ["sanity", "--quick", "--model", "NOWHERE", "--out", "OUT"],
    "phantom": ["phantom", "--model", "NOWHERE", "--out", "OUT"],
}


def _bad_work(command: str, out: Path, tmp_path: Path) -> list[str]:
    return [a.replace("NOWHERE", str(tmp_path / "nowhere")).replace("OUT", str(out)) for a in BAD_WORK[command]]


@pytest.mark.parametrize("command", BAD_WORK)
def test_a_second_command_on_a_held_out_folder_is_refused_before_its_work_naming_the_holder(command, tmp_path, capsys):
    """A command held its --out folder only once it came to write: a second given the same folder did all its
    work (minutes) before it was refused, without saying by whom. Each now holds the folder before its work: the
    second is refused at once (here before it meets its own bad input), naming the holder's pid."""
    out = tmp_path / "out"
    hold = (
        "import pathlib, parity.outdir as o\n"
        f"with o.held_output_dir(pathlib.Path({str(out)!r}), 'eval', 'out'):\n    print(flush=True); input()"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    holder = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        holder.stdout.readline()  # the folder is made and held, nothing written in it yet
        _refused(
            _bad_work(command, out, tmp_path), capsys, f"{out}: in use by another Parity command (pid {holder.pid})"
        )
        assert list(out.iterdir()) == []
    finally:
        holder.communicate(b"\n")


@pytest.mark.parametrize("command", BAD_WORK)
def test_a_command_whose_work_finds_bad_input_leaves_no_out_folder(command, tmp_path, capsys):
    """The --out folder, made before the work to hold it, goes again with the folders made for it when the
    work refuses its input: nothing is left of a refused command."""
    out = tmp_path / "new" / "out"
    assert main(_bad_work(command, out, tmp_path)) == 2
    assert "nowhere" in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_report_refuses_a_missing_run_without_creating_its_folder(tiny_run, tmp_path, capsys):
    out = tmp_path / "rep"
    _refused(["report", str(tmp_path / "no-such-run"), "--out", str(out)], capsys, "no metrics.jsonl")
    assert not out.exists()
    run = tiny_run
    mine = _users_folder(tmp_path / "mine", "report.md")
    _refused(["report", str(run), "--out", str(mine)], capsys, "holds files Parity did not write")
    assert (mine / "report.md").read_text() == "the user's report.md\n"
    assert main(["report", str(run), "--out", str(out)]) == 0 and (out / "report.md").is_file()


def test_a_result_that_cannot_be_written_for_its_size_is_named_in_one_line(tiny_run, tmp_path):
    """A write past a file-size limit (or a full disk) was `parity report: error: File too large`, naming no file."""
    limit = functools.partial(resource.setrlimit, resource.RLIMIT_FSIZE, (8_000, 8_000))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    argv = [sys.executable, "-m", "parity", "report", str(tiny_run), "--out", str(tmp_path / "rep")]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, preexec_fn=limit)
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        f"parity report: error: {tmp_path / 'rep' / 'accuracy.png'}: File too large"
    )
    assert "Traceback" not in done.stderr and [p.name for p in (tmp_path / "rep").iterdir()] == [MARK]


def test_perfectible_replaces_only_a_set_it_wrote(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "set.jsonl"
    out.write_text('{"prompt": "mine", "answer": "1"}\n')
    argv = ["perfectible", "num_candidates=4", "samples=2", f"out={out}"]
    _refused(argv, capsys, "set.jsonl:1 is not a row of a perfectible set")
    assert out.read_text() == '{"prompt": "mine", "answer": "1"}\n'
    out.unlink()
    assert main(argv) == 0 and main(argv) == 0  # a set it wrote is replaced
    assert all(json.loads(x).keys() == {"prompt", "answer", "base_accuracy"} for x in out.read_text().splitlines())


def test_perfectible_refuses_where_it_cannot_write_before_its_search(tmp_path, capsys, monkeypatch):
    """An out, or a cache folder, it could not write was found after the whole search (27 min on SmolLM2)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "afile").write_text("")
    argv = ["perfectible", "num_candidates=4", "samples=2"]
    out = tmp_path / "afile" / "set.jsonl"
    _refused([*argv, f"out={out}"], capsys, f"out: {out}: {tmp_path}/afile is a file, not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "afile" / "cache"))
    _refused([*argv, f"out={tmp_path / 'set.jsonl'}"], capsys, "the perfectible search's cache")
    assert not (tmp_path / "set.jsonl").exists()


def test_sanity_and_phantom_refuse_bad_flags_before_writing(tmp_path, capsys):
    out = tmp_path / "out"
    _refused(["sanity", "--quick", "--jobs", "0", "--out", str(out)], capsys, "--jobs must be >= 1, got 0")
    _refused(["phantom", "--eps", "nan", "--out", str(out)], capsys, "--eps: expected clip epsilons > 0")
    _refused(["phantom", "--eps", "0.1,x", "--out", str(out)], capsys, "--eps: expected comma-separated floats")
    _refused(["phantom", "--steps", "-1", "--out", str(out)], capsys, "--steps: must be >= 1, got -1")
    _refused(["phantom", "--model", "m", "--seeds", "-3", "--out", str(out)], capsys, "--seeds: expected seeds in")
    # The write-up's experiment wrote its prompts into --out, then refused a key, or a model they do not fit
    model = ["phantom", "--model", str(BUILTIN_DIR), "--steps", "1", "--out", str(out)]
    _refused([*model, "foo.bar=1"], capsys, "unknown config key foo")
    _refused(model, capsys, "rollout.max_new_tokens=128: the model's max_position_embeddings is 128")
    _refused(["doctor", "--prompts", "-5", "--out", str(out)], capsys, "--prompts: must be between 1 and 1024")
    # --steps 0 ran the default 60 steps; --seed -1 wrote the folder before it was refused; an option of the
    # other experiment was ignored
    _refused(["phantom", "--steps", "0", "--out", str(out)], capsys, "--steps: must be >= 1, got 0")
    _refused(["phantom", "--seed", "-1", "--out", str(out)], capsys, "--seed: expected seeds in")
    _refused(["phantom", "--seeds", "0,1", "--out", str(out)], capsys, "--seeds and --no-async go with --model DIR")
    _refused(["phantom", "--model", "m", "--eps", "0.1", "--out", str(out)], capsys, "--eps goes with the built-in")
    _refused(["build-model", "--steps", "0", "--out", str(out)], capsys, "--steps: must be >= 1, got 0")
    _refused(["build-model", "--seed", "-1", "--out", str(out)], capsys, "--seed: must be in [0, 4294967295], got -1")
    assert not out.exists()


def test_an_out_folder_that_cannot_be_made_is_refused_before_the_work(tmp_path, capsys):
    """`--out afile/sub` ran the whole command, then failed with 'Not a directory' naming no key."""
    (tmp_path / "afile").write_text("mine")
    out = tmp_path / "afile" / "sub"
    _refused(["doctor", "--model", "builtin", "--out", str(out)], capsys, f"{out}: {tmp_path / 'afile'} is a file")
    _refused(["mismatch", "pairs=[]", "--out", str(tmp_path / "m")], capsys, "pairs: expected distinct TRAINER/ROLLOUT")
    assert (tmp_path / "afile").read_text() == "mine" and not (tmp_path / "m").exists()


def test_a_runs_folder_holding_anything_else_is_not_deleted(tmp_path):
    """`parity sanity` and `parity phantom` redo their runs by deleting the previous ones: never a folder
    holding anything but a run's files."""
    run = tmp_path / "runs" / "fp16-grpo"
    _users_folder_with(run, "config.yaml")
    _users_folder_with(run, "results/table.csv")
    with pytest.raises(ConfigError, match="holds files that are not a run's"):
        remove_run(run)
    assert (run / "results" / "table.csv").read_text() == "mine\n"


def test_build_model_replaces_only_a_folder_it_wrote(tmp_path, capsys):
    """`parity build-model --out DIR` deleted the whole of DIR: a folder of the user's (a model of theirs)
    is refused before the three-minute build, and a folder build-model wrote is replaced."""
    theirs = _users_folder(tmp_path / "my-llama", "config.json", "model.safetensors")
    before = _digest(theirs)
    _refused(["build-model", "--out", str(theirs), "--steps", "1"], capsys, "holds files Parity did not write")
    assert _digest(theirs) == before
    ours = tmp_path / "built"
    cfg = BuildConfig(steps=2, eval_problems=4, eval_samples=2)
    build_model(ours, cfg, log=lambda _: None)
    first = (ours / "model.safetensors").read_bytes()
    build_model(ours, BuildConfig(steps=3, eval_problems=4, eval_samples=2), log=lambda _: None)
    assert (ours / "model.safetensors").read_bytes() != first and (ours / MARK).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["built", "my-llama"]  # no temporary folder left
    assert BUILTIN_DIR.is_dir()


def test_result_files_are_strict_json(tmp_path):
    """eval.json and doctor.json held bare NaN, which strict parsers (jq, JavaScript) refuse."""
    from parity.outdir import claim_output_dir, write_output_json

    out = claim_output_dir(tmp_path / "out", "report")
    write_output_json(out / "r.json", {"kl": float("nan"), "gaps": [float("inf"), 1.5], "n": 2})

    def refuse(constant):
        raise ValueError(constant)

    assert json.loads((out / "r.json").read_text(), parse_constant=refuse) == {"kl": None, "gaps": [None, 1.5], "n": 2}


def test_a_folder_of_one_command_s_results_is_refused_to_another(tmp_path):
    """`parity report --out` a sanity run's folder replaced its report.md and summary.json, silently."""
    from parity.outdir import check_output_dir, claim_output_dir, write_output

    out = claim_output_dir(tmp_path / "sanity", "sanity", folders=("runs",))
    write_output(out / "report.md", "the sanity run's\n")
    check_output_dir(out, "sanity")  # its own command writes there again
    with pytest.raises(ConfigError) as e:
        claim_output_dir(out, "report")
    assert str(e.value) == (
        f"--out {out}: holds the results of `parity sanity`, which `parity report` would replace; choose another folder"
    )
    assert (out / "report.md").read_text() == "the sanity run's\n"
    # A mark written before it named its command takes any command's results, as it did.
    mark = json.loads((out / MARK).read_text())
    (out / MARK).write_text(json.dumps({k: v for k, v in mark.items() if k != "command"}))
    claim_output_dir(out, "report")


def test_a_flag_and_its_key_given_together_are_refused(capsys):
    """`out=a --out b` wrote b alone; `model=builtin --model DIR` took DIR: one of them was dropped silently."""
    _refused(["mismatch", "out=a", "--out", "b"], capsys, "--out and out=: give one")
    _refused(["mismatch", "model=builtin", "--model", "builtin"], capsys, "--model and model=: give one")
    _refused(["eval", "builtin", "out=a", "--out", "b"], capsys, "--out and out=: give one")


def test_bad_values_are_named_by_their_keys(tmp_path, capsys):
    """Each said less: a missing data file named no key (or task.data, a key perfectible does not take), a
    count below 1 named two keys and no value, a file given as the model was "no such directory"."""
    (tmp_path / "afile.txt").write_text("")
    missing = tmp_path / "none.jsonl"
    _refused(["perfectible", f"data={missing}"], capsys, f"data: '{missing}' does not exist")
    _refused(["perfectible", "samples=0"], capsys, "samples: must be >= 1, got 0")
    _refused(["mismatch", "group_size=0"], capsys, "group_size: must be >= 1, got 0")
    _refused(["mismatch", "--model", str(tmp_path / "afile.txt")], capsys, "afile.txt': a file, not a directory")


def test_a_folder_that_cannot_be_made_or_a_run_without_its_config_is_named(tiny_run, tmp_path, capsys):
    """`--out /proc/x` said "/proc/x: No such file or directory" (no key); a run folder whose config.yaml is
    gone said "no tokenizer.json", as if it were a model."""
    _refused(["report", str(tiny_run), "--out", "/proc/parity-x"], capsys, "--out /proc/parity-x: No such file")
    run = copy_run(tiny_run, tmp_path / "run")
    (run / "config.yaml").unlink()
    _refused(["eval", str(run)], capsys, "(a run directory without its config.yaml, which `parity eval`")


def test_a_dotted_key_under_a_plain_key_is_an_unknown_key(capsys):
    """`parity eval ... task.answer_column=x` said "task: expected a string, got {'answer_column': 'x'}"."""
    _refused(["eval", "builtin", "task.answer_column=x"], capsys, "unknown config key task.answer_column; did you mean")
