"""Held-out evaluation and the deployment gap (docs/design.md, "Evaluation and the deployment gap").

Training accuracy is measured on the samples being trained on. Here held-out prompts are answered by a
rollout engine, the policy that is served, and the same weights are served in each of a list of
precisions. The reference is the trainer's policy: an exact-mode engine in the trainer precision, which
samples with the trainer's arithmetic one token at a time (in an exact-mode run, the trainer's bits).
The deployment gap of a serving precision is its score minus the trainer policy's, beside the per-token
KL(μ_serving ‖ π_trainer) on its samples, π scored by the trainer's own code path.

A score is the accuracy for a binary reward (1 = correct) and the mean reward otherwise. Evaluation
draws its random numbers from a generator of its own, with one seed for every evaluation of a run
(checkpoints and precisions are compared on the same draws), so it changes nothing a run trains on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from parity.engines import kernels
from parity.engines import precision as prec
from parity.engines.batch import RolloutBatch
from parity.engines.models.config import ModelConfig
from parity.engines.models.modules import CausalLM
from parity.engines.rollout import RolloutEngine
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import Tokenizer
from parity.engines.trainer import logprobs_of_batch
from parity.rl.diagnostics import mismatch_metrics
from parity.rl.problems import Problem
from parity.rl.rewards import RewardRunner, score_rollouts
from parity.rl.tasks import TASKS
from parity.runtime import draws_bars, progress_line

TRAINER = "trainer"  # the label of the trainer's policy among the evaluated ones
HELDOUT_DRAWS = 8  # candidates drawn per held-out problem wanted, before duplicates and training prompts go


def heldout_problems(task_name: str, difficulty: str, n: int, seed: int, exclude: set[str]) -> list[Problem]:
    """Up to `n` distinct problems of the task's held-out split whose prompts are not in `exclude` (the
    problems trained on), `rl/tasks.py`'s `Task.heldout`. `task.name=number`: its word problems' held-out
    eighth, which training never draws; lookup: its held-out tables; any other: the arithmetic held-out eighth
    (which the built-in model was not pretrained on and RL trains on), drawn in a stream of its own with the
    training problems removed."""
    task = TASKS[task_name]
    if not task.heldout_by_prompt:
        return task.heldout(n, seed, difficulty)
    candidates = task.heldout(n * HELDOUT_DRAWS, seed, difficulty)
    out, seen = [], set(exclude)
    for problem in candidates:
        if problem.prompt not in seen:
            seen.add(problem.prompt)
            out.append(problem)
            if len(out) == n:
                break
    return out


def eval_sampling(temperature: float, max_new_tokens: int) -> SamplingParams:
    """Sampling at `temperature`; 0 is greedy (the most likely token, as top-k with k = 1)."""
    if temperature == 0:
        return SamplingParams(temperature=1.0, top_k=1, max_new_tokens=max_new_tokens)
    return SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)


@dataclass(frozen=True)
class EvalSet:
    """What an evaluation answers: the problems, their prompts as token ids, and how."""

    problems: list[Problem]
    prompts: list[list[int]]
    samples: int  # responses per prompt (pass@k's k)
    sampling: SamplingParams
    binary: bool  # the reward is 1 for a correct response and 0 otherwise


def prompt_scores(rewards: list[float], samples: int, binary: bool) -> torch.Tensor:
    """Each prompt's score [P] FP64: the fraction of its responses that are correct (binary reward), else
    their mean reward. Rows are grouped by prompt."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, samples)
    # A response no reward function scored (NaN: each returned None) is left out of its prompt's mean.
    return (r >= 1.0).double().mean(-1) if binary else r.nanmean(-1).nan_to_num(0.0)


def outcome_metrics(
    batch: RolloutBatch,
    rewards: list[float],
    samples: int,
    binary: bool,
    per_function: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """accuracy, pass@k (k = samples: some response of a prompt is correct) and mean length, for a
    binary reward; the mean reward (the functions' weighted total) always, and each reward function's own
    mean score (`reward/<name>/mean`, from `per_function`). Rows are grouped by prompt."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, samples)
    # the model's own tokens (an episode's fed ids are not its answer's length)
    scored = r[~r.isnan()]  # responses no reward function scored (each returned None) are left out
    reward_mean = float(scored.mean()) if scored.numel() else 0.0
    out = {"reward_mean": reward_mean, "mean_length": float(batch.sampled_mask.sum(-1).double().mean())}
    for name, scores in (per_function or {}).items():
        values = torch.tensor(scores, dtype=torch.float64)
        if not values.isnan().all():  # a function that returned None for every sample has no mean
            out[f"reward/{name}/mean"] = float(values.nanmean())
    if binary:
        correct = r >= 1.0
        out.update(accuracy=float(correct.double().mean()), **{"pass@k": float(correct.any(-1).double().mean())})
    return out


def gap_standard_error(scores: torch.Tensor, reference: torch.Tensor) -> float:
    """The standard error of mean(scores − reference) over prompts, paired by prompt (both answered the
    same prompts with the same random numbers); 0 with one prompt."""
    d = scores - reference
    return float(d.std() / len(d) ** 0.5) if len(d) > 1 else 0.0


class Evaluator:
    """Answers an `EvalSet` with the weights it is given, under each serving precision and the trainer's
    policy; `evaluate` returns `eval/...` and `deploy/...` metrics (docs/metrics.md).

    `served`: the precision and numerics a run's own rollout engine samples with (eval/accuracy etc.;
    None: no such policy). `precisions`: serving precisions for the deployment gap (eval/<p>/...,
    deploy/gap_<p>, deploy/kl_<p>); empty: the run's own policy only. Engines that would compute the same
    thing are built once."""

    def __init__(
        self,
        config: ModelConfig,
        tokenizer: Tokenizer,
        evalset: EvalSet,
        rewards: RewardRunner,
        served: tuple[str, kernels.Numerics] | None,
        precisions: list[str],
        trainer_precision: str,
        micro_batch_tokens: int,
        device: str | torch.device = "cpu",
        episodes=None,
        turn_tokens: int = 0,
    ):
        self.tokenizer, self.evalset, self.rewards = tokenizer, evalset, rewards
        # An episode run's (`rl/episodes.EpisodeSetup`): every policy answers with whole episodes, each turn
        # at most `turn_tokens`, within the episode's budget (eval.max_new_tokens may be below it).
        self.episodes, self.turn_tokens = episodes, min(turn_tokens, evalset.sampling.max_new_tokens)
        self.trainer_precision = trainer_precision
        self.micro_batch_tokens = micro_batch_tokens  # the trainer's, for the KL to its policy
        # label -> (precision, numerics): each served precision as an inference engine runs it, and the
        # trainer's policy: its precision with exact mode's arithmetic (the trainer's forms of every op).
        policies = {p: (p, kernels.numerics(device)) for p in precisions}
        if precisions:
            policies[TRAINER] = (trainer_precision, kernels.numerics(device, exact=True))
        # A run's own policy is one of those when it has the same precision and numerics.
        self.own = next((label for label, policy in policies.items() if policy == served), None)
        if self.own is None and served is not None:
            self.own, policies = "served", {"served": served, **policies}
        self.engines = {
            label: RolloutEngine(config, p, tokenizer.eos_ids, tokenizer.pad_id, numerics)
            for label, (p, numerics) in policies.items()
        }
        self.gaps = bool(precisions)
        self.precisions = list(precisions)

    @property
    def scores_with_trainer(self) -> bool:
        """Whether `evaluate` reads `trainer_model` (the deployment KLs: sampled answers, serving precisions)."""
        return self.gaps and self.evalset.sampling.top_k != 1

    def evaluate(
        self,
        weights: dict[str, torch.Tensor],
        version: int,
        seed: int,
        trainer_model: CausalLM | None = None,
        progress: bool = False,
    ) -> dict[str, float]:
        """Every policy answers the set with `weights` (FP32, Hugging Face names); `trainer_model`, holding
        the same weights, scores the served samples for deploy/kl_<p> (skipped when None or greedy)."""
        es = self.evalset
        outcomes: dict[str, dict[str, float]] = {}
        batches: dict[str, RolloutBatch] = {}
        scores: dict[str, torch.Tensor] = {}
        policies = tqdm(self.engines.items(), desc="eval", unit="policy", leave=False, disable=not draws_bars(progress))
        for i, (label, engine) in enumerate(policies, 1):
            answers = f"{len(es.prompts)} x {es.samples}"
            progress_line(progress, f"eval:   policy {i}/{len(self.engines)}, {label}: answering {answers}")
            engine.weights.load(weights, version)
            batch = self._answer(engine, seed)
            result = score_rollouts(batch, es.problems, self.tokenizer, self.rewards)
            outcomes[label] = outcome_metrics(batch, result.rewards, es.samples, es.binary, result.per_function)
            batches[label] = batch
            scores[label] = prompt_scores(result.rewards, es.samples, es.binary)
        metrics = {"eval/prompts": len(es.prompts)}
        if self.own is not None:
            metrics.update({f"eval/{k}": v for k, v in outcomes[self.own].items()})
        if not self.gaps:
            return metrics
        score = "accuracy" if es.binary else "reward_mean"
        for label in [*self.precisions, TRAINER]:
            metrics.update({f"eval/{label}/{k}": v for k, v in outcomes[label].items()})
        kl = trainer_model is not None and self.scores_with_trainer
        for p in self.precisions:
            metrics[f"deploy/gap_{p}"] = outcomes[p][score] - outcomes[TRAINER][score]
            metrics[f"deploy/gap_se_{p}"] = gap_standard_error(scores[p], scores[TRAINER])
            metrics[f"deploy/changed_{p}"] = changed_responses(batches[p], batches[TRAINER])
            if kl:
                metrics[f"deploy/kl_{p}"] = self._kl_to_trainer(batches[p], trainer_model)
        if kl:
            metrics["deploy/kl_trainer"] = self._kl_to_trainer(batches[TRAINER], trainer_model)
        return metrics

    def _answer(self, engine: RolloutEngine, seed: int) -> RolloutBatch:
        """The set answered by one policy: a response per sample, or in an episode run whole episodes (the
        same environments, made afresh, for every policy)."""
        es = self.evalset
        if self.episodes is None:
            return engine.generate(es.prompts, es.samples, es.sampling, seed)
        episodes, prompts = self.episodes.start(es.problems, es.samples)
        limits = [self.turn_tokens] * len(episodes.episodes)
        batch = engine.generate(prompts, es.samples, es.sampling, seed, limits=limits, between=episodes.between)
        episodes.finish(batch, count_drift=False)
        return batch

    def _kl_to_trainer(self, batch: RolloutBatch, model: CausalLM) -> float:
        """Per-token KL(μ ‖ π) on `batch`'s sampled tokens (k3), π from the trainer's code path and precision."""
        pi = logprobs_of_batch(model, batch, prec.to_dtype(self.trainer_precision), self.micro_batch_tokens)
        return mismatch_metrics(pi, batch.rollout_logprobs, batch.sampled_mask)["k3"]


def changed_responses(batch: RolloutBatch, other: RolloutBatch) -> float:
    """Fraction of rows whose response differs in any token: two policies answering with the same random
    numbers give the same response unless their distributions differ where it was drawn."""
    width = max(batch.response_ids.shape[1], other.response_ids.shape[1])

    def tokens(b: RolloutBatch) -> torch.Tensor:
        ids = b.response_ids.masked_fill(~b.response_mask, -1)
        return torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=-1)

    return float((tokens(batch) != tokens(other)).any(-1).double().mean())


def evaluation_due(step: int, total: int, every: int) -> bool:
    """`eval.every`: after every `every` steps and after the last; 0: the last only; -1: never."""
    if every < 0:
        return False
    return step == total or (every > 0 and step % every == 0)
