"""The Python API: `parity.train`, `parity.evaluate`, `parity.push_to_hub` (docs/your-task.md).

The same objects as the CLI: a `TrainConfig` checked key by key, `Run.create`/`Run.resume` of the
one-process or distributed run, and `parity eval`'s `run_eval`. What the CLI names by text, the API
takes as Python objects: reward functions as callables, a dataset as a `datasets.Dataset` or a list of
dicts (written into the run directory's data/, so that `--resume` and `parity eval` read it again).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parity import config as config_mod
from parity.commands.evaluate import EvalConfig, run_eval, write_outputs
from parity.config import ConfigError, described
from parity.distributed.driver import backend_for, backend_for_run
from parity.outdir import check_output_dir
from parity.rl.callbacks import Callback, checked_callbacks
from parity.rl.checkpoint import checkpoints
from parity.rl.episodes import Step  # noqa: F401 - parity.Step, what an environment returns
from parity.rl.loop import Run
from parity.rl.reward_fns import Reward, function_spec
from parity.rl.train_config import TrainConfig
from parity.runtime import use_free_cores

RewardLike = Callable[..., Any] | Reward
Dataset = Any  # a `datasets.Dataset`, a list of dicts, or a JSONL/Parquet file's path


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    history: list[dict[str, float]]  # every step's metrics, as metrics.jsonl holds them
    model_dir: Path | None  # the newest checkpoint's model (or LoRA adapter) folder; None if none was kept


# Every argument is checked, by these, before anything is loaded or written: a wrong one is a one-line
# ConfigError naming the argument, what it was given and what it takes.


def _path(name: str, value: object, expected: str) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{name}: expected {expected}, got {described(value)}")
    return os.fspath(value)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: expected True or False, got {described(value)}")
    return value


def _rows(data: Dataset, name: str) -> list[dict[str, Any]] | str:
    """A file's path as text, or the dataset's rows (their contents are checked as they are written)."""
    if isinstance(data, (str, os.PathLike)):
        return os.fspath(data)
    if isinstance(data, Mapping):
        keys = ", ".join(map(str, list(data)[:6]))
        raise ConfigError(f"{name}: a mapping ({keys}); pass one split (a datasets.Dataset) or a list of row dicts")
    to_list = getattr(data, "to_list", None)  # datasets.Dataset
    rows = to_list() if callable(to_list) else data
    if isinstance(rows, (bytes, bytearray)) or not isinstance(rows, Iterable):
        raise ConfigError(
            f"{name}: expected a datasets.Dataset, a list of dicts or a JSONL/Parquet file's path, got "
            f"{described(data)}"
        )
    return list(rows)


def _rewards(rewards: object) -> list[Reward]:
    """`rewards=` as Rewards: None or () for the task's own reward, or one function or Reward, or an iterable
    of them (each function checked by `Reward`)."""
    if rewards is None:
        return []
    if isinstance(rewards, Reward) or (callable(rewards) and not isinstance(rewards, type)):
        rewards = [rewards]
    elif isinstance(rewards, (str, bytes, Mapping)) or not isinstance(rewards, Iterable):
        raise ConfigError(f"rewards: expected a function, a parity.Reward or a list of them, got {described(rewards)}")
    out = []
    for i, r in enumerate(rewards):
        if not isinstance(r, Reward) and (isinstance(r, type) or not callable(r)):
            raise ConfigError(f"rewards[{i}]: expected a function or a parity.Reward, got {described(r)}")
        out.append(r if isinstance(r, Reward) else Reward(r))
    return out


def _tools(tools: object) -> list[Callable[..., Any]]:
    """`tools=` as a list of functions (each described by `rl/tools.tool_schema` when the run is built)."""
    if tools is None:
        return []
    if callable(tools) and not isinstance(tools, type):
        tools = [tools]
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Iterable):
        raise ConfigError(f"tools: expected a list of functions, got {described(tools)}")
    tools = list(tools)
    for i, fn in enumerate(tools):
        if isinstance(fn, type) or not callable(fn) or not hasattr(fn, "__name__"):
            raise ConfigError(f"tools[{i}]: expected a function, got {described(fn)}")
    return tools


def _environment(environment: object) -> object:
    if environment is not None and not callable(environment):
        raise ConfigError(
            f"environment: expected a class (made once per episode) or a function making one, got "
            f"{described(environment)}"
        )
    return environment


def train(
    model: str | Path = "builtin",
    dataset: Dataset | None = None,
    rewards: RewardLike | Iterable[RewardLike] | None = (),
    *,
    tools: Iterable[Callable[..., Any]] | None = None,
    environment: Callable[[], Any] | None = None,
    eval_dataset: Dataset | None = None,
    config: TrainConfig | str | Path | Mapping[str, Any] | None = None,
    callbacks: Callback | Iterable[Callback] | None = (),
    resume: str | Path | None = None,
    progress: bool = True,
    **keys: Any,
) -> TrainResult:
    """RL fine-tuning, as `parity train` runs it.

    `model`: a model directory, a Hugging Face id in the local cache, or "builtin". `dataset`: the
    training prompts (a `datasets.Dataset`, a list of dicts, or a JSONL/Parquet file) with a `prompt`
    column (`task.prompt_column` names another); None: the built-in task. `rewards`: functions in
    either form (`parity.Reward` for a weight, a name or the form), one alone, or None for the task's
    own. `tools`: functions the model may call (their JSON schemas from their signatures and docstrings),
    or `environment`: a class made once per episode (`reset(row)`, `step(assistant) -> parity.Step`);
    either makes each sample an episode of several model turns (docs/agents.md). `callbacks`: objects with
    `on_step_end` and/or `on_eval` (`parity.Callback`), or one alone.
    `config`: a `TrainConfig`, a YAML file or a dict of keys; `keys` override single keys by their names,
    dots as `__` (`trainer__lr=1e-5`) or in a dict (`config={"trainer.lr": 1e-5}`). `resume`: a run
    directory to continue (its saved config; `keys` may change only what `parity train --resume` lets
    change; pass `rewards` again). Every argument is checked before anything is loaded or written: a
    wrong one raises `ConfigError` (or `DataError`, for rows) with one line, the line the CLI prints. A
    callback that raises stops the run after a checkpoint of its step, with a `CallbackError`."""
    use_free_cores()
    bound = _rewards(rewards)
    tool_fns, environment = _tools(tools), _environment(environment)
    if tool_fns and environment is not None:
        raise ConfigError("tools and environment: give one (an environment offers its own tools, as its `tools`)")
    hooks = checked_callbacks(callbacks)
    _flag("progress", progress)
    values = {k.replace("__", "."): v for k, v in keys.items()}
    if resume is not None:
        resume = _path("resume", resume, "a run directory")
        model_given = not (isinstance(model, str) and model == "builtin")
        if model_given or config is not None or dataset is not None or eval_dataset is not None:
            raise ConfigError("resume: a resumed run keeps its model, config and data; pass only keys that may change")
        overrides = [f"{k}={v}" for k, v in values.items()]
        backend = backend_for_run(resume)
        run = Run.resume(
            resume,
            overrides,
            progress=progress,
            rewards=bound or None,
            backend=backend,
            tools=tool_fns or None,
            environment=environment,
        )
    else:
        model = _path("model", model, 'a model directory, a Hugging Face id or "builtin"')
        if model != "builtin" or "model" not in values:
            values["model"] = model
        if bound:
            values["task.reward_fn"] = [function_spec(r.fn) for r in bound]
            values["task.reward_weights"] = [r.weight for r in bound]
        if tool_fns:
            values["task.tools"] = [function_spec(fn) for fn in tool_fns]
        if environment is not None:
            values["task.environment"] = function_spec(environment)
        datasets = {}
        for split, name, data, key in (
            ("train", "dataset", dataset, "task.data"),
            ("eval", "eval_dataset", eval_dataset, "eval.data"),
        ):
            if data is None:
                continue
            rows = _rows(data, name)
            if isinstance(rows, str):
                values[key] = rows
            else:
                datasets[split] = rows
                values[key] = "builtin" if split == "train" else "auto"  # until written into the run
        cfg = _config(config, values)
        run = Run.create(
            cfg,
            progress=progress,
            rewards=bound or None,
            datasets=datasets,
            backend=backend_for(cfg),
            tools=tool_fns or None,
            environment=environment,
        )
    if run.step_count >= run.cfg.steps:
        run.close()
        history = []
    else:
        history = run.train(callbacks=hooks)
    saved = checkpoints(run.run_dir)
    model_dir = None
    if saved:
        model_dir = next((saved[-1] / d for d in ("model", "adapter") if (saved[-1] / d).is_dir()), None)
    return TrainResult(run.run_dir, history, model_dir)


def _config(config: object, values: dict[str, Any]) -> TrainConfig:
    if isinstance(config, TrainConfig):
        base = config_mod.to_dict(config)
        return config_mod.load(TrainConfig, None, None, {**config_mod.flatten(base), **values})
    if isinstance(config, Mapping):
        for key in config:
            if not isinstance(key, str):
                raise ConfigError(f'config: a key is {described(key)}; keys are names ("trainer.lr" or "trainer")')
        return config_mod.load(TrainConfig, None, None, {**config, **values})
    if config is not None:
        _path("config", config, "a parity.TrainConfig, a YAML file's path or a dict of keys")
    return config_mod.load(TrainConfig, config, None, values)


def evaluate(
    target: str | Path,
    rewards: RewardLike | Iterable[RewardLike] | None = (),
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
    target = _path("target", target, 'a model directory, a LoRA adapter folder, a run directory or "builtin"')
    bound = _rewards(rewards)
    if out is not None:
        out = Path(_path("out", out, "a folder's path or None"))
        check_output_dir(out, "out")  # before the evaluation, not after it
    _flag("progress", progress)
    values = {k.replace("__", "."): v for k, v in keys.items()}
    cfg = config_mod.load(EvalConfig, None, None, {"target": target, **values, "out": str(out or "")})
    result = run_eval(cfg, progress=progress, rewards=bound or None, trust_reward_fn=True)
    if out is not None:
        write_outputs(result, out)
    return result


def push_to_hub(model_dir: str | Path, repo_id: str, token: str | None = None, private: bool = True) -> str:
    """Upload a saved model folder (a checkpoint's model/ or adapter/, with its model card) to the Hugging
    Face Hub; returns the repository's URL. Needs `huggingface_hub`, a token (`token`, or HF_TOKEN) and the
    network: without any of them, a ConfigError says which."""
    folder = Path(_path("model_dir", model_dir, "a saved model folder"))
    if not isinstance(repo_id, str) or not repo_id.strip():
        raise ConfigError(f"repo_id: expected a Hub repository's name ('owner/name'), got {described(repo_id)}")
    if token is not None and not isinstance(token, str):
        raise ConfigError(f"token: expected a Hub token (text) or None, got {type(token).__name__}")
    _flag("private", private)
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
