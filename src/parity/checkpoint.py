"""Checkpoints: everything a run needs to continue bit-for-bit, written atomically.

`RUN_DIR/checkpoints/step_NNNNNN/` holds the model in the Hugging Face format
(`config.json`, `model.safetensors`, tokenizer files: `transformers` loads it),
the AdamW state as `optimizer.safetensors` plus JSON, and `state.json` (step,
data position, weight version, loss scaler, RNG). Nothing is pickled. A
checkpoint directory appears only once complete (written to a temporary folder,
then renamed), so a run killed mid-save leaves the previous one intact.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from parity.files import atomic_dir
from parity.models import load_model, save_model
from parity.trainer import Trainer

FORMAT_VERSION = 1


@dataclass
class RunState:
    step: int  # optimizer-updated RL steps completed
    data_position: int
    weight_version: int


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


def save_checkpoint(run_dir: Path, trainer: Trainer, state: RunState, tokenizer_dir: Path, keep: int) -> Path:
    ckpt_root = run_dir / "checkpoints"
    target = ckpt_root / f"step_{state.step:06d}"
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
                },
                indent=2,
            )
            + "\n"
        )
    for old in sorted(ckpt_root.glob("step_*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return target


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if (p / "state.json").is_file())
    return found[-1] if found else None


def load_checkpoint(path: Path, trainer: Trainer) -> RunState:
    """Restore weights, optimizer, scaler and RNG into `trainer`; return the run state."""
    meta = json.loads((path / "state.json").read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}/state.json: unsupported checkpoint format {meta.get('format')!r}")
    model = load_model(path / "model")
    trainer.model.load_state_dict(model.state_dict())
    tensors = load_file(str(path / "optimizer.safetensors"))
    torch.set_rng_state(tensors.pop("rng.torch"))
    _load_optimizer(trainer.optimizer, tensors, meta["optimizer"])
    trainer.scaler.load_state_dict(meta["scaler"])
    trainer.weight_version = meta["weight_version"]
    return RunState(step=meta["step"], data_position=meta["data_position"], weight_version=meta["weight_version"])
