"""A run directory before its `Run` is built: a new run's directory, lock and data (`new_run_dir`), and a
resumed run's lock and config under the resume rules (`lock_for_resume`, `resumed_config`). `Run.create` and
`Run.resume` (`rl/loop.py`) build the run on what these give.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parity import config as config_mod
from parity.config import ConfigError
from parity.engines.models.config import ModelError
from parity.engines.models.io import resolve_model_dir
from parity.files import JSONError, parse_json
from parity.folders import Folder
from parity.rl.checkpoint import checkpoints, saved_config
from parity.rl.data import DATA_DIR, write_rows
from parity.rl.reward_fns import data_columns
from parity.rl.train_config import RESUMABLE_KEYS, TrainConfig
from parity.rundir import RunLock, check_run_dir, clean_leftovers, enclosing_run, foreign_entries


@dataclass
class NewRunDir:
    path: Path
    lock: RunLock
    made: Path | None  # the outermost folder made for it (the run directory, or a parent); None: it existed

    def abandon(self) -> None:
        """The run was refused before it started: release the lock, and remove what was made for it."""
        self.lock.release()
        if not (self.path / "config.yaml").exists():
            self.remove()

    def remove(self) -> None:
        """Remove the run directory, and the folders made for it that nothing else has come to hold."""
        if self.made is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)  # a refused run leaves nothing behind
        for parent in self.path.parents:
            if not parent.is_relative_to(self.made):
                break
            try:
                parent.rmdir()  # only if empty
            except OSError:
                break


def new_run_dir(cfg: TrainConfig, datasets: dict[str, list[dict[str, Any]]] | None) -> NewRunDir:
    """`cfg.run_dir` (or a dated name) made and locked for a new run, refused if it holds one; `cfg`'s paths made
    absolute, and `datasets` (rows for "train" and "eval" held in memory) written into its data/ so that
    config.yaml names files that `--resume` and `parity eval` read."""
    path = Path(cfg.run_dir or time.strftime("runs/train-%Y%m%d-%H%M%S"))
    check_run_dir(path)
    outer = enclosing_run(path.parent)
    if outer is not None:  # its checkpoints' pruning, or its own resume, would meet this one
        raise ConfigError(f"run_dir={path}: inside the run directory {outer}; choose a folder outside it")
    missing = [folder for folder in (path, *path.parents) if not folder.exists()]
    path.mkdir(parents=True, exist_ok=True)
    made = missing[-1] if missing else None
    new = NewRunDir(path, RunLock(path), made)  # locked before looking inside: two starts cannot both pass
    try:
        if (path / "metrics.jsonl").exists() or checkpoints(path) or (path / "config.yaml").exists():
            raise ConfigError(
                f"run_dir: {path} already holds a run; continue it with `parity train --resume {path}` (in Python, "
                "Trainer.train(resume_from_checkpoint=True)) or choose another run_dir"
            )
        cfg.run_dir = str(path)
        cfg.resolve_paths(Path.cwd())
        for split, rows in (datasets or {}).items():
            written = write_rows(path, f"{DATA_DIR}/{split}.jsonl", rows, split, data_columns(cfg))
            if split == "train":
                cfg.task.data = str(written.resolve())
            else:
                cfg.eval.data = str(written.resolve())
    except BaseException:
        new.abandon()
        raise
    return new


def lock_for_resume(run_dir: Path) -> RunLock:
    """The lock of the run in `run_dir`, refused in one line where there is no run to continue."""
    if not (run_dir / "config.yaml").is_file():
        if run_dir.is_dir() and (run_dir / ".lock").is_file() and not foreign_entries(run_dir):
            raise ConfigError(
                f"--resume {run_dir}: the run there stopped before it started (no config.yaml yet); "
                f"start it again with run_dir={run_dir}"
            )
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; is this a run directory?")
    check_run_dir(run_dir)
    return RunLock(run_dir)


def resumed_config(run_dir: Path, overrides: list[str], trust_code: bool, note: Callable[[str], None]) -> TrainConfig:
    """The config a resumed run trains with: exactly its saved one (config.yaml, checked against the newest
    checkpoint's copy), with `overrides` of RESUMABLE_KEYS only (data paths relative to the working
    directory). A config that imports Python code (rewards, tools, an environment) needs `trust_code`.
    Leftovers of an interrupted write are cleaned first; `note` hears what changed."""
    for line in clean_leftovers(run_dir):
        note(line)
    keys = [item.split("=", 1)[0].strip() for item in overrides]
    known = config_mod.config_keys(TrainConfig)
    for key in keys:
        if key not in known and key not in TrainConfig.RENAMED_KEYS:  # a misspelling is no key, not a change
            raise ConfigError(config_mod.unknown_key(TrainConfig, key, RESUMABLE_KEYS))
        if key not in (*RESUMABLE_KEYS, "model"):  # model: a LoRA run's base, moved (checked below)
            raise ConfigError(
                f"--resume {run_dir}: {key} cannot change on resume (a resumed run trains exactly as it "
                f"started); only {', '.join(RESUMABLE_KEYS)} can. Start a new run to change {key}"
            )
    cfg = config_mod.load(TrainConfig, run_dir / "config.yaml", overrides)
    cfg.run_dir = str(run_dir)
    cfg.resolve_paths(Path.cwd())  # an override names a file from here; the saved paths are absolute
    _check_moved_model(run_dir, cfg, "model" in keys)
    for key, data in (("task.data", cfg.task.data), ("eval.data", cfg.eval.data)):
        if data not in ("builtin", "auto") and not Path(data).exists():
            raise ConfigError(f"{key}: {data!r} does not exist; if the run's data moved, give its place: {key}=PATH")
    code = [
        f"{k}={v}"
        for k, v in (
            ("task.reward_fn", cfg.task.reward_fn),
            ("task.environment", cfg.task.environment),
            ("task.tools", cfg.task.tools),
        )
        if v
    ]
    if code and not trust_code:
        raise ConfigError(
            f"--resume {run_dir}: its config.yaml sets {', '.join(code)}, which imports and "
            "runs that Python code in this process; resume only runs you trust, and confirm with "
            "--trust-reward-fn"
        )
    saved = _saved_config(run_dir)
    if saved is not None:
        current = config_mod.flatten(config_mod.to_dict(cfg))
        # A key this version added after the run was saved trains as before at its default.
        defaults = config_mod.flatten(config_mod.to_dict(TrainConfig()))
        saved = {k: saved.get(k, defaults.get(k)) for k in current}
        changed = [k for k in current if k != "run_dir" and saved[k] != current[k]]
        movable = ("model",) if cfg.lora.rank > 0 else ()  # a LoRA run's base, checked against its fingerprint
        refused = [k for k in changed if k not in (*RESUMABLE_KEYS, *movable)]
        if refused:
            diffs = "; ".join(f"{k}: {saved.get(k)!r} when saved, {current[k]!r} now" for k in refused[:4])
            raise ConfigError(
                f"--resume {run_dir}: config.yaml differs from the config the run was trained with ({diffs}); "
                f"a resumed run trains exactly as it started (only {', '.join(RESUMABLE_KEYS)} may change). "
                "Undo the edit, or start a new run"
            )
        for k in changed:
            note(f"{k} {saved.get(k)!r} -> {current[k]!r}")
    return cfg


def _check_moved_model(run_dir: Path, cfg: TrainConfig, given: bool) -> None:
    """A resumed run's base model is where config.yaml says, or a LoRA run's was given where it is now (`given`;
    its checkpoints fingerprint the base, which `load_checkpoint` checks). A full run's checkpoints do not
    fingerprint their base, which gives the tokenizer and the evaluation's base: it stays where it was."""
    lora = cfg.lora.rank > 0
    if given and not lora:
        raise ConfigError(
            f"--resume {run_dir}: model cannot change on resume of a full run (its checkpoints do not record which "
            "base model it was); if the model moved, put it back where config.yaml says (a symlink will do)"
        )
    try:
        resolve_model_dir(cfg.model)
    except ModelError as e:
        raise ConfigError(f"--resume {run_dir}: {e}; {moved_model_hint(lora)}") from None


def moved_model_hint(lora: bool) -> str:
    """What to do when a run's base model is not where its config.yaml says."""
    if lora:
        return "if the run's model moved, give its place: model=DIR (its checkpoints check it is the same base)"
    return (
        "if the run's model moved, put it back there (a symlink will do): a full run's checkpoints do not record "
        "which base model it was"
    )


def _saved_config(run_dir: Path) -> dict[str, Any] | None:
    """The config stored in the newest checkpoint whose state.json reads, flattened."""
    for path in reversed(checkpoints(run_dir)):
        saved = saved_config(path)
        if saved is not None:
            return {TrainConfig.RENAMED_KEYS.get(k, k): v for k, v in config_mod.flatten(saved).items()}
    return None


def recorded_threads(run_dir: Path) -> int | None:
    """The CPU threads the run computed on, as its numerics.json records them (`Run.record_numerics`), or None
    (a run recorded before it said, or a file that is not the run's: a received folder's is not trusted)."""
    try:  # through the folder: never a link, never more than a numerics.json holds
        with Folder.open(run_dir, key="run_dir") as run:
            recorded = parse_json(run.read_bytes("numerics.json", 2**20).decode("utf-8"))
        threads = recorded.get("run_threads", recorded.get("threads"))  # `threads` alone: recorded before run_threads
    except (OSError, ValueError, ConfigError, JSONError, UnicodeDecodeError, AttributeError):
        return None
    return threads if isinstance(threads, int) and not isinstance(threads, bool) and 1 <= threads <= 4096 else None
