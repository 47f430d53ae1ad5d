"""One RL step: its pieces, shared by every backend, and the backend that runs them in this process.

    rollouts (μ, and π_old scored by the sampler) ─► `resolve_old`: π_old and its source ─►
    `prepare`: rewards, group advantages, loss mask, rejections ─► `train_on_batch`: epochs ×
    mini-batches of π_θ, estimator loss, backward, optimizer step (on one learner, or on each
    learner's rows of every mini-batch)
    ─► `step_metrics`: rewards, losses, the mismatch g = π_old − μ = β + κ, α, phantom clipping

`Run.step` (`rl/loop.py`) calls them in that order through its backend (the `Backend` protocol there):
`LocalBackend`, below, holds every engine in this process; `parity.distributed.driver.RayBackend`
samples on Ray rollout workers and trains on FSDP2 learners. `train_on_batch` is what a learner runs;
the rest runs where the rollouts arrive.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from parity.config import ConfigError
from parity.engines.batch import RolloutBatch
from parity.engines.kernels import Numerics
from parity.engines.lora import AdapterError
from parity.engines.models.config import ModelConfig
from parity.engines.models.io import load_model
from parity.engines.models.modules import CausalLM
from parity.engines.precision import to_dtype
from parity.engines.sampler import ExactnessError, Sampler
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import Tokenizer
from parity.engines.trainer import StepStats, Trainer, full_vocab_logprobs
from parity.rl.algorithms import (
    PER_FUNCTION_ADVANTAGES,
    Algorithm,
    PolicyInputs,
    aggregate,
    denominators,
    group_advantages,
    kl_penalty,
)
from parity.rl.checkpoint import RunState, load_checkpoint, non_finite_tensors, restore_latest, save_checkpoint
from parity.rl.data import DataOrder
from parity.rl.diagnostics import (
    full_vocab_metrics,
    gap_metrics,
    mismatch_by_length,
    mismatch_metrics,
    phantom_clip_frac,
)
from parity.rl.episodes import EpisodeSetup
from parity.rl.problems import Problem
from parity.rl.rewards import RewardResult, training_rewards
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
    model: CausalLM | None  # the base model, checked; None for a backend whose learners load their own
    problems: list[Problem]
    data: DataOrder  # which problems each step takes
    sampling: SamplingParams
    episodes: EpisodeSetup | None = None  # several model turns per sample (task.environment, task.tools)

    def rollout_seed(self, step: int) -> int:
        """The seed of step `step`'s rollouts (0-based): each step samples with its own."""
        return self.cfg.seed * 1_000_003 + step

    def order_seed(self, step: int) -> int:
        """The seed of step `step`'s mini-batch order."""
        return self.cfg.seed * 7919 + step

    def encode(self, problem: Problem) -> list[int]:
        return self.tokenizer.encode_prompt(problem.prompt, self.cfg.task.chat_template)


@dataclass(frozen=True)
class UpdatePlan:
    """What `train_on_batch` needs besides the batch: the algorithm, resolved, and the batch's shape."""

    algorithm: Algorithm  # `AlgorithmConfig.build`
    micro_batch_tokens: int
    prompts: int
    group_size: int
    max_new_tokens: int
    routing_replay: bool = False  # MoE: π_θ uses the experts the rollout engine chose
    lr: float | None = None  # this step's learning rate (`trainer.lr_schedule`); None: the optimizer's own


@dataclass(frozen=True)
class Prepared:
    """A scored batch, ready to train on; built once by `prepare`."""

    rewards: torch.Tensor  # [B] as the loss sees them (`training_rewards`: 0 for a cut-off response under zero_reward)
    advantages: torch.Tensor  # [B]
    loss_mask: torch.Tensor  # [B, T], rejected sequences cleared
    rejected: torch.Tensor | None  # [B] sequences a rejection rule took out of the loss
    old_logprobs: torch.Tensor | None  # π_old when known before the first update; None: the first π_θ pass
    old_source: str  # where π_old comes from (`resolve_old`)


@dataclass
class UpdateResult:
    """What one learner's updates on a batch produced; `merge` joins the learners'."""

    losses: list[float] = field(default_factory=list)  # per micro-batch, with the mini-batch's denominators
    kls: list[float] = field(default_factory=list)  # per micro-batch: the KL summed over its tokens
    kl_tokens: list[float] = field(default_factory=list)  # ... and those tokens' count
    stats: dict[str, list[float]] = field(default_factory=dict)  # estimator statistics per micro-batch
    grad_norms: list[float] = field(default_factory=list)  # per optimizer update
    skipped_updates: int = 0
    updates: int = 0
    step_stats: StepStats | None = None  # of the last update
    first_pass: torch.Tensor | None = None  # π_θ before any update [B, T] (π_old when it was free), this learner's rows
    flops: float = 0.0
    seconds: float = 0.0
    non_finite_weights: list[str] = field(default_factory=list)  # parameters holding inf/NaN after the updates

    @staticmethod
    def merge(parts: list[UpdateResult]) -> UpdateResult:
        """Join the learners' results: losses and statistics are per micro-batch, so they concatenate;
        the optimizer's figures (global grad norm, skips, scale) are the same on every learner."""
        out = UpdateResult(
            grad_norms=parts[0].grad_norms,
            skipped_updates=parts[0].skipped_updates,
            updates=parts[0].updates,
            step_stats=parts[0].step_stats,
            flops=sum(p.flops for p in parts),
            seconds=max(p.seconds for p in parts),
        )
        for p in parts:
            out.losses += p.losses
            out.non_finite_weights += p.non_finite_weights
            out.kls += p.kls
            out.kl_tokens += p.kl_tokens
            for k, v in p.stats.items():
                out.stats.setdefault(k, []).extend(v)
            if p.first_pass is not None:
                out.first_pass = p.first_pass if out.first_pass is None else out.first_pass + p.first_pass
        return out


def resolve_old(batch: RolloutBatch, plan: UpdatePlan, trainer: Trainer | None) -> tuple[torch.Tensor | None, str]:
    """π_old — the trainer's code path and precision on the weights that sampled — and its source;
    the one place it is decided:

    - `sampler`: scored by the sampler (ratio_source=shadow, or distributed workers);
    - `learner_pass`: a no-grad pass of `trainer` before the first update, when something needs it
      then (several updates per rollout, or a rejection that shapes the loss mask);
    - `first_pass`: the first π_θ pass itself, free (returned as None; `train_on_batch` records it).

    The loss takes μ in its place when the ratio is against the rollout (`train_on_batch`). `trainer`: None
    where the sampler scores every batch (distributed workers)."""
    if batch.old_logprobs is not None:
        return batch.old_logprobs, "sampler"
    if plan.algorithm.ppo_epochs * plan.algorithm.num_minibatches > 1 or plan.algorithm.rejects:
        return trainer.frozen_logprobs(batch, plan.micro_batch_tokens, plan.routing_replay), "learner_pass"
    return None, "first_pass"


def trained_rewards(
    batch: RolloutBatch, result: RewardResult, advantage: str, truncated: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rewards the loss sees (the scores with `algorithm.truncated` applied) and their group advantages
    (`algorithm.advantage`), one per row. An episode its environment broke is not the model's doing: it is
    unscored, as a sample no function scored."""
    device = batch.response_mask.device
    broken = torch.tensor(batch.episodes.broken() if batch.episodes is not None else [False], device=device)
    rewards = torch.tensor(result.rewards, device=device).masked_fill(broken, math.nan)
    rewards = training_rewards(rewards, batch.truncated, truncated)
    scores = weights = None
    if advantage in PER_FUNCTION_ADVANTAGES and result.per_function:  # each function's scores [B, K]
        scores = torch.tensor(list(result.per_function.values()), device=device).T
        scores = scores.masked_fill(broken[:, None], math.nan)
        scores = training_rewards(scores, batch.truncated[:, None], truncated)
        weights = torch.tensor([result.weights[name] for name in result.per_function], device=device)
    # A sample no reward function scored (each returned None) is NaN: `group_advantages` gives it 0.
    return rewards, group_advantages(rewards, batch.group_index, advantage, scores, weights)


def prepare(
    batch: RolloutBatch,
    trained: tuple[torch.Tensor, torch.Tensor],
    plan: UpdatePlan,
    truncated: str,
    old: tuple[torch.Tensor | None, str],
) -> Prepared:
    """The loss mask, with the estimator's rejection applied, beside the rewards and advantages
    `trained_rewards` gave (`trained`); `old` is `resolve_old`'s answer."""
    old_logprobs, old_source = old
    rewards, advantages = trained
    loss_mask = batch.sampled_mask.clone()
    if truncated == "drop":
        loss_mask[batch.truncated] = False
    rejected = None
    if plan.algorithm.rejects:  # then resolve_old gave π_old
        rejected = plan.algorithm.rejected(old_logprobs, batch.rollout_logprobs, loss_mask)
        loss_mask[rejected] = False
    return Prepared(rewards, advantages, loss_mask, rejected, old_logprobs, old_source)


def old_policy(prepared: Prepared, update: UpdateResult) -> torch.Tensor:
    """π_old of every row: known before the update, or the first π_θ pass of it."""
    return prepared.old_logprobs if prepared.old_logprobs is not None else update.first_pass


def train_on_batch(
    trainer: Trainer,
    batch: RolloutBatch,
    prepared: Prepared,
    plan: UpdatePlan,
    order_seed: int,
    reference: Trainer | None = None,
    rank: int = 0,
    world: int = 1,
    before_first_step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
    full_vocab: bool = False,
) -> UpdateResult:
    """Every optimizer update of one step: `ppo_epochs` passes over `num_minibatches`
    mini-batches of whole groups (shuffled per epoch after the first).

    With `world` learners, each takes its contiguous share (`rank`) of every mini-batch and
    the losses keep the whole mini-batch's denominators, so the learners' gradients sum to
    the single-learner gradient (the sharded optimizer sums them). `before_first_step` sees π_old of
    every row, and this learner's rows of the first mini-batch with their first π_θ pass, before the
    optimizer first steps (exact mode's check: a failure there moves no weight). `full_vocab` (one learner):
    fill the batch's full-vocabulary record on the weights that sampled, from the first update's passes
    where they hold every recorded row (and replay no experts), else by a pass of its own before it steps."""
    if plan.lr is not None:
        trainer.set_lr(plan.lr)
    algorithm = plan.algorithm
    estimator = algorithm.estimator
    mu, loss_mask, advantages = batch.rollout_logprobs, prepared.loss_mask, prepared.advantages
    out = UpdateResult()
    # π_old: known before the update, or filled in by its first pass (`resolve_old`).
    first_pass = torch.zeros_like(mu) if prepared.old_logprobs is None else None
    pi_old = prepared.old_logprobs if first_pass is None else first_pass
    ratio_base = mu if algorithm.ratio_source == "rollout" else pi_old  # what the loss's ratio is against
    pi_ref = None  # the reference policy's log-probabilities, for the KL penalty
    if reference is not None:
        pi_ref = reference.frozen_logprobs(batch, plan.micro_batch_tokens, plan.routing_replay)
    rows_per_mb = batch.response_ids.shape[0] // algorithm.num_minibatches
    order_gen = torch.Generator().manual_seed(order_seed)
    pending: list[tuple[list[float], torch.Tensor | float]] = []  # (where it goes, scalar) until the update ends
    first_update: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, π_θ) of the first update's passes
    record = batch.full_vocab if full_vocab else None
    record_in_passes = (
        record is not None and world == 1 and not plan.routing_replay and int(record.rows.max()) < rows_per_mb
    )
    for epoch in range(algorithm.ppo_epochs):
        # Mini-batches hold whole groups, shuffled per epoch.
        groups = torch.randperm(plan.prompts, generator=order_gen) if epoch else torch.arange(plan.prompts)
        row_order = (groups[:, None] * plan.group_size + torch.arange(plan.group_size)).flatten()
        for mb in row_order.split(rows_per_mb):
            norm = denominators(loss_mask[mb], plan.max_new_tokens)
            with trainer.model.casting_once():
                micro_batches = share_micro_batches(batch, mb, plan.micro_batch_tokens, rank, world)
                for rows in micro_batches:
                    record_here = record_in_passes and not out.updates
                    logp = trainer.batch_logprobs(batch, rows, plan.routing_replay, record_here)
                    if first_pass is not None and epoch == 0:
                        first_pass[rows] = logp.detach()
                    if before_first_step is not None and out.updates == 0:
                        first_update.append((rows, logp.detach()))
                    mask = loss_mask[rows]
                    inputs = PolicyInputs(
                        logprobs=logp,
                        old_logprobs=ratio_base[rows],
                        rollout_logprobs=mu[rows],
                        advantages=advantages[rows],
                        mask=mask,
                    )
                    token_loss, loss_stats = estimator.loss(inputs, algorithm.loss)
                    # α, the real policy change, and phantom clipping, on every ratio source.
                    n = mask.sum().clamp(min=1)
                    loss_stats["alpha/abs_mean"] = ((logp.detach() - pi_old[rows]).abs() * mask).sum() / n
                    if estimator.clipped is not None:
                        by_gap, by_policy = (
                            estimator.clipped(logp.detach(), against, advantages[rows], mask, algorithm.loss)
                            for against in (mu[rows], pi_old[rows])
                        )
                        loss_stats["phantom/clip_frac"] = phantom_clip_frac(by_gap, by_policy, mask)
                    if pi_ref is not None:
                        kl = kl_penalty(logp, pi_ref[rows], algorithm.kl_estimator)
                        pending += [(out.kls, (kl.detach() * mask).sum()), (out.kl_tokens, mask.sum())]
                        token_loss = token_loss + algorithm.kl_coef * kl
                    loss = aggregate(token_loss, mask, algorithm.aggregation, norm)
                    trainer.backward(loss)
                    pending.append((out.losses, loss.detach()))
                    pending += [(out.stats.setdefault(k, []), v) for k, v in loss_stats.items()]
            if before_first_step is not None and out.updates == 0:
                # π_old is known for every row now: given, or this first mini-batch's pass
                before_first_step(pi_old, *(torch.cat(parts) for parts in zip(*first_update)))
            if record is not None and not record_in_passes and not out.updates:
                record.trainer_logprobs = full_vocab_logprobs(trainer.model, batch, trainer.dtype)
            out.step_stats = trainer.step()
            # The micro-batches' figures reach the host once per update, after the step has waited for them.
            for (target, _), value in zip(pending, host_floats([v for _, v in pending], trainer.device)):
                target.append(value)
            pending.clear()
            out.updates += 1
            out.skipped_updates += out.step_stats.skipped
            out.grad_norms.append(out.step_stats.grad_norm)
    out.first_pass = first_pass
    return out


def share_micro_batches(
    batch: RolloutBatch, rows: torch.Tensor, tokens: int, rank: int, world: int
) -> list[torch.Tensor]:
    """Learner `rank`'s contiguous share of a mini-batch's `rows` as micro-batches of at most `tokens`
    (`RolloutBatch.micro_batches`), as many as the learner with the most: under FSDP2 every micro-batch's
    forward and backward are collectives all learners join, and one with fewer left the others waiting for
    ever. The shares hold equal numbers of rows, so the micro-batch of most rows can always be halved again."""
    packed = [batch.micro_batches(share, tokens) for share in rows.tensor_split(world)]
    mine, most = packed[rank], max(map(len, packed))
    while len(mine) < most:
        widest = max(range(len(mine)), key=lambda i: len(mine[i]))
        mine[widest : widest + 1] = mine[widest].tensor_split(2)
    return mine


def host_floats(values: list[torch.Tensor | float], device: torch.device) -> list[float]:
    """Scalars (0-d tensors or numbers) as floats, brought to the host in one transfer."""
    if not values:
        return []
    return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values]).tolist()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def step_metrics(
    batch: RolloutBatch,
    prepared: Prepared,
    update: UpdateResult,
    result: RewardResult,
    pi_old: torch.Tensor,
    plan: UpdatePlan,
    binary_reward: bool,
    same_precision: bool,
) -> dict[str, float]:
    """Everything logged about a step, from tensors the step already computed.

    `pi_old` is π_old, the trainer's code path on the sampling weights; `same_precision`:
    the trainer and the rollout engine share a precision (then β = 0 without a probe)."""
    rewards, advantages, mu = prepared.rewards, prepared.advantages, batch.rollout_logprobs
    # A sample no reward function scored (NaN) is left out of the reward's statistics.
    scored = ~rewards.isnan()
    kept = rewards[scored]
    # Rows are grouped contiguously, one group per prompt: a group's std over its scored rows.
    grouped = rewards.view(plan.prompts, plan.group_size)
    centred = (grouped - grouped.nanmean(-1, keepdim=True)).square().nan_to_num(0.0)
    group_var = centred.sum(-1) / scored.view(plan.prompts, plan.group_size).sum(-1).clamp(min=1)
    metrics: dict[str, float] = {
        "reward/mean": float(kept.mean()) if kept.numel() else 0.0,
        "reward/std": float(kept.std()) if kept.numel() > 1 else 0.0,
        "reward/unscored_frac": float((~scored).float().mean()),
        "reward/errors": result.errors,
        "reward/timeouts": result.timeouts,
        "response/length_mean": float(batch.sampled_mask.sum(-1).float().mean()),
        "response/length_max": int(batch.sampled_mask.sum(-1).max()),
        "response/truncated_frac": float(batch.truncated.float().mean()),
        "groups/zero_variance_frac": float((group_var == 0).float().mean()),
        "loss/policy": sum(update.losses),
        "grad/norm": _mean(update.grad_norms),
        "precision/loss_scale": update.step_stats.loss_scale,
        "precision/skipped_steps": update.step_stats.skipped_total,
        "train/samples": len(rewards),
        "train/updates": update.updates,
        "train/old_logprob_pass": int(prepared.old_source == "learner_pass"),
        "weights/version": update.step_stats.weight_version,
    }
    if batch.routing_mismatch is not None:
        metrics["moe/routing_mismatch"] = float(batch.routing_mismatch.mean())
        for layer, frac in enumerate(batch.routing_mismatch.tolist()):  # numbered among the MoE layers
            metrics[f"moe/routing_mismatch_layer{layer}"] = frac
    if prepared.rejected is not None:
        metrics["is/rejected_seq_frac"] = float(prepared.rejected.float().mean())
    if binary_reward:
        metrics["reward/accuracy"] = float((rewards >= 1.0).float().mean())
        # Right by the checker, 0 to the loss: cut off at the length limit under algorithm.truncated=zero_reward.
        checked = torch.tensor(result.rewards, device=rewards.device) >= 1.0
        metrics["reward/correct_cut_off_frac"] = float((checked & (rewards < 1.0)).float().mean())
    if update.kls:  # per token over the step, whichever learner scored which tokens
        metrics["loss/kl"] = sum(update.kls) / max(sum(update.kl_tokens), 1.0)
    for name, values in result.per_function.items():  # each reward function's own, unweighted scores
        # the samples it scored (None for the others), of those the loss scores (not an episode its environment
        # broke: `trained_rewards` left it unscored, as a sample no function scored)
        scores = torch.tensor(values, dtype=torch.float64)[scored.cpu()]
        scores = scores[~scores.isnan()]
        if scores.numel():
            metrics[f"reward/{name}/mean"] = float(scores.mean())
            metrics[f"reward/{name}/std"] = float(scores.std()) if scores.numel() > 1 else 0.0
    if plan.lr is not None:
        metrics["trainer/lr"] = plan.lr
    for k, v in update.stats.items():  # the estimator's diagnostics, under their own names
        metrics[k] = max(v) if k.endswith("_max") else _mean(v)
    if batch.full_vocab is not None and batch.full_vocab.trainer_logprobs is not None:
        full = full_vocab_metrics(batch.full_vocab.rollout_logprobs, batch.full_vocab.trainer_logprobs)
        metrics.update({f"full_vocab/{k}": v for k, v in full.items()})
    response_mask = batch.sampled_mask
    mm = mismatch_metrics(pi_old, mu, response_mask)
    metrics.update({f"mismatch/{k}": v for k, v in mm.items()})
    if batch.episodes is not None:
        metrics.update(batch.episodes.metrics(batch))
        turns = batch.turn_index()
        for turn in range(int(turns.max()) + 1):
            metrics[f"mismatch/k3_turn{turn}"] = mismatch_metrics(pi_old, mu, turns == turn)["k3"]
    metrics.update({f"mismatch/{k}": v for k, v in mismatch_by_length(pi_old, mu, response_mask).items()})
    # g = π_old − μ = β + κ. β is known without a probe when the precisions match (it is 0).
    probe = batch.probe_logprobs
    if probe is None and same_precision:
        probe = pi_old
    parts = {"gap": pi_old - mu}
    if probe is not None:
        parts.update(beta=pi_old - probe, kappa=probe - mu)
    for name, part in parts.items():
        metrics.update(gap_metrics(name, part, mu, advantages, response_mask))
    return metrics


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


class LocalBackend:
    """Every engine in this process: the sampler (the rollout engine, and the trainer's code path on the
    weights that sampled), the trainer, and the frozen reference model of the KL loss."""

    loads_own_model = False  # it trains `RunParts.model`

    def __init__(self, parts: RunParts):
        cfg = parts.cfg
        if cfg.distributed_mode:  # a config asking for workers or learners must not quietly train here
            d = cfg.distributed
            raise ConfigError(
                f"distributed.rollout_workers={d.rollout_workers}, distributed.learners={d.learners} ask for a "
                "distributed run, which the one-process backend cannot give; build it with "
                "parity.distributed.driver.backend_for(cfg) (as `parity train` does)"
            )
        self.parts = parts
        try:
            self.trainer = Trainer(parts.model, cfg.trainer_precision, cfg.trainer, cfg.lora_config(), cfg.seed)
        except AdapterError as e:
            raise ConfigError(str(e)) from None
        self.reference = None
        if cfg.algorithm.kl_coef > 0:
            reference = load_model(parts.model_dir, parts.numerics)
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
            self.trainer.share_frozen(self.sampler.engine.weights.named_weights())
        if unmerged:
            self.sampler.load_adapters(*self.trainer.export_adapters())

    def rollouts(self, step: int, times: dict[str, float]) -> tuple[list[Problem], RolloutBatch]:
        parts, cfg = self.parts, self.parts.cfg
        problems = [parts.problems[i] for i in parts.data.take(cfg.prompts_per_step)]
        t = time.perf_counter()
        if parts.episodes is None:
            episodes, prompts = None, [parts.encode(p) for p in problems]
        else:
            episodes, prompts = parts.episodes.start(problems, cfg.rollout.group_size)
        batch = self.sampler.generate(
            prompts,
            cfg.rollout.group_size,
            parts.sampling,
            seed=parts.rollout_seed(step),
            full_vocab=cfg.diagnostics.full_vocab_positions,
            limits=None if episodes is None else [cfg.turn_tokens] * len(problems) * cfg.rollout.group_size,
            between=None if episodes is None else episodes.between,
        )
        times["rollout"] = time.perf_counter() - t
        if episodes is not None:
            episodes.finish(batch, cfg.episode.retokenization)
            if cfg.episode.retokenization_logprob:  # the trainer still holds the weights that sampled
                model = self.sampler.scorer or self.trainer.model
                episodes.drift_logprobs(batch, model, to_dtype(cfg.trainer_precision))
            times.update(batch.episodes.times())
        t = time.perf_counter()
        self.sampler.fill_old_logprobs(batch)
        times["score"] = time.perf_counter() - t
        if batch.full_vocab is not None and self.sampler.scorer is not None:
            t = time.perf_counter()
            self.sampler.fill_full_vocab(batch)
            times["full_vocab"] = time.perf_counter() - t
        # Otherwise the trainer, which holds the weights that sampled until it updates, fills the record in
        # its update (`train_on_batch(full_vocab=True)`).
        return problems, batch

    def old_logprobs(self, batch: RolloutBatch, plan: UpdatePlan) -> tuple[torch.Tensor | None, str]:
        return resolve_old(batch, plan, self.trainer)

    def update(self, step: int, batch: RolloutBatch, prepared: Prepared, plan: UpdatePlan) -> UpdateResult:
        trainers = [self.trainer] + ([self.reference] if self.reference is not None else [])
        flops_before = sum(tr.matmul_flops for tr in trainers)

        def verify(pi_old: torch.Tensor, rows: torch.Tensor, first_pass: torch.Tensor) -> None:
            """What the numerics promise (exact mode: μ = π_old), before the optimizer steps: a failing step
            moves, syncs and saves nothing."""
            try:
                self.sampler.verify(batch, pi_old, rows, first_pass)
            except ExactnessError as e:
                raise TrainingError(f"step {step + 1}: {e}") from None

        update = train_on_batch(
            self.trainer,
            batch,
            prepared,
            plan,
            self.parts.order_seed(step),
            self.reference,
            before_first_step=verify,
            full_vocab=self.sampler.scorer is None,
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

    def evaluation_policy(self, with_model: bool) -> tuple[dict[str, torch.Tensor], int, CausalLM | None]:
        weights, version = self.trainer.export_weights(merge=True)
        return weights, version, self.trainer.model if with_model else None

    def save(self, run_dir: Path, state: RunState, keep: int) -> Path:
        return save_checkpoint(run_dir, self.trainer, state, self.parts.model_dir, keep)

    def restore(self, log: Callable[[str], None]) -> RunState | None:
        load = functools.partial(load_checkpoint, trainer=self.trainer, base_dir=self.parts.model_dir)
        state = restore_latest(self.parts.run_dir, load, log)
        if state is not None:
            self._push_weights(base=False)
        return state

    def close(self) -> None:
        """Nothing runs beyond this process."""
