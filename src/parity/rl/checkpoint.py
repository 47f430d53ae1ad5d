"""Checkpoints: everything a run needs to continue bit-for-bit, written atomically.

`RUN_DIR/checkpoints/step_NNNNNN/` holds the model in the Hugging Face format
(`config.json`, `model.safetensors`, tokenizer files: `transformers` loads it),
the AdamW state as `optimizer.safetensors` plus JSON, `state.json` (step, data
position, weight version, loss scaler, the run's config) and `manifest.json`
(the SHA-256 and size of every other file). Nothing is pickled.

A checkpoint directory appears only once complete (written to a temporary
folder, then renamed), so a run killed mid-save leaves the previous one intact;
only finite weights are ever saved. On resume a checkpoint whose files do not
match its manifest, or whose weights are not finite, is moved to
`checkpoints/corrupt/` and the newest intact one is used instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from parity.engines.models import ModelError, load_model, save_model
from parity.engines.trainer import Trainer
from parity.files import atomic_dir

FORMAT_VERSION = 2  # 2: manifest.json with checksums, the config in state.json
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or used; the message names it and the problem."""


@dataclass
class RunState:
    step: int  # optimizer-updated RL steps completed
    data_position: int
    weight_version: int
    config: dict[str, Any] | None = None  # the run's config when it was saved


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = optimizer.state_dict()
    tensors = {
        f"state.{idx}.{name}": value.detach().clone().contiguous()
        for idx, entry in sd["state"].items()
        for name, value in entry.items()
    }
    return tensors, {"param_groups": sd["param_groups"]}


def _load_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def non_finite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding inf or NaN."""
    return [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    entries = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT_VERSION, "files": entries}, indent=2) + "\n")


def verify_checkpoint(path: Path) -> str | None:
    """What is wrong with the checkpoint at `path` (a missing, changed or cut file), or None."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        entries = manifest["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (not a complete checkpoint of this format)"
    except (json.JSONDecodeError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name, entry in entries.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != entry["bytes"]:
            return f"{name} is {file.stat().st_size} bytes, the manifest says {entry['bytes']}"
        if _sha256(file) != entry["sha256"]:
            return f"{name} does not match its checksum"
    return None


def save_checkpoint(run_dir: Path, trainer: Trainer, state: RunState, tokenizer_dir: Path, keep: int) -> Path:
    ckpt_root = run_dir / "checkpoints"
    bad = non_finite_tensors(dict(trainer.model.named_parameters()))
    if bad:
        raise CheckpointError(f"step {state.step}: not saving a checkpoint: inf/NaN in {', '.join(bad[:3])}")
    target = ckpt_root / f"step_{state.step:06d}"
    try:
        _write_checkpoint(target, trainer, state, tokenizer_dir)
    except (OSError, SafetensorError) as e:  # a full disk, a file-size limit: the earlier ones stay intact
        raise CheckpointError(f"{target}: could not be written ({e}); earlier checkpoints are intact") from None
    # Older ones go; `target`, just written from finite weights, is always the newest kept.
    older = [p for p in sorted(ckpt_root.glob("step_*")) if p.name < target.name]
    for old in older[: max(len(older) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def _write_checkpoint(target: Path, trainer: Trainer, state: RunState, tokenizer_dir: Path) -> None:
    with atomic_dir(target) as tmp:
        save_model(trainer.model, tmp / "model", tokenizer_dir=tokenizer_dir)
        tensors, meta = _optimizer_tensors(trainer.optimizer)
        tensors["rng.torch"] = torch.get_rng_state()
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "state.json").write_text(
            json.dumps(
                {
                    "format": FORMAT_VERSION,
                    "step": state.step,
                    "data_position": state.data_position,
                    "weight_version": state.weight_version,
                    "scaler": trainer.scaler.state_dict(),
                    "optimizer": meta,
                    "config": state.config,
                },
                indent=2,
            )
            + "\n"
        )
        _write_manifest(tmp)


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoint folders, oldest first."""
    return sorted(p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())


def load_checkpoint(path: Path, trainer: Trainer) -> RunState:
    """Restore weights, optimizer, scaler and RNG into `trainer`; return the run state.

    Raises CheckpointError when the checkpoint is damaged or holds non-finite values."""
    problem = verify_checkpoint(path)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
    try:
        meta = json.loads((path / "state.json").read_text())
        if meta.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"{path}/state.json: unsupported checkpoint format {meta.get('format')!r}")
        weights = load_model(path / "model").state_dict()
        tensors = load_file(str(path / "optimizer.safetensors"))
    except (ModelError, json.JSONDecodeError, OSError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    bad = non_finite_tensors(weights) + non_finite_tensors(tensors)
    if bad:
        raise CheckpointError(f"{path}: inf/NaN in {', '.join(bad[:3])}")
    trainer.model.load_state_dict(weights)
    torch.set_rng_state(tensors.pop("rng.torch"))
    _load_optimizer(trainer.optimizer, tensors, meta["optimizer"])
    trainer.scaler.load_state_dict(meta["scaler"])
    trainer.weight_version = meta["weight_version"]
    return RunState(meta["step"], meta["data_position"], meta["weight_version"], meta.get("config"))


def restore_latest(run_dir: Path, trainer: Trainer, log) -> RunState | None:
    """Load the newest usable checkpoint into `trainer`; set damaged ones aside in
    `checkpoints/corrupt/`, saying so through `log`. None when there is none."""
    for path in reversed(checkpoints(run_dir)):
        try:
            return load_checkpoint(path, trainer)
        except CheckpointError as e:
            aside = run_dir / "checkpoints" / "corrupt" / path.name
            aside.parent.mkdir(exist_ok=True)
            n = 1
            while aside.exists():
                aside, n = aside.with_name(f"{path.name}.{n}"), n + 1
            os.replace(path, aside)
            log(f"checkpoint {path.name} is unusable ({str(e).removeprefix(f'{path}: ')}); moved it to {aside}")
    return None
