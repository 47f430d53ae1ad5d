"""`parity train`: the synchronous RL loop, its config, and its run directory.

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
import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from parity import config as config_mod
from parity.config import ConfigError, check_range
from parity.engines import kernels
from parity.engines import precision as prec
from parity.engines.batch import RolloutBatch
from parity.engines.locate import first_divergence, format_table, worst_row
from parity.engines.lora import TARGETS, AdapterError, LoRAConfig
from parity.engines.models import BUILTIN_DIR, load_model, resolve_model_dir
from parity.engines.sampler import Sampler
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import CHAT_TEMPLATE_MODES, load_tokenizer
from parity.engines.trainer import OptimConfig, Trainer
from parity.files import atomic_write_json, atomic_write_text
from parity.rl.algorithms import (
    ADVANTAGES,
    AGGREGATIONS,
    ESTIMATORS,
    KL_ESTIMATORS,
    TUNABLE,
    LossConfig,
)
from parity.rl.checkpoint import (
    RunState,
    checkpoints,
    non_finite_tensors,
    require_finite_weights,
    restore_latest,
    save_checkpoint,
)
from parity.rl.diagnostics import mismatch_alarm
from parity.rl.rewards import RewardHealth, RewardRunner, score_rollouts
from parity.rl.step import (
    BINARY_REWARDS,
    Prepared,
    UpdatePlan,
    UpdateResult,
    no_grad_logprobs,
    prepare,
    reject,
    step_metrics,
    train_on_batch,
)
from parity.rl.tasks import (
    DIFFICULTIES,
    REWARDS,
    TRUSTED_REWARDS,
    DataOrder,
    Problem,
    PromptLimit,
    builtin_problems,
    difficulty_has_no_effect,
    extract_boxed,
    import_reward_fn,
    load_problems,
)
from parity.rundir import RunLock, check_run_dir, clean_leftovers, foreign_entries
from parity.runtime import reuse_freed_memory

TRUNCATION_MODES = ("keep", "zero_reward", "drop")
# Keys `parity train --resume RUN key=value` may change: how long and how often, never what is trained.
RESUMABLE_KEYS = ("steps", "checkpoint_every", "keep_checkpoints", "tensorboard")
RATIO_SOURCES = ("recompute", "shadow", "rollout")

# ----------------------------------------------------------------------------- config


def _one_of(key: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: unknown value {value!r}; allowed: {', '.join(sorted(allowed))}")


@dataclass
class RolloutSection:
    precision: str | None = None  # overrides `precision` for the rollout engine
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 96
    group_size: int = 8


@dataclass
class TrainerSection:
    precision: str | None = None  # overrides `precision` for the trainer
    lr: float | None = None  # unset: 2e-4 on the built-in model; on any other 1e-6, or 1e-5 with LoRA
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0
    loss_scale_init: float = 65536.0
    loss_scale_growth_interval: int = 200
    micro_batch_size: int = 64  # sequences per forward/backward
    # Keep only each decoder layer's input through the forward and recompute the layer in the
    # backward: activation memory of one layer instead of all, for about one more forward.
    activation_checkpointing: bool = False


@dataclass
class AlgorithmSection:
    """Unset (null) keys take the estimator's reference value (docs/training.md, "Estimators")."""

    name: str = "pg_seq_is"
    advantage: str | None = None  # the estimator's: drgrpo (the paper's recipe), grpo for gspo
    aggregation: str | None = None  # the estimator's: seq_mean_token_sum_norm (÷ L_max), GSPO's per sequence
    clip_low: float | None = None  # ε_low of the estimator's clip; its own (0.2; gspo 3e-4; cispo 10: none)
    clip_high: float | None = None  # ε_high (0.2; gspo 4e-4)
    cap: float | None = None  # C; the estimator's (grpo_token_tis 2, grpo_seq_mis 10, ...)
    cap_low: float | None = None  # C_min; the estimator's (0, or 0.99 for grpo_seq_geo_rs)
    delta: float | None = None  # δ: the trust region / masking threshold of dppo_*, grpo_opsm, grpo_seq_max_k*
    tau_pos: float | None = None  # sapo's gate temperature for A > 0
    tau_neg: float | None = None  # ... and for A < 0
    token_veto: float = 0.0  # reject a sequence if a token's exp(π_old − μ) is below this (VeRL: 1e-4); 0 = off
    ppo_epochs: int = 1
    num_minibatches: int = 1
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # as a loss: k2 or k3 (k1 has zero expected gradient)
    # Responses without EOS: zero_reward (the paper's recipe) | keep | drop (from the loss).
    # Unset: zero_reward, or keep on task.name=length (where a zero reward would be the best one).
    truncated: str | None = None
    # What the PPO ratio π_θ/π_old is taken against. recompute: π_old from the learner on the
    # sampling weights; shadow: π_old scored by the sampler with the trainer's code path and
    # precision on the weights that sampled (the research's fix; what asynchronous training
    # needs); rollout: μ itself, as TRL's AsyncGRPO does (the mismatch enters the clip and
    # importance weights become 1), for ablation.
    ratio_source: str = "recompute"
    # The probe: the sampler also scores its samples in the rollout precision, splitting the
    # mismatch g = π_old − μ into β (precision) and κ (engine). Free when the precisions match.
    shadow_forward: bool = False


@dataclass
class TaskSection:
    name: str = "builtin"  # the reward: builtin | length | exact | math | number
    # builtin (generated problems: word problems for name=number, else arithmetic) or a JSONL/Parquet file
    data: str = "builtin"
    num_problems: int = 1024  # size of the generated builtin dataset
    difficulty: str = "standard"  # name=number's generated word problems: standard | easy
    reward_fn: str = ""  # module:function, called as fn(prompt, response, answer); overrides `name`
    chat_template: str = "auto"  # auto (the model's chat template, when it has one) | none (raw text)


@dataclass
class RewardSection:
    timeout_s: float = 5.0
    strict: bool = False  # a failing reward stops the run instead of scoring 0
    isolate: str = "auto"  # auto (user/math rewards in a worker process) | always | never
    warn_error_rate: float = 0.1  # warn when this share of a step's rewards failed or timed out
    max_failed_steps: int = 3  # stop after this many consecutive steps where every reward failed; 0 = never


@dataclass
class HealthSection:
    alarm_window: int = 20  # steps; the rule is in docs/training.md
    alarm_factor: float = 4.0
    on_alarm: str = "warn"  # warn | checkpoint (save, go on) | stop (save, end the run)
    # FP16: stop after this many consecutive steps whose every update the loss scaler skipped.
    # (FP32/BF16 have no scaler: a non-finite loss or gradient stops the run at once.)
    max_skipped_steps: int = 10


@dataclass
class DistributedSection:
    """Rollout workers (Ray actors) and learners (torch.distributed, FSDP2). Both at their
    defaults (0 workers, 1 learner): one process, no Ray."""

    rollout_workers: int = 0
    learners: int = 1
    address: str = ""  # "" starts a local Ray cluster for the run; "auto" or host:port joins one
    threads: int = 0  # torch threads per worker and learner process; 0 = cores / processes (at least 1)
    # How long a dead rollout worker may take to come back while Ray reports it restarting (a
    # busy machine is slow to start one); a worker Ray gives up on stops the run at once.
    restart_timeout_s: float = 900.0


@dataclass
class MoESection:
    # The trainer (π_old and π_θ) uses the experts the rollout engine chose for each token, so
    # the routing mismatch (moe/routing_mismatch) does not enter the log-probabilities.
    routing_replay: bool = False


@dataclass
class LoRASection:
    """Low-rank adapters on a frozen base (docs/training.md, "LoRA"). rank 0: full fine-tuning."""

    rank: int = 0
    alpha: float | None = None  # unset: 2 x rank (each adapter's update is scaled by alpha / rank)
    targets: list[str] = field(default_factory=lambda: list(TARGETS))  # the projections adapted
    # true: the rollout engine gets W + scale·B·A each sync; false: it keeps the base and applies the
    # adapters unmerged, as the trainer does (docs/real-models.md measures both)
    merge: bool = True


@dataclass
class AsyncSection:
    max_staleness: int = 0  # policy versions a sample may lag the learners; 0 = synchronous, on-policy


def default_lr(model: str, lora: bool) -> float:
    """`trainer.lr` when unset. The built-in 4M model learns its task at 2e-4; a pretrained model
    takes the RL fine-tuning norm (TRL's GRPO default, the research's scripts) of 1e-6, and ten times
    that with LoRA, whose low-rank updates need a larger step for the same change."""
    if model == "builtin" or Path(model).expanduser().resolve() == BUILTIN_DIR.resolve():
        return 2e-4
    return 1e-5 if lora else 1e-6


# Every numeric key and its range (floats are already finite: `config._coerce`).
NUMERIC_RANGES = (
    ("trainer.lr", lambda v: v > 0, "> 0"),
    ("trainer.weight_decay", lambda v: v >= 0, ">= 0"),
    ("trainer.beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("trainer.beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("trainer.eps", lambda v: v > 0, "> 0"),
    ("trainer.grad_clip", lambda v: v >= 0, ">= 0 (0 = off)"),
    ("trainer.loss_scale_init", lambda v: v >= 1, ">= 1 (the scaler's floor)"),
    ("trainer.loss_scale_growth_interval", lambda v: v >= 1, ">= 1"),
    ("trainer.micro_batch_size", lambda v: v >= 1, ">= 1"),
    ("reward.timeout_s", lambda v: v > 0, "> 0 seconds"),
    ("reward.warn_error_rate", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("reward.max_failed_steps", lambda v: v >= 0, ">= 0 (0 = never stop)"),
    ("health.alarm_window", lambda v: v >= 2, ">= 2"),
    ("health.alarm_factor", lambda v: v >= 0, ">= 0"),
    ("health.max_skipped_steps", lambda v: v >= 1, ">= 1"),
    ("steps", lambda v: v >= 1, ">= 1"),
    ("prompts_per_step", lambda v: v >= 1, ">= 1"),
    ("rollout.group_size", lambda v: v >= 1, ">= 1"),
    ("algorithm.ppo_epochs", lambda v: v >= 1, ">= 1"),
    ("algorithm.num_minibatches", lambda v: v >= 1, ">= 1"),
    ("algorithm.kl_coef", lambda v: v >= 0, ">= 0 (0 = no KL loss)"),
    ("keep_checkpoints", lambda v: v >= 1, ">= 1"),
    ("checkpoint_every", lambda v: v >= -1, ">= -1 (-1 = never)"),
    ("task.num_problems", lambda v: v >= 1, ">= 1"),
    ("distributed.rollout_workers", lambda v: v >= 0, ">= 0 (0 = sample in this process)"),
    ("distributed.learners", lambda v: v >= 1, ">= 1"),
    ("distributed.threads", lambda v: v >= 0, ">= 0 (0 = share the cores)"),
    ("distributed.restart_timeout_s", lambda v: v > 0, "> 0 seconds"),
    ("async.max_staleness", lambda v: v >= 0, ">= 0 (0 = synchronous)"),
    ("lora.rank", lambda v: v >= 0, ">= 0 (0 = off: full fine-tuning)"),
)


@dataclass
class TrainConfig:
    model: str = "builtin"
    precision: str = "fp16"  # both engines; rollout.precision / trainer.precision override one side
    device: str = "cpu"  # cpu | cuda: where both engines run (the batch and the RL arithmetic stay on the CPU)
    # Exact mode: the rollout engine and the trainer compute the same bits for every sampled token
    # (μ = π_old), checked every step (docs/exact.md).
    exact: bool = False
    allow_precision_mismatch: bool = False
    steps: int = 50
    prompts_per_step: int = 16
    seed: int = 0
    run_dir: str = ""  # default: runs/train-<time>
    checkpoint_every: int = 10  # steps; 0 = only at the end; -1 = never
    keep_checkpoints: int = 2
    tensorboard: bool = True  # when the tensorboard package is installed
    rollout: RolloutSection = field(default_factory=RolloutSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    task: TaskSection = field(default_factory=TaskSection)
    reward: RewardSection = field(default_factory=RewardSection)
    health: HealthSection = field(default_factory=HealthSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    async_: AsyncSection = field(default_factory=AsyncSection, metadata={"key": "async"})
    moe: MoESection = field(default_factory=MoESection)
    lora: LoRASection = field(default_factory=LoRASection)

    @property
    def distributed_mode(self) -> bool:
        """Rollout workers on Ray and learners under torch.distributed, instead of one process."""
        return self.distributed.rollout_workers > 0 or self.distributed.learners > 1

    def lora_config(self) -> LoRAConfig | None:
        """The resolved LoRA settings, None for full fine-tuning."""
        r = self.lora
        return LoRAConfig(r.rank, r.alpha, tuple(r.targets)) if r.rank else None

    def _check_lora(self) -> None:
        """Check the lora keys and fill the unset alpha (saved resolved in config.yaml)."""
        r = self.lora
        if r.alpha is not None and not r.alpha > 0:
            raise ConfigError(f"lora.alpha: must be > 0, got {r.alpha!r}")
        unknown = [t for t in r.targets if t not in TARGETS]
        if unknown or not r.targets or len(set(r.targets)) != len(r.targets):
            raise ConfigError(
                f"lora.targets: expected distinct names from {', '.join(TARGETS)} (a list or a comma-separated "
                f"string), got {','.join(r.targets) or 'none'}"
            )
        if not r.rank:
            if r.alpha is not None:
                raise ConfigError(f"lora.alpha={r.alpha:g} has no effect with lora.rank=0 (LoRA off); set lora.rank")
            if not r.merge:
                raise ConfigError("lora.merge=false has no effect with lora.rank=0 (LoRA off); set lora.rank")
            return
        r.alpha = 2.0 * r.rank if r.alpha is None else r.alpha
        if not r.merge and self.algorithm.shadow_forward:
            raise ConfigError(
                "lora.merge=false with algorithm.shadow_forward=true: the probe scores merged weights; "
                "set lora.merge=true or drop the probe"
            )
        if self.algorithm.ratio_source == "shadow":
            raise ConfigError(
                "algorithm.ratio_source=shadow with lora.rank > 0: the sampler scores π_old on the merged weights, "
                "not the trainer's code path (base and adapters apart), so the merge's rounding would enter the "
                "clip; use algorithm.ratio_source=recompute"
            )
        if self.distributed_mode:
            raise ConfigError(
                "lora.rank > 0 runs in one process only so far (distributed learners shard a full model); "
                "set distributed.rollout_workers=0 and distributed.learners=1"
            )

    def optim_config(self) -> OptimConfig:
        t = self.trainer
        return OptimConfig(
            lr=t.lr,
            weight_decay=t.weight_decay,
            beta1=t.beta1,
            beta2=t.beta2,
            eps=t.eps,
            grad_clip=t.grad_clip,
            loss_scale_init=t.loss_scale_init,
            loss_scale_growth_interval=t.loss_scale_growth_interval,
        )

    @property
    def rollout_precision(self) -> str:
        return self.rollout.precision or self.precision

    @property
    def trainer_precision(self) -> str:
        return self.trainer.precision or self.precision

    def _resolve_algorithm(self) -> None:
        """Fill unset algorithm keys from the estimator's reference values, then check them."""
        a = self.algorithm
        est = ESTIMATORS[a.name]
        for key in TUNABLE:
            if key in est.params:
                setattr(a, key, est.params[key] if getattr(a, key) is None else getattr(a, key))
            elif getattr(a, key) is not None:
                owners = ", ".join(n for n, e in ESTIMATORS.items() if key in e.params)
                raise ConfigError(f"algorithm.{key}: {a.name} does not use it (the estimators that do: {owners})")
        if "cap_low" in est.params and not 0 <= a.cap_low < a.cap:  # both finite: config._coerce refuses inf and NaN
            raise ConfigError(f"algorithm.cap_low={a.cap_low}, algorithm.cap={a.cap}: need 0 <= cap_low < cap")
        a.advantage = est.advantage if a.advantage is None else a.advantage
        a.aggregation = (est.aggregation or "seq_mean_token_sum_norm") if a.aggregation is None else a.aggregation
        if a.truncated is None:
            a.truncated = "keep" if self.task.name == "length" else "zero_reward"
        _one_of("algorithm.advantage", a.advantage, ADVANTAGES)
        _one_of("algorithm.aggregation", a.aggregation, AGGREGATIONS)
        _one_of("algorithm.truncated", a.truncated, TRUNCATION_MODES)
        if est.aggregation is not None and a.aggregation != est.aggregation:
            raise ConfigError(
                f"algorithm.aggregation={a.aggregation}: {a.name} is defined per sequence ({est.aggregation}); "
                "any other aggregation weighs each sequence by its length (VeRL forces it, TRL warns)"
            )
        if a.kl_estimator == "k1":
            raise ConfigError(
                "algorithm.kl_estimator=k1: as a loss term k1 has zero expected gradient (E[∇ log π] = 0), so it "
                "regularises nothing; use k2 or k3"
            )
        _one_of("algorithm.kl_estimator", a.kl_estimator, KL_ESTIMATORS)
        if self.task.name == "length" and a.truncated == "zero_reward":
            raise ConfigError("algorithm.truncated=zero_reward would reward the longest responses on task.name=length")
        for key in ("clip_low", "clip_high", "cap", "delta", "tau_pos", "tau_neg"):
            value = getattr(a, key)
            if value is not None and not value > 0:
                raise ConfigError(f"algorithm.{key}: must be > 0, got {value}")
        if not 0 <= a.token_veto < 1:
            raise ConfigError(f"algorithm.token_veto: must be in [0, 1) (0 = off; VeRL uses 1e-4), got {a.token_veto}")

    def loss_config(self) -> LossConfig:
        a = self.algorithm
        return LossConfig(
            token_veto=a.token_veto,
            **{key: getattr(a, key) for key in TUNABLE if getattr(a, key) is not None},
        )

    def _check_ranges(self) -> None:
        for key, ok, expected in NUMERIC_RANGES:
            value = config_mod.get_key(self, key)
            check_range(key, value, ok(value), expected)

    def validate(self) -> None:
        """Check every key and fill the unset algorithm keys (saved resolved in config.yaml)."""

        for key, value in (
            ("precision", self.precision),
            ("rollout.precision", self.rollout_precision),
            ("trainer.precision", self.trainer_precision),
        ):
            _one_of(key, value, prec.PRECISIONS)
        if self.rollout_precision != self.trainer_precision and not self.allow_precision_mismatch:
            raise ConfigError(
                f"rollout.precision={self.rollout_precision} and trainer.precision={self.trainer_precision} differ; "
                "a mismatched pair is an ablation: set allow_precision_mismatch=true to run it on purpose"
            )
        _one_of("algorithm.name", self.algorithm.name, ESTIMATORS)
        _one_of("task.name", self.task.name, REWARDS)
        _one_of("task.chat_template", self.task.chat_template, CHAT_TEMPLATE_MODES)
        _one_of("task.difficulty", self.task.difficulty, DIFFICULTIES)
        if difficulty_has_no_effect(self.task.difficulty, self.task.name, self.task.data):
            raise ConfigError(
                f"task.difficulty={self.task.difficulty}: only the generated word problems of task.name=number "
                "(task.data=builtin) have levels"
            )
        self._resolve_algorithm()
        if self.trainer.lr is None:
            self.trainer.lr = default_lr(self.model, self.lora.rank > 0)
        _one_of("reward.isolate", self.reward.isolate, ("auto", "always", "never"))
        _one_of("algorithm.ratio_source", self.algorithm.ratio_source, RATIO_SOURCES)
        a = self.algorithm
        if a.ratio_source == "rollout" and (ESTIMATORS[a.name].corrects_mismatch or a.token_veto > 0):
            rule = (
                f"algorithm.name={a.name}"
                if ESTIMATORS[a.name].corrects_mismatch
                else f"algorithm.token_veto={a.token_veto:g}"
            )
            raise ConfigError(
                f"{rule} corrects by π_old/μ, which algorithm.ratio_source=rollout makes 1 (π_old is μ there), "
                "so it would do nothing; use ratio_source=recompute or shadow"
            )
        _one_of("health.on_alarm", self.health.on_alarm, ("warn", "checkpoint", "stop"))
        self._check_ranges()
        if self.prompts_per_step % self.algorithm.num_minibatches:
            raise ConfigError(
                f"algorithm.num_minibatches={self.algorithm.num_minibatches} must divide "
                f"prompts_per_step={self.prompts_per_step} (mini-batches hold whole groups)"
            )
        if self.rollout.group_size < 2:
            raise ConfigError(
                f"rollout.group_size={self.rollout.group_size}: the group baseline of algorithm.advantage="
                f"{self.algorithm.advantage} needs rollout.group_size >= 2 (with one sample every advantage is 0)"
            )
        if self.task.reward_fn and self.task.reward_fn.count(":") != 1:
            raise ConfigError(f"task.reward_fn: expected 'module:function', got {self.task.reward_fn!r}")
        try:
            SamplingParams(
                self.rollout.temperature, self.rollout.top_k, self.rollout.top_p, self.rollout.max_new_tokens
            )
        except ValueError as e:
            raise ConfigError(str(e).replace("sampling.", "rollout.")) from None
        kernels.check_device(self.device)
        self._check_distributed()
        self._check_lora()
        self._check_exact()

    def _check_exact(self) -> None:
        if not self.exact:
            return
        if self.rollout_precision != self.trainer_precision:
            raise ConfigError(
                f"exact=true with rollout.precision={self.rollout_precision} and trainer.precision="
                f"{self.trainer_precision}: exact mode makes both engines compute the same bits in one precision"
            )
        if self.lora.rank:
            raise ConfigError(
                "exact=true with lora.rank > 0: the rollout engine runs the adapters merged into the weights and "
                "the trainer runs them beside the frozen base, which rounds differently; use one or the other"
            )
        if self.distributed_mode:
            raise ConfigError(
                "exact=true runs in one process only so far (distributed.rollout_workers=0, distributed.learners=1); "
                "docs/exact.md says what the distributed trainer needs to keep it"
            )

    def _check_distributed(self) -> None:
        """Combinations the distributed trainer cannot run, refused before any work."""
        d, staleness = self.distributed, self.async_.max_staleness
        if not self.distributed_mode:
            if staleness:
                raise ConfigError(
                    f"async.max_staleness={staleness}: asynchronous training needs rollout workers; "
                    "set distributed.rollout_workers >= 1"
                )
            return
        if self.device != "cpu":
            raise ConfigError(
                f"device={self.device}: distributed training runs on the CPU only so far (gloo learners; "
                "the NCCL placement in docs/scaling.md is not built)"
            )
        if d.rollout_workers < 1:
            raise ConfigError(
                f"distributed.learners={d.learners} needs distributed.rollout_workers >= 1: in distributed mode "
                "the samples come from rollout workers"
            )
        if self.algorithm.kl_coef > 0:
            raise ConfigError(
                "algorithm.kl_coef > 0 is not supported with distributed learners yet (they hold no reference "
                "model); run it in one process (distributed.rollout_workers=0, distributed.learners=1)"
            )
        rows = self.prompts_per_step * self.rollout.group_size // self.algorithm.num_minibatches
        if rows % d.learners:
            raise ConfigError(
                f"distributed.learners={d.learners} must divide the rows of a mini-batch (prompts_per_step x "
                f"rollout.group_size / algorithm.num_minibatches = {rows}): every learner takes an equal share"
            )
        if self.prompts_per_step < d.rollout_workers:
            raise ConfigError(
                f"distributed.rollout_workers={d.rollout_workers} is more than prompts_per_step="
                f"{self.prompts_per_step}: each worker samples whole prompt groups"
            )


# ----------------------------------------------------------------------------- logging


class MetricsLog:
    """`metrics.jsonl`, one object per step with "step"; TensorBoard too when available."""

    def __init__(self, run_dir: Path, tensorboard: bool):
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                pass

    def truncate_after(self, step: int) -> None:
        """Drop lines logged after `step` (a killed run's steps past its checkpoint)."""
        if not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError):
                continue  # a line cut short by the kill
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def log(self, metrics: dict[str, float]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                if key != "step":
                    self.writer.add_scalar(key, value, metrics["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# ----------------------------------------------------------------------------- the run


class TrainingError(RuntimeError):
    """The run stopped because going on would train on garbage (non-finite loss or weights)."""


def _flatten(obj: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in obj.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _saved_config(run_dir: Path) -> dict[str, Any] | None:
    """The config stored in the newest checkpoint whose state.json reads, flattened."""
    for path in reversed(checkpoints(run_dir)):
        try:
            saved = json.loads((path / "state.json").read_text()).get("config")
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(saved, dict):
            return _flatten(saved)
    return None


class Run:
    """A training run: engines, data, rewards and the step. Build with `Run.create`/`Run.resume`."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, progress: bool = True):
        reuse_freed_memory()
        self.cfg, self.run_dir, self.progress = cfg, run_dir, progress
        self.model_dir = resolve_model_dir(cfg.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        # The kernels every engine of this run computes with, decided once (numerics.json records them).
        self.numerics = kernels.numerics(cfg.device, cfg.exact)
        model = load_model(self.model_dir).to(cfg.device)
        require_finite_weights(model, self.model_dir, "nothing can be trained from them (`parity doctor` shows where)")
        model.activation_checkpointing = cfg.trainer.activation_checkpointing
        model.numerics = self.numerics
        if cfg.moe.routing_replay and not model.config.num_experts:
            raise ConfigError(
                f"moe.routing_replay=true: {cfg.model} is a dense {model.config.architecture} model with no experts"
            )
        optim = cfg.optim_config()
        try:
            self.trainer = Trainer(model, cfg.trainer_precision, optim, cfg.lora_config(), cfg.seed)
        except AdapterError as e:
            raise ConfigError(str(e)) from None
        self.reference = None
        if cfg.algorithm.kl_coef > 0:
            reference = load_model(self.model_dir).to(cfg.device)
            reference.numerics = self.numerics
            self.reference = Trainer(reference, cfg.trainer_precision, optim)
            self.reference.model.requires_grad_(False)
        positions, max_new = model.config.max_position_embeddings, cfg.rollout.max_new_tokens
        room = f"model max_position_embeddings {positions} minus rollout.max_new_tokens {max_new}"
        if cfg.task.data == "builtin":
            self.problems = builtin_problems(cfg.task.name, cfg.task.num_problems, cfg.seed, cfg.task.difficulty)
            limit = PromptLimit(self.tokenizer, positions - max_new, room, cfg.task.chat_template)
            for i, problem in enumerate(self.problems):
                limit.check(f"task.data=builtin: generated problem {i}", problem.prompt)
        else:
            self.problems = load_problems(
                cfg.task.data, self.tokenizer, positions - max_new, room, cfg.task.chat_template
            )
        self.data = DataOrder(len(self.problems), cfg.seed)
        if cfg.task.reward_fn:
            reward_fn, trusted = import_reward_fn(cfg.task.reward_fn), False
        else:
            reward_fn, trusted = REWARDS[cfg.task.name], cfg.task.name in TRUSTED_REWARDS
        isolate = {"auto": not trusted, "always": True, "never": False}[cfg.reward.isolate]
        self.rewards = RewardRunner(reward_fn, isolate, cfg.reward.timeout_s, cfg.reward.strict)
        self.reward_health = RewardHealth(cfg.reward.warn_error_rate, cfg.reward.max_failed_steps)
        self.sampling = SamplingParams(
            cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p, cfg.rollout.max_new_tokens
        )
        self.plan = self._update_plan()
        self.step_count = 0
        self.alarm_series: list[float] = []  # mismatch/k3 per step, for the collapse warning
        self.alarmed = False
        self.skipped_streak = 0  # consecutive steps whose every update the FP16 scaler skipped
        self.zero_variance_warned = False
        # task.name=math scores only \boxed{} answers: warn (once) if a whole step holds none.
        self.watch_boxed = cfg.task.name == "math" and not cfg.task.reward_fn
        self.lock: RunLock | None = None  # set by create/resume; released when train() ends
        self.log = MetricsLog(run_dir, cfg.tensorboard)
        with self._closed_on_failure():
            self._start_engines()

    def close(self) -> None:
        """Stop the engines (and a Ray cluster this run started), the reward runner and the log, and
        release the run directory."""
        self._stop_engines()
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

    # -- engines: in this process (here) or on Ray (`parity.distributed.driver.DistributedRun`) --

    def _start_engines(self) -> None:
        cfg = self.cfg
        self.sampler = Sampler(
            self.trainer.model.config,
            cfg.rollout_precision,
            cfg.trainer_precision,
            self.tokenizer.eos_ids,
            self.tokenizer.pad_id,
            score_old=cfg.algorithm.ratio_source == "shadow",
            probe=cfg.algorithm.shadow_forward,
            micro_batch_size=cfg.trainer.micro_batch_size,
            routing_replay=cfg.moe.routing_replay,
            numerics=self.numerics,
        )
        self._push_weights(base=True)

    def _push_weights(self, base: bool) -> None:
        """The trainer's weights to the sampler. Unmerged LoRA sends the frozen base only when `base`
        (at the start), then the adapters alone; otherwise every sync sends every weight."""
        unmerged = self.cfg.lora.rank > 0 and not self.cfg.lora.merge
        if base or not unmerged:
            self.sampler.load_weights(*self.trainer.export_weights(merge=not unmerged))
        if unmerged and base:  # the frozen base once: the trainer takes the engine's (fused) copy
            self.trainer.share_frozen(self.sampler.engine.named_weights())
        if unmerged:
            self.sampler.load_adapters(*self.trainer.export_adapters())

    def _weights_restored(self) -> None:
        """`self.trainer` now holds a checkpoint's state: hand the weights on."""
        self._push_weights(base=False)

    def _gather_state(self) -> None:
        """Bring the newest trainer state into `self.trainer` before a checkpoint (here it is)."""

    def _stop_engines(self) -> None:
        """Release what the engines hold beyond this process (nothing here)."""

    def record_numerics(self) -> None:
        """numerics.json: the device, processor and kernel path per precision this process runs
        (a resumed run on another machine records its own)."""
        atomic_write_json(self.run_dir / "numerics.json", self.numerics.describe())

    @property
    def data_position(self) -> int:
        """Where the data order stands after the steps already trained (what a checkpoint records)."""
        return self.data.position

    # -- construction ---------------------------------------------------------

    @classmethod
    def create(cls, cfg: TrainConfig, progress: bool = True) -> Run:
        run_dir = Path(cfg.run_dir or time.strftime("runs/train-%Y%m%d-%H%M%S"))
        check_run_dir(run_dir)
        created = not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir)  # before looking inside: two runs starting at once cannot both pass
        try:
            if (run_dir / "metrics.jsonl").exists() or checkpoints(run_dir) or (run_dir / "config.yaml").exists():
                raise ConfigError(
                    f"run_dir: {run_dir} already holds a run; continue it with `parity train --resume {run_dir}` "
                    "or choose another run_dir"
                )
            cfg.run_dir = str(run_dir)
            run = cls(cfg, run_dir, progress)  # model, data and reward are checked before anything is written
            with run._closed_on_failure():
                atomic_write_text(run_dir / "config.yaml", config_mod.dump_yaml(cfg))
                run.record_numerics()
        except BaseException:
            lock.release()
            if created and not (run_dir / "config.yaml").exists():
                shutil.rmtree(run_dir, ignore_errors=True)  # a refused run leaves nothing behind
            raise
        run.lock = lock
        return run

    @classmethod
    def resume(
        cls,
        run_dir: str | Path,
        overrides: list[str] | None = None,
        trust_reward_fn: bool = False,
        progress: bool = True,
    ) -> Run:
        """Continue the run in `run_dir` from its newest intact checkpoint, with exactly its
        saved config; `overrides` may set only RESUMABLE_KEYS."""
        run_dir = Path(run_dir)
        if not (run_dir / "config.yaml").is_file():
            if run_dir.is_dir() and (run_dir / ".lock").is_file() and not foreign_entries(run_dir):
                raise ConfigError(
                    f"--resume {run_dir}: the run there stopped before it started (no config.yaml yet); "
                    f"start it again with run_dir={run_dir}"
                )
            raise ConfigError(f"--resume {run_dir}: no config.yaml there; is this a run directory?")
        check_run_dir(run_dir)
        lock = RunLock(run_dir)
        try:
            run = cls._resume_locked(run_dir, overrides or [], trust_reward_fn, progress)
        except BaseException:
            lock.release()
            raise
        run.lock = lock
        return run

    @classmethod
    def _resume_locked(cls, run_dir: Path, overrides: list[str], trust_reward_fn: bool, progress: bool) -> Run:
        def note(line: str) -> None:
            print(f"resume: {line}", file=sys.stderr)

        for line in clean_leftovers(run_dir):
            note(line)
        for item in overrides:
            key = item.split("=", 1)[0].strip()
            if key not in RESUMABLE_KEYS:
                raise ConfigError(
                    f"--resume {run_dir}: {key} cannot change on resume (a resumed run trains exactly as it "
                    f"started); only {', '.join(RESUMABLE_KEYS)} can. Start a new run to change {key}"
                )
        cfg = config_mod.load(TrainConfig, run_dir / "config.yaml", overrides)
        cfg.run_dir = str(run_dir)
        if cfg.task.reward_fn and not trust_reward_fn:
            raise ConfigError(
                f"--resume {run_dir}: its config.yaml sets task.reward_fn={cfg.task.reward_fn}, which imports and "
                "runs that Python code in this process; resume only runs you trust, and confirm with "
                "--trust-reward-fn"
            )
        saved = _saved_config(run_dir)
        if saved is not None:
            current = _flatten(config_mod.to_dict(cfg))
            # A key this version added after the run was saved trains as before at its default.
            defaults = _flatten(config_mod.to_dict(TrainConfig()))
            saved = {k: saved.get(k, defaults.get(k)) for k in current}
            changed = [k for k in current if k != "run_dir" and saved[k] != current[k]]
            refused = [k for k in changed if k not in RESUMABLE_KEYS]
            if refused:
                diffs = "; ".join(f"{k}: {saved.get(k)!r} when saved, {current[k]!r} now" for k in refused[:4])
                raise ConfigError(
                    f"--resume {run_dir}: config.yaml differs from the config the run was trained with ({diffs}); "
                    f"a resumed run trains exactly as it started (only {', '.join(RESUMABLE_KEYS)} may change). "
                    "Undo the edit, or start a new run"
                )
            for k in changed:
                note(f"{k} {saved.get(k)!r} -> {current[k]!r}")
        if overrides:
            atomic_write_text(run_dir / "config.yaml", config_mod.dump_yaml(cfg))
        run = cls(cfg, run_dir, progress)
        with run._closed_on_failure():
            run.record_numerics()
            state = restore_latest(run_dir, run.trainer, note, base_dir=run.model_dir)
            if state is not None:
                run.step_count = state.step
                run.data.position = state.data_position
                run._weights_restored()
                note(f"continuing from step {state.step}")
            elif checkpoints(run_dir) or run.log.path.is_file():
                note("no usable checkpoint; starting again from step 0")
            run.log.truncate_after(run.step_count)
            for line in run.log.path.read_text().splitlines() if run.log.path.is_file() else []:
                logged = json.loads(line)
                run.alarm_series.append(logged["mismatch/k3"])
                run.alarmed = run.alarmed or bool(logged.get("health/mismatch_alarm"))
        return run

    # -- one step -------------------------------------------------------------

    def _update_plan(self) -> UpdatePlan:
        cfg, a = self.cfg, self.cfg.algorithm
        return UpdatePlan(
            estimator=a.name,
            loss=cfg.loss_config(),
            ratio_source=a.ratio_source,
            aggregation=a.aggregation,
            ppo_epochs=a.ppo_epochs,
            num_minibatches=a.num_minibatches,
            micro_batch_size=cfg.trainer.micro_batch_size,
            prompts=cfg.prompts_per_step,
            group_size=cfg.rollout.group_size,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            kl_coef=a.kl_coef,
            kl_estimator=a.kl_estimator,
            routing_replay=cfg.moe.routing_replay,
        )

    def _rollouts(self, times: dict[str, float]) -> tuple[list[Problem], RolloutBatch]:
        """This step's problems and their samples, scored by the sampler (π_old when it is the
        ratio's source, and the probe) on the weights that sampled."""
        cfg = self.cfg
        problems = [self.problems[i] for i in self.data.take(cfg.prompts_per_step)]
        t = time.perf_counter()
        batch = self.sampler.generate(
            [self.tokenizer.encode_prompt(p.prompt, cfg.task.chat_template) for p in problems],
            cfg.rollout.group_size,
            self.sampling,
            seed=self.rollout_seed(self.step_count),
        )
        times["rollout"] = time.perf_counter() - t
        t = time.perf_counter()
        self.sampler.score_samples(batch)
        times["score"] = time.perf_counter() - t
        return problems, batch

    def rollout_seed(self, step: int) -> int:
        return self.cfg.seed * 1_000_003 + step

    def _update(self, batch: RolloutBatch, prepared: Prepared) -> UpdateResult:
        """The optimizer updates of this step, on the in-process trainer."""
        plan = self.plan
        if prepared.learner_old_pass:
            prepared.old_logprobs = no_grad_logprobs(self.trainer, batch, plan)
            reject(prepared, batch, plan)
        trainers = [self.trainer] + ([self.reference] if self.reference is not None else [])
        flops_before = sum(tr.matmul_flops for tr in trainers)
        update = train_on_batch(
            self.trainer, batch, prepared, plan, self.cfg.seed * 7919 + self.step_count, self.reference
        )
        update.flops = sum(tr.matmul_flops for tr in trainers) - flops_before
        # Only trained weights can turn non-finite: a LoRA run's frozen base is not scanned every step.
        trained = {n: p for n, p in self.trainer.model.named_parameters() if p.requires_grad}
        update.non_finite_weights = non_finite_tensors(trained)
        self._check_finite(update)
        return update

    def _sync(self, times: dict[str, float]) -> dict[str, float]:
        """The new weights to the sampler; returns sync metrics (none in one process)."""
        t = time.perf_counter()
        self._push_weights(base=False)
        times["sync"] = time.perf_counter() - t
        return {}

    def step(self) -> dict[str, float]:
        cfg, a = self.cfg, self.cfg.algorithm
        times: dict[str, float] = {}
        t0 = time.perf_counter()
        problems, batch = self._rollouts(times)

        t = time.perf_counter()
        result = score_rollouts(batch, problems, self.tokenizer, self.rewards)
        warning = self.reward_health.observe(self.step_count + 1, result, len(result.rewards))
        if warning is not None:
            tqdm.write(f"WARNING {warning}", file=sys.stderr)
        if self.watch_boxed and not any(extract_boxed(r) is not None for r in result.responses):
            self.watch_boxed = False
            tqdm.write(
                f"WARNING step {self.step_count + 1}: task.name=math found no \\boxed{{...}} answer in any of the "
                f"step's {len(result.responses)} responses, so every reward is 0; for a model that does not box "
                "its answers use task.name=number (the last number in the response) or a task.reward_fn",
                file=sys.stderr,
            )
        prepared = prepare(batch, result, self.plan, a.advantage, a.truncated)
        times["reward"] = time.perf_counter() - t

        t = time.perf_counter()
        update = self._update(batch, prepared)
        times["train"] = time.perf_counter() - t
        sampling_pi = prepared.old_logprobs if prepared.old_logprobs is not None else update.first_pass
        if cfg.exact:
            self._verify_exact(batch, sampling_pi)
        extra = self._sync(times)
        self.step_count += 1
        times["step"] = time.perf_counter() - t0

        metrics: dict[str, float] = {"step": self.step_count}
        metrics.update(
            step_metrics(
                batch,
                prepared,
                update,
                result,
                sampling_pi,
                self.plan,
                binary_reward=cfg.task.name in BINARY_REWARDS and not cfg.task.reward_fn,
                same_precision=cfg.trainer_precision == cfg.rollout_precision,
            )
        )
        self.alarm_series.append(metrics["mismatch/k3"])
        metrics["health/mismatch_alarm"] = int(
            mismatch_alarm(self.alarm_series, cfg.health.alarm_window, cfg.health.alarm_factor)
        )
        metrics.update(extra)
        metrics.update({f"time/{k}": v for k, v in times.items()})
        metrics["perf/tokens_per_s"] = batch.num_tokens / times["step"]
        metrics["perf/train_gflops"] = update.flops / 1e9 / times["train"]
        return metrics

    def _verify_exact(self, batch: RolloutBatch, sampling_pi: torch.Tensor) -> None:
        """exact=true: stop at the first step where a token's μ and π_old differ, naming the stage of
        the forward pass where the two engines first part (re-scored on the row holding the worst
        token, before the sampler's weights move on)."""
        mask = batch.response_mask
        differs = (sampling_pi != batch.rollout_logprobs) & mask
        if not bool(differs.any()):
            return
        row = worst_row(sampling_pi, batch)
        largest = float(((sampling_pi - batch.rollout_logprobs) * mask).abs().max())
        diffs = self.sampler.locate(batch, row)
        first = first_divergence(diffs)
        where = (
            f"the engines first part at {first.stage} (position {first.first_position}, max |Δ| {first.max_abs:.3g})"
            if first is not None
            else "replayed alone, that row gives the same bits in both engines, so the difference depends on the "
            "batch it was computed in"
        )
        raise TrainingError(
            f"step {self.step_count + 1}: exact=true, but {int(differs.sum())} of {int(mask.sum())} sampled tokens "
            f"have μ != π_old (max |Δ| {largest:.3g}); re-scoring row {row}, {where}. "
            f"Stage by stage:\n{format_table(diffs)}"
        )

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

        def where() -> str:  # only on the way out: no directory listing on every step
            last = checkpoints(self.run_dir)
            return f"the newest checkpoint is {last[-1].name}" if last else "no checkpoint was written"

        if bad:
            raise TrainingError(
                f"step {step}: the weights hold inf/NaN after the optimizer step (trainer.lr="
                f"{self.cfg.trainer.lr:g}); the run stopped without saving them ({', '.join(bad[:3])}); {where()}"
            )
        if self.trainer.scaler.enabled:
            self.skipped_streak = self.skipped_streak + 1 if skipped_updates == updates else 0
            if self.skipped_streak >= self.cfg.health.max_skipped_steps:
                raise TrainingError(
                    f"step {step}: the FP16 loss scaler skipped every update of {self.skipped_streak} steps in a row "
                    f"(loss {loss:g}, loss scale {update.step_stats.loss_scale:g}; health.max_skipped_steps="
                    f"{self.cfg.health.max_skipped_steps}): the model overflows FP16; try precision=bf16; {where()}"
                )
        elif skipped_updates or not math.isfinite(loss):
            raise TrainingError(
                f"step {step}: non-finite loss ({loss:g}) or gradients in {self.trainer.precision}, which has no "
                f"loss scaler to skip them; {skipped_updates} of {updates} updates were not applied and the run "
                f"stopped; {where()}"
            )

    # -- the loop -------------------------------------------------------------

    def train(self, should_stop: Callable[[], bool] | None = None) -> list[dict[str, float]]:
        """Train up to `cfg.steps`; `should_stop` (asked after every step) ends the run early, with a
        checkpoint of the last step."""
        cfg = self.cfg
        if cfg.trainer_precision != cfg.rollout_precision:
            print(
                f"WARNING: mismatched precisions on purpose: trainer {cfg.trainer_precision}, "
                f"rollout {cfg.rollout_precision}",
                file=sys.stderr,
            )
        history = []
        bar = tqdm(total=cfg.steps, initial=self.step_count, desc="train", unit="step", disable=not self.progress)
        try:
            while self.step_count < cfg.steps:
                metrics = self.step()
                self.log.log(metrics)
                history.append(metrics)
                bar.update(1)
                headline = {
                    "reward": f"{metrics['reward/mean']:.3f}",
                    "len": f"{metrics['response/length_mean']:.1f}",
                    "k3": f"{metrics['mismatch/k3']:.1e}",
                }
                if "reward/accuracy" in metrics:
                    headline["acc"] = f"{metrics['reward/accuracy']:.2f}"
                bar.set_postfix(headline)
                if metrics["groups/zero_variance_frac"] == 1.0:
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
                stopping = should_stop is not None and should_stop()
                if every >= 0 and (
                    (every and self.step_count % every == 0) or self.step_count == cfg.steps or stopping
                ):
                    self.checkpoint()
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
        finally:
            bar.close()
            self.close()
        return history

    def checkpoint(self) -> Path:
        self._gather_state()
        state = RunState(self.step_count, self.data_position, self.trainer.weight_version, config_mod.to_dict(self.cfg))
        return save_checkpoint(self.run_dir, self.trainer, state, self.model_dir, self.cfg.keep_checkpoints)


def summary_line(history: list[dict[str, Any]]) -> str:
    if not history:
        return "no steps run"
    first, last = history[0], history[-1]
    key = "reward/accuracy" if "reward/accuracy" in last else "reward/mean"
    return (
        f"step {last['step']}: {key} {first[key]:.3f} -> {last[key]:.3f}, "
        f"response length {last['response/length_mean']:.1f}, mismatch k3 {last['mismatch/k3']:.2e}"
    )
