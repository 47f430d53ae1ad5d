"""The Python API: `parity.train`, `parity.evaluate`, `parity.push_to_hub` (docs/your-task.md).

The same objects as the CLI: a `TrainConfig` checked key by key, `Run.create`/`Run.resume` of the
one-process or distributed run, and `parity eval`'s `run_eval`. What the CLI names by text, the API
takes as Python objects: reward functions as callables, a dataset as a `datasets.Dataset` or a list of
dicts (written into the run directory's data/, so that `--resume` and `parity eval` read it again).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parity import config as config_mod
from parity.commands.evaluate import EvalConfig, run_eval, write_outputs
from parity.config import ConfigError
from parity.distributed.driver import backend_for, backend_for_run
from parity.rl.checkpoint import checkpoints
from parity.rl.data import DataError
from parity.rl.loop import Callback, Run
from parity.rl.reward_fns import Reward, function_spec
from parity.rl.train_config import TrainConfig
from parity.runtime import use_free_cores

RewardLike = Callable[..., Any] | Reward
Dataset = Any  # a `datasets.Dataset`, a list of dicts, or a JSONL/Parquet file's path

__all__ = ["Callback", "Reward", "TrainConfig", "TrainResult", "evaluate", "push_to_hub", "train"]


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    history: list[dict[str, float]]  # every step's metrics, as metrics.jsonl holds them
    model_dir: Path | None  # the newest checkpoint's model (or LoRA adapter) folder; None if none was kept


def _rows(data: Dataset, split: str) -> list[dict[str, Any]] | str:
    """A file's path as text, or the dataset's rows as dicts."""
    if isinstance(data, (str, os.PathLike)):
        return str(data)
    if isinstance(data, Mapping):
        raise DataError(f"{split} dataset: a mapping of splits ({', '.join(map(str, data))}); pass one split")
    to_list = getattr(data, "to_list", None)  # datasets.Dataset, pyarrow.Table
    rows = to_list() if callable(to_list) else data
    if not isinstance(rows, Iterable):
        raise DataError(f"{split} dataset: expected a datasets.Dataset, a list of dicts or a file, got {type(data)}")
    return list(rows)


def _rewards(rewards: Sequence[RewardLike]) -> list[Reward]:
    out = []
    for r in rewards:
        reward = r if isinstance(r, Reward) else Reward(r)
        if not callable(reward.fn):
            raise ConfigError(f"rewards: {reward.fn!r} is not a function")
        out.append(reward)
    return out


def train(
    model: str | Path = "builtin",
    dataset: Dataset | None = None,
    rewards: Sequence[RewardLike] = (),
    *,
    eval_dataset: Dataset | None = None,
    config: TrainConfig | str | Path | Mapping[str, Any] | None = None,
    callbacks: Sequence[Callback] = (),
    resume: str | Path | None = None,
    progress: bool = True,
    **keys: Any,
) -> TrainResult:
    """RL fine-tuning, as `parity train` runs it.

    `model`: a model directory, a Hugging Face id in the local cache, or "builtin". `dataset`: the
    training prompts (a `datasets.Dataset`, a list of dicts, or a JSONL/Parquet file) with a `prompt`
    column (`task.prompt_column` names another); None: the built-in task. `rewards`: functions in
    either form (`parity.Reward` for a weight, a name or the form). `config`: a `TrainConfig`, a YAML
    file or a dict of keys; `keys` override single keys by their names, dots as `__` (`trainer__lr=1e-5`)
    or in a dict (`config={"trainer.lr": 1e-5}`). `resume`: a run directory to continue (its saved
    config; `keys` may change only what `parity train --resume` lets change; pass `rewards` again).
    Errors in the input raise `ConfigError` or `DataError` with the one line the CLI prints."""
    use_free_cores()
    values = {k.replace("__", "."): v for k, v in keys.items()}
    bound = _rewards(rewards)
    if resume is not None:
        if config is not None or dataset is not None or eval_dataset is not None:
            raise ConfigError("resume: a resumed run keeps its config and data; pass only keys that may change")
        overrides = [f"{k}={v}" for k, v in values.items()]
        backend = backend_for_run(resume)
        run = Run.resume(resume, overrides, progress=progress, rewards=bound or None, backend=backend)
    else:
        if model != "builtin" or "model" not in values:
            values["model"] = str(model)
        if bound:
            values["task.reward_fn"] = [function_spec(r.fn) for r in bound]
            values["task.reward_weights"] = [float(r.weight) for r in bound]
        datasets = {}
        for split, data, key in (("train", dataset, "task.data"), ("eval", eval_dataset, "eval.data")):
            if data is None:
                continue
            rows = _rows(data, split)
            if isinstance(rows, str):
                values[key] = rows
            else:
                datasets[split] = rows
                values[key] = "builtin" if split == "train" else "auto"  # until written into the run
        cfg = _config(config, values)
        run = Run.create(cfg, progress=progress, rewards=bound or None, datasets=datasets, backend=backend_for(cfg))
    if run.step_count >= run.cfg.steps:
        run.close()
        history = []
    else:
        history = run.train(callbacks=list(callbacks))
    saved = checkpoints(run.run_dir)
    model_dir = None
    if saved:
        model_dir = next((saved[-1] / d for d in ("model", "adapter") if (saved[-1] / d).is_dir()), None)
    return TrainResult(run.run_dir, history, model_dir)


def _config(config: TrainConfig | str | Path | Mapping[str, Any] | None, values: dict[str, Any]) -> TrainConfig:
    if isinstance(config, TrainConfig):
        base = config_mod.to_dict(config)
        return config_mod.load(TrainConfig, None, None, {**_dotted(base), **values})
    if isinstance(config, Mapping):
        return config_mod.load(TrainConfig, None, None, {**config, **values})
    return config_mod.load(TrainConfig, config, None, values)


def _dotted(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(_dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def evaluate(
    target: str | Path,
    rewards: Sequence[RewardLike] = (),
    *,
    out: str | Path | None = None,
    progress: bool = True,
    **keys: Any,
) -> dict[str, Any]:
    """`parity eval` from Python: the held-out score of a model, a LoRA adapter folder, or every
    checkpoint of a run, per serving precision. `rewards`: the functions to score with (a run's own by
    default, imported from its config.yaml). `keys`: `parity eval`'s keys (precisions, data, samples...).
    Writes eval.json, eval.md and eval.png into `out` when given; returns what eval.json holds."""
    use_free_cores()
    values = {k.replace("__", "."): v for k, v in keys.items()}
    cfg = config_mod.load(EvalConfig, None, None, {"target": str(target), **values, "out": str(out or "")})
    result = run_eval(cfg, progress=progress, rewards=_rewards(rewards) or None, trust_reward_fn=True)
    if out is not None:
        write_outputs(result, Path(out))
    return result


def push_to_hub(model_dir: str | Path, repo_id: str, token: str | None = None, private: bool = True) -> str:
    """Upload a saved model folder (a checkpoint's model/ or adapter/, with its model card) to the Hugging
    Face Hub; returns the repository's URL. Needs `huggingface_hub`, a token (`token`, or HF_TOKEN) and the
    network: without any of them, a ConfigError says which."""
    folder = Path(model_dir)
    if not (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file():
        raise ConfigError(f"push_to_hub: {folder} is not a saved model (no config.json or adapter_config.json)")
    token = token or os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if not token:
        raise ConfigError("push_to_hub: no token; pass token=... or set HF_TOKEN (a write token from your Hub account)")
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise ConfigError(
            "push_to_hub: the huggingface_hub package is not installed (pip install huggingface_hub)"
        ) from None
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=str(folder))
    except Exception as e:  # no network, a refused token, a name taken: the Hub client's own words
        raise ConfigError(f"push_to_hub {repo_id}: {type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
    return f"https://huggingface.co/{repo_id}"
