"""The Python API: `parity.train`, `parity.evaluate`, `parity.push_to_hub` (docs/your-task.md).

The same objects as the CLI: a `TrainConfig` checked key by key, `open_run` (`Run.create`/`Run.resume`) of the
one-process or distributed run, and `parity eval`'s `run_eval`. What the CLI names by text, the API
takes as Python objects: reward functions as callables, a dataset as a `datasets.Dataset` or a list of
dicts (written into the run directory's data/, so that `--resume` and `parity eval` read it again).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from parity import config as config_mod
from parity.commands.evaluate import EvalConfig, run_eval, write_outputs
from parity.config import ConfigError, described
from parity.distributed.driver import open_run
from parity.engines.lora import TARGETS as LORA_TARGETS
from parity.engines.lora import AdapterError, check_adapter_fields
from parity.engines.models.config import ModelError
from parity.engines.models.io import load_checked_config, resolve_model_dir
from parity.outdir import held_output_dir
from parity.rl.callbacks import (  # noqa: F401 - CallbackError, TrainerCallback, TrainerControl: parity's names
    Callback,
    CallbackError,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    checked_callbacks,
)
from parity.rl.checkpoint import checkpoints, export_model
from parity.rl.data import DataError, write_rows  # noqa: F401 - parity.DataError
from parity.rl.episodes import Step  # noqa: F401 - parity.Step, what an environment returns
from parity.rl.reward_fns import Reward, found_again, function_spec, importing_user_code
from parity.rl.rewards import RewardError  # noqa: F401 - parity.RewardError: rewards that time out or keep failing
from parity.rl.train_config import TrainConfig
from parity.rl.trl_config import grpo_config
from parity.rundir import checkpoint_step
from parity.runtime import use_free_cores

RewardLike = Callable[..., Any] | Reward


def GRPOConfig(**trl_arguments: Any) -> TrainConfig:  # noqa: N802 - TRL's name, as TRL users write it
    """TRL's `GRPOConfig` names and defaults, as a Parity `TrainConfig` (`rl/trl_config.py`): pass it as
    `parity.train(..., config=parity.GRPOConfig(num_generations=4, ...))`. A name with no Parity counterpart,
    or a value Parity cannot express, is a one-line ConfigError naming it."""
    return grpo_config(**trl_arguments)


Dataset = Any  # a `datasets.Dataset`, a list of dicts, or a JSONL/Parquet file's path


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    history: list[dict[str, float]]  # the metrics of each step this call trained (`Trainer.state.log_history`
    # and metrics.jsonl hold a resumed run's earlier steps too)
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
    if isinstance(data, Iterable) and not isinstance(data, Sized):  # a stream: refused before it is read
        raise ConfigError(
            f"{name}: {described(data)} has no length (a stream: an IterableDataset, a generator); the run writes "
            "its rows into its directory first, and a stream is read to its end: give the rows it needs as a list "
            "or a datasets.Dataset (Dataset.from_list(list(stream.take(N))))"
        )
    to_list = getattr(data, "to_list", None)  # datasets.Dataset
    if not callable(to_list) and hasattr(data, "columns") and callable(getattr(data, "to_dict", None)):
        rows = data.to_dict("records")  # a pandas DataFrame, whose iteration gives its column names
    else:
        rows = to_list() if callable(to_list) else data
    if isinstance(rows, (bytes, bytearray)) or not isinstance(rows, Iterable):
        raise ConfigError(
            f"{name}: expected a datasets.Dataset, a list of dicts or a JSONL/Parquet file's path, got "
            f"{described(data)}"
        )
    return list(rows)


def _not_importing(call: str) -> None:
    """Refuse a run started as Parity imports the user's code by name (a rollout worker's tools, a resume's
    rewards): a script's top level ran again, and with it the script's own run, which would start a second
    run inside the first (it hung, waiting on the first run's cluster)."""
    spec = importing_user_code()
    if spec is not None:
        raise ConfigError(
            f"{call} was called as Parity imported {spec} to find your code by name, which runs the script's top "
            'level again: put the call under `if __name__ == "__main__":`'
        )


def _warn_not_found_again(what: str, fn: object) -> None:
    """Say that config.yaml cannot name `fn` for `--resume` and `parity eval` to import it."""
    print(
        f"WARNING {what} {function_spec(fn)}: a lambda, a nested function, a functools.partial or a callable object "
        "is not found again by its name: `parity train --resume` and `parity eval` of this run need it given from "
        "Python again (a module-level function is found)",
        file=sys.stderr,
    )


# GRPOTrainer's names for `Trainer`'s arguments, taken as they are.
TRL_TRAINER_NAMES = {"reward_funcs": "rewards", "args": "config", "train_dataset": "dataset"}
# TRL's reward_funcs also take a reward model's Hub id; Parity runs no model it was not given.
MODEL_BY_NAME = " (a reward model by its name, as TRL takes one, is not taken: give a function that scores with it)"


def _rewards(rewards: object) -> list[Reward]:
    """`rewards=` as Rewards: None or () for the task's own reward, or one function or Reward, or an iterable
    of them (each function checked by `Reward`)."""
    if rewards is None:
        return []
    if isinstance(rewards, Reward) or (callable(rewards) and not isinstance(rewards, type)):
        rewards = [rewards]
    elif isinstance(rewards, (str, bytes, Mapping)) or not isinstance(rewards, Iterable):
        raise ConfigError(
            f"rewards: expected a function, a parity.Reward or a list of them, got {described(rewards)}"
            + (MODEL_BY_NAME if isinstance(rewards, str) else "")
        )
    out = []
    for i, r in enumerate(rewards):
        if not isinstance(r, Reward) and (isinstance(r, type) or not callable(r)):
            raise ConfigError(
                f"rewards[{i}]: expected a function or a parity.Reward, got {described(r)}"
                + (MODEL_BY_NAME if isinstance(r, str) else "")
            )
        out.append(r if isinstance(r, Reward) else Reward(r))
    return out


def _is_rewards(value: object) -> bool:
    """A function, a Reward or a list of them: reward functions where a dataset was expected."""
    one = isinstance(value, Reward) or (callable(value) and not isinstance(value, type))
    many = isinstance(value, (list, tuple)) and value and all(_is_rewards(v) for v in value)
    return one or bool(many)


def _positional_order(dataset: object, more: tuple, call: str) -> None:
    """Refuse arguments by position past (model, dataset, rewards): GRPOTrainer's order (reward functions
    second) is named as such, anything else goes by name."""
    if _is_rewards(dataset):
        raise ConfigError(
            "dataset: reward functions, by position in GRPOTrainer's order (model, reward_funcs, args, "
            "train_dataset), not Parity's (model, dataset, rewards, config=...): give them in Parity's order, or "
            "by TRL's names (reward_funcs=..., args=..., train_dataset=...)"
        )
    if more:
        raise ConfigError(
            f"{call}: {3 + len(more)} arguments by position; it takes (model, dataset, rewards), then the rest by "
            "name (config=..., eval_dataset=...)"
        )


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


def _episode_code(tools: object, environment: object) -> tuple[list[Callable[..., Any]], object]:
    """`tools=` (`_tools`) and `environment=`, checked: an environment is a class or a function making one, and
    it offers its own tools."""
    tools = _tools(tools)
    if environment is not None and not callable(environment):
        raise ConfigError(
            f"environment: expected a class (made once per episode) or a function making one, got "
            f"{described(environment)}"
        )
    if tools and environment is not None:
        raise ConfigError("tools and environment: give one (an environment offers its own tools, as its `tools`)")
    return tools, environment


def _lora_keys(peft_config: object) -> dict[str, Any]:
    """A `peft.LoraConfig` as Parity's lora.* keys: `r`, `lora_alpha` and `target_modules` map onto lora.rank,
    lora.alpha and lora.targets, checked as an adapter folder's adapter_config.json is; every other field must
    hold PEFT's default (plain LoRA, which Parity computes): one that does not is a ConfigError naming it."""
    to_dict = getattr(peft_config, "to_dict", None)
    if isinstance(peft_config, type) or not callable(to_dict):
        raise ConfigError(f"peft_config: expected a peft.LoraConfig, got {described(peft_config)}")
    fields = to_dict()
    try:
        defaults = type(peft_config)().to_dict()
    except Exception:
        defaults = {}
    peft_type = str(getattr(fields.get("peft_type"), "value", fields.get("peft_type")))
    if peft_type != "LORA":
        kind = type(peft_config).__name__
        raise ConfigError(f"peft_config: a {kind} ({peft_type}); Parity trains LoRA adapters only")
    targets = fields.get("target_modules")
    if targets == "all-linear":
        targets = list(LORA_TARGETS)
    elif isinstance(targets, (set, frozenset)):
        targets = sorted(targets, key=lambda t: (LORA_TARGETS.index(t) if t in LORA_TARGETS else len(LORA_TARGETS), t))
    fields = {**fields, "target_modules": targets}
    if fields.get("task_type") not in (None, "CAUSAL_LM"):
        raise ConfigError(f"peft_config: task_type: expected CAUSAL_LM, got {fields['task_type']!r:.80}")
    try:
        lora = check_adapter_fields(fields, "peft_config")
    except AdapterError as e:
        raise ConfigError(str(e)) from None
    mapped = {"r", "lora_alpha", "target_modules", "task_type", "peft_type", "inference_mode"}
    mapped |= {"base_model_name_or_path", "revision", "peft_version", "auto_mapping"}  # where, not what
    for key, value in fields.items():
        if key not in mapped and key in defaults and value != defaults[key]:
            raise ConfigError(
                f"peft_config: {key}={value!r:.60} is not plain LoRA, which Parity trains; leave it at PEFT's "
                f"default ({defaults[key]!r:.40})"
            )
    return {"lora.rank": lora.rank, "lora.alpha": lora.alpha, "lora.targets": list(lora.targets)}


class Trainer:
    """RL fine-tuning as an object, for a user of TRL's `GRPOTrainer`: `Trainer(model, dataset, rewards,
    config=..., eval_dataset=..., callbacks=..., peft_config=...)`, then `train()`, `evaluate()`,
    `save_model()` and `push_to_hub()`. `parity.train` is `Trainer(...).train()`. GRPOTrainer's names
    (`reward_funcs`, `args`, `train_dataset`) are taken for theirs (TRL_TRAINER_NAMES).

    The arguments are `parity.train`'s (docs/your-task.md), checked when the Trainer is made, before anything
    is loaded or written: a wrong one raises a one-line `ConfigError` (or `DataError`, for rows).
    `peft_config`: a `peft.LoraConfig`, as the lora.* keys (`_lora_keys`). `callbacks`: Parity's
    `Callback`s or transformers' `TrainerCallback`s (`parity.TrainerCallback`), whose `control` the run
    honours. `config` is the run's `TrainConfig` (`trainer.config`); `trainer.run_dir` its run directory
    once training starts (or run_dir=, when set), and `trainer.state` its `TrainerState` after training."""

    def __init__(
        self,
        model: str | Path = "builtin",
        dataset: Dataset | None = None,
        rewards: RewardLike | Iterable[RewardLike] | None = (),
        *more: Any,
        config: TrainConfig | str | Path | Mapping[str, Any] | None = None,
        eval_dataset: Dataset | None = None,
        callbacks: Iterable[Any] | None = (),
        peft_config: Any = None,
        tools: Iterable[Callable[..., Any]] | None = None,
        environment: Callable[[], Any] | None = None,
        progress: bool = True,
        **keys: Any,
    ):
        _not_importing("parity.Trainer")
        _positional_order(dataset, more, "Trainer")
        use_free_cores()
        trl = {name: keys.pop(name) for name in TRL_TRAINER_NAMES if name in keys}  # TRL's code, as written
        if "processing_class" in keys:
            raise ConfigError("processing_class: Parity reads the tokenizer and chat template from the model directory")
        ours = {"rewards": rewards, "config": config, "dataset": dataset}
        for name, value in trl.items():
            if ours[TRL_TRAINER_NAMES[name]] not in (None, ()):
                raise ConfigError(f"{name} and {TRL_TRAINER_NAMES[name]}: give one ({name} is TRL's name for it)")
            ours[TRL_TRAINER_NAMES[name]] = value
        rewards, config, dataset = ours["rewards"], ours["config"], ours["dataset"]
        self.rewards = _rewards(rewards)
        self.tools, self.environment = _episode_code(tools, environment)
        self.callbacks = checked_callbacks(callbacks)
        self.progress = _flag("progress", progress)
        values = {k.replace("__", "."): v for k, v in keys.items()}
        if peft_config is not None:
            given = [*values, *(config if isinstance(config, Mapping) else ())]
            clash = [k for k in given if isinstance(k, str) and (k == "lora" or k.startswith("lora."))]
            if clash:
                raise ConfigError(f"peft_config and {clash[0]}: give one (peft_config sets lora.rank, lora.alpha ...)")
            values.update(_lora_keys(peft_config))
        model = _path("model", model, 'a model directory, a Hugging Face id or "builtin"')
        self._model_given = model != "builtin"
        if model != "builtin":  # else the config's (a YAML file's, a dict's), or the built-in model
            values["model"] = model
        for key, given in (("task.tools", self.tools), ("task.environment", self.environment)):
            if given and key in values:  # the Python objects would win over the key, silently
                raise ConfigError(f"{key.split('.')[1]}= and {key}: give one (the objects, or where to import them)")
        if self.tools:
            values["task.tools"] = [function_spec(fn) for fn in self.tools]
        if self.environment is not None:  # before the config is first read (episode.* keys need them)
            values["task.environment"] = function_spec(self.environment)
        if self.rewards:
            # Plain functions take task.reward_weights (TRL's reward_weights), one per function, from the keys
            # or the config, when given; a `parity.Reward` keeps its own weight.
            weights = values.pop("task.reward_weights", None) or _config(config, values).task.reward_weights
            if weights:
                if len(weights) != len(self.rewards):
                    raise ConfigError(
                        f"task.reward_weights: {len(weights)} weights for {len(self.rewards)} reward functions "
                        "(rewards=); give one per function, or none (1 each)"
                    )
                given = _as_list(rewards)
                self.rewards = [
                    r if isinstance(g, Reward) else dataclasses.replace(r, weight=w)
                    for g, r, w in zip(given, self.rewards, weights)
                ]
            values["task.reward_fn"] = [function_spec(r.fn) for r in self.rewards]
            values["task.reward_weights"] = [r.weight for r in self.rewards]
        self.datasets: dict[str, list[dict[str, Any]]] = {}
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
                self.datasets[split] = rows
                values[key] = "builtin" if split == "train" else "auto"  # until written into the run
        self.config = _config(config, values)
        try:  # before anything runs, and as the API's error: a ModelError is also a damaged checkpoint's
            load_checked_config(self.config.model)  # config.json against the weights' headers: no tensor read
        except ModelError as e:
            raise ConfigError(str(e)) from None
        code = [("reward function", r.fn) for r in self.rewards] + [("tool", fn) for fn in self.tools]
        workers = self.config.distributed.rollout_workers
        for what, fn in code + ([("environment", self.environment)] if self.environment is not None else []):
            if found_again(fn):
                continue
            if workers and what != "reward function":  # the rewards run here; the episodes on the workers
                raise ConfigError(
                    f"{what} {getattr(fn, '__qualname__', fn)!r}: distributed.rollout_workers={workers} import it by "
                    "name in each worker, which cannot find a lambda, a nested function, a functools.partial or a "
                    "callable object; define it at a module's top level"
                )
            _warn_not_found_again(what, fn)
        self.run_dir: Path | None = Path(self.config.run_dir) if self.config.run_dir else None
        self.state = TrainerState(max_steps=self.config.steps)
        self.result: TrainResult | None = None

    # -- training -------------------------------------------------------------

    def train(self, resume_from_checkpoint: bool | str | Path | None = None) -> TrainResult:
        """Train; returns the run's `TrainResult` (`self.result`). `resume_from_checkpoint`: True continues the
        run in this config's run_dir from its newest checkpoint, a path the run directory named (or its newest
        checkpoint's folder); a resumed run keeps its model, config and data, and only the keys `parity train
        --resume` lets change may differ from them (`ConfigError` otherwise). A callback that raises stops the
        run after a checkpoint of its step, with a `CallbackError`."""
        use_free_cores()  # the process's threads again, after any resume since this Trainer was made
        parts = dict(progress=self.progress, rewards=self.rewards or None, tools=self.tools or None)
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            cfg = copy.deepcopy(self.config)
            run = open_run(cfg, datasets=self.datasets, environment=self.environment, **parts)
        else:
            run_dir = self._resumed_dir(resume_from_checkpoint)
            overrides = self._resume_overrides(run_dir)
            run = open_run(resume=run_dir, overrides=overrides, environment=self.environment, **parts)
        self.run_dir, self.config = run.run_dir, run.cfg
        if run.completed:  # open_run closed it
            history = []
        else:
            try:
                history = run.train(callbacks=self.callbacks)
            finally:
                self.state = run.state
        self.result = TrainResult(run.run_dir, history, self._saved_model())
        return self.result

    def _resumed_dir(self, resume: object) -> Path:
        """The run directory `resume_from_checkpoint` names."""
        if resume is True:
            if self.run_dir is None:
                raise ConfigError("resume_from_checkpoint=True: no run_dir is set; pass the run directory instead")
            return self.run_dir
        path = Path(_path("resume_from_checkpoint", resume, "True or a run directory"))
        if path.parent.name == "checkpoints" and checkpoint_step(path.name) is not None:
            newest = checkpoints(path.parent.parent)
            if not newest or newest[-1].name != path.name:
                held = newest[-1].name if newest else "none"
                raise ConfigError(
                    f"resume_from_checkpoint: {path} is not the run's newest checkpoint ({held}); a run continues from "
                    "its newest only: pass the run directory"
                )
            return path.parent.parent
        return path

    def _resume_overrides(self, run_dir: Path) -> list[str]:
        """The keys this Trainer sets otherwise than the run's config.yaml: given to `Run.resume`, which lets only
        `RESUMABLE_KEYS` change. The model, unless named, and data held in memory (the run's own rows, written
        into its data/ when it started) are the run's."""
        if not (run_dir / "config.yaml").is_file():
            return []  # Run.resume says what is missing
        saved = config_mod.flatten(config_mod.to_dict(config_mod.load(TrainConfig, run_dir / "config.yaml")))
        mine = copy.deepcopy(self.config)
        mine.resolve_paths(Path.cwd())
        in_memory = (("train", "task.data"), ("eval", "eval.data"))
        skip = {"run_dir"} | {key for split, key in in_memory if split in self.datasets}
        if not self._model_given:
            skip.add("model")
        flat = config_mod.flatten(config_mod.to_dict(mine))
        return [f"{k}={json.dumps(v)}" for k, v in flat.items() if k not in skip and saved.get(k, v) != v]

    def _saved_model(self) -> Path | None:
        """The newest checkpoint's model/ (or adapter/) folder; None when there is none (or it is sharded)."""
        saved = checkpoints(self.run_dir) if self.run_dir is not None else []
        if not saved:
            return None
        return next((saved[-1] / d for d in ("model", "adapter") if (saved[-1] / d).is_dir()), None)

    def _newest_checkpoint(self, what: str) -> Path:
        saved = checkpoints(self.run_dir) if self.run_dir is not None else []
        if not saved:
            done = "the run kept no checkpoint (checkpoint_every=-1)" if self.result else "nothing is trained yet"
            raise ConfigError(f"{what}: {done}; call train() first" if not self.result else f"{what}: {done}")
        return saved[-1]

    # -- after training -------------------------------------------------------

    def evaluate(self, eval_dataset: Dataset | None = None) -> dict[str, float]:
        """The held-out metrics of the trained policy (its newest checkpoint), or of the base model before
        training, as `parity eval` measures them: `eval/<precision>/*` for the run's rollout precision and each
        of eval.precisions, `eval/trainer/*` for the trainer's policy and `deploy/*` for the gaps; with the
        run's eval.* settings and rewards, on `eval_dataset` (rows or a file), else on the run's held-out data."""
        use_free_cores()  # as parity.evaluate: not a resumed run's threads
        rows = None if eval_dataset is None else _rows(eval_dataset, "eval_dataset")
        cfg, e = self.config, self.config.eval
        keys: dict[str, Any] = {
            "precisions": list(dict.fromkeys([cfg.rollout_precision, *e.precisions])),
            "num_prompts": e.num_prompts,
            "samples": e.samples,
            "temperature": e.temperature,
            "device": cfg.device,
        }
        saved = checkpoints(self.run_dir) if self.run_dir is not None and self.result is not None else []
        if saved:
            target = str(self.run_dir)
            keys["max_new_tokens"] = e.max_new_tokens or 0  # 0: the run's rollout.max_new_tokens
        else:
            if self.result is not None:
                self._newest_checkpoint("evaluate")
            target = cfg.model
            keys.update(
                task=cfg.task.name,
                difficulty=cfg.task.difficulty,
                chat_template=cfg.task.chat_template,
                max_new_tokens=e.max_new_tokens or cfg.rollout.max_new_tokens,
                reference=cfg.trainer_precision,
                seed=cfg.seed,
                completion_format=cfg.task.completion_format,
            )
            held = self.datasets.get("eval")
            if rows is None and held is not None:
                rows = held
            elif rows is None and (cfg.eval_data is None or ("train" in self.datasets and cfg.eval.data == "auto")):
                raise ConfigError(
                    "evaluate: nothing held out to evaluate on (your data, and no eval_dataset); pass eval_dataset="
                )
            elif rows is None and cfg.eval_data != "heldout":
                keys["data"] = cfg.eval_data
        with tempfile.TemporaryDirectory(prefix="parity-evaluate-") as tmp:
            if rows is not None:
                keys["data"] = str(write_rows(Path(tmp), "eval.jsonl", rows, "eval"))
            eval_cfg = config_mod.load(EvalConfig, None, None, {"target": target, **keys})
            result = run_eval(
                eval_cfg,
                progress=self.progress,
                rewards=self.rewards or None,
                trust_reward_fn=True,
                newest_only=True,
                tools=self.tools or None,
                environment=self.environment,
                episodes_of=cfg if cfg.episodes else None,
            )
        return result["states"][-1]["metrics"]

    def save_model(self, output_dir: str | Path | None = None) -> Path:
        """The trained model as a folder `transformers` loads (with LoRA, PEFT's adapter folder), with its model
        card: None, the newest checkpoint's model/ (or adapter/) folder as it is; else written to `output_dir`
        atomically, replacing a model saved there before (a folder holding anything else is refused)."""
        checkpoint = self._newest_checkpoint("save_model")
        if output_dir is None:
            held = self._saved_model()
            if held is None:
                raise ConfigError(
                    f"save_model: {checkpoint} holds sharded weights (distributed learners); pass output_dir= for "
                    "a folder to write the whole model into"
                )
            return held
        out = Path(_path("output_dir", output_dir, "a folder's path or None"))
        if out.exists() and (not out.is_dir() or out.is_symlink()):
            raise ConfigError(f"output_dir: {out} is not a folder")
        if out.is_dir() and any(out.iterdir()):
            if not any((out / name).is_file() for name in ("config.json", "adapter_config.json")):
                raise ConfigError(f"output_dir: {out} holds files that are not a saved model; choose a new folder")
        return export_model(checkpoint, resolve_model_dir(self.config.model), out)

    def push_to_hub(self, repo_id: str, token: str | None = None, private: bool = True) -> str:
        """`parity.push_to_hub` of the trained model (`save_model()`'s folder); returns the repository's URL."""
        checkpoint = self._newest_checkpoint("push_to_hub")
        held = self._saved_model()
        if held is not None:
            return push_to_hub(held, repo_id, token, private)
        with tempfile.TemporaryDirectory(prefix="parity-push-") as tmp:
            folder = export_model(checkpoint, resolve_model_dir(self.config.model), Path(tmp) / "model")
            return push_to_hub(folder, repo_id, token, private)


def train(
    model: str | Path = "builtin",
    dataset: Dataset | None = None,
    rewards: RewardLike | Iterable[RewardLike] | None = (),
    *more: Any,
    tools: Iterable[Callable[..., Any]] | None = None,
    environment: Callable[[], Any] | None = None,
    eval_dataset: Dataset | None = None,
    config: TrainConfig | str | Path | Mapping[str, Any] | None = None,
    callbacks: Callback | Iterable[Callback] | None = (),
    resume: str | Path | None = None,
    progress: bool = True,
    **keys: Any,
) -> TrainResult:
    """RL fine-tuning, as `parity train` runs it: `Trainer(...).train()`.

    `model`: a model directory, a Hugging Face id in the local cache, or "builtin". `dataset`: the
    training prompts (a `datasets.Dataset`, a list of dicts, or a JSONL/Parquet file) with a `prompt`
    column (`task.prompt_column` names another); None: the built-in task. `rewards`: functions in
    either form (`parity.Reward` for a weight, a name or the form), one alone, or None for the task's
    own. `tools`: functions the model may call (their JSON schemas from their signatures and docstrings),
    or `environment`: a class made once per episode (`reset(row)`, `step(assistant) -> parity.Step`);
    either makes each sample an episode of several model turns (docs/agents.md). `callbacks`: objects with
    `on_step_end` and/or `on_eval` (`parity.Callback`), or transformers' callbacks, or one alone.
    `config`: a `TrainConfig`, a YAML file or a dict of keys; `keys` override single keys by their names,
    dots as `__` (`trainer__lr=1e-5`) or in a dict (`config={"trainer.lr": 1e-5}`). `resume`: a run
    directory to continue (its saved config; `keys` may change only what `parity train --resume` lets
    change; pass `rewards` again). Every argument is checked before anything is loaded or written: a
    wrong one raises `ConfigError` (or `DataError`, for rows) with one line, the line the CLI prints. A
    callback that raises stops the run after a checkpoint of its step, with a `CallbackError`."""
    _positional_order(dataset, more, "train")
    if resume is None:
        trainer = Trainer(
            model, dataset, rewards, config=config, eval_dataset=eval_dataset, callbacks=callbacks, tools=tools,
            environment=environment, progress=progress, **keys,
        )  # fmt: skip
        return trainer.train()
    resume = Path(_path("resume", resume, "a run directory"))
    model_given = not (isinstance(model, str) and model == "builtin")
    if model_given or config is not None or dataset is not None or eval_dataset is not None:
        raise ConfigError("resume: a resumed run keeps its model, config and data; pass only keys that may change")
    saved = resume / "config.yaml"
    trainer = Trainer(
        rewards=rewards, config=saved if saved.is_file() else None, callbacks=callbacks, tools=tools,
        environment=environment, progress=progress, **keys,
    )  # fmt: skip
    return trainer.train(resume_from_checkpoint=resume)


def _as_list(rewards: object) -> list[object]:
    return [rewards] if isinstance(rewards, Reward) or callable(rewards) else list(rewards or [])


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
    tools: Iterable[Callable[..., Any]] | None = None,
    environment: Callable[[], Any] | None = None,
    out: str | Path | None = None,
    progress: bool = True,
    **keys: Any,
) -> dict[str, Any]:
    """`parity eval` from Python: the held-out score of a model, a LoRA adapter folder, or every
    checkpoint of a run, per serving precision. `rewards`: the functions to score with (a run's own by
    default, imported from its config.yaml). A run of episodes answers in episodes, with `tools` or
    `environment` (default: the run's own, imported from its config.yaml). `keys`: `parity eval`'s keys
    (precisions, data, samples...), dots as `__` (a model's episodes: `episode__max_turns=2`).
    Writes eval.json, eval.md and eval.png into `out` when given; returns what eval.json holds."""
    _not_importing("parity.evaluate")
    use_free_cores()
    target = _path("target", target, 'a model directory, a LoRA adapter folder, a run directory or "builtin"')
    bound = _rewards(rewards)
    tools, environment = _episode_code(tools, environment)
    if out is not None:
        out = Path(_path("out", out, "a folder's path or None"))
    _flag("progress", progress)
    values = {k.replace("__", "."): v for k, v in keys.items()}
    cfg = config_mod.load(EvalConfig, None, None, {"target": target, **values, "out": str(out or "")})
    # Held from before the evaluation to the return: a second one is refused at once, not after its work.
    with held_output_dir(out, "eval", "out"):
        result = run_eval(
            cfg, progress, bound or None, trust_reward_fn=True, tools=tools or None, environment=environment
        )
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
