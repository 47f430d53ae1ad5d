"""Model directories: where a model is (`resolve_model_dir`), reading its config and safetensors weights
(`load_model`, one tensor and, sharded, one row range at a time), the checks on its files (links that
leave the directory, pickles, sizes the weights do not hold, a first forward that is not finite), and
saving in the Hugging Face format (`save_model`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from parity.engines import kernels
from parity.engines.models.config import ModelConfig, ModelError
from parity.engines.models.modules import CausalLM
from parity.engines.packing import pack
from parity.folders import atomic_dir

BUILTIN_DIR = Path(__file__).parents[2] / "builtin" / "model"
AGENT_DIR = Path(__file__).parents[2] / "builtin" / "agent_model"  # `builtin-agent`: the tool-calling model
SHIPPED_MODELS = {
    "builtin": (BUILTIN_DIR, "parity build-model"),
    "builtin-agent": (AGENT_DIR, "parity build-model --agent"),
}


def model_file(model_dir: Path, name: str) -> Path:
    """`model_dir / name`, refused when it resolves outside the model directory (a symlink to a file
    elsewhere: a template linked to /etc/passwd would be read into every prompt, and a tokenizer file
    copied into every checkpoint). A snapshot in the Hugging Face cache links its files to the cached
    repository's blobs, which stay allowed (`_cache_blobs`)."""
    path = model_dir / name
    if not path.is_symlink() and not any(p.is_symlink() for p in path.parents if p != model_dir):
        return path
    real, root = path.resolve(), model_dir.resolve()
    blobs = _cache_blobs(root)
    if not real.is_relative_to(root) and not (blobs is not None and real.is_relative_to(blobs)):
        raise ModelError(
            f"{path}: links to {real}, outside the model directory; Parity reads only files inside it "
            "(copy the file in instead of linking it)"
        )
    return path


def _cache_blobs(snapshot: Path) -> Path | None:
    """The blobs folder a Hugging Face cache snapshot links into, when `snapshot` (resolved) is one:
    HUB/models--ORG--NAME/snapshots/REVISION beside HUB/models--ORG--NAME/blobs. Any other folder named
    snapshots/X is an ordinary directory, whose links must stay inside it."""
    snapshots, repo = snapshot.parent, snapshot.parent.parent
    if snapshots.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return repo / "blobs"
    return None


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ModelError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a model directory's file; anything else is a one-line ModelError."""
    try:
        value = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except RecursionError:
        raise ModelError(f"{path}: JSON nested too deeply to read") from None
    if not isinstance(value, dict):
        raise ModelError(f"{path}: expected a JSON object {{...}} at the top level, got a {type(value).__name__}")
    return value


def hf_cache_dir() -> Path:
    """Where the Hugging Face libraries keep downloaded repositories: $HF_HUB_CACHE, $HF_HOME/hub, or
    ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of a Hugging Face model id (`org/name`) that `main` points at in the cache, or
    None: Parity reads the cache and never the network."""
    repo = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    try:
        revision = (repo / "refs" / "main").read_text().strip()
    except OSError:
        snapshots = sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
        return snapshots[-1] if len(snapshots) == 1 else None
    snapshot = repo / "snapshots" / revision
    return snapshot if snapshot.is_dir() else None


def resolve_model_dir(model: str | Path) -> Path:
    """`builtin` and `builtin-agent` name the shipped models; `org/name` that is not a directory, a Hugging
    Face id in the local cache; anything else is a local directory."""
    if str(model) in SHIPPED_MODELS:
        folder, command = SHIPPED_MODELS[str(model)]
        if not (folder / "model.safetensors").is_file():
            raise ModelError(f"the {model} model is missing from {folder}; rebuild it with `{command}`")
        return folder
    if not str(model).strip():
        raise ModelError("model: empty; give a model directory, a Hugging Face id in the local cache or builtin")
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    text = str(model)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        snapshot = cached_snapshot(text)
        if snapshot is not None:
            return snapshot
        raise ModelError(
            f"model {text!r}: no such directory, and not in the local Hugging Face cache ({hf_cache_dir()}); "
            f"Parity never downloads: fetch it first (hf download {text})"
        )
    what = "a file, not a directory" if path.exists() else "no such directory"
    raise ModelError(
        f"model {text!r}: {what} (give a model directory, a Hugging Face id in the local cache, "
        "builtin or builtin-agent)"
    )


def not_a_model(folder: Path) -> str:
    """What a folder given as a model directory is instead, when it is a checkpoint, a run or an adapter of
    Parity's (a hint for the line that refuses it), else ''."""
    if (folder / "model" / "config.json").is_file() and (folder / "state.json").is_file():
        return f" (a checkpoint: its model is {folder / 'model'})"
    if (folder / "config.yaml").is_file() and (folder / "checkpoints").is_dir():
        return " (a run directory: `parity eval` takes it; a checkpoint's model is checkpoints/step_N/model)"
    if (folder / "adapter_config.json").is_file():
        return " (a LoRA adapter: `parity eval` takes it; other commands take its base model)"
    if (folder / "checkpoints").is_dir() or (folder / "metrics.jsonl").is_file():
        return " (a run directory without its config.yaml, which `parity eval` and `--resume` read)"
    return ""


def load_config(model_dir: str | Path) -> ModelConfig:
    model_dir = resolve_model_dir(model_dir)
    path = model_file(model_dir, "config.json")
    if not path.is_file():
        raise ModelError(
            f"{model_dir}: no config.json; this is not a Hugging Face model directory{not_a_model(model_dir)}"
        )
    return ModelConfig.from_hf(read_json(path), source=str(path))


def _weight_files(model_dir: Path) -> list[Path]:
    single = model_file(model_dir, "model.safetensors")
    if single.is_file():
        return [single]
    index = model_file(model_dir, "model.safetensors.index.json")
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelError(f'{index}: expected {{"weight_map": {{"TENSOR NAME": "SHARD FILE", ...}}}}')
        return [model_file(model_dir, s) for s in sorted(set(weight_map.values()))]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")) or any(model_dir.glob("*.pth")):
        raise ModelError(
            f"{model_dir}: weights are pickle files (.bin/.pt), which Parity never unpickles; "
            "convert them with model.save_pretrained(DIR, safe_serialization=True)"
        )
    raise ModelError(f"{model_dir}: no model.safetensors (or sharded index) found")


def load_checked_config(model_dir: str | Path) -> ModelConfig:
    """config.json with its sizes checked against the weight files' headers, no tensor read: what may size
    memory before the weights load (a `vocab_size` of 10**12 is the config's error, not the batch's)."""
    model_dir = resolve_model_dir(model_dir)
    cfg = load_config(model_dir)
    with _WeightFiles(_weight_files(model_dir)) as files:
        _check_sizes(cfg, files.file_shapes, model_dir)
    return cfg


def load_model(
    model_dir: str | Path, numerics: kernels.Numerics, shard: Callable[[CausalLM], object] | None = None
) -> CausalLM:
    """Load FP32 weights from a Hugging Face directory, one tensor at a time, into a model that computes with
    `numerics` on its device (`kernels.numerics()`, the CPU's plain kernels, where only the weights are
    wanted). `trust_remote_code` is never used. `shard` (FSDP2's `fully_shard` of each learner) is applied to
    the model before any weight is read: the model is built on the meta device, sharded, given memory for its
    shards only, and each process then reads only the rows of each tensor that its shards hold."""
    model_dir = resolve_model_dir(model_dir)
    cfg = load_config(model_dir)
    with _WeightFiles(_weight_files(model_dir)) as files:
        _check_sizes(cfg, files.file_shapes, model_dir)
        if shard is None:
            model = CausalLM(cfg, numerics)
        else:
            with torch.device("meta"):
                model = CausalLM(cfg, numerics)
            shard(model)
            model.to_empty(device=numerics.device)
            model.init_buffers()
        params = {
            k: v
            for k, v in model.state_dict(keep_vars=True).items()
            if not (cfg.tie_word_embeddings and k == "lm_head.weight")
        }
        missing = sorted(params.keys() - files.shapes.keys())
        unexpected = sorted(
            k
            for k in files.shapes.keys() - params.keys()
            if not (k.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and k == "lm_head.weight"))
        )
        if missing or unexpected:
            raise ModelError(
                f"{model_dir}: weights do not match a {cfg.architecture} model "
                f"(missing {missing[:4]}, unexpected {unexpected[:4]})"
            )
        wrong_shape = [
            f"{k} {files.shapes[k]}, expected {tuple(v.shape)}"
            for k, v in params.items()
            if files.shapes[k] != tuple(v.shape)
        ]
        if wrong_shape:
            raise ModelError(f"{model_dir}: weights do not match config.json ({'; '.join(wrong_shape[:3])})")
        with torch.no_grad():
            for name, param in params.items():
                local, first = _local_rows(param)
                local.copy_(files.read(name, first, first + local.shape[0]))
    return model if numerics.device.type == "cpu" else model.to(numerics.device)


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The part of `param` this process holds, and the row of the whole tensor where it begins: all of
    it from row 0, or for an FSDP2 parameter (a DTensor sharded on dim 0 over a 1-D mesh, as
    `torch.chunk` splits it) this rank's rows."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return param, 0
    if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise ValueError(f"load_model: cannot read shards placed as {param.placements} on a {param.device_mesh}")
    rows, world = param.shape[0], param.device_mesh.size()
    chunk = -(-rows // world)
    first = min(param.device_mesh.get_local_rank() * chunk, rows)
    local = param.to_local()
    if local.shape[0] != min(chunk, rows - first):
        raise ValueError(f"load_model: a shard of {rows} rows over {world} ranks holds {local.shape[0]} (not chunked)")
    return local, first


class _WeightFiles:
    """A model's safetensors files, open for reading tensor by tensor and row range by row range under
    the model's parameter names: nothing is read before it is asked for. Experts stacked in two tensors
    per layer (transformers 5: gate_up_proj [E, 2I, H], down_proj [E, H, I]) are read as the per-expert
    names of checkpoints on the Hub."""

    def __init__(self, files: list[Path]):
        self.files = files
        self._open = contextlib.ExitStack()
        self._slices: dict[str, tuple[Any, Path]] = {}  # tensor name in the files -> (its lazy slice, its file)
        self.file_shapes: dict[str, tuple[int, ...]] = {}
        # per-expert name -> (stacked tensor's name, expert, first row in it)
        self._stacked: dict[str, tuple[str, int, int]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}  # under the model's names

    def __enter__(self) -> _WeightFiles:
        try:
            self._index()
        except BaseException:
            self._open.close()
            raise
        return self

    def _index(self) -> None:
        from safetensors import safe_open

        for f in self.files:
            if not f.is_file():
                raise ModelError(f"{f}: missing (a shard the index names)")
            try:
                opened = self._open.enter_context(safe_open(str(f), "pt"))
                for k in opened.keys():
                    self._slices[k] = (opened.get_slice(k), f)
                    self.file_shapes[k] = tuple(self._slices[k][0].get_shape())
            except Exception as e:  # safetensors raises its own error types for cut or garbled files
                raise ModelError(f"{f}: not a readable safetensors file ({e})") from None
        self.shapes = dict(self.file_shapes)
        for name in [n for n in self.file_shapes if n.endswith(".mlp.experts.gate_up_proj")]:
            prefix, where = name.removesuffix("gate_up_proj"), self._slices[name][1]
            down = prefix + "down_proj"
            gate_up_shape, down_shape = self.shapes.pop(name), self.shapes.pop(down, None)
            if len(gate_up_shape) != 3 or down_shape is None or len(down_shape) != 3:
                raise ModelError(
                    f"{where}: stacked experts must be {name} [experts, 2 x intermediate, hidden] and {down} "
                    f"[experts, hidden, intermediate]; found {gate_up_shape} and {down_shape}"
                )
            experts, width, hidden = gate_up_shape[0], gate_up_shape[1] // 2, gate_up_shape[2]
            for e in range(experts):
                for proj, source, first, shape in (
                    ("gate_proj", name, 0, (width, hidden)),
                    ("up_proj", name, width, (width, hidden)),
                    ("down_proj", down, 0, down_shape[1:]),
                ):
                    self._stacked[f"{prefix}{e}.{proj}.weight"] = (source, e, first)
                    self.shapes[f"{prefix}{e}.{proj}.weight"] = shape

    def __exit__(self, *exc) -> None:
        self._open.close()

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the tensor the model names `name`, as stored (FP32 copies are the caller's)."""
        stacked = self._stacked.get(name)
        lazy, f = self._slices[stacked[0] if stacked else name]
        try:
            if stacked:
                _, expert, first = stacked
                return lazy[expert, first + start : first + stop]
            return lazy[start:stop]
        except Exception as e:
            raise ModelError(f"{f}: {name} could not be read ({e})") from None


def _check_sizes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], model_dir: Path) -> None:
    """Refuse a config.json whose sizes the weight files do not hold, from the files' headers, before
    anything is allocated (a vocab_size of 10**12 would otherwise reach the allocator)."""
    differ = f"{model_dir}: weights do not match config.json:"
    embed = shapes.get("model.embed_tokens.weight")
    if embed != (cfg.vocab_size, cfg.hidden_size):
        raise ModelError(
            f"{differ} vocab_size {cfg.vocab_size} x hidden_size {cfg.hidden_size}, "
            f"but model.embed_tokens.weight is {embed}"
        )
    layers = {int(k.split(".")[2]) for k in shapes if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    if layers != set(range(cfg.num_layers)):
        raise ModelError(f"{differ} num_hidden_layers {cfg.num_layers}, but the weights hold {len(layers)} layers")
    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    expected = {
        "self_attn.q_proj.weight": ((q_width, cfg.hidden_size), "num_attention_heads x head_dim"),
        "self_attn.k_proj.weight": ((kv_width, cfg.hidden_size), "num_key_value_heads x head_dim"),
        "mlp.gate_proj.weight": ((cfg.intermediate_size, cfg.hidden_size), "intermediate_size"),
    }
    for name, (shape, keys) in expected.items():
        found = shapes.get(f"model.layers.0.{name}")
        if found is not None and found != shape:
            raise ModelError(f"{differ} {keys} make model.layers.0.{name} {shape}, but the weights hold {found}")
    if cfg.num_experts and cfg.moe_layers:
        first = f"model.layers.{cfg.moe_layers[0]}.mlp.experts."
        stacked = shapes.get(first + "gate_up_proj")
        held = stacked[0] if stacked else len({k[len(first) :].split(".")[0] for k in shapes if k.startswith(first)})
        if held != cfg.num_experts:
            raise ModelError(f"{differ} num_experts {cfg.num_experts}, but the weights hold {held}")


# Tokens of the first forward that `require_finite_logits` runs: enough to pass every layer, cheap on any model.
PROBE_TOKENS = 32


def require_finite_logits(model: CausalLM, prompt: list[int], dtypes: dict[str, torch.dtype], source: Path) -> None:
    """Refuse a model whose first forward gives inf/NaN logits in any of `dtypes` (precision name -> dtype),
    before anything is computed or written. Positive config values can still make every output NaN (a RoPE
    base too small for FP16's range, norms that divide by 0), and a run would then train on NaN while
    exiting 0."""
    packed = pack([prompt[:PROBE_TOKENS]], device=next(model.parameters()).device)
    with torch.no_grad():
        for name, dtype in dtypes.items():
            if not torch.isfinite(model.logits(model.hidden_states(packed, dtype))).all():
                raise ModelError(
                    f"{source}: the first forward in {name} gives inf/NaN logits; nothing can be trained or "
                    "measured from them (`parity doctor` names the first layer that overflows)"
                )


def export_state(
    model: CausalLM, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """Parameters under their Hugging Face names, cast to `dtype` (tied head omitted), on `device`
    (default: where the model is, so that a weight sync on one GPU never passes through the host)."""
    return {
        k: v.detach().to(device=device or v.device, dtype=dtype).contiguous()
        for k, v in model.state_dict().items()
        if not (model.config.tie_word_embeddings and k == "lm_head.weight")
    }


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """A safetensors file, readable as the process's umask allows, as every other file Parity writes
    (safetensors' `save_file` makes it 0600: nobody else could read a shared run's weights)."""
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def save_model(model: CausalLM, out_dir: str | Path, add_files: Callable[[Path], object] | None = None) -> Path:
    """Write config.json + model.safetensors atomically; `add_files(folder)` puts more files
    (the tokenizer's: `tokenizer.copy_tokenizer_files`) in before the folder appears."""
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2) + "\n")
        save_tensors(export_state(model, device="cpu"), tmp / "model.safetensors", {"format": "pt"})
        if add_files is not None:
            add_files(tmp)
    return out_dir
