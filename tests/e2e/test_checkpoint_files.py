"""A checkpoint is input: a run directory someone sent runs no code, a damaged checkpoint is set aside in one
line, and only Parity's own names under checkpoints/ are read, pruned or evaluated (issue 43)."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import TINY, TINY_RUN, copy_run, metrics, reseal, run_dir_held
from parity.cli import main
from parity.engines import kernels
from parity.engines.models.io import load_model, resolve_model_dir
from parity.engines.trainer import OptimConfig, Trainer
from parity.rl.checkpoint import MANIFEST, load_checkpoint, save_shards

EVAL = ["num_prompts=2", "samples=1", "max_new_tokens=8", "precisions=[fp32]"]


class _WritesMarker:
    """Unpickling this writes `path`: what a forged pickle would do with anything else."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.write_text, (self.path, "code ran")


def _error_line(err: str) -> str:
    """The one line a refusal prints (progress bars aside), with no traceback."""
    lines = [x for x in err.splitlines() if x.startswith("parity ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _run(trained_run, tmp_path: Path, steps: int = 2) -> Path:
    """A copy of the session's tiny run (TINY_RUN: 2 steps, a checkpoint after each), or of one as long as
    it for `steps` steps."""
    return copy_run(trained_run(*TINY_RUN, f"steps={steps}"), tmp_path / "run")


def _as_sharded(ckpt: Path) -> None:
    """Turn a one-process checkpoint into the sharded form distributed learners write (one shard here)."""
    trainer = Trainer(load_model(resolve_model_dir("builtin"), kernels.numerics()), "fp32", OptimConfig())
    load_checkpoint(ckpt, trainer)
    shutil.rmtree(ckpt / "model")
    (ckpt / "optimizer.safetensors").unlink()
    save_shards(trainer, ckpt / "sharded")
    save_file({"rng.torch": torch.get_rng_state()}, str(ckpt / "rng.safetensors"))
    state = json.loads((ckpt / "state.json").read_text())
    del state["optimizer"]
    (ckpt / "state.json").write_text(json.dumps(state))
    reseal(ckpt)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_forged_sharded_index_runs_no_code_on_resume_or_eval(trained_run, tmp_path, capsys):
    """torch's reader unpickles sharded/.metadata. A forged one (its manifest entry rewritten) whose
    unpickling writes a marker: `parity train --resume` and `parity eval` never run it."""
    run_dir = _run(trained_run, tmp_path)
    ckpt = run_dir / "checkpoints" / "step_000002"
    _as_sharded(ckpt)
    assert main(["eval", str(run_dir), *EVAL, f"out={tmp_path / 'ok'}"]) == 0  # the sharded form reads back
    marker = tmp_path / "marker"
    forged = pickle.dumps(_WritesMarker(marker))
    pickle.loads(forged)  # the payload is live: unpickled, it writes the marker
    assert marker.read_text() == "code ran"
    marker.unlink()
    (ckpt / "sharded" / "metadata.json").unlink()
    (ckpt / "sharded" / ".metadata").write_bytes(forged)
    reseal(ckpt)
    capsys.readouterr()

    assert main(["eval", str(run_dir), *EVAL, f"out={tmp_path / 'eval'}"]) == 2
    err = _error_line(capsys.readouterr().err)
    assert "step_000002" in err and "pickled index is not read" in err
    assert not (tmp_path / "eval").exists() and not marker.exists()

    assert main(["train", "--resume", str(run_dir), "steps=3"]) == 0
    err = capsys.readouterr().err
    assert "checkpoint step_000002 is unusable (no metadata.json" in err and "continuing from step 1" in err
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_shard_replaced_by_a_pickle_runs_no_code(trained_run, tmp_path, capsys):
    run_dir = _run(trained_run, tmp_path)
    ckpt = run_dir / "checkpoints" / "step_000002"
    _as_sharded(ckpt)
    marker = tmp_path / "marker"
    (shard,) = (ckpt / "sharded").glob("__*.safetensors")
    shard.write_bytes(pickle.dumps({"model.model.norm.weight": _WritesMarker(marker)}))
    reseal(ckpt)
    assert main(["train", "--resume", str(run_dir), "steps=3"]) == 0
    err = capsys.readouterr().err
    assert "checkpoint step_000002 is unusable" in err and "not a readable safetensors file" in err
    assert not marker.exists()


def damaged(ckpt: Path, sharded: bool, damage, resealed: bool) -> None:
    """A DAMAGE case applied to `ckpt`: in the sharded form if it says so, its manifest resealed if it says so."""
    if sharded:
        _as_sharded(ckpt)
    damage(ckpt)
    if resealed:
        reseal(ckpt)


def _state(**changes):
    def apply(ckpt: Path) -> None:
        state = json.loads((ckpt / "state.json").read_text())
        (ckpt / "state.json").write_text(json.dumps({**state, **changes}))

    return apply


def _manifest(files) -> callable:
    def apply(ckpt: Path) -> None:
        (ckpt / MANIFEST).write_text(json.dumps({"format": 3, "files": files}) if files is not None else "[" * 100_000)

    return apply


def _cut_rng(ckpt: Path) -> None:
    path = ckpt / "rng.safetensors"
    path.write_bytes(path.read_bytes()[:200])


def _garble_index(ckpt: Path) -> None:
    index = json.loads((ckpt / "sharded" / "metadata.json").read_text())
    first = next(iter(index["tensors"].values()))
    first["chunks"][0]["file"] = "__7_0.safetensors"  # a shard that is not there
    (ckpt / "sharded" / "metadata.json").write_text(json.dumps(index))


# (case, sharded first?, damage, reseal the manifest?, what the one line says)
DAMAGE = [
    ("step a string", False, _state(step="abc"), True, "state.json: step must be an integer >= 0, got 'abc'"),
    ("step negative", False, _state(step=-5), True, "state.json: step must be an integer >= 0, got -5"),
    ("scaler a list", False, _state(scaler=[]), True, "state.json: scaler must be"),
    ("config a list", False, _state(config=[1]), True, "state.json: config must be an object"),
    ("state.json nested 100k deep", False, lambda c: (c / "state.json").write_text("[" * 100_000), True, "nested"),
    ("rng cut short", True, _cut_rng, True, "rng.safetensors"),
    ("index names a missing shard", True, _garble_index, True, "its shard __7_0.safetensors is missing"),
    ("index not JSON", True, lambda c: (c / "sharded" / "metadata.json").write_text("{"), True, "invalid JSON"),
    ("manifest files a list", False, _manifest([]), False, "files must be an object"),
    ("manifest entry not an object", False, _manifest({"state.json": 3}), False, 'expected {"bytes": N'),
    ("manifest nested 100k deep", False, _manifest(None), False, "nested more than 100 deep"),
    ("manifest path outside", False, _manifest({"../../x": {"bytes": 1, "sha256": "0" * 64}}), False, "not a path"),
]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("case, sharded, damage, resealed, message", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_a_damaged_checkpoint_is_set_aside_in_one_line(
    case, sharded, damage, resealed, message, trained_run, tmp_path, capsys
):
    run_dir = _run(trained_run, tmp_path)
    damaged(run_dir / "checkpoints" / "step_000002", sharded, damage, resealed)
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "steps=3"]) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if "is unusable" in x)
    assert line.startswith("resume: checkpoint step_000002 is unusable (") and message in line, line
    assert "continuing from step 1" in err and "Traceback" not in err
    assert (run_dir / "checkpoints" / "corrupt" / "step_000002").is_dir()
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3]


def test_only_parity_names_under_checkpoints_are_read_pruned_or_evaluated(trained_run, tmp_path, capsys):
    """A user's step_best (a copy of step 2), step_000001.bak, step_000001-keep and a file: resume continues
    from the newest real checkpoint, pruning leaves them, and `parity eval` evaluates the real ones only."""
    run_dir = _run(trained_run, tmp_path, steps=3)
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000003"]
    shutil.rmtree(ckpts / "step_000003")  # as if killed after step 3's log line, before its checkpoint
    mine = {"step_best": ckpts / "step_000002", "step_000001.bak": None, "step_000001-keep": None}
    for name, source in mine.items():
        if source is None:
            (ckpts / name).mkdir()
            (ckpts / name / "notes.txt").write_text("mine")
        else:
            shutil.copytree(source, ckpts / name)
    (ckpts / "step_000009").write_text("a file, not a folder")
    before = {p.name: sorted(q.name for q in p.rglob("*")) for p in ckpts.iterdir() if p.is_dir()}
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "steps=5", "keep_checkpoints=1"]) == 0
    assert "continuing from step 2" in capsys.readouterr().err
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in ckpts.iterdir()) == sorted([*mine, "step_000009", "step_000005"])
    assert all(sorted(q.name for q in (ckpts / n).rglob("*")) == before[n] for n in mine)
    assert main(["eval", str(run_dir), *EVAL, f"out={tmp_path / 'eval'}"]) == 0
    states = [s["name"] for s in json.loads((tmp_path / "eval" / "eval.json").read_text())["states"]]
    assert states == ["base", "step_000005"]


def test_eval_refuses_another_models_checkpoint_and_a_live_run(trained_run, tmp_path, llama_dir, capsys):
    run_dir = _run(trained_run, tmp_path)
    other = tmp_path / "other"
    assert main(["train", f"run_dir={other}", *TINY, f"model={llama_dir}", "task.name=number", "steps=1"]) == 0
    ckpts = run_dir / "checkpoints"
    shutil.rmtree(ckpts / "step_000001")
    shutil.copytree(other / "checkpoints" / "step_000001", ckpts / "step_000001")
    capsys.readouterr()
    assert main(["eval", str(run_dir), *EVAL, f"out={tmp_path / 'eval'}"]) == 2
    err = _error_line(capsys.readouterr().err)
    assert "step_000001" in err and "another model's weights" in err
    assert not (tmp_path / "eval").exists()

    with run_dir_held(run_dir) as holder:  # a run going on holds its directory
        assert main(["eval", str(run_dir), *EVAL, f"out={tmp_path / 'eval'}"]) == 2
        assert f"in use by a running `parity train` (pid {holder.pid})" in _error_line(capsys.readouterr().err)
        assert not (tmp_path / "eval").exists()


def test_a_resume_reads_only_the_steps_in_metrics_jsonl(trained_run, tmp_path, capsys):
    """A received run's metrics.jsonl with lines that are not steps (nested 100,000 deep, a step that is a
    string, no mismatch/k3): they are dropped as a cut-short line is, and the run goes on."""
    run_dir = _run(trained_run, tmp_path)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write("[" * 100_000 + "\n" + '{"step": "abc"}\n' + '{"step": 1}\n' + '{"step": 2, "mismatch/k3": []}\n')
    assert main(["train", "--resume", str(run_dir), "steps=3"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3]


def test_what_someone_put_in_a_checkpoint_is_not_pruned_and_nothing_is_made_inside_a_run(trained_run, tmp_path, capsys):
    """Pruning removed a checkpoint folder whole, with an evaluation or a run someone had put in it: a
    checkpoint holding what its manifest does not list is kept, with a warning; `parity eval --out` and a new
    run_dir inside a run are refused in one line, naming the run."""
    run_dir = _run(trained_run, tmp_path)
    step_1 = run_dir / "checkpoints" / "step_000001"
    (step_1 / "notes").mkdir()
    (step_1 / "notes" / "mine.txt").write_text("mine")
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "steps=3", "keep_checkpoints=1"]) == 0
    assert "WARNING checkpoints/step_000001 holds what Parity did not write (notes): kept" in capsys.readouterr().err
    assert (step_1 / "notes" / "mine.txt").read_text() == "mine"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001", "step_000003"]
    out = run_dir / "checkpoints" / "step_000003" / "eval"
    assert main(["eval", str(out.parent / "model"), *EVAL, f"out={out}"]) == 2
    assert _error_line(capsys.readouterr().err).endswith(
        f"inside the run directory {run_dir.resolve()}, which holds a run's files only; choose a folder outside it"
    )
    assert main(["train", *TINY, "steps=1", f"run_dir={out.parent / 'inner'}"]) == 2
    assert _error_line(capsys.readouterr().err).endswith(
        f"inside the run directory {run_dir.resolve()}; choose a folder outside it"
    )
    assert not out.exists() and not (out.parent / "inner").exists()


def test_eval_refuses_a_damaged_checkpoint_before_it_evaluates_any_state(trained_run, tmp_path, capsys, monkeypatch):
    """The base and every earlier checkpoint were evaluated (minutes each on a real model) before the
    damaged one was read and refused."""
    from parity.commands import evaluate

    run_dir = _run(trained_run, tmp_path)
    weights = run_dir / "checkpoints" / "step_000002" / "optimizer.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    evaluated = []
    monkeypatch.setattr(evaluate.Evaluator, "evaluate", lambda self, *a, **k: evaluated.append(a) or {})
    capsys.readouterr()
    assert main(["eval", str(run_dir), *EVAL, f"out={tmp_path / 'eval'}"]) == 2
    assert "step_000002: optimizer.safetensors is" in _error_line(capsys.readouterr().err)
    assert evaluated == [] and not (tmp_path / "eval").exists()
