"""Where a run's engines live: the `Backend` protocol `Run` steps through, and its one-process form.

`Run` (`rl/loop.py`) holds the step's logic once: data, rewards, advantages, the loss plan, metrics,
checkpoints. A backend holds the engines and answers five kinds of call:

    rollouts   this step's problems and their samples, with μ (and π_old where the sampler scores it)
    update     the optimizer updates of one step, on the trainer (or each learner's share)
    sync       the new weights to whoever samples
    state      gather, save and restore the trained state (checkpoints; the evaluator reads it)
    close      stop what the engines hold beyond this process

`LocalBackend` runs every engine in this process; `parity.distributed.driver.RayBackend` samples on Ray
rollout workers and trains on FSDP2 learners. `Run.create(cfg, backend=...)` takes either class.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from parity.config import ConfigError
from parity.engines.batch import RolloutBatch
from parity.engines.kernels import Numerics
from parity.engines.models.config import ModelConfig
from parity.engines.models.io import load_model
from parity.engines.sampler import ExactnessError, Sampler
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import Tokenizer
from parity.engines.trainer import Trainer
from parity.rl.checkpoint import RunState, non_finite_tensors, save_checkpoint
from parity.rl.data import DataOrder
from parity.rl.problems import Problem
from parity.rl.step import Prepared, UpdatePlan, UpdateResult, resolve_old, train_on_batch
from parity.rl.train_config import TrainConfig


class TrainingError(RuntimeError):
    """The run stopped because going on would train on garbage (non-finite loss or weights), or because
    exact mode found the engines computing different bits."""


@dataclass
class RunParts:
    """What a backend is built from: the run's config and the parts `Run` made and checked first."""

    cfg: TrainConfig
    run_dir: Path
    model_dir: Path
    tokenizer: Tokenizer
    numerics: Numerics
    trainer: Trainer  # the run's trained state as checkpoints hold it
    problems: list[Problem]
    data: DataOrder  # which problems each step takes
    sampling: SamplingParams

    def rollout_seed(self, step: int) -> int:
        """The seed of step `step`'s rollouts (0-based): each step samples with its own."""
        return self.cfg.seed * 1_000_003 + step

    def order_seed(self, step: int) -> int:
        """The seed of step `step`'s mini-batch order."""
        return self.cfg.seed * 7919 + step

    def encode(self, problem: Problem) -> list[int]:
        return self.tokenizer.encode_prompt(problem.prompt, self.cfg.task.chat_template)


def build_sampler(
    cfg: TrainConfig, model: ModelConfig, tokenizer: Tokenizer, numerics: Numerics, score_old: bool
) -> Sampler:
    """A run's sampler, in this process or on a rollout worker: the rollout engine in the rollout
    precision, and the trainer's code path for π_old (when `score_old`) and the probe."""
    return Sampler(
        model,
        cfg.rollout_precision,
        cfg.trainer_precision,
        tokenizer.eos_ids,
        tokenizer.pad_id,
        score_old=score_old,
        probe=cfg.algorithm.probe,
        micro_batch_tokens=cfg.trainer.micro_batch_tokens,
        routing_replay=cfg.moe.routing_replay,
        numerics=numerics,
    )


class Backend(Protocol):
    """The engines of a run, wherever they are. `step` is the 0-based index of the step under way."""

    trainer: Trainer  # holds the trained state after `gather`

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

    def gather(self) -> None:
        """Bring the newest trained state into `trainer` (before an evaluation)."""
        ...

    def save(self, run_dir: Path, state: RunState, keep: int) -> Path:
        """Write a checkpoint of the trained state and `state`; its folder."""
        ...

    def shard_reader(self) -> Callable[[Path], list[str]] | None:
        """Who reads a sharded checkpoint on resume (`rl.checkpoint.restore_latest`); None: `trainer`."""
        ...

    def restored(self, state: RunState) -> None:
        """`trainer` (or the learners) now hold a checkpoint's state: hand the weights on."""
        ...

    def close(self) -> None:
        """Release what the engines hold beyond this process."""
        ...


class LocalBackend:
    """Every engine in this process: the sampler (the rollout engine, and the trainer's code path on the
    weights that sampled), the trainer, and the frozen reference model of the KL loss."""

    def __init__(self, parts: RunParts):
        cfg = parts.cfg
        if cfg.distributed_mode:  # a config asking for workers or learners must not quietly train here
            d = cfg.distributed
            raise ConfigError(
                f"distributed.rollout_workers={d.rollout_workers}, distributed.learners={d.learners} ask for a "
                "distributed run, which the one-process backend cannot give; build it with "
                "parity.distributed.driver.backend_for(cfg) (as `parity train` does)"
            )
        self.parts, self.trainer = parts, parts.trainer
        self.reference = None
        if cfg.algorithm.kl_coef > 0:
            reference = load_model(parts.model_dir).to(cfg.device)
            reference.numerics = parts.numerics
            self.reference = Trainer(reference, cfg.trainer_precision, self.trainer.optim_config)
            self.reference.model.requires_grad_(False)
        score_old = cfg.algorithm.ratio_source == "shadow"
        self.sampler = build_sampler(cfg, self.trainer.model.config, parts.tokenizer, parts.numerics, score_old)
        self._push_weights(base=True)

    def _push_weights(self, base: bool) -> None:
        """The trainer's weights to the sampler. Unmerged LoRA sends the frozen base only when `base`
        (at the start), then the adapters alone; otherwise every sync sends every weight."""
        unmerged = self.parts.cfg.lora.rank > 0 and not self.parts.cfg.lora.merge
        if base or not unmerged:
            self.sampler.load_weights(*self.trainer.export_weights(merge=not unmerged))
        if unmerged and base:  # the frozen base once: the trainer takes the engine's (fused) copy
            self.trainer.share_frozen(self.sampler.engine.named_weights())
        if unmerged:
            self.sampler.load_adapters(*self.trainer.export_adapters())

    def rollouts(self, step: int, times: dict[str, float]) -> tuple[list[Problem], RolloutBatch]:
        parts, cfg = self.parts, self.parts.cfg
        problems = [parts.problems[i] for i in parts.data.take(cfg.prompts_per_step)]
        t = time.perf_counter()
        batch = self.sampler.generate(
            [parts.encode(p) for p in problems],
            cfg.rollout.group_size,
            parts.sampling,
            seed=parts.rollout_seed(step),
            full_vocab=cfg.diagnostics.full_vocab_positions,
        )
        times["rollout"] = time.perf_counter() - t
        t = time.perf_counter()
        self.sampler.score_samples(batch)
        times["score"] = time.perf_counter() - t
        if batch.full_vocab is not None:
            t = time.perf_counter()
            # The trainer still holds the weights that sampled: it updates after this.
            self.sampler.score_full_vocab(batch, None if self.sampler.scorer is not None else self.trainer.model)
            times["full_vocab"] = time.perf_counter() - t
        return problems, batch

    def old_logprobs(self, batch: RolloutBatch, plan: UpdatePlan) -> tuple[torch.Tensor | None, str]:
        return resolve_old(batch, plan, self.trainer)

    def update(self, step: int, batch: RolloutBatch, prepared: Prepared, plan: UpdatePlan) -> UpdateResult:
        trainers = [self.trainer] + ([self.reference] if self.reference is not None else [])
        flops_before = sum(tr.matmul_flops for tr in trainers)

        def check_exact(pi_old: torch.Tensor, rows: torch.Tensor, first_pass: torch.Tensor) -> None:
            """μ = π_old before the optimizer steps: a failing step moves, syncs and saves nothing."""
            try:
                self.sampler.verify_exact(batch, pi_old, rows, first_pass)
            except ExactnessError as e:
                raise TrainingError(f"step {step + 1}: {e}") from None

        update = train_on_batch(
            self.trainer,
            batch,
            prepared,
            plan,
            self.parts.order_seed(step),
            self.reference,
            before_first_step=check_exact if self.parts.cfg.exact else None,
        )
        update.flops = sum(tr.matmul_flops for tr in trainers) - flops_before
        # Only trained weights can turn non-finite: a LoRA run's frozen base is not scanned every step.
        trained = {n: p for n, p in self.trainer.model.named_parameters() if p.requires_grad}
        update.non_finite_weights = non_finite_tensors(trained)
        return update

    def sync(self, step: int, times: dict[str, float]) -> None:
        t = time.perf_counter()
        self._push_weights(base=False)
        times["sync"] = time.perf_counter() - t

    def step_metrics(self, times: dict[str, float]) -> dict[str, float]:
        return {}

    @property
    def data_position(self) -> int:
        return self.parts.data.position

    def gather(self) -> None:
        """The trainer here holds the newest state already."""

    def save(self, run_dir: Path, state: RunState, keep: int) -> Path:
        return save_checkpoint(run_dir, self.trainer, state, self.parts.model_dir, keep)

    def shard_reader(self) -> Callable[[Path], list[str]] | None:
        return None

    def restored(self, state: RunState) -> None:
        self._push_weights(base=False)

    def close(self) -> None:
        """Nothing runs beyond this process."""
