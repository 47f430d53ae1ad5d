"""`parity train`: the synchronous RL loop and its run (its config: `rl/train_config.py`; the run directory
before the run is built, new or resumed: `rl/run_setup.py`).

One step, top to bottom (`Run.step`), with the three policies kept apart — μ (the
sampler's log-probs), π_old (the trainer's code path and precision on the weights
that sampled), π_θ (being trained):

    prompts ─► Sampler: RolloutEngine (rollout precision) ─► tokens, μ
               [scores its own samples with the trainer's code path: π_old (shadow), the probe]
            ─► rewards ─► group advantages
            ─► π_old: the sampler's, a learner pass (several updates), or the first π_θ pass (free)
            ─► for each epoch, mini-batch: π_θ, estimator loss (ratio π_θ/π_old, IS weights
               π_old/μ), scaled backward, optimizer step; α and phantom clipping measured
            ─► mismatch g = π_old − μ = β + κ ─► weight sync ─► log, checkpoint
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from parity import config as config_mod
from parity.config import ConfigError
from parity.engines import kernels
from parity.engines.batch import RolloutBatch
from parity.engines.budget import check_rollout_memory
from parity.engines.models.config import ModelConfig
from parity.engines.models.io import load_model, require_finite_logits, resolve_model_dir
from parity.engines.models.modules import CausalLM
from parity.engines.precision import to_dtype
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import load_tokenizer
from parity.engines.trainer import scheduled_lr
from parity.folders import atomic_write_json, atomic_write_text
from parity.rl.builtin_rewards import extract_boxed
from parity.rl.callbacks import CallbackError, Callbacks, TrainerState, checked_callbacks
from parity.rl.checkpoint import (
    RunState,
    checkpoints,
    require_finite_weights,
)
from parity.rl.completions import (
    completion_rows,
    drop_completions_after,
    markdown_table,
    sample_rows,
    write_completions,
)
from parity.rl.data import DataOrder, fingerprint, load_problems, prompt_limit
from parity.rl.diagnostics import mismatch_alarm
from parity.rl.episodes import episode_setup
from parity.rl.evaluation import EvalSet, Evaluator, eval_sampling, evaluation_due, heldout_problems
from parity.rl.metrics_log import MetricsLog
from parity.rl.problems import Problem
from parity.rl.reward_fns import Reward, binary_reward, config_rewards, data_columns, run_rewards
from parity.rl.rewards import RewardError, RewardHealth, score_rollouts
from parity.rl.run_setup import NewRunDir, lock_for_resume, new_run_dir, recorded_threads, resumed_config
from parity.rl.step import (
    LocalBackend,
    Prepared,
    RunParts,
    TrainingError,
    UpdatePlan,
    UpdateResult,
    old_policy,
    prepare,
    step_metrics,
    trained_rewards,
)
from parity.rl.tasks import EVAL_SEED, TASKS, builtin_problems
from parity.rl.trackers import check_trackers, open_trackers
from parity.rl.train_config import CHUNKED_HEAD_MODES, TrainConfig
from parity.rundir import RunLock, checkpoint_step
from parity.runtime import draws_bars, keep_threads, reuse_freed_memory

PROGRESS_LINES = 50  # lines a run prints in place of its progress bar when stderr is no terminal

# ----------------------------------------------------------------------------- the run


def _note(line: str) -> None:
    print(f"resume: {line}", file=sys.stderr)


@contextlib.contextmanager
def _out_of_memory(step: int, phase: str, sizes: str):
    """A device out of memory during `phase` of step `step` (0-based) as one line naming the sizes that set
    its memory (TrainingError): PyTorch's own message runs to a paragraph of allocator advice."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        what = str(e).split(" Including ")[0].split(" See documentation")[0].strip()
        raise TrainingError(f"step {step + 1}: the device ran out of memory {phase} ({what}); {sizes}") from None


class Backend(Protocol):
    """The engines of a run, wherever they are, and the trained state they hold. `step` is the 0-based index
    of the step under way."""

    loads_own_model: bool  # True: its learners load the model themselves (`RunParts.model` is None)

    def rollouts(self, step: int, times: dict[str, float]) -> tuple[list[Problem], RolloutBatch]:
        """Step `step`'s problems and their samples, scored by the sampler where it scores (π_old, the
        probe, the full-vocabulary record) on the weights that sampled; `times` gets the parts' seconds."""
        ...

    def old_logprobs(self, batch: RolloutBatch, plan: UpdatePlan) -> tuple[torch.Tensor | None, str]:
        """π_old and its source (`step.resolve_old`)."""
        ...

    def update(self, step: int, batch: RolloutBatch, prepared: Prepared, plan: UpdatePlan) -> UpdateResult:
        """Every optimizer update of the step; exact mode's check runs before the first (TrainingError)."""
        ...

    def sync(self, step: int, times: dict[str, float]) -> None:
        """The weights after step `step`'s updates to the sampler(s)."""
        ...

    def step_metrics(self, times: dict[str, float]) -> dict[str, float]:
        """The backend's own metrics of the step just done (sync, async pipeline, faults)."""
        ...

    @property
    def data_position(self) -> int:
        """Where the data order stands for a checkpoint: the problems trained on so far."""
        ...

    def evaluation_policy(self, with_model: bool) -> tuple[dict[str, torch.Tensor], int, CausalLM | None]:
        """The newest trained weights (FP32, merged), their version and, `with_model`, a model holding them in
        the trainer's code path (an evaluation's deploy/kl_*)."""
        ...

    def save(self, run_dir: Path, state: RunState, keep: int) -> Path:
        """Write a checkpoint of the trained state and `state`; its folder."""
        ...

    def restore(self, log: Callable[[str], None]) -> RunState | None:
        """Load the run's newest usable checkpoint (`rl.checkpoint.restore_latest`) and hand its weights to
        the sampler(s); None when there is none."""
        ...

    def close(self) -> None:
        """Release what the engines hold beyond this process."""
        ...


class Run:
    """A training run: data, rewards and the step, over a backend that holds the engines
    (`Backend`: `rl/step.LocalBackend` in this process, `distributed/driver.RayBackend` on Ray).
    Build with `Run.create`/`Run.resume`."""

    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: Path,
        progress: bool = True,
        rewards: list[Reward] | None = None,
        backend: type[Backend] = LocalBackend,
        tools: list | None = None,
        environment: object = None,
    ):
        reuse_freed_memory()
        check_trackers(cfg.log.to)  # a missing tracker library, refused before anything starts
        self.cfg, self.run_dir, self.progress = cfg, run_dir, progress
        self.model_dir = resolve_model_dir(cfg.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        # The kernels every engine of this run computes with, decided once (numerics.json records them).
        self.numerics = kernels.numerics(cfg.device, cfg.exact)
        self.run_threads = torch.get_num_threads()  # a resumed run's are its start's (`Run.resume`)
        model = load_model(self.model_dir, self.numerics)
        require_finite_weights(model, self.model_dir, "nothing can be trained from them (`parity doctor` shows where)")
        model.activation_checkpointing = cfg.trainer.activation_checkpointing
        model.chunked_head = CHUNKED_HEAD_MODES[cfg.trainer.chunked_head]
        if cfg.moe.routing_replay and not model.config.num_experts:
            raise ConfigError(
                f"moe.routing_replay=true: {cfg.model} is a dense {model.config.architecture} model with no experts"
            )
        positions = model.config.max_position_embeddings
        limit = prompt_limit(
            self.tokenizer, positions, cfg.rollout.max_new_tokens, "rollout.max_new_tokens", cfg.task.chat_template
        )
        self.columns = data_columns(cfg)
        if cfg.task.data == "builtin":
            self.problems = builtin_problems(cfg.task.name, cfg.task.num_problems, cfg.seed, cfg.task.difficulty)
            for i, problem in enumerate(self.problems):
                limit.check(f"task.data=builtin: generated problem {i}", problem.prompt)
        else:
            self.problems = load_problems(cfg.task.data, limit, columns=self.columns, run_dir=run_dir)
        first_prompt = limit.check("task.data: problem 0", self.problems[0].prompt)
        precisions = {p: to_dtype(p) for p in (cfg.trainer_precision, cfg.rollout_precision)}
        require_finite_logits(model, first_prompt, precisions, self.model_dir)
        if not cfg.distributed.address:  # a joined cluster samples on its own machines, whose memory is not here
            check_rollout_memory(
                model.config,
                cfg.prompts_per_step * cfg.rollout.group_size,
                limit.longest,
                cfg.rollout.max_new_tokens,
                "prompts_per_step x rollout.group_size, rollout.max_new_tokens, diagnostics.full_vocab_positions",
                cfg.device,
                cfg.diagnostics.full_vocab_positions,
            )
        self.data = DataOrder(len(self.problems), cfg.seed)
        self.data_sha256 = fingerprint(self.problems)  # what a checkpoint records, and a resume checks
        self.episodes = episode_setup(cfg, self.tokenizer, tools, environment) if cfg.episodes else None
        self.rewards = run_rewards(cfg, self.problems, rewards, state=lambda: self.state)
        self.reward_health = RewardHealth(cfg.reward.warn_error_rate, cfg.reward.max_failed_steps)
        self.sampling = SamplingParams(
            cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p, cfg.rollout.max_new_tokens
        )
        self.model_config = model.config
        self.evaluator = self._evaluator(model.config)
        self.evaluator_asked = False  # a callback's control.should_evaluate built it (eval.every=-1)
        if backend.loads_own_model:  # checked; its learners load their own: this process keeps none
            model = None
        self.plan = self._update_plan()
        self.step_count = 0
        self.alarm_series: list[float] = []  # mismatch/k3 per step, for the collapse warning
        self.alarmed = False
        self.skipped_streak = 0  # consecutive steps whose every update the FP16 scaler skipped
        self.zero_variance_warned = False
        self.unscored_warned = False  # every reward function returned None for a sample: said once
        self.warned: set[str] = set()  # `_warn_once`'s
        self.saved_step = 0  # the step of the newest checkpoint this run wrote or resumed from
        self.state = TrainerState(max_steps=cfg.steps)  # where the run stands, for callbacks (`train`)
        self.truncation_warned = False  # this streak of steps cutting off most responses was warned of
        self.announce = True  # train() starts with `settings_line`; `parity sanity` prints its own, once
        self.last_metrics: dict[str, float] = {}  # the newest step's, for the model card of a checkpoint
        # task.name=math scores only \boxed{} answers: warn (once) if a whole step holds none.
        self.watch_boxed = TASKS[cfg.task.name].boxed and not cfg.task.reward_fn
        self.lock: RunLock | None = None  # set by create/resume; released when train() ends
        self.closed = False  # close() ran: a second call does nothing
        self.new_dir: NewRunDir | None = None  # create()'s: a run that stops before its first step removes it
        self.log = MetricsLog(run_dir, [])
        self.backend: Backend | None = None
        with self._closed_on_failure():
            self.backend = backend(
                RunParts(
                    cfg,
                    run_dir,
                    self.model_dir,
                    self.tokenizer,
                    self.numerics,
                    model,
                    self.problems,
                    self.data,
                    self.sampling,
                    self.episodes,
                )
            )

    def _evaluator(self, config: ModelConfig, asked: bool = False) -> Evaluator | None:
        """The held-out evaluation `eval.*` asks for (`asked`: a callback's `control.should_evaluate` asks,
        whatever eval.every), or None (eval.every=-1, or nothing held out)."""
        cfg, e = self.cfg, self.cfg.eval
        if e.every < 0 and not asked:
            return None
        source = cfg.eval_data
        max_new = e.max_new_tokens or cfg.rollout.max_new_tokens
        key = "eval.max_new_tokens" if e.max_new_tokens else "rollout.max_new_tokens"
        limit = prompt_limit(self.tokenizer, config.max_position_embeddings, max_new, key, cfg.task.chat_template)
        problems: list[Problem] = []
        if source == "heldout":
            trained = {str(p.prompt) for p in self.problems}
            problems = heldout_problems(cfg.task.name, cfg.task.difficulty, e.num_prompts, cfg.seed, trained)
            for i, problem in enumerate(problems):
                limit.check(f"eval: held-out problem {i}", problem.prompt)
        elif source is not None:
            problems = load_problems(source, limit, columns=self.columns, run_dir=self.run_dir, key="eval.data")
            problems = problems[: e.num_prompts]
        if not problems:
            scored = f"task.name={cfg.task.name}"
            if cfg.task.reward_fn or cfg.task.environment:
                scored = "your reward functions" if cfg.task.reward_fn else "your environment's rewards"
            print(
                ("control.should_evaluate: " if asked else "")
                + f"eval: no held-out problems (task.data={cfg.task.data} with {scored}"
                + ", whose problems Parity does not generate); set eval.data=FILE (eval_dataset= in Python) to "
                "evaluate" + (" (nothing is evaluated)" if asked else ", or eval.every=-1"),
                file=sys.stderr,
            )
            return None
        keys = f"eval.num_prompts x eval.samples, {key}"
        check_rollout_memory(config, len(problems) * e.samples, limit.longest, max_new, keys, cfg.device)
        evalset = EvalSet(
            problems=problems,
            prompts=[limit.check(f"eval: problem {i}", p.prompt) for i, p in enumerate(problems)],
            samples=e.samples,
            sampling=eval_sampling(e.temperature, max_new),
            binary=binary_reward(cfg),
        )
        served = (cfg.rollout_precision, self.numerics)
        return Evaluator(
            config,
            self.tokenizer,
            evalset,
            self.rewards,
            served,
            e.precisions,
            cfg.trainer_precision,
            cfg.trainer.micro_batch_tokens,
            cfg.device,
            self.episodes,
            cfg.turn_tokens,
        )

    @property
    def completed(self) -> bool:
        """The run has taken all its steps (a resumed one may have: `--resume` with a larger `steps` goes on)."""
        return self.step_count >= self.cfg.steps

    def evaluate(self) -> dict[str, float]:
        """The held-out evaluation of the current weights (`eval.*`): eval/* and deploy/* metrics."""
        t = time.perf_counter()
        weights, version, model = self.backend.evaluation_policy(self.evaluator.scores_with_trainer)
        seed = self.cfg.seed + EVAL_SEED
        metrics = self.evaluator.evaluate(weights, version, seed, model, self.progress)
        metrics["time/eval"] = time.perf_counter() - t
        return metrics

    def close(self) -> None:
        """Stop the engines (and a Ray cluster this run started), the reward runner and the log, and
        release the run directory. Once: a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        if self.backend is not None:
            self.backend.close()
        self.rewards.close()
        self.log.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    @contextlib.contextmanager
    def _closed_on_failure(self):
        """A start that fails or is interrupted (SIGINT, SIGTERM) leaves no engine or Ray process running."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    def _open_trackers(self) -> None:
        """TensorBoard and `log.to`'s trackers, opened once nothing can refuse the run any more (`create`, after the
        backend, whose trainer refuses a LoRA config that does not fit the model; `_restore`): each writes in the run
        directory as it opens, and W&B and MLflow start (or resume) a run of theirs."""
        cfg = self.cfg
        flat = config_mod.flatten(config_mod.to_dict(cfg))
        self.log.trackers = open_trackers(cfg.tensorboard, cfg.log.to, self.run_dir, cfg.log.project, flat)

    def record_numerics(self) -> None:
        """numerics.json: the device, processor and kernel path per precision this process runs, its CPU threads,
        and the run's (`run_threads`: its start's, which a resume keeps, `runtime.keep_threads`, where it can: a
        resume on a machine of fewer cores does not change what a later one keeps)."""
        threads = {"threads": torch.get_num_threads(), "run_threads": self.run_threads}
        atomic_write_json(self.run_dir / "numerics.json", {**self.numerics.describe(), **threads})

    # -- construction ---------------------------------------------------------

    @classmethod
    def create(
        cls,
        cfg: TrainConfig,
        progress: bool = True,
        rewards: list[Reward] | None = None,
        datasets: dict[str, list[dict[str, Any]]] | None = None,
        backend: type[Backend] = LocalBackend,
        tools: list | None = None,
        environment: object = None,
    ) -> Run:
        """A new run of `cfg`. `rewards`: Python callables for the functions `task.reward_fn` names (the
        API's). `datasets`: rows for "train" (and "eval") held in memory, written into the run directory's
        data/ so that config.yaml names files that `--resume` and `parity eval` read. `backend`: where the
        engines run (`parity.distributed.driver.backend_for(cfg)` picks it from the config)."""
        if rewards is None and cfg.task.reward_fn:
            # before run_dir is made: an import that must be stopped at once (`rewards.bounded`) leaves nothing
            rewards = config_rewards(cfg)
        new = new_run_dir(cfg, datasets)
        try:
            # model, data, reward checked before anything is written
            run = cls(cfg, new.path, progress, rewards, backend, tools, environment)
            run.new_dir = new
            with run._closed_on_failure():
                run._open_trackers()
                atomic_write_text(new.path / "config.yaml", config_mod.dump_yaml(cfg))
                run.record_numerics()
        except BaseException:
            new.abandon()
            raise
        run.lock = new.lock
        return run

    @classmethod
    def resume(
        cls,
        run_dir: str | Path,
        overrides: list[str] | None = None,
        trust_reward_fn: bool = False,
        progress: bool = True,
        rewards: list[Reward] | None = None,
        backend: type[Backend] = LocalBackend,
        tools: list | None = None,
        environment: object = None,
    ) -> Run:
        """Continue the run in `run_dir` from its newest intact checkpoint, with exactly its
        saved config; `overrides` may set only RESUMABLE_KEYS (data paths relative to the working
        directory). `rewards`: the Python callables of its `task.reward_fn` (the API's)."""
        run_dir = Path(run_dir)
        lock = lock_for_resume(run_dir)
        try:
            cfg = resumed_config(run_dir, overrides or [], trust_reward_fn or rewards is not None, _note)
            threads = recorded_threads(run_dir)
            if threads is not None:
                keep_threads(threads, _note)
            # checks model, data, reward before writing anything
            run = cls(cfg, run_dir, progress, rewards, backend, tools, environment)
            run.run_threads = threads or run.run_threads
            with run._closed_on_failure():
                saved = checkpoints(run_dir)
                done = checkpoint_step(saved[-1].name) if saved else 0
                if cfg.steps < done:  # config.yaml would say fewer steps than its checkpoints took
                    raise ConfigError(f"steps={cfg.steps}: the run has taken {done} steps; give steps >= {done}")
                run._restore()  # before config.yaml changes: it may refuse the run's data
                if overrides:
                    atomic_write_text(run_dir / "config.yaml", config_mod.dump_yaml(cfg))
                run.record_numerics()
        except BaseException:
            lock.release()
            raise
        run.lock = lock
        return run

    def _restore(self) -> None:
        """The newest intact checkpoint's state into this run (a resume), the log cut back to it."""
        state = self.backend.restore(_note)
        if state is not None and state.data_sha256 not in (None, self.data_sha256):
            raise ConfigError(
                f"task.data={self.cfg.task.data}: not the problems the run trained on (its step {state.step} "
                "checkpoint records others); a resume goes on through the same problems: give the file it trained on"
            )
        self._open_trackers()  # not before: a refused resume leaves no TensorBoard file, starts no W&B run
        if state is not None:
            self.step_count = state.step
            self.data.position = state.data_position
            _note(f"continuing from step {state.step}")
        elif self.log.path.is_file():
            # Stopped before its first checkpoint (`restore_latest` refuses one whose every checkpoint is damaged):
            # no weights hold the steps logged, and taking them again from the same seed logs them again.
            _note("no checkpoint (the run stopped before its first); starting again from step 0, its steps logged anew")
        self.log.truncate_after(self.step_count)
        drop_completions_after(self.run_dir, self.step_count)
        for logged in self.log.rows():
            self.alarm_series.append(logged["mismatch/k3"])
            self.alarmed = self.alarmed or bool(logged.get("health/mismatch_alarm"))

    # -- one step -------------------------------------------------------------

    def _update_plan(self) -> UpdatePlan:
        cfg = self.cfg
        return UpdatePlan(
            algorithm=cfg.algorithm.build(),
            micro_batch_tokens=cfg.trainer.micro_batch_tokens,
            prompts=cfg.prompts_per_step,
            group_size=cfg.rollout.group_size,
            max_new_tokens=cfg.rollout.max_new_tokens,
            routing_replay=cfg.moe.routing_replay,
        )

    def step(self) -> dict[str, float]:
        cfg, a = self.cfg, self.cfg.algorithm
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        t = cfg.trainer
        if t.lr_schedule != "constant" or t.warmup_steps:  # a constant rate stays the optimizer's own
            lr = scheduled_lr(t.lr, t.lr_schedule, t.warmup_steps, self.step_count, cfg.steps)
            self.plan = dataclasses.replace(self.plan, lr=lr)
        r = cfg.rollout
        with _out_of_memory(
            self.step_count,
            "while sampling",
            f"{cfg.prompts_per_step * r.group_size} rows (prompts_per_step × rollout.group_size) of up to "
            f"rollout.max_new_tokens={r.max_new_tokens} new tokens, scored in micro-batches of "
            f"trainer.micro_batch_tokens={cfg.trainer.micro_batch_tokens}: lower one of them",
        ):
            problems, batch = self.backend.rollouts(self.step_count, times)

        t = time.perf_counter()
        result = score_rollouts(batch, problems, self.tokenizer, self.rewards)
        warning = self.reward_health.observe(self.step_count + 1, result)
        if warning is not None:
            tqdm.write(f"WARNING {warning}", file=sys.stderr)
        unscored = sum(r != r for r in result.rewards)  # NaN: every reward function returned None
        if unscored and not self.unscored_warned:
            self.unscored_warned = True
            tqdm.write(
                f"WARNING step {self.step_count + 1}: every reward function returned None for {unscored} of the step's "
                f"{len(result.rewards)} completions; they are left out of their group's baseline with advantage 0 "
                "(reward/unscored_frac counts them each step)",
                file=sys.stderr,
            )
        if self.watch_boxed and not any(extract_boxed(r) is not None for r in result.responses):
            self.watch_boxed = False
            tqdm.write(
                f"WARNING step {self.step_count + 1}: task.name=math found no \\boxed{{...}} answer in any of the "
                f"step's {len(result.responses)} responses, so every reward is 0; for a model that does not box "
                "its answers use task.name=number (the last number in the response) or a task.reward_fn",
                file=sys.stderr,
            )
        times["reward"] = time.perf_counter() - t
        t = time.perf_counter()
        trained = trained_rewards(batch, result, a.advantage, a.truncated)  # what the loss and the files see
        self._show_completions(batch, problems, result, trained)
        times["completions"] = time.perf_counter() - t

        t = time.perf_counter()
        with _out_of_memory(
            self.step_count,
            "in the update",
            f"trainer.micro_batch_tokens={cfg.trainer.micro_batch_tokens} tokens per forward and backward: lower it "
            "(or set trainer.activation_checkpointing=true)",
        ):
            old = self.backend.old_logprobs(batch, self.plan)
            prepared = prepare(batch, trained, self.plan, a.truncated, old)
            update = self.backend.update(self.step_count, batch, prepared, self.plan)
        self._check_finite(update)
        times["train"] = time.perf_counter() - t
        pi_old = old_policy(prepared, update)
        self.backend.sync(self.step_count, times)
        self.step_count += 1
        times["step"] = time.perf_counter() - t0

        metrics: dict[str, float] = {"step": self.step_count}
        metrics.update(
            step_metrics(
                batch,
                prepared,
                update,
                result,
                pi_old,
                self.plan,
                binary_reward=binary_reward(cfg),
                same_precision=cfg.trainer_precision == cfg.rollout_precision,
            )
        )
        self.alarm_series.append(metrics["mismatch/k3"])
        metrics["health/mismatch_alarm"] = int(
            mismatch_alarm(self.alarm_series, cfg.health.alarm_window, cfg.health.alarm_factor)
        )
        metrics.update(self.backend.step_metrics(times))
        metrics.update({f"time/{k}": v for k, v in times.items()})
        metrics["perf/tokens_per_s"] = batch.num_tokens / times["step"]
        metrics["perf/train_gflops"] = update.flops / 1e9 / times["train"]
        self._warn_truncation(metrics)
        for name, value in result.metrics.items():  # what reward functions gave `log_metric`, under its name
            if name in metrics:
                self._warn_once(f"log_metric({name!r}) is a metric Parity logs: the reward function's is left out")
            else:
                metrics[name] = value
        return metrics

    def _warn_once(self, line: str) -> None:
        if line not in self.warned:
            self.warned.add(line)
            tqdm.write(f"WARNING step {self.step_count}: {line}", file=sys.stderr)

    def _warn_truncation(self, metrics: dict[str, float]) -> None:
        """A step that cut off more than half of its responses under a rule that zeroes their reward (or drops
        them) says so, once per streak of such steps: its reward is mostly the rule's, not the task's."""
        a, cut = self.cfg.algorithm, metrics["response/truncated_frac"]
        if cut <= 0.5 or a.truncated == "keep":
            self.truncation_warned = False
            return
        if not self.truncation_warned:
            samples, budget = int(metrics["train/samples"]), f"rollout.max_new_tokens={self.cfg.rollout.max_new_tokens}"
            done = "scored them 0" if a.truncated == "zero_reward" else "left them out of the loss"
            where, raise_ = f"at {budget}", "rollout.max_new_tokens"
            if self.cfg.episodes:  # a turn's limit, the episode's budget, or its turns (episode.max_turns)
                turns = f"episode.max_turns={self.cfg.episode.max_turns}"
                where = f"(a turn at episode.turn_tokens={self.cfg.turn_tokens}, the episode at {budget} or {turns})"
                raise_ = "episode.turn_tokens, rollout.max_new_tokens or episode.max_turns (episode/end_* says which)"
            tqdm.write(
                f"WARNING step {self.step_count}: {round(cut * samples)} of {samples} responses were cut off {where} "
                f"and algorithm.truncated={a.truncated} {done}; raise {raise_}, or set algorithm.truncated=keep to "
                "train on their rewards",
                file=sys.stderr,
            )
        self.truncation_warned = True

    def _show_completions(
        self, batch: RolloutBatch, problems: list[Problem], result, trained: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """completions/step_N.jsonl with every completion of the step, the reward it trains on and its advantage
        (`trained`), and its scores; `log.completions` of them printed as a table."""
        groups = batch.group_index.tolist()
        trained, advantages = trained
        extra = None if batch.episodes is None else batch.episodes.records(batch)
        if result.extra:  # what reward functions gave `log_extra`: a column each, under "extra"
            logged = [{"extra": {k: v[i] for k, v in result.extra.items()}} for i in range(len(groups))]
            extra = logged if extra is None else [{**e, **x} for e, x in zip(extra, logged)]
        rows = completion_rows(
            self.step_count + 1,
            [problems[g] for g in groups],
            result.responses,
            result.rewards,
            result.per_function,
            batch.sampled_mask.sum(-1).tolist(),  # the model's own tokens (an episode's fed ones left out)
            batch.truncated.tolist(),
            trained.tolist(),
            advantages.tolist(),
            extra,
        )
        write_completions(self.run_dir, self.step_count + 1, rows)
        if self.cfg.log.completions:
            shown = markdown_table(sample_rows(rows, self.cfg.log.completions))
            tqdm.write(f"step {self.step_count + 1} completions (log.completions=0 hides them):\n{shown}")

    def _check_finite(self, update: UpdateResult) -> None:
        """Stop before a non-finite update is synced, logged or saved.

        FP16 skips an update whose gradients overflow and lowers the loss scale; that is
        routine, so only a long run of fully skipped steps stops it. FP32 and BF16 have no
        scaler: a non-finite loss or gradient there means the run has diverged."""
        step = self.step_count + 1
        loss, skipped_updates, updates, bad = (
            sum(update.losses),
            update.skipped_updates,
            update.updates,
            update.non_finite_weights,
        )

        where = self.newest_checkpoint
        if bad:
            raise TrainingError(
                f"step {step}: the weights hold inf/NaN after the optimizer step (trainer.lr="
                f"{self.cfg.trainer.lr:g}); the run stopped without saving them ({', '.join(bad[:3])}); {where()}"
            )
        if self.cfg.trainer_precision.loss_scaled:
            self.skipped_streak = self.skipped_streak + 1 if skipped_updates == updates else 0
            if self.skipped_streak >= self.cfg.health.max_skipped_steps:
                raise TrainingError(
                    f"step {step}: the FP16 loss scaler skipped every update of {self.skipped_streak} steps in a row "
                    f"(loss {loss:g}, loss scale {update.step_stats.loss_scale:g}; health.max_skipped_steps="
                    f"{self.cfg.health.max_skipped_steps}): the model overflows FP16; try precision=bf16; {where()}"
                )
        elif skipped_updates or not math.isfinite(loss):
            raise TrainingError(
                f"step {step}: non-finite loss ({loss:g}) or gradients in {self.cfg.trainer_precision}, which has no "
                f"loss scaler to skip them; {skipped_updates} of {updates} updates were not applied and the run "
                f"stopped; {where()}"
            )

    def newest_checkpoint(self) -> str:
        """Where a stopped run can resume from, for its last line (a directory listing: only on the way out)."""
        last = checkpoints(self.run_dir)
        if not last:  # what `--resume` will do (`Run.resume`), said before the user runs it
            return "no checkpoint was written (a resume starts again from step 0)"
        return f"the newest checkpoint is {last[-1].name}"

    # -- the loop -------------------------------------------------------------

    def train(
        self, should_stop: Callable[[], bool] | None = None, callbacks: list[Any] | None = None
    ) -> list[dict[str, float]]:
        """Train up to `cfg.steps`; `should_stop` (asked after every step) or a callback (its control's
        `should_training_stop`, or the first form's `on_step_end` returning True) ends the run early, with a
        checkpoint of the last step. A callback that raises, or answers what the run cannot use, stops it
        the same way, then raises a CallbackError (`rl/callbacks.py`, which says when each event comes).
        `self.state` is the run's `TrainerState` afterwards. A reward function that fails its first batch (a
        ConfigError) or runs past its time (a RewardError), or an environment that cannot be made, stops the run
        before it trains, and a run directory this run made goes with it."""
        logged = self.log.rows() if self.step_count else []  # a resumed run's earlier steps
        self.state = TrainerState(self.step_count, self.cfg.steps, self._epoch(), logged)
        hooks = Callbacks(checked_callbacks(callbacks), copy.deepcopy(self.cfg), self.state)
        try:
            return self._train(should_stop, hooks)
        except (ConfigError, RewardError):
            if self.new_dir is not None and self.step_count == 0:
                self.new_dir.remove()  # nothing was trained: the run leaves nothing
            raise

    def _epoch(self) -> float:
        """Passes over the training prompts so far."""
        return self.backend.data_position / len(self.problems)

    def _train(self, should_stop: Callable[[], bool] | None, hooks: Callbacks) -> list[dict[str, float]]:
        cfg, state = self.cfg, hooks.state
        if cfg.trainer_precision != cfg.rollout_precision:
            print(
                f"WARNING: mismatched precisions on purpose: trainer {cfg.trainer_precision}, "
                f"rollout {cfg.rollout_precision}",
                file=sys.stderr,
            )
        if self.announce:
            print(settings_line(cfg), file=sys.stderr)
        if threading.current_thread() is not threading.main_thread():
            print(  # `rewards.bounded` arms SIGALRM, which only the main thread receives
                "WARNING: this run trains outside the main thread, where the time limits of reward functions, tools "
                "and environments (reward.in_process_timeout_s, episode.tool_timeout_s) cannot be enforced",
                file=sys.stderr,
            )
        history = []
        self.saved_step = self.step_count  # a resumed run's step is its checkpoint's
        # Where no bar can be drawn (a log file), plain lines instead: about 50 in a run, and its last step's.
        live = draws_bars(self.progress)
        bar = tqdm(total=cfg.steps, initial=self.step_count, desc="train", unit="step", disable=not live)
        line_every = max(1, cfg.steps // PROGRESS_LINES) if self.progress and not live else 0
        try:
            hooks.event("on_train_begin")
            self._stop_on_failure(hooks)
            while self.step_count < cfg.steps:
                hooks.control.new_step()
                hooks.event("on_step_begin")
                self._stop_on_failure(hooks)
                metrics = self._step_keeping_finished()
                state.global_step, state.epoch = self.step_count, self._epoch()
                hooks.control.should_log = True  # every step is logged
                hooks.event("on_step_end", metrics=metrics)
                evaluator = self.evaluator
                if evaluator is None and hooks.switch("should_evaluate") and not self.evaluator_asked:
                    self.evaluator_asked = True
                    evaluator = self.evaluator = self._evaluator(self.model_config, asked=True)
                asked = hooks.switch("should_evaluate")
                if evaluator is not None and (asked or evaluation_due(self.step_count, cfg.steps, cfg.eval.every)):
                    evaluated = self.evaluate()
                    metrics.update(evaluated)
                    hooks.event("on_evaluate", metrics=evaluated)
                self.log.log(metrics)
                self.last_metrics = metrics
                history.append(metrics)
                state.log_history.append(dict(metrics))
                hooks.event("on_log", logs=metrics)  # the first form's on_step_end
                bar.update(1)
                headline = {
                    "reward": f"{metrics['reward/mean']:.3f}",
                    "len": f"{metrics['response/length_mean']:.1f}",
                    "k3": f"{metrics['mismatch/k3']:.1e}",
                }
                if "reward/accuracy" in metrics:
                    headline["acc"] = f"{metrics['reward/accuracy']:.2f}"
                if "eval/accuracy" in metrics:
                    headline["eval"] = f"{metrics['eval/accuracy']:.2f}"
                bar.set_postfix(headline)
                if line_every and (self.step_count % line_every == 0 or self.step_count == cfg.steps):
                    shown = ", ".join(f"{k} {v}" for k, v in headline.items())
                    print(f"step {self.step_count}/{cfg.steps}: {shown}, {metrics['time/step']:.2f} s", file=sys.stderr)
                # A step whose every response is correct trained nothing too, but that is the task solved.
                if metrics["groups/zero_variance_frac"] == 1.0 and metrics.get("reward/accuracy") != 1.0:
                    if not self.zero_variance_warned:
                        tqdm.write(
                            f"WARNING step {self.step_count}: every group's rewards are equal "
                            "(groups/zero_variance_frac = 1), so every advantage is 0 and the step trained nothing; "
                            "if it persists, the task is too hard or too easy for the model, or the reward is constant",
                            file=sys.stderr,
                        )
                    self.zero_variance_warned = True
                else:
                    self.zero_variance_warned = False
                every = cfg.checkpoint_every
                stopping = (
                    hooks.switch("should_training_stop")
                    or hooks.failure is not None
                    or (should_stop is not None and should_stop())
                )
                due = every >= 0 and ((every and self.step_count % every == 0) or self.step_count == cfg.steps)
                if hooks.switch("should_save") or due or (every >= 0 and stopping):
                    saved = self.checkpoint()
                    if hooks.failure is None:
                        hooks.event("on_save", checkpoint=saved)
                self._stop_on_failure(hooks)
                if metrics["health/mismatch_alarm"] and not self.alarmed:
                    self.alarmed = True
                    action = cfg.health.on_alarm
                    tqdm.write(
                        f"WARNING step {self.step_count}: the training-inference mismatch is rising (mismatch/k3 "
                        f"{metrics['mismatch/k3']:.2e}, over {cfg.health.alarm_factor:g}x its early level): "
                        f"an early sign of collapse; health.on_alarm={action}",
                        file=sys.stderr,
                    )
                    if action in ("checkpoint", "stop"):
                        self.checkpoint()
                    if action == "stop":
                        break
                if stopping:
                    break
            hooks.event("on_train_end")
            self._stop_on_failure(hooks)
        finally:
            bar.close()
            self.close()
        return history

    def _step_keeping_finished(self) -> dict[str, float]:
        """`step()`; one that stops the run before its update (an environment that cannot be reset, rewards that
        keep failing) leaves the steps before it whole: they are checkpointed (unless checkpoint_every=-1), and
        the error says where the run resumes from."""
        try:
            return self.step()
        except (ConfigError, RewardError) as e:
            if self.step_count == self.saved_step or self.cfg.checkpoint_every < 0:
                raise
            self.checkpoint()
            raise type(e)(f"{e}; the run stopped: {self.newest_checkpoint()}") from None

    def _stop_on_failure(self, hooks: Callbacks) -> None:
        """A callback's failure: a checkpoint of the newest step if it has none (unless checkpoint_every=-1),
        then the CallbackError."""
        if hooks.failure is None:
            return
        if self.step_count > self.saved_step and self.cfg.checkpoint_every >= 0:
            self.checkpoint()
        line, cause = hooks.failure
        raise CallbackError(f"{line}; the run stopped: {self.newest_checkpoint()}") from cause

    def checkpoint(self) -> Path:
        self.saved_step = self.step_count
        state = RunState(
            self.step_count,
            self.backend.data_position,
            config=config_mod.to_dict(self.cfg),
            metrics=self.last_metrics,
            data_sha256=self.data_sha256,
        )
        return self.backend.save(self.run_dir, state, self.cfg.keep_checkpoints)


TRUNCATION_RULES = {"zero_reward": "scores 0", "drop": "is left out of the loss", "keep": "keeps its reward"}


def settings_line(cfg: TrainConfig) -> str:
    """The settings that make a run train something else than another library's defaults would, on one line:
    the precisions, the estimator, the advantage and what a response cut off at the length limit gets."""
    a = cfg.algorithm
    if cfg.trainer_precision == cfg.rollout_precision:
        precision = f"precision={cfg.trainer_precision}"
    else:
        precision = f"trainer.precision={cfg.trainer_precision}, rollout.precision={cfg.rollout_precision}"
    return (
        f"settings: {precision}{', exact=true' if cfg.exact else ''}, algorithm.name={a.name}, "
        f"algorithm.advantage={a.advantage}, algorithm.truncated={a.truncated} (a response cut off at "
        f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} {TRUNCATION_RULES[a.truncated]})"
    )


def summary_line(history: list[dict[str, Any]]) -> str:
    """`parity train`'s last line: the headline reward at the first and the last step this call trained (a
    resumed run's first is named by its step, so that it does not read as the run's step 1)."""
    if not history:
        return "no steps run"
    first, last = history[0], history[-1]
    key = "reward/accuracy" if "reward/accuracy" in last else "reward/mean"
    since = f" (step {first['step']})" if first["step"] != 1 else ""
    return (
        f"step {last['step']}: {key} {first[key]:.3f}{since} -> {last[key]:.3f}, "
        f"response length {last['response/length_mean']:.1f}, mismatch k3 {last['mismatch/k3']:.2e}"
    )
