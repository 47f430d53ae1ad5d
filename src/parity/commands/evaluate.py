"""`parity eval MODEL_OR_RUN_DIR`: the deployment gap, measured offline.

The same weights answer held-out problems in each serving precision and under the trainer's policy
(`rl/evaluation.py`): for a model directory, its weights; for a LoRA adapter folder, its base with the
adapters; for a `parity train` run directory, its base model and every checkpoint it kept, scored with
the run's own rewards (its reward functions too) on the run's own held-out data (`eval.data`, else the
task's generated held-out split). Writes eval.json, eval.md and eval.png (accuracy per precision, per
checkpoint).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from safetensors import SafetensorError
from tqdm import tqdm

from parity import config as config_mod
from parity.config import ConfigError, check_range
from parity.engines import kernels
from parity.engines import precision as prec
from parity.engines.budget import check_rollout_memory
from parity.engines.lora import (
    CONFIG_FILE,
    AdapterError,
    LoRAConfig,
    check_lora,
    load_adapter_state,
    read_adapter,
    read_adapter_config,
)
from parity.engines.models.config import ModelError
from parity.engines.models.io import load_checked_config, load_model, resolve_model_dir
from parity.engines.models.modules import CausalLM
from parity.engines.tokenizer import CHAT_TEMPLATE_MODES, Tokenizer, has_builtin_tokenizer, load_tokenizer
from parity.engines.trainer import OptimConfig, Trainer
from parity.files import regular_file_problem
from parity.outdir import claim_output_dir, write_output, write_output_json
from parity.rl.checkpoint import (
    ADAPTER_DIR,
    CheckpointError,
    base_problem,
    checkpoints,
    load_checkpoint,
    require_finite_weights,
    verify_checkpoint,
)
from parity.rl.data import DataColumns, load_problems, prompt_limit
from parity.rl.episodes import EpisodeSetup, episode_setup
from parity.rl.evaluation import TRAINER, EvalSet, Evaluator, eval_sampling, heldout_problems
from parity.rl.problems import DIFFICULTIES, MAX_PROBLEMS
from parity.rl.reward_fns import (
    Reward,
    UserRewards,
    bind_all,
    data_columns,
    environment_reward,
    function_spec,
    import_reward_fn,
    reward_columns,
)
from parity.rl.rewards import RewardRunner
from parity.rl.run_setup import moved_model_hint
from parity.rl.tasks import EVAL_SEED, TASKS, builtin_problems
from parity.rl.train_config import (
    COMPLETION_FORMATS,
    MAX_SEED,
    MICRO_BATCH_TOKENS,
    EpisodeSection,
    RewardSection,
    TrainConfig,
)
from parity.rundir import checkpoint_step, in_use_by, refuse_run_links
from parity.runtime import draws_bars, progress_line

BUILTIN_MAX_NEW_TOKENS = 96  # a model directory's default response budget (a run's is its own)
MODEL_NUM_PROMPTS, MODEL_SAMPLES = 64, 8  # a model directory's default evaluation (a run's is its own eval.*)


@dataclass
class EvalConfig:
    target: str = "builtin"  # a model directory ('builtin'), or a `parity train` run directory
    # The base model of a LoRA run or an adapter folder where it is now, when it moved (auto: where it was)
    model: str = "auto"
    precisions: list[str] = field(default_factory=lambda: list(prec.PRECISIONS))  # serving precisions
    # The trainer precision whose policy each gap is measured against: auto = a run's own, fp32 for a model
    reference: str = "auto"
    data: str = "auto"  # auto: the task's held-out split (without a run's training problems); or a file
    task: str = "auto"  # the reward: auto = a run's task.name; builtin for the built-in model, number otherwise
    difficulty: str = "auto"  # task=number's generated problems: auto = a run's, else standard
    # 0: a run's own eval.num_prompts and eval.samples, so that `parity eval RUN_DIR` repeats its evaluation;
    # for a model, 64 and 8
    num_prompts: int = 0
    samples: int = 0  # responses per prompt (pass@k's k)
    temperature: float = 1.0  # 0 = greedy
    max_new_tokens: int = 0  # 0: a run's rollout.max_new_tokens, else 96
    chat_template: str = "auto"
    # The data's prompt and answer columns: auto = a run's task.prompt_column and task.answer_column, else
    # prompt and answer
    prompt_column: str = "auto"
    answer_column: str = "auto"
    # Reward functions, module:function each (with reward_weights): the target's rewards instead of a task's
    # built-in reward. Unset: a run's own task.reward_fn
    reward_fn: list[str] = field(default_factory=list)
    reward_weights: list[float] = field(default_factory=list)
    # How reward functions get completions: text | messages (TRL's chat form) | auto (messages on chat
    # prompts); run: a run's task.completion_format, or text for a model
    completion_format: str = "run"
    # A model answered in episodes (docs/agents.md): tools, module:function each, or an environment,
    # module:Class, as `parity train`'s task.tools and task.environment. A run answers with its own
    tools: list[str] = field(default_factory=list)
    environment: str = ""
    # The limits of a model's episodes: `parity train`'s episode.* keys, checked by its checks. A run keeps its own
    episode: EpisodeSection = field(default_factory=EpisodeSection)
    device: str = "cpu"
    seed: int = 0
    out: str = "parity-eval"

    def validate(self) -> None:
        kernels.check_device(self.device)
        unknown = [p for p in self.precisions if p not in prec.PRECISIONS]
        if unknown or not self.precisions or len(set(self.precisions)) != len(self.precisions):
            raise ConfigError(
                f"precisions: expected distinct names from {', '.join(prec.PRECISIONS)}, got "
                f"{','.join(self.precisions) or 'none'}"
            )
        if self.reference not in ("auto", *prec.PRECISIONS):
            raise ConfigError(
                f"reference: unknown value {self.reference!r}; allowed: auto, {', '.join(prec.PRECISIONS)}"
            )
        if self.completion_format not in ("run", *COMPLETION_FORMATS):
            raise ConfigError(
                f"completion_format: unknown value {self.completion_format!r}; allowed: run, "
                f"{', '.join(COMPLETION_FORMATS)}"
            )
        if self.task not in ("auto", *TASKS):
            raise ConfigError(f"task: unknown value {self.task!r}; allowed: auto, {', '.join(TASKS)}")
        if self.difficulty not in ("auto", *DIFFICULTIES):
            raise ConfigError(
                f"difficulty: unknown value {self.difficulty!r}; allowed: auto, {', '.join(DIFFICULTIES)}"
            )
        if self.chat_template not in CHAT_TEMPLATE_MODES:
            raise ConfigError(
                f"chat_template: unknown value {self.chat_template!r}; allowed: {', '.join(CHAT_TEMPLATE_MODES)}"
            )
        if self.tools and self.environment:
            raise ConfigError("tools and environment: give one (an environment offers its own tools)")
        if self.reward_weights and len(self.reward_weights) != len(self.reward_fn):  # zip dropped the extra ones
            raise ConfigError(
                f"reward_weights: {len(self.reward_weights)} weights for {len(self.reward_fn)} reward functions "
                "(reward_fn); give one per function, or none (1 each)"
            )
        for key, low in (("num_prompts", 0), ("samples", 0), ("max_new_tokens", 0)):
            if getattr(self, key) < low:
                raise ConfigError(f"{key}: must be >= {low}, got {getattr(self, key)}")
        # as `parity train`'s eval.num_prompts and seed; samples and max_new_tokens are checked against the model
        check_range(
            "num_prompts",
            self.num_prompts,
            self.num_prompts <= MAX_PROBLEMS,
            f"in [1, {MAX_PROBLEMS:,}] (0: a run's own)",
        )
        check_range("seed", self.seed, 0 <= self.seed <= MAX_SEED, f"in [0, {MAX_SEED}]")
        if self.temperature < 0:
            raise ConfigError(f"temperature: must be >= 0 (0 = greedy), got {self.temperature}")
        problem = regular_file_problem(Path(self.data).expanduser()) if self.data != "auto" else None
        if problem is not None:
            raise ConfigError(
                f"data: {self.data!r} {problem} (use auto for the task's held-out split, or a JSONL/Parquet file)"
            )


@dataclass(frozen=True)
class Target:
    """What is evaluated: a model directory (with a LoRA adapter folder's adapters), or a run's base model
    and checkpoints."""

    model_dir: Path
    run: TrainConfig | None  # the run's config; None for a model directory
    checkpoints: list[Path]
    adapter: tuple[Path, LoRAConfig] | None = None  # an adapter folder and its settings, on model_dir


def _adapter_target(path: Path, model: str) -> Target:
    """A PEFT LoRA adapter folder: its base model (`base_model_name_or_path`, or `model` where it is now) with
    its adapters. A checkpoint's adapters are checked against the base it fingerprints; others fit or not."""
    try:
        lora, base = read_adapter_config(path)
    except AdapterError as e:
        raise ConfigError(str(e)) from None
    if model != "auto":
        in_checkpoint = path.name == ADAPTER_DIR and (path.parent / "state.json").is_file()
        return Target(_given_base(model, path.parent if in_checkpoint else None), None, [], (path, lora))
    if not isinstance(base, str) or not base:
        raise ConfigError(
            f"{path / CONFIG_FILE}: base_model_name_or_path: expected the base model (a directory or a Hugging Face "
            f"id), got {base!r:.80}; or give it: model=DIR"
        )
    named_by = "adapter_config.json's base_model_name_or_path"
    return Target(_base_dir(base, named_by, "if it moved, give its place: model=DIR"), None, [], (path, lora))


def _base_dir(model: str, named_by: str, hint: str = "") -> Path:
    """The base model directory `model` names (given as `named_by`), or a ConfigError ending in `hint`."""
    try:
        return resolve_model_dir(model)
    except ModelError as e:
        raise ConfigError(f"{e} ({named_by})" + (f"; {hint}" if hint else "")) from None


def _given_base(model: str, checkpoint: Path | None) -> Path:
    """`model=`, a base model where it is now: the one the LoRA `checkpoint` fingerprints, when there is one."""
    model_dir = _base_dir(model, "model")
    problem = None if checkpoint is None else base_problem(checkpoint, model_dir)
    if problem is not None:
        raise ConfigError(f"model: {problem}")
    return model_dir


def _run_base(run: TrainConfig, saved: list[Path], model: str) -> Path:
    """A run's base model: where config.yaml says, or for a LoRA run `model`, where it is now. A full run's
    checkpoints record no fingerprint to check another place against."""
    if model == "auto":
        return _base_dir(run.model, "config.yaml's model", moved_model_hint(run.lora.rank > 0))
    if run.lora.rank == 0:
        raise ConfigError("model: a full run's checkpoints do not record their base model; it stays config.yaml's")
    return _given_base(model, saved[-1])


def resolve_target(cfg: EvalConfig, held: list[IO[bytes]]) -> Target:
    """What `cfg.target` names; a run's lock file is appended to `held`, open under a shared lock that keeps a
    `parity train` from starting there until it is closed."""
    path = Path(cfg.target).expanduser()
    if (path / CONFIG_FILE).exists():
        return _adapter_target(path, cfg.model)
    started = (path / "metrics.jsonl").exists() or (path / "checkpoints").is_dir()
    if (path / "config.yaml").is_file() and started:
        refuse_run_links(path, "target")  # a run someone sent: read only what it holds itself
        holder = in_use_by(path, held)
        if holder is not None:
            raise ConfigError(
                f"{path}: in use by a running `parity train` (pid {holder}), which writes and prunes its "
                "checkpoints; evaluate the run once it stops"
            )
        run = config_mod.load(TrainConfig, path / "config.yaml")
        saved = checkpoints(path)
        if not saved:
            raise ConfigError(
                f"{path}: the run kept no checkpoint (checkpoint_every=-1, or it stopped before its first); "
                "nothing of it to evaluate but its base model, which `parity eval` takes directly"
            )
        return Target(_run_base(run, saved, cfg.model), run, saved)
    if (path / "config.yaml").is_file():
        raise ConfigError(f"{path}: a run directory without metrics or checkpoints yet: nothing to evaluate")
    if cfg.model != "auto":
        raise ConfigError(f"model: for a LoRA run or an adapter folder whose base model moved; {cfg.target} is neither")
    try:  # builtin, builtin-agent, a model directory, or a Hugging Face id in the local cache
        return Target(resolve_model_dir(cfg.target), None, [])
    except ModelError as e:
        raise ConfigError(f"target: {e}; or a `parity train` run directory") from None


def evaluation_set(cfg: EvalConfig, target: Target, functions: bool = False) -> tuple[EvalSet, str, str]:
    """The problems and how they are answered; also the task name whose reward scores them, and where
    the problems came from (a file, or the task's generated held-out split). `functions`: reward functions
    given from Python score them."""
    run = target.run
    task = (
        cfg.task
        if cfg.task != "auto"
        else run.task.name
        if run
        else "builtin"
        if has_builtin_tokenizer(target.model_dir)
        else "number"
    )
    difficulty = cfg.difficulty if cfg.difficulty != "auto" else run.task.difficulty if run else "standard"
    chat_template = run.task.chat_template if run and cfg.chat_template == "auto" else cfg.chat_template
    max_new = cfg.max_new_tokens or (run.rollout.max_new_tokens if run else BUILTIN_MAX_NEW_TOKENS)
    num_prompts = cfg.num_prompts or (run.eval.num_prompts if run else MODEL_NUM_PROMPTS)
    samples = cfg.samples or (run.eval.samples if run else MODEL_SAMPLES)
    key = "max_new_tokens" if cfg.max_new_tokens or not run else "the run's rollout.max_new_tokens"
    tokenizer = load_tokenizer(target.model_dir)
    model_config = load_checked_config(target.model_dir)
    positions = model_config.max_position_embeddings
    limit = prompt_limit(tokenizer, positions, max_new, key, chat_template)
    columns = data_columns(run) if run is not None else DataColumns(answer_required=not cfg.reward_fn)
    columns = dataclasses.replace(
        columns,
        prompt=columns.prompt if cfg.prompt_column == "auto" else cfg.prompt_column,
        answer=columns.answer if cfg.answer_column == "auto" else cfg.answer_column,
        keys=True,
        prefix="",  # named by this command's own keys
    )
    data = cfg.data if cfg.data != "auto" else run.eval.data if run is not None and run.eval.data != "auto" else None
    if data is not None:
        problems = load_problems(data, limit, columns=columns, key="data" if cfg.data != "auto" else "eval.data")
        problems, source = problems[:num_prompts], str(Path(data).resolve())
    else:
        if run is not None and run.eval_data is None:
            scored = "your reward functions" if run.task.reward_fn else f"task.name={run.task.name}"
            raise ConfigError(
                f"{cfg.target}: the run trained on {run.task.data} with {scored} and set no eval.data, and Parity "
                "generates no held-out split for it; pass data=FILE (eval_dataset= in Python)"
            )
        trained = set()
        if run is not None:
            if run.task.data == "builtin":
                trained = {str(p.prompt) for p in builtin_problems(task, run.task.num_problems, run.seed, difficulty)}
            else:
                trained = {str(p.prompt) for p in load_problems(run.task.data, columns=data_columns(run))}
        problems = heldout_problems(task, difficulty, num_prompts, run.seed if run else cfg.seed, trained)
        source = f"the held-out split of task {task} (generated)"
    if not problems:
        raise ConfigError(f"data: no problems to evaluate on ({cfg.data})")
    rows = len(problems) * samples
    check_rollout_memory(model_config, rows, limit.longest, max_new, f"num_prompts x samples, {key}", cfg.device)
    evalset = EvalSet(
        problems=problems,
        prompts=[limit.check(f"held-out problem {i}", p.prompt) for i, p in enumerate(problems)],
        samples=samples,
        sampling=eval_sampling(cfg.temperature, max_new),
        # reward functions (`functions`: the API's) score a mean reward, as a run of them reports, not accuracy
        binary=TASKS[task].binary and not functions and not _reward_specs(cfg, target.run)[0],
    )
    return evalset, task, source


def _reward_specs(cfg: EvalConfig, run: TrainConfig | None) -> tuple[list[str], list[float]]:
    """The reward functions that score (module:function each) and their weights: `reward_fn`, else a run's."""
    if cfg.reward_fn:
        return cfg.reward_fn, cfg.reward_weights or [1.0] * len(cfg.reward_fn)
    if run is not None and run.task.reward_fn:
        return run.task.reward_fn, run.task.reward_weights or [1.0] * len(run.task.reward_fn)
    return [], []


def _rewards(
    cfg: EvalConfig,
    target: Target,
    task: str,
    problems,
    rewards: list[Reward] | None,
    trust_reward_fn: bool,
    episode_run: TrainConfig | None,
) -> RewardRunner | UserRewards:
    """What scores the answers, as in the run (`reward_fns.run_rewards`): `rewards`, `reward_fn`, a run's own
    reward functions, an environment's own rewards (a run with an environment and no reward functions), else
    the task's built-in reward. In an episode run a function may also name the episode's columns."""
    specs, weights = _reward_specs(cfg, target.run)
    bounds = target.run.reward if target.run else RewardSection()  # how long its code may run here
    if rewards is None and specs:
        if target.run is not None and not cfg.reward_fn and not trust_reward_fn:
            raise ConfigError(
                f"{cfg.target}: the run scores with task.reward_fn={','.join(specs)}, Python code that `parity eval` "
                "would import and run; confirm with --trust-reward-fn (or pass reward_fn=module:function)"
            )
        rewards = [Reward(import_reward_fn(spec, bounds.import_timeout_s), weight=w) for spec, w in zip(specs, weights)]
    if rewards is None and not specs and episode_run is not None and episode_run.task.environment:
        rewards = [Reward(environment_reward, name="environment")]
    if rewards:
        bound = bind_all(rewards, reward_columns(problems, episode_run is not None and episode_run.episodes))
        fmt = cfg.completion_format
        if fmt == "run":
            fmt = target.run.task.completion_format if target.run else "text"
        return UserRewards(bound, in_process_timeout_s=bounds.in_process_timeout_s, completion_format=fmt)
    isolate = not TASKS[task].trusted
    return RewardRunner(TASKS[task].reward, isolate, in_process_timeout_s=bounds.in_process_timeout_s)


def _episodes(
    cfg: EvalConfig, run: TrainConfig | None, tokenizer: Tokenizer, trust_code: bool, tools, environment
) -> EpisodeSetup | None:
    """A run's episodes (task.tools, task.environment, or task.name=lookup's tables): every policy then answers
    with whole episodes, as the run's own held-out evaluation does; None for one-turn answers. A run's tools and
    environment are Python code that is imported and run here: `trust_code`, unless given as objects."""
    if run is None or not run.episodes:
        return None
    specs = (("task.tools", ",".join(run.task.tools)), ("task.environment", run.task.environment))
    code = [f"{key}={spec}" for key, spec in specs if spec]
    if code and not trust_code and tools is None and environment is None:
        raise ConfigError(
            f"{cfg.target}: the run's episodes call {', '.join(code)}, Python code that `parity eval` would import "
            "and run; confirm with --trust-reward-fn"
        )
    return episode_setup(run, tokenizer, tools, environment)


def _task_of_episodes(
    cfg: EvalConfig, target: Target, task: str, max_new_tokens: int, tools, environment
) -> TrainConfig | None:
    """For a model target answered in episodes, the run whose episodes it answers in (the environment, limits
    and tool-call format): with the API's `tools` or `environment`, the `tools` or `environment` keys, or a
    built-in task of episodes (lookup)."""
    values = {
        "model": str(target.model_dir),
        "task.name": task,
        "rollout.max_new_tokens": max_new_tokens,
        "episode": config_mod.to_dict(cfg.episode),
    }
    if tools:
        values["task.tools"] = [function_spec(fn) for fn in tools]
    elif environment is not None:
        values["task.environment"] = function_spec(environment)
    elif cfg.tools or cfg.environment:
        values["task.tools"], values["task.environment"] = cfg.tools, cfg.environment
    elif not TASKS[task].episodes:
        if given := cfg.episode.given():  # one-turn answers would ignore them
            raise ConfigError(
                f"{given[0]}: a setting of episodes, and this evaluation has none (tools, environment or task=lookup)"
            )
        return None
    return config_mod.load(TrainConfig, None, None, values)


def run_eval(
    cfg: EvalConfig,
    progress: bool = True,
    rewards: list[Reward] | None = None,
    trust_reward_fn: bool = False,
    newest_only: bool = False,
    tools: list | None = None,
    environment: object = None,
    episodes_of: TrainConfig | None = None,
) -> dict[str, Any]:
    """Evaluate every state of the target (`newest_only`: its newest alone, a run's newest checkpoint); returns
    what eval.json holds. `rewards`: Python callables to score with (the API's); else `reward_fn`, a run's own
    reward functions (with `trust_reward_fn`), or the task's built-in reward. A run of episodes is answered in
    episodes, with its tools or environment (`tools`, `environment`: the API's objects; else imported, with
    `trust_reward_fn`); `episodes_of`: the run whose episodes a model target is answered in (the API's, before
    its first checkpoint)."""
    held: list[IO[bytes]] = []
    try:
        target = resolve_target(cfg, held)
        return _evaluate(cfg, target, progress, rewards, trust_reward_fn, newest_only, tools, environment, episodes_of)
    finally:
        for lock in held:
            lock.close()


def _evaluate(
    cfg: EvalConfig,
    target: Target,
    progress: bool,
    rewards: list[Reward] | None,
    trust_reward_fn: bool,
    newest_only: bool,
    tools: list | None,
    environment: object,
    episodes_of: TrainConfig | None,
) -> dict[str, Any]:
    run = target.run
    if run is not None and (cfg.tools or cfg.environment):
        key = "tools" if cfg.tools else "environment"
        raise ConfigError(f"{key}: for a model; a run directory answers with its own task.tools or task.environment")
    if run is not None and (given := cfg.episode.given()):
        raise ConfigError(f"{given[0]}: for a model; a run directory answers with its own episode.*")
    evalset, task, source = evaluation_set(cfg, target, bool(rewards))
    reference = cfg.reference if cfg.reference != "auto" else run.trainer_precision if run else "fp32"
    tokenizer = load_tokenizer(target.model_dir)
    numerics = kernels.numerics(cfg.device)
    try:
        episode_run = run or episodes_of
        episode_run = episode_run or _task_of_episodes(
            cfg, target, task, evalset.sampling.max_new_tokens, tools, environment
        )
        # Code named in this call's own keys is the user's to run, as reward_fn is.
        trust_code = trust_reward_fn or bool(cfg.tools or cfg.environment)
        episodes = _episodes(cfg, episode_run, tokenizer, trust_code, tools, environment)
    except ConfigError as e:
        if run is not None or episodes_of is not None:
            raise
        # a model's episodes are set by this command's keys: named by them, not by `parity train`'s
        message = str(e)
        renamed = {"task.tools": "tools", "task.environment": "environment", "rollout.max_new_tokens": "max_new_tokens"}
        for train_key, key in renamed.items():
            message = message.replace(train_key, key)
        raise ConfigError(message) from None
    scorer = _rewards(cfg, target, task, evalset.problems, rewards, trust_reward_fn, episode_run)
    if progress:
        print(f"eval: {len(evalset.problems)} prompts from {source}", file=sys.stderr)
    states = [("base", 0, None)] + [(p.name, checkpoint_step(p.name), p) for p in target.checkpoints]
    if target.adapter is not None:  # a checkpoint's adapter folder is of its step; another's step is unknown
        folder = target.adapter[0]
        step = checkpoint_step(folder.parent.name)
        states = [("base", 0, None), (folder.name, step, folder)]
    if newest_only:
        states = states[-1:]
    results = []
    try:
        base = load_model(target.model_dir, kernels.numerics())
        require_finite_weights(base, target.model_dir, "nothing can be evaluated")
        _check_lora(target, base)
        # Every state is checked before any is evaluated (minutes each on a real model): an adapter that does not
        # fit is read now (its trainer kept for its turn), a checkpoint's files against its manifest.
        adapted: dict[Path, Trainer] = {}
        for _, _, path in states:
            if target.adapter is not None and path is not None:
                adapted[path] = _trainer(target, run, path, reference, cfg.device, base)
            elif path is not None and (problem := verify_checkpoint(path)) is not None:
                raise CheckpointError(f"{path}: {problem}")
        micro_batch_tokens = run.trainer.micro_batch_tokens if run else MICRO_BATCH_TOKENS[cfg.device]
        evaluator = Evaluator(
            base.config,
            tokenizer,
            evalset,
            scorer,
            None,
            cfg.precisions,
            reference,
            micro_batch_tokens,
            cfg.device,
            episodes,
            episode_run.turn_tokens if episodes else 0,
        )
        bar = tqdm(states, desc="checkpoints", unit="state", disable=not draws_bars(progress))
        for i, (name, step, path) in enumerate(bar, 1):
            progress_line(progress, f"eval: state {i}/{len(states)}, {name}")
            trainer = adapted.pop(path, None) or _trainer(target, run, path, reference, cfg.device, base)
            weights, version = trainer.export_weights(merge=True)
            seed = (run.seed if run else cfg.seed) + EVAL_SEED
            metrics = evaluator.evaluate(weights, version, seed, trainer.model, progress=progress)
            results.append({"name": name, "step": step, "metrics": metrics})
    finally:
        scorer.close()
    return {
        "target": str(cfg.target),
        "model": str(target.model_dir),
        "adapter": str(target.adapter[0]) if target.adapter else None,
        "data": source,
        "task": task if not isinstance(scorer, UserRewards) else "reward functions: " + ", ".join(scorer.names),
        "reference": reference,
        "precisions": cfg.precisions,
        "prompts": len(evalset.prompts),
        "samples": evalset.samples,
        "temperature": cfg.temperature,
        "max_new_tokens": evalset.sampling.max_new_tokens,
        "turn_tokens": evaluator.turn_tokens or None,  # episodes: a model turn's limit (max_new_tokens: the episode's)
        "max_turns": episode_run.episode.max_turns if episodes else None,  # episodes: its model turns at most
        "numerics": numerics.describe(),
        "states": results,
    }


def _check_lora(target: Target, base: CausalLM) -> None:
    """The adapters of an adapter folder, or of a LoRA run's checkpoints, checked against their base before any
    state is evaluated: a ConfigError naming the file and the key (a rank past the model's widths) otherwise."""
    if target.adapter is not None:
        lora, source, keys = target.adapter[1], target.adapter[0] / CONFIG_FILE, ("r", "target_modules")
    elif target.run is not None and target.run.lora_config() is not None:
        lora, keys = target.run.lora_config(), ("lora.rank", "lora.targets")
        source = target.checkpoints[0].parents[1] / "config.yaml"  # RUN_DIR/checkpoints/step_N
    else:
        return
    try:
        check_lora(base, lora, *(f"{source}: {key}" for key in keys))
    except AdapterError as e:
        raise ConfigError(str(e)) from None


def _trainer(
    target: Target, run: TrainConfig | None, checkpoint: Path | None, precision: str, device: str, base: CausalLM
) -> Trainer:
    """A trainer in `precision` holding the base weights (a copy of `base`), a checkpoint's, or an adapter
    folder's adapters on their base."""
    model = copy.deepcopy(base).to(device)
    # An exact-mode run's trainer computed with exact mode's numerics: its deploy/kl_* are those of that code path.
    model.numerics = kernels.numerics(device, exact=bool(run and run.exact))
    if target.adapter is not None and checkpoint is not None:
        trainer = Trainer(model, precision, OptimConfig(), target.adapter[1])
        try:
            load_adapter_state(trainer.model, read_adapter(*target.adapter))
        except (AdapterError, OSError, SafetensorError) as e:
            raise ConfigError(f"{checkpoint}: the adapters cannot be read ({e})") from None
        return trainer
    trainer = Trainer(model, precision, OptimConfig(), run.lora_config() if run and checkpoint else None)
    if checkpoint is not None:
        load_checkpoint(checkpoint, trainer, target.model_dir)
    return trainer


def reward_functions(result: dict[str, Any]) -> list[str]:
    """The reward functions whose own mean scores the states hold (`eval/<policy>/reward/<name>/mean`)."""
    prefix = f"eval/{TRAINER}/reward/"
    metrics = result["states"][0]["metrics"] if result["states"] else {}
    return [k[len(prefix) : -len("/mean")] for k in metrics if k.startswith(prefix) and k.endswith("/mean")]


def markdown_table(result: dict[str, Any]) -> str:
    """One row per state and policy: its score, each reward function's mean score (with reward functions of
    your own), pass@k, length, and the gap and KL to the trainer's policy."""
    binary = any("accuracy" in k for state in result["states"] for k in state["metrics"])
    score = "accuracy" if binary else "reward_mean"
    functions = reward_functions(result)
    lines = [
        f"| state | step | policy | {score} | "
        + "".join(f"reward/{name} | " for name in functions)
        + f"pass@{result['samples']} | mean length | gap to trainer | responses changed | KL(μ‖π_trainer) per token |",
        "|---|---|---|---|" + "---|" * len(functions) + "---|---|---|---|---|",
    ]
    for state in result["states"]:
        m = state["metrics"]
        for label in [*result["precisions"], TRAINER]:
            name = f"trainer ({result['reference']})" if label == TRAINER else label
            passed = m.get(f"eval/{label}/pass@k")
            gap, se, kl, changed = (m.get(f"deploy/{k}_{label}") for k in ("gap", "gap_se", "kl", "changed"))
            cells = [
                f"{m[f'eval/{label}/{score}']:.3f}",
                *(f"{m[f'eval/{label}/reward/{name}/mean']:.3f}" for name in functions),
                "-" if passed is None else f"{passed:.3f}",
                f"{m[f'eval/{label}/mean_length']:.1f}",
                "-" if gap is None else f"{gap:+.3f} ± {se:.3f}",
                "-" if changed is None else f"{changed:.1%}",
                "-" if kl is None else f"{kl:.2e}",
            ]
            step = "—" if state["step"] is None else state["step"]
            lines.append(f"| {state['name']} | {step} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(result: dict[str, Any], out: Path) -> None:
    claim_output_dir(out, "eval", "out")
    write_output_json(out / "eval.json", result)
    md = (
        f"# Held-out evaluation: {result['target']}\n\n"
        f"{result['prompts']} held-out prompts ({result['data']}) x {result['samples']} samples at temperature "
        f"{result['temperature']} "
        f"(0 = greedy), up to {result['max_new_tokens']} new tokens"
        + (
            f" per episode ({result['max_turns']} model turns at most, each model turn at most {result['turn_tokens']})"
            if result.get("turn_tokens")
            else ""
        )
        + f", task {result['task']}; the same random draws for "
        f"every state and policy. Policies: the weights served in each precision, and the trainer's policy "
        f"({result['reference']}, sampled with the trainer's arithmetic). Gap = a policy's score minus the "
        "trainer policy's, ± its standard error over prompts (paired); responses changed: rows whose response "
        "differs from the trainer policy's in any token; KL per token on the policy's samples, π from the "
        "trainer's code path."
        + (" reward/NAME: each reward function's own mean score, unweighted." if reward_functions(result) else "")
        + "\n\n"
        + markdown_table(result)
        + "\n![accuracy per precision](eval.png)\n"
    )
    write_output(out / "eval.md", md)
    plot_eval(result, out / "eval.png")


def plot_eval(result: dict[str, Any], path: Path) -> None:
    """Left: the score per policy at each state (the base model, then each checkpoint in step order). Right:
    each serving precision's gap to the trainer's policy, with ± one standard error (paired over prompts). The
    states stand at even places, labelled with their steps, and each policy a little apart at its state: one
    state, or steps far apart, no longer stack the points on one another."""
    from parity.commands.report import plt, save_figure

    states = result["states"]
    binary = any("accuracy" in k for k in states[0]["metrics"])
    score = "accuracy" if binary else "reward_mean"
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    places = range(len(states))
    labels = [s["name"] if s["step"] in (0, None) else f"step {s['step']}" for s in states]

    def apart(i: int, count: int) -> list[float]:
        return [x + (i - (count - 1) / 2) * min(0.3, 0.6 / count) for x in places]

    policies = [*result["precisions"], TRAINER]
    for i, label in enumerate(policies):
        name = label if label != TRAINER else f"trainer policy ({result['reference']})"
        style = dict(ls=":", color="black") if label == TRAINER else {}
        scores = [s["metrics"][f"eval/{label}/{score}"] for s in states]
        left.plot(apart(i, len(policies)), scores, marker="o", label=name, **style)
    for i, p in enumerate(result["precisions"]):
        gaps = [s["metrics"][f"deploy/gap_{p}"] for s in states]
        errors = [s["metrics"][f"deploy/gap_se_{p}"] for s in states]
        at = apart(i, len(result["precisions"]))
        right.errorbar(at, gaps, yerr=errors, marker="o", capsize=3, ls="none", label=p)
    right.axhline(0, color="black", lw=0.7)
    for ax in (left, right):
        ax.set_xticks(list(places), labels)
        ax.set_xlim(-0.5, len(states) - 0.5)
        ax.legend(fontsize=8)
    left.set(xlabel="model evaluated", ylabel=f"held-out {score}", title="Held-out score per serving precision")
    right.set(xlabel="model evaluated", ylabel=f"{score} served − trainer policy's")
    right.set_title("Deployment gap (± 1 standard error over prompts)")
    save_figure(fig, path)
