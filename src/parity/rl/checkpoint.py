"""Checkpoints: everything a run needs to continue bit-for-bit, written atomically.

`RUN_DIR/checkpoints/step_NNNNNN/` holds the model in the Hugging Face format
(`config.json`, `model.safetensors`, tokenizer files: `transformers` loads it) or, when
the run trains LoRA adapters, only the adapters in PEFT's format (`adapter/`: PEFT loads
them onto the base model, which the run's `model` names and `state.json` fingerprints),
the AdamW state as `optimizer.safetensors` plus JSON, `state.json` (step, data
position, weight version, loss scaler, the run's config) and `manifest.json`
(the SHA-256 and size of every other file). Nothing is pickled, and nothing read is unpickled.

A run with distributed learners writes `sharded/` instead of `model/` and the optimizer
file: each learner saves its own shards of the weights and AdamW state with
`torch.distributed.checkpoint` (no learner gathers the whole model) in Parity's own
storage (`rl/shards.py`: safetensors shards, a JSON index), and the driver the RNG state as
`rng.safetensors`. DCP reshards on load, so any learner count, or one process (`parity
eval`), reads it back; on resume each learner calls `load_checkpoint` with its own sharded
trainer and reads its own shards in place, so no process holds the trained model whole.

A checkpoint is input like any other: a run directory may come from someone else. Only
Parity's own names under `checkpoints/` are read (`rundir.checkpoint_step`), each reached from the
run's folder without following a link (`folders.Folder`), every field of
`manifest.json` and `state.json` is checked before anything is loaded, and a checkpoint that
fails a check is set aside on resume (when an older one is intact), or refused in one line by `parity eval`.

A checkpoint directory appears only once complete (written to a temporary
folder, then renamed), so a run killed mid-save leaves the previous one intact;
only finite weights are ever saved. On resume a checkpoint whose files do not
match its manifest, or whose weights are not finite, is moved to
`checkpoints/corrupt/` and the newest intact one is used instead; where none is intact,
the resume is refused and nothing is moved (`restore_latest`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import stat
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from parity.config import ConfigError
from parity.engines import kernels
from parity.engines.lora import AdapterError, load_adapter_state, read_adapter, save_adapter
from parity.engines.models.config import ModelError
from parity.engines.models.io import load_model, save_model, save_tensors
from parity.engines.tokenizer import copy_tokenizer_files
from parity.engines.trainer import OptimConfig, Trainer
from parity.files import JSONError, parse_json
from parity.folders import Folder, atomic_dir
from parity.rl import shards
from parity.rl.model_card import model_card
from parity.rundir import CHECKPOINTS_DIR, checkpoint_name, checkpoint_step

# 2: manifest.json with checksums, the config in state.json; 3: sharded checkpoints in rl/shards.py's storage.
# A format-2 checkpoint of one process reads as before; a format-2 sharded one holds a pickled index, not read.
FORMAT_VERSION = 3
READABLE_FORMATS = (2, 3)
MANIFEST = "manifest.json"
MAX_JSON_BYTES = 64 * 2**20  # manifest.json and state.json list files and settings: far below this
ADAPTER_DIR = "adapter"
SHARDED_DIR = "sharded"  # the weights and AdamW state as torch.distributed.checkpoint shards
SHARDED_RNG = "rng.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or used; the message names it and the problem."""


@dataclass
class RunState:
    step: int  # optimizer-updated RL steps completed
    data_position: int
    weight_version: int = 0  # as loaded; a save records the trainer's (or the learners')
    config: dict[str, Any] | None = None  # the run's config when it was saved
    metrics: dict[str, float] | None = None  # the newest step's metrics, for the saved model's card
    data_sha256: str | None = None  # the training problems' fingerprint (`data.fingerprint`); None before it


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = optimizer.state_dict()
    tensors = {
        f"state.{idx}.{name}": value.detach().clone().contiguous()
        for idx, entry in sd["state"].items()
        for name, value in entry.items()
    }
    return tensors, {"param_groups": sd["param_groups"]}


def _optimizer_state(tensors: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """optimizer.safetensors' tensors by parameter position, as `_optimizer_tensors` wrote them."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    return state


def non_finite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding inf or NaN: one read from the device for all of them.

    A tensor's FP32 sum is finite only if every element is, and one pass of sums costs a fifth of
    `isfinite(...).all()`'s four (0.3 s a step on SmolLM2-135M, 2 CPU cores); a sum that is not finite (an
    element, or an overflow of finite ones) is settled by the elementwise check."""
    names = [k for k, v in tensors.items() if v.is_floating_point()]
    if not names:
        return []
    device = tensors[names[0]].device
    sums = torch.stack([tensors[k].sum(dtype=torch.float32).to(device) for k in names])
    suspect = [k for k, ok in zip(names, torch.isfinite(sums).tolist()) if not ok]
    if not suspect:
        return []
    finite = torch.stack([torch.isfinite(tensors[k]).all().to(device) for k in suspect]).tolist()
    return [k for k, ok in zip(suspect, finite) if not ok]


def local_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter as this process holds it: its shard under FSDP2, else the whole tensor."""
    from torch.distributed.tensor import DTensor

    return {n: p.to_local() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}


def require_finite_weights(model: torch.nn.Module, model_dir: Path, consequence: str) -> None:
    """Refuse a model whose weights hold inf or NaN, before anything is computed or written."""
    bad = non_finite_tensors(dict(model.named_parameters()))
    if bad:
        raise ModelError(f"{model_dir}: weights hold inf/NaN ({', '.join(bad[:3])}); {consequence}")


def _write_manifest(folder: Folder) -> None:
    """manifest.json: the size and SHA-256 of every file the fresh checkpoint folder holds."""
    names, stack = [], [""]
    while stack:
        below = stack.pop()
        for name in folder.names(below):
            rel = f"{below}/{name}" if below else name
            (stack if folder.is_dir(rel) else names).append(rel)
    entries = {n: {"bytes": folder.lstat(n).st_size, "sha256": folder.sha256(n)} for n in sorted(names)}
    folder.write_text(MANIFEST, json.dumps({"format": FORMAT_VERSION, "files": entries}, indent=2) + "\n")


def open_checkpoint(path: Path) -> Folder:
    """The checkpoint folder `path`: a run's RUN/checkpoints/step_N reached from the run's folder without
    following a link, or a folder given on its own, opened as named."""
    if path.parent.name != CHECKPOINTS_DIR:
        return Folder.open(path, key="checkpoint")
    with Folder.open(path.parent.parent, key="run_dir") as run:
        return run.sub(f"{CHECKPOINTS_DIR}/{path.name}")


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


def _read_json(ckpt: Folder, name: str) -> Any:
    """A checkpoint's small JSON file; a JSONError (or OSError) when it cannot be used."""
    try:
        data = ckpt.read_bytes(name, MAX_JSON_BYTES)
    except ConfigError:  # a link, a FIFO
        raise JSONError("a link or not a regular file, which Parity never writes") from None
    except ValueError:
        raise JSONError(f"more than the {MAX_JSON_BYTES:,} bytes a checkpoint's {name} holds") from None
    try:
        return parse_json(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise JSONError(f"not UTF-8 (byte at offset {e.start})") from None


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _manifest_problem(entries: Any) -> str | None:
    """What makes manifest.json's `files` unusable: not {relative path: {"bytes": N, "sha256": HEX}}."""
    if not isinstance(entries, dict):
        return f'{MANIFEST}: files must be an object {{"PATH": {{"bytes": N, "sha256": HEX}}}}'
    for name, entry in entries.items():
        parts = Path(name).parts
        if not parts or Path(name).is_absolute() or ".." in parts:
            return f"{MANIFEST}: {name!r} is not a path inside the checkpoint"
        ok = isinstance(entry, dict) and type(entry.get("bytes")) is int and entry["bytes"] >= 0
        if not ok or not isinstance(entry.get("sha256"), str) or not _SHA256.fullmatch(entry["sha256"]):
            return f'{MANIFEST}: {name}: expected {{"bytes": N, "sha256": HEX}}'
    return None


def verify_checkpoint(path: Path) -> str | None:
    """What is wrong with the checkpoint at `path` (a missing, changed or cut file, a link), or None."""
    with open_checkpoint(path) as ckpt:
        return _manifest_mismatch(ckpt)


def _manifest_mismatch(ckpt: Folder) -> str | None:
    try:
        manifest = _read_json(ckpt, MANIFEST)
    except FileNotFoundError:
        return f"no {MANIFEST} (not a complete checkpoint of this format)"
    except (JSONError, OSError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    entries = manifest.get("files") if isinstance(manifest, dict) else None
    problem = _manifest_problem(entries)
    if problem is not None:
        return problem
    for name, entry in entries.items():
        try:
            st = ckpt.lstat(name)
            if st is not None and stat.S_ISLNK(st.st_mode):
                return f"{name} is a link, which Parity never writes"
            if st is None or not stat.S_ISREG(st.st_mode):
                return f"{name} is missing"
            if st.st_size != entry["bytes"]:
                return f"{name} is {st.st_size} bytes, the manifest says {entry['bytes']}"
            if ckpt.sha256(name) != entry["sha256"]:
                return f"{name} does not match its checksum"
        except ConfigError:  # a link on the way to it
            return f"{name} lies behind a link, which Parity never writes"
        except NotADirectoryError:
            return f"{name} is missing"
    return None


def _saved_state(path: Path) -> dict[str, Any]:
    """The checkpoint's state.json as a dict ({} when it does not read)."""
    try:
        with open_checkpoint(path) as ckpt:
            meta = _read_json(ckpt, "state.json")
    except (JSONError, OSError, ConfigError):
        return {}
    return meta if isinstance(meta, dict) else {}


def saved_config(path: Path) -> dict[str, Any] | None:
    """The run's config that the checkpoint at `path` stores, or None when its state.json does not read."""
    config = _saved_state(path).get("config")
    return config if isinstance(config, dict) else None


def base_problem(path: Path, base_dir: Path, meta: dict[str, Any] | None = None) -> str | None:
    """Why `base_dir` is not the base model the LoRA checkpoint at `path` was trained on (its state.json
    records the base's `base_sha256`), or None when it is: the same base may have moved, another must not
    take its place. `meta`: the checkpoint's state.json, when read already."""
    meta = _saved_state(path) if meta is None else meta
    base = meta.get("base_model") if isinstance(meta.get("base_model"), dict) else {}
    if base.get("sha256") == base_sha256(base_dir):
        return None
    return (
        f"the base model in {base_dir} is not the one this run's LoRA adapters were trained on "
        f"({base.get('path')}, sha256 {str(base.get('sha256'))[:12]})"
    )


def _count(meta: dict[str, Any], key: str) -> int:
    value = meta.get(key)
    if type(value) is not int or value < 0:
        raise CheckpointError(f"state.json: {key} must be an integer >= 0, got {value!r}")
    return value


def _run_state(meta: Any) -> RunState:
    """state.json's run state, every field checked (a CheckpointError names the first that is not usable)."""
    if not isinstance(meta, dict):
        raise CheckpointError("state.json: expected a JSON object")
    if meta.get("format") not in READABLE_FORMATS:
        raise CheckpointError(f"state.json: unsupported checkpoint format {meta.get('format')!r}")
    scaler = meta.get("scaler")
    counts = ("clean_steps", "skipped_steps")
    if (
        not isinstance(scaler, dict)
        or not isinstance(scaler.get("scale"), (int, float))
        or isinstance(scaler["scale"], bool)
        or not (math.isfinite(scaler["scale"]) and scaler["scale"] > 0)
        or any(type(scaler.get(k)) is not int or scaler[k] < 0 for k in counts)
    ):
        raise CheckpointError(
            'state.json: scaler must be {"scale": a positive number, "clean_steps": N, "skipped_steps": N}'
        )
    if meta.get("config") is not None and not isinstance(meta["config"], dict):
        raise CheckpointError("state.json: config must be an object")
    data = meta.get("data_sha256")
    if data is not None and not (isinstance(data, str) and _SHA256.fullmatch(data)):
        raise CheckpointError("state.json: data_sha256 must be a SHA-256 in hex")
    return RunState(
        _count(meta, "step"),
        _count(meta, "data_position"),
        _count(meta, "weight_version"),
        meta.get("config"),
        data_sha256=data,
    )


def _tensors(ckpt: Folder, name: str) -> dict[str, torch.Tensor]:
    if not ckpt.is_file(name):
        raise CheckpointError(f"{name}: missing, or not a regular file")
    try:
        return load_file(str(ckpt.path(name)))
    except SafetensorError as e:
        raise CheckpointError(f"{name}: not a readable safetensors file ({e})") from None


def _check_rng(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    rng, expected = tensors.pop("rng.torch", None), torch.get_rng_state()
    if rng is None or rng.dtype != expected.dtype or rng.shape != expected.shape:
        raise CheckpointError(f"rng.torch: expected the generator state, {tuple(expected.shape)} bytes")
    return rng


def _check_weights(trainer: Trainer, weights: dict[str, torch.Tensor]) -> None:
    """A checkpoint's full weights must be this trainer's, name for name and shape for shape: a checkpoint
    of another model in a run's folder is refused here, before any weight is replaced."""
    own = {k: tuple(v.shape) for k, v in trainer.model.state_dict().items()}
    held = {k: tuple(v.shape) for k, v in weights.items()}
    if held != own:
        name = sorted(k for k in own.keys() | held.keys() if own.get(k) != held.get(k))[0]
        raise CheckpointError(f"holds another model's weights ({name}: {held.get(name)} there, {own.get(name)} here)")


def _check_optimizer(trainer: Trainer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """optimizer.safetensors and state.json's param_groups must fit this trainer's optimizer."""
    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    groups = (meta.get("optimizer") or {}).get("param_groups") if isinstance(meta.get("optimizer"), dict) else None
    if not isinstance(groups, list) or [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in groups] != [
        len(g["params"]) for g in trainer.optimizer.param_groups
    ]:
        raise CheckpointError("state.json: optimizer.param_groups do not fit this trainer's optimizer")
    for key, value in tensors.items():
        match = re.fullmatch(r"state\.(\d+)\.(\w+)", key)
        if match is None or int(match[1]) >= len(params):
            raise CheckpointError(f"optimizer.safetensors: {key} is not an optimizer state of this model")
        if value.dim() and value.shape != params[int(match[1])].shape:
            raise CheckpointError(f"optimizer.safetensors: {key} is {tuple(value.shape)}, its parameter not")


# A learner group's writer of a sharded checkpoint: every learner writes its own shards into the folder; the
# writer returns the names of any non-finite tensors (then nothing is saved), the loss scaler and the version.
# The folder it gets is the fresh checkpoint's, which each learner opens itself (`Folder.root`, `Folder.rel`).
ShardWriter = Callable[[Folder], tuple[list[str], dict[str, float], int]]


def save_checkpoint(
    run_dir: Path,
    trained: Trainer | ShardWriter,
    state: RunState,
    model_dir: Path,
    keep: int,
) -> Path:
    """Save `trained`: this process's trainer, whole, or a learner group's shards (`ShardWriter`).
    `model_dir`: the run's model (its tokenizer files are copied; with LoRA, the adapters' base)."""
    if isinstance(trained, Trainer):
        bad = non_finite_tensors({n: p for n, p in trained.model.named_parameters() if p.requires_grad})
        if bad:
            raise CheckpointError(f"step {state.step}: not saving a checkpoint: inf/NaN in {', '.join(bad[:3])}")
    name = checkpoint_name(state.step)
    target = run_dir / CHECKPOINTS_DIR / name
    with Folder.open(run_dir, create=True, key="run_dir") as run, run.sub(CHECKPOINTS_DIR, create=True) as saved:
        try:
            with saved.new_dir(name) as folder:
                _write_checkpoint(folder, trained, state, model_dir)
        except (OSError, SafetensorError) as e:  # a full disk, a file-size limit: the earlier ones stay intact
            raise CheckpointError(f"{target}: could not be written ({e}); earlier checkpoints are intact") from None
        # Older ones go; `target`, just written from finite weights, is always the newest kept.
        older = [n for n in _checkpoint_names(run) if checkpoint_step(n) < state.step]
        for old in older[: max(len(older) - (keep - 1), 0)]:
            with saved.sub(old) as ckpt:
                added = _not_written(ckpt)
            if added:  # what someone put there is not Parity's to delete
                print(
                    f"WARNING {CHECKPOINTS_DIR}/{old} holds what Parity did not write ({', '.join(added[:3])}): kept, "
                    "not pruned (keep_checkpoints); remove it yourself",
                    file=sys.stderr,
                )
            else:
                saved.remove(old)
    return target


def _not_written(ckpt: Folder) -> list[str]:
    """The entries of a checkpoint folder that its manifest does not list (all of them, without a manifest)."""
    try:
        files = set(_read_json(ckpt, MANIFEST).get("files", {})) | {MANIFEST}
    except (JSONError, OSError, AttributeError):
        return ckpt.names()
    folders = {str(parent) for name in files for parent in Path(name).parents if str(parent) != "."}
    added, stack = [], [""]
    while stack:
        below = stack.pop()
        for name in ckpt.names(below):
            rel = f"{below}/{name}" if below else name
            if rel in folders and ckpt.is_dir(rel):
                stack.append(rel)
            elif rel not in files:
                added.append(rel)
    return sorted(added)


def _write_checkpoint(folder: Folder, trained: Trainer | ShardWriter, state: RunState, model_dir: Path) -> None:
    tmp = folder.path()  # the fresh folder itself, for the libraries that write by path
    meta: dict[str, Any] = {"format": FORMAT_VERSION}
    if not isinstance(trained, Trainer):
        bad, scaler, version = trained(folder)
        if bad:
            raise CheckpointError(f"step {state.step}: not saving a checkpoint: inf/NaN in {', '.join(bad[:3])}")
        tensors, tensor_file = {}, SHARDED_RNG
    else:
        card = model_card(
            state.config or {}, state.metrics or {}, state.step, Path(model_dir), trained.lora is not None
        )
        if trained.lora is None:
            save_model(trained.model, tmp / "model", functools.partial(_model_files, model_dir, card))
        else:
            base = Path(model_dir).resolve()
            save_adapter(trained.model, trained.lora, tmp / ADAPTER_DIR, base_model=str(base))
            folder.write_text(f"{ADAPTER_DIR}/README.md", card)
            meta["base_model"] = {"path": str(base), "sha256": base_sha256(base)}
        tensors, meta["optimizer"] = _optimizer_tensors(trained.optimizer)
        tensor_file = "optimizer.safetensors"
        scaler, version = trained.scaler.state_dict(), trained.weight_version
    tensors["rng.torch"] = torch.get_rng_state()
    save_tensors(tensors, tmp / tensor_file)
    meta.update(
        step=state.step,
        data_position=state.data_position,
        data_sha256=state.data_sha256,
        weight_version=version,
        scaler=scaler,
        config=state.config,
    )
    folder.write_text("state.json", json.dumps(meta, indent=2) + "\n")
    _write_manifest(folder)


def export_model(checkpoint: Path, model_dir: Path, out_dir: Path) -> Path:
    """A checkpoint's model as a folder `transformers` (or PEFT, for adapters) loads, written atomically to
    `out_dir` (which it replaces): the checkpoint's model/ or adapter/ copied file by file, once its manifest
    checks; a sharded checkpoint's weights gathered in this process (`load_checkpoint`) and written as a
    checkpoint writes model/, with its card. `model_dir`: the run's model (the tokenizer's files, the base)."""
    problem = verify_checkpoint(checkpoint)
    if problem is not None:
        raise CheckpointError(f"{checkpoint}: {problem}")
    with open_checkpoint(checkpoint) as ckpt:
        saved = next((d for d in ("model", ADAPTER_DIR) if ckpt.is_dir(d)), None)
        if saved is not None:
            with atomic_dir(out_dir) as tmp:
                for name in ckpt.names(saved):
                    (tmp / name).write_bytes(ckpt.read_bytes(f"{saved}/{name}"))
            return out_dir
    trainer = Trainer(load_model(model_dir, kernels.numerics()), "fp32", OptimConfig())
    state = load_checkpoint(checkpoint, trainer, verified=True)
    card = model_card(state.config or {}, state.metrics or {}, state.step, str(Path(model_dir).resolve()))
    return save_model(trainer.model, out_dir, functools.partial(_model_files, model_dir, card))


def _model_files(model_dir: Path, card: str, folder: Path) -> None:
    """A saved model's files beside its weights: the tokenizer's and its model card (README.md)."""
    copy_tokenizer_files(model_dir, folder)
    (folder / "README.md").write_text(card, encoding="utf-8")


def _state_dicts(trainer: Trainer) -> tuple[dict[str, dict], list[dict]]:
    """The trainer's tensors keyed by parameter name, each as this process holds it (a shard under FSDP2):
    what a sharded checkpoint saves and loads in place; and the optimizer's param_groups, which it does not
    store (`rl/shards.py`)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = get_state_dict(trainer.model, trainer.optimizer)
    return {"model": model, "optim": {"state": optim["state"]}}, optim["param_groups"]


def save_shards(trainer: Trainer, folder: Path) -> None:
    """Write this learner's shards of the trainer's state into `folder`: a collective, every learner of
    the group calls it at once (rank 0 also writes the index of all shards)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(_state_dicts(trainer)[0], storage_writer=shards.ShardWriter(folder), no_dist=not dist.is_initialized())


def load_shards(folder: Path, trainer: Trainer) -> list[str]:
    """Read a sharded checkpoint into `trainer` whatever its layout: one process, or a learner group
    of any size (DCP reshards; in a group, a collective). Returns the names of the non-finite tensors this
    process now holds. Raises CheckpointError when the shards are damaged or do not fit the model."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state, param_groups = _state_dicts(trainer)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=shards.ShardReader(folder), no_dist=not dist.is_initialized())
    except CheckpointException as e:  # its text is every rank's traceback: name the first failure only
        failure = next(iter(e.failures.values()))[0]
        raise CheckpointError(f"{folder}: {failure}") from None
    except (RuntimeError, ValueError) as e:  # a shard that does not fit this model
        raise CheckpointError(f"{folder}: {e}") from None
    optim = {"state": state["optim"]["state"], "param_groups": param_groups}
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=optim)
    return non_finite_tensors(local_parameters(trainer.model))


def _checkpoint_names(run: Folder) -> list[str]:
    """The names of the run's checkpoint folders, oldest first: Parity's names only (`rundir.checkpoint_step`);
    `checkpoints` being a link is refused (LinkError)."""
    found = [n for n in run.names(CHECKPOINTS_DIR) if checkpoint_step(n) is not None]
    return sorted((n for n in found if run.is_dir(f"{CHECKPOINTS_DIR}/{n}")), key=checkpoint_step)


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoint folders, oldest first (none when `run_dir` is no folder)."""
    if not Path(run_dir).is_dir():
        return []
    with Folder.open(run_dir, key="run_dir") as run:
        return [Path(run_dir) / CHECKPOINTS_DIR / n for n in _checkpoint_names(run)]


def _check_kind(path: Path, lora: bool, trainer: Trainer, meta: dict[str, Any], base_dir: Path | None) -> None:
    """A LoRA checkpoint (`lora`: it holds adapters) goes to a LoRA trainer on the same base, a full one to a
    full trainer. ConfigError, not CheckpointError: the checkpoint is sound, so it must not be set aside."""
    if lora != (trainer.lora is not None):
        held, wanted = ("LoRA adapters", "full weights") if lora else ("full weights", "LoRA adapters")
        raise ConfigError(f"{path}: holds {held}, but this trainer trains {wanted} (lora.rank)")
    if not lora:
        return
    if base_dir is None:
        raise ValueError(f"{path}: loading LoRA adapters needs base_dir, the base model they were trained on")
    problem = base_problem(path, base_dir, meta)
    if problem is not None:
        raise ConfigError(f"model: {problem}; give that base (model=DIR where it is now)")


def load_checkpoint(path: Path, trainer: Trainer, base_dir: Path | None = None, verified: bool = False) -> RunState:
    """Restore weights (or LoRA adapters, whose base is `base_dir`), optimizer, scaler and RNG
    into `trainer`; return the run state. A sharded trainer (a learner; every learner calls this at once)
    reads its own shards of a sharded checkpoint in place. `verified`: the caller has checked the files
    against the manifest (`verify_checkpoint`).

    Raises CheckpointError when the checkpoint is damaged or holds non-finite values, and
    ConfigError when it does not fit this trainer (LoRA or not, another base model)."""
    with open_checkpoint(path) as ckpt:
        try:
            return _load(ckpt, path, trainer, base_dir, verified)
        except CheckpointError as e:  # a library's message names the folder by its descriptor: by its name here
            raise CheckpointError(str(e).replace(str(ckpt.path()), str(path))) from None


def _load(ckpt: Folder, path: Path, trainer: Trainer, base_dir: Path | None, verified: bool) -> RunState:
    problem = None if verified else _manifest_mismatch(ckpt)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
    sharded = ckpt.is_dir(SHARDED_DIR)
    try:
        meta = _read_json(ckpt, "state.json")
        state = _run_state(meta)
        if checkpoint_step(path.name) not in (None, state.step):
            raise CheckpointError(f"state.json: step {state.step} in the folder of step {checkpoint_step(path.name)}")
        _check_kind(path, ckpt.is_dir(ADAPTER_DIR), trainer, meta, base_dir)
        if trainer.sharded and not sharded:  # a distributed run writes sharded ones only
            raise ConfigError(f"{path}: a one-process checkpoint; a learner group resumes its own sharded ones")
        if sharded:
            shards.read_index(ckpt.path(SHARDED_DIR))  # the index, checked here before any learner reads it
            weights = {}  # checked once loaded: DCP reads into the trainer's own tensors
            tensors = _tensors(ckpt, SHARDED_RNG)
        else:
            if trainer.lora is None:
                weights = load_model(ckpt.path("model"), kernels.numerics()).state_dict()
                _check_weights(trainer, weights)
            else:
                weights = read_adapter(ckpt.path(ADAPTER_DIR), trainer.lora)
            tensors = _tensors(ckpt, "optimizer.safetensors")
        rng = _check_rng(tensors)
        if not sharded:
            _check_optimizer(trainer, tensors, meta)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except ConfigError:  # a sound checkpoint that does not fit this trainer: not to be set aside
        raise
    except (ModelError, AdapterError, JSONError, ValueError, OSError, SafetensorError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    bad = non_finite_tensors(weights) + non_finite_tensors(tensors)
    if bad:
        raise CheckpointError(f"{path}: inf/NaN in {', '.join(bad[:3])}")
    if sharded:
        bad = load_shards(ckpt.path(SHARDED_DIR), trainer)
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
        trainer.optimizer.load_state_dict(
            {"state": _optimizer_state(tensors), "param_groups": meta["optimizer"]["param_groups"]}
        )
    torch.set_rng_state(rng)
    trainer.scaler.load_state_dict(meta["scaler"])
    trainer.weight_version = state.weight_version
    return state


def restore_latest(run_dir: Path, load: Callable[[Path], RunState], log: Callable[[str], None]) -> RunState | None:
    """The newest usable checkpoint, loaded by `load(path)` (`load_checkpoint` into the run's trainer, or into
    every learner); the damaged ones newer than it (CheckpointError) are set aside in `checkpoints/corrupt/`,
    saying so through `log`. None when the run has no checkpoint.

    When none can be used, a CheckpointError naming each, and nothing moved: the run's history (metrics.jsonl)
    stands on them, a copy may repair them, and "damaged" may be the user's doing (another base model put where
    the run's was), where setting every checkpoint aside and training again from step 0 would lose the run."""
    unusable: list[tuple[Path, str]] = []
    for path in reversed(checkpoints(run_dir)):
        try:
            state = load(path)
        except CheckpointError as e:
            unusable.append((path, str(e).removeprefix(f"{path}: ")))
            continue
        for damaged, problem in unusable:
            log(f"checkpoint {damaged.name} is unusable ({problem}); moved it to {_set_aside(run_dir, damaged.name)}")
        return state
    if unusable:
        problems = "; ".join(f"{path.name}: {problem}" for path, problem in unusable)
        raise CheckpointError(
            f"--resume {run_dir}: no checkpoint of the run is usable ({problems}); nothing was moved or cut "
            "back. Restore them from a copy, or start a new run (to train this one again from step 0, move its "
            f"{CHECKPOINTS_DIR}/ away)"
        )
    return None


def _set_aside(run_dir: Path, name: str) -> Path:
    """Move the run's checkpoint `name` into `checkpoints/corrupt/` (as `name.N` where one by its name is there)."""
    with Folder.open(run_dir, key="run_dir") as run:
        run.mkdir(f"{CHECKPOINTS_DIR}/corrupt")
        aside, n = name, 1
        while run.lstat(f"{CHECKPOINTS_DIR}/corrupt/{aside}") is not None:
            aside, n = f"{name}.{n}", n + 1
        run.replace(f"{CHECKPOINTS_DIR}/{name}", f"{CHECKPOINTS_DIR}/corrupt/{aside}")
    return run_dir / CHECKPOINTS_DIR / "corrupt" / aside
