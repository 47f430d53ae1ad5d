"""Checkpoints: everything a run needs to continue bit-for-bit, written atomically.

`RUN_DIR/checkpoints/step_NNNNNN/` holds the model in the Hugging Face format
(`config.json`, `model.safetensors`, tokenizer files: `transformers` loads it) or, when
the run trains LoRA adapters, only the adapters in PEFT's format (`adapter/`: PEFT loads
them onto the base model, which the run's `model` names and `state.json` fingerprints),
the AdamW state as `optimizer.safetensors` plus JSON, `state.json` (step, data
position, weight version, loss scaler, the run's config) and `manifest.json`
(the SHA-256 and size of every other file). Nothing is pickled.

A run with distributed learners writes `sharded/` instead of `model/` and the optimizer
file: each learner saves its own shards of the weights and AdamW state with
`torch.distributed.checkpoint` (no learner gathers the whole model), and the driver the
RNG state as `rng.safetensors`. DCP reshards on load, so any learner count, or one
process (`parity eval`, a resume), reads it back; a learner group reads its own shards in
place (`load_checkpoint(..., read_shards=)`), so no process holds the trained model whole.

A checkpoint directory appears only once complete (written to a temporary
folder, then renamed), so a run killed mid-save leaves the previous one intact;
only finite weights are ever saved. On resume a checkpoint whose files do not
match its manifest, or whose weights are not finite, is moved to
`checkpoints/corrupt/` and the newest intact one is used instead.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from parity.config import ConfigError
from parity.engines.lora import AdapterError, load_adapter_state, read_adapter, save_adapter
from parity.engines.models import ModelError, load_model, save_model
from parity.engines.tokenizer import copy_tokenizer_files
from parity.engines.trainer import Trainer
from parity.files import atomic_dir
from parity.rl.model_card import model_card

FORMAT_VERSION = 2  # 2: manifest.json with checksums, the config in state.json
MANIFEST = "manifest.json"
ADAPTER_DIR = "adapter"
SHARDED_DIR = "sharded"  # the weights and AdamW state as torch.distributed.checkpoint shards
SHARDED_RNG = "rng.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or used; the message names it and the problem."""


@dataclass
class RunState:
    step: int  # optimizer-updated RL steps completed
    data_position: int
    weight_version: int  # as loaded; a save takes the trainer's
    config: dict[str, Any] | None = None  # the run's config when it was saved
    metrics: dict[str, float] | None = None  # the newest step's metrics, for the saved model's card
    read_in_place: bool = False  # loaded: the weights went straight to sharded learners, not to the trainer


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
    """Names of the floating-point tensors holding inf or NaN: one read from the device for all of them."""
    names = [k for k, v in tensors.items() if v.is_floating_point()]
    if not names:
        return []
    finite = torch.stack([torch.isfinite(tensors[k]).all().to(tensors[names[0]].device) for k in names]).tolist()
    return [k for k, ok in zip(names, finite) if not ok]


def local_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter as this process holds it: its shard under FSDP2, else the whole tensor."""
    from torch.distributed.tensor import DTensor

    return {n: p.to_local() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}


def require_finite_weights(model: torch.nn.Module, model_dir: Path, consequence: str) -> None:
    """Refuse a model whose weights hold inf or NaN, before anything is computed or written."""
    bad = non_finite_tensors(dict(model.named_parameters()))
    if bad:
        raise ModelError(f"{model_dir}: weights hold inf/NaN ({', '.join(bad[:3])}); {consequence}")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    entries = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT_VERSION, "files": entries}, indent=2) + "\n")


def base_sha256(model_dir: Path) -> str:
    """SHA-256 of a model directory's config.json and weight files. A LoRA checkpoint holds only
    adapters: resuming them on a changed base would silently train another model. Hashed once
    per process while the files are unchanged."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.name == "config.json" or p.suffix == ".safetensors")
    return _files_sha256(tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files))


@functools.lru_cache(maxsize=4)
def _files_sha256(files: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for path, _, _ in files:
        digest.update(Path(path).name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(2**24):
                digest.update(chunk)
    return digest.hexdigest()


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


def save_checkpoint(
    run_dir: Path,
    trainer: Trainer,
    state: RunState,
    model_dir: Path,
    keep: int,
    write_shards: Callable[[Path], list[str]] | None = None,
) -> Path:
    """`model_dir`: the run's model (its tokenizer files are copied; with LoRA, the adapters' base).
    `write_shards(folder)`: sharded learners write the trainer's state into `folder` themselves and
    return the names of any non-finite tensors (then nothing is saved); `trainer` gives the rest."""
    ckpt_root = run_dir / "checkpoints"
    if write_shards is None:
        bad = non_finite_tensors({n: p for n, p in trainer.model.named_parameters() if p.requires_grad})
        if bad:
            raise CheckpointError(f"step {state.step}: not saving a checkpoint: inf/NaN in {', '.join(bad[:3])}")
    target = ckpt_root / f"step_{state.step:06d}"
    try:
        _write_checkpoint(target, trainer, state, model_dir, write_shards)
    except (OSError, SafetensorError) as e:  # a full disk, a file-size limit: the earlier ones stay intact
        raise CheckpointError(f"{target}: could not be written ({e}); earlier checkpoints are intact") from None
    # Older ones go; `target`, just written from finite weights, is always the newest kept.
    older = [p for p in sorted(ckpt_root.glob("step_*")) if p.name < target.name]
    for old in older[: max(len(older) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def _write_checkpoint(
    target: Path, trainer: Trainer, state: RunState, model_dir: Path, write_shards: Callable[[Path], list[str]] | None
) -> None:
    with atomic_dir(target) as tmp:
        meta: dict[str, Any] = {"format": FORMAT_VERSION}
        if write_shards is not None:
            bad = write_shards(tmp / SHARDED_DIR)
            if bad:
                raise CheckpointError(f"step {state.step}: not saving a checkpoint: inf/NaN in {', '.join(bad[:3])}")
            tensors, tensor_file = {}, SHARDED_RNG
        else:
            card = model_card(state.config or {}, state.metrics or {}, state.step, str(Path(model_dir).resolve()))
            if trainer.lora is None:
                save_model(trainer.model, tmp / "model", functools.partial(_model_files, model_dir, card))
            else:
                base = Path(model_dir).resolve()
                save_adapter(trainer.model, trainer.lora, tmp / ADAPTER_DIR, base_model=str(base))
                (tmp / ADAPTER_DIR / "README.md").write_text(card, encoding="utf-8")
                meta["base_model"] = {"path": str(base), "sha256": base_sha256(base)}
            tensors, meta["optimizer"] = _optimizer_tensors(trainer.optimizer)
            tensor_file = "optimizer.safetensors"
        tensors["rng.torch"] = torch.get_rng_state()
        save_file(tensors, str(tmp / tensor_file))
        meta.update(
            step=state.step,
            data_position=state.data_position,
            weight_version=trainer.weight_version,  # with the scaler: the trainer's, once its shards are written
            scaler=trainer.scaler.state_dict(),
            config=state.config,
        )
        (tmp / "state.json").write_text(json.dumps(meta, indent=2) + "\n")
        _write_manifest(tmp)


def _model_files(model_dir: Path, card: str, folder: Path) -> None:
    """A saved model's files beside its weights: the tokenizer's and its model card (README.md)."""
    copy_tokenizer_files(model_dir, folder)
    (folder / "README.md").write_text(card, encoding="utf-8")


def _state_dicts(trainer: Trainer) -> dict[str, dict]:
    """The trainer's weights and AdamW state keyed by parameter name, each tensor as this process holds it
    (a shard under FSDP2): what torch.distributed.checkpoint saves and loads in place."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(trainer.model, trainer.optimizer)
    return {"model": model, "optim": optim}


def save_shards(trainer: Trainer, folder: Path) -> None:
    """Write this learner's shards of the trainer's state into `folder`: a collective, every learner of
    the group calls it at once (rank 0 also writes the index of all shards)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state_dicts(trainer), checkpoint_id=str(folder))


def load_shards(folder: Path, trainer: Trainer) -> list[str]:
    """Read a sharded checkpoint into `trainer` whatever its layout: one process, or a learner group
    of any size (DCP reshards; in a group, a collective). Returns the names of the non-finite tensors this
    process now holds. Raises CheckpointError when the shards do not fit the model."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state_dicts(trainer)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(folder), no_dist=not dist.is_initialized())
    except (CheckpointException, RuntimeError, ValueError) as e:  # a shard that does not fit this model
        raise CheckpointError(f"{folder}: {e}") from None
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return non_finite_tensors(local_parameters(trainer.model))


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoint folders, oldest first."""
    return sorted(p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())


def _check_kind(path: Path, trainer: Trainer, meta: dict[str, Any], base_dir: Path | None) -> None:
    """A LoRA checkpoint goes to a LoRA trainer on the same base, a full one to a full trainer.
    ConfigError, not CheckpointError: the checkpoint is sound, so it must not be set aside."""
    lora = (path / ADAPTER_DIR).is_dir()
    if lora != (trainer.lora is not None):
        held, wanted = ("LoRA adapters", "full weights") if lora else ("full weights", "LoRA adapters")
        raise ConfigError(f"{path}: holds {held}, but this trainer trains {wanted} (lora.rank)")
    if not lora:
        return
    if base_dir is None:
        raise ValueError(f"{path}: loading LoRA adapters needs base_dir, the base model they were trained on")
    saved = meta.get("base_model", {}).get("sha256")
    if saved != base_sha256(base_dir):
        raise ConfigError(
            f"model: the base model in {base_dir} is not the one this run's LoRA adapters were trained on "
            f"({meta.get('base_model', {}).get('path')}, sha256 {str(saved)[:12]}); restore that base to resume"
        )


def load_checkpoint(
    path: Path,
    trainer: Trainer,
    base_dir: Path | None = None,
    read_shards: Callable[[Path], list[str]] | None = None,
) -> RunState:
    """Restore weights (or LoRA adapters, whose base is `base_dir`), optimizer, scaler and RNG
    into `trainer`; return the run state. `read_shards(folder)`: sharded learners read a sharded
    checkpoint's weights and AdamW state into their own trainers and return the names of non-finite
    tensors (`trainer` then takes the rest: RNG, scaler, version; not the weights).

    Raises CheckpointError when the checkpoint is damaged or holds non-finite values, and
    ConfigError when it does not fit this trainer (LoRA or not, another base model)."""
    problem = verify_checkpoint(path)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
    sharded = (path / SHARDED_DIR).is_dir()
    try:
        meta = json.loads((path / "state.json").read_text())
        if meta.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"{path}/state.json: unsupported checkpoint format {meta.get('format')!r}")
        _check_kind(path, trainer, meta, base_dir)
        if sharded:
            weights = {}  # checked once loaded: DCP reads into the trainer's own tensors
            tensors = load_file(str(path / SHARDED_RNG))
        else:
            if trainer.lora is None:
                weights = load_model(path / "model").state_dict()
            else:
                weights = read_adapter(path / ADAPTER_DIR, trainer.lora)
            tensors = load_file(str(path / "optimizer.safetensors"))
    except (ModelError, AdapterError, json.JSONDecodeError, OSError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    bad = non_finite_tensors(weights) + non_finite_tensors(tensors)
    if bad:
        raise CheckpointError(f"{path}: inf/NaN in {', '.join(bad[:3])}")
    if sharded:
        bad = (read_shards or functools.partial(load_shards, trainer=trainer))(path / SHARDED_DIR)
        if bad:
            raise CheckpointError(f"{path}: inf/NaN in {', '.join(bad[:3])}")
    else:
        try:
            if trainer.lora is None:
                trainer.model.load_state_dict(weights)
            else:
                load_adapter_state(trainer.model, weights)
        except AdapterError as e:
            raise CheckpointError(f"{path}: {e}") from None
    torch.set_rng_state(tensors.pop("rng.torch"))
    if not sharded:
        _load_optimizer(trainer.optimizer, tensors, meta["optimizer"])
    trainer.scaler.load_state_dict(meta["scaler"])
    trainer.weight_version = meta["weight_version"]
    in_place = sharded and read_shards is not None
    return RunState(meta["step"], meta["data_position"], meta["weight_version"], meta.get("config"), in_place)


def restore_latest(
    run_dir: Path,
    trainer: Trainer,
    log,
    base_dir: Path | None = None,
    read_shards: Callable[[Path], list[str]] | None = None,
) -> RunState | None:
    """Load the newest usable checkpoint into `trainer` (`base_dir`, `read_shards`: as `load_checkpoint`);
    set damaged ones aside in `checkpoints/corrupt/`, saying so through `log`. None when there is none."""
    for path in reversed(checkpoints(run_dir)):
        try:
            return load_checkpoint(path, trainer, base_dir, read_shards)
        except CheckpointError as e:
            aside = run_dir / "checkpoints" / "corrupt" / path.name
            aside.parent.mkdir(exist_ok=True)
            n = 1
            while aside.exists():
                aside, n = aside.with_name(f"{path.name}.{n}"), n + 1
            os.replace(path, aside)
            log(f"checkpoint {path.name} is unusable ({str(e).removeprefix(f'{path}: ')}); moved it to {aside}")
    return None
