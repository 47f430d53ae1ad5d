"""RL estimators as pure tensor functions, each registered by name.

Every policy loss takes a `PolicyInputs` (per-token log-probs of the sampled
tokens, [B, T], plus advantages and a response mask) and returns per-token
losses [B, T] and a dict of diagnostics; `aggregate` reduces them. There is no
engine or I/O in this module: a new estimator is one function and one
`@register` line, testable on hand-made tensors.

Notation (DESIGN.md): π_θ = `logprobs` (with grad), π_old = `old_logprobs` (the
trainer on the sampling weights), μ = `rollout_logprobs` (the rollout engine at
sampling time), A = advantage, C = `cap`. Importance weights are detached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LOG_RATIO_CLAMP = 20.0  # every log-ratio is clamped before exp


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2  # ε_low of the PPO clip
    clip_high: float = 0.2  # ε_high
    gspo_clip_low: float = 3e-4
    gspo_clip_high: float = 4e-4
    cap: float = 2.0  # C, the truncation / masking level of importance weights


@dataclass
class PolicyInputs:
    logprobs: torch.Tensor  # π_θ [B, T], differentiable
    old_logprobs: torch.Tensor  # π_old [B, T], detached
    rollout_logprobs: torch.Tensor  # μ [B, T]
    advantages: torch.Tensor  # A [B]
    mask: torch.Tensor  # [B, T] bool


LossFn = Callable[[PolicyInputs, LossConfig], tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: dict[str, LossFn] = {}
# Estimators whose ratio needs π_old (a forward on the sampling weights).
NEEDS_OLD_LOGPROBS: set[str] = set()
# Estimators that clip the token-level ratio exp(π_θ − π_old) (where phantom clipping is measured).
TOKEN_RATIO_CLIP: set[str] = set()


def register(name: str, needs_old: bool = False, token_clip: bool = False) -> Callable[[LossFn], LossFn]:
    def wrap(fn: LossFn) -> LossFn:
        POLICY_LOSSES[name] = fn
        if needs_old:
            NEEDS_OLD_LOGPROBS.add(name)
        if token_clip:
            TOKEN_RATIO_CLIP.add(name)
        return fn

    return wrap


def _exp(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(-1)


# ----------------------------------------------------------------------------- PPO family


def _ppo_clip(
    ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """max(−A·r, −A·clip(r, 1−low, 1+high)) per token, with clip-activity fractions."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - low, 1 + high)
    loss = torch.maximum(unclipped, clipped)
    m = mask.to(ratio.dtype)
    n = m.sum().clamp(min=1)
    # The clipped branch is active (zero gradient) where it is strictly larger.
    active = (clipped > unclipped).float() * m
    stats = {
        "clip_frac": active.sum() / n,
        "clip_frac_low": (active * (ratio < 1 - low).float()).sum() / n,
        "clip_frac_high": (active * (ratio > 1 + high).float()).sum() / n,
        "ratio_mean": (ratio.detach() * m).sum() / n,
    }
    return loss, stats


def _grpo(inp: PolicyInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ratio = _exp(inp.logprobs - inp.old_logprobs)
    return _ppo_clip(ratio, inp.advantages[:, None], cfg.clip_low, cfg.clip_high, inp.mask)


def _weight_stats(weights: torch.Tensor, mask: torch.Tensor, kept: torch.Tensor | None = None) -> dict:
    m = mask.to(weights.dtype)
    n = m.sum().clamp(min=1)
    stats = {"is_weight_mean": (weights * m).sum() / n, "is_weight_max": (weights * m).max()}
    if kept is not None:
        stats["is_masked_frac"] = ((~kept).to(m.dtype) * m).sum() / n
    return stats


@register("grpo", needs_old=True, token_clip=True)
def grpo(inp: PolicyInputs, cfg: LossConfig):
    """PPO clip on r = exp(π_θ − π_old)."""
    return _grpo(inp, cfg)


@register("grpo_token_tis", needs_old=True, token_clip=True)
def grpo_token_tis(inp: PolicyInputs, cfg: LossConfig):
    """grpo × min(exp(π_old − μ), C) per token (truncated IS)."""
    loss, stats = _grpo(inp, cfg)
    w = _exp(inp.old_logprobs - inp.rollout_logprobs).detach()
    truncated = w.clamp(max=cfg.cap)
    return loss * truncated, {**stats, **_weight_stats(truncated, inp.mask)}


@register("grpo_token_mis", needs_old=True, token_clip=True)
def grpo_token_mis(inp: PolicyInputs, cfg: LossConfig):
    """grpo × w·1[w ≤ C] per token, w = exp(π_old − μ) (masked IS)."""
    loss, stats = _grpo(inp, cfg)
    w = _exp(inp.old_logprobs - inp.rollout_logprobs).detach()
    kept = w <= cfg.cap
    return loss * w * kept, {**stats, **_weight_stats(w * kept, inp.mask, kept)}


def _seq_weight(inp: PolicyInputs, current: torch.Tensor) -> torch.Tensor:
    """ρ = exp Σ_t(current − μ) per sequence, detached, as [B, 1]."""
    return _exp(_seq_sum(current.detach() - inp.rollout_logprobs, inp.mask))[:, None]


@register("grpo_seq_tis", needs_old=True, token_clip=True)
def grpo_seq_tis(inp: PolicyInputs, cfg: LossConfig):
    """grpo × min(ρ, C), ρ = exp Σ_t(π_old − μ)."""
    loss, stats = _grpo(inp, cfg)
    rho = _seq_weight(inp, inp.old_logprobs).clamp(max=cfg.cap)
    return loss * rho, {**stats, **_weight_stats(rho.expand_as(loss), inp.mask)}


@register("grpo_seq_mis", needs_old=True, token_clip=True)
def grpo_seq_mis(inp: PolicyInputs, cfg: LossConfig):
    """grpo × ρ·1[ρ ≤ C], ρ = exp Σ_t(π_old − μ)."""
    loss, stats = _grpo(inp, cfg)
    rho = _seq_weight(inp, inp.old_logprobs)
    kept = rho <= cfg.cap
    w = (rho * kept).expand_as(loss)
    return loss * w, {**stats, **_weight_stats(w, inp.mask, kept.expand_as(loss))}


@register("gspo", needs_old=True)
def gspo(inp: PolicyInputs, cfg: LossConfig):
    """Sequence-level ratio s = exp(mean_t(π_θ − π_old)), applied per token as
    R_t = sg(s)·exp(π_θ,t − sg(π_θ,t)), clipped to [1 − 3e-4, 1 + 4e-4]."""
    m = inp.mask.to(inp.logprobs.dtype)
    n_tok = m.sum(-1).clamp(min=1)
    s = _exp(_seq_sum(inp.logprobs - inp.old_logprobs, m) / n_tok)[:, None]
    ratio = s.detach() * torch.exp(inp.logprobs - inp.logprobs.detach())
    return _ppo_clip(ratio, inp.advantages[:, None], cfg.gspo_clip_low, cfg.gspo_clip_high, inp.mask)


# ----------------------------------------------------------------------------- policy gradient family


@register("pg_seq_is")
def pg_seq_is(inp: PolicyInputs, cfg: LossConfig):
    """−sg(ρ̃)·A·π_θ,t, ρ̃ = exp Σ_t(π_θ − μ)."""
    rho = _seq_weight(inp, inp.logprobs)
    return -rho * inp.advantages[:, None] * inp.logprobs, _weight_stats(rho.expand_as(inp.logprobs), inp.mask)


@register("pg_seq_tis")
def pg_seq_tis(inp: PolicyInputs, cfg: LossConfig):
    """−min(sg(ρ̃), C)·A·π_θ,t."""
    rho = _seq_weight(inp, inp.logprobs).clamp(max=cfg.cap)
    return -rho * inp.advantages[:, None] * inp.logprobs, _weight_stats(rho.expand_as(inp.logprobs), inp.mask)


@register("pg_seq_mis")
def pg_seq_mis(inp: PolicyInputs, cfg: LossConfig):
    """−sg(ρ̃)·1[ρ̃ ≤ C]·A·π_θ,t."""
    rho = _seq_weight(inp, inp.logprobs)
    kept = rho <= cfg.cap
    w = (rho * kept).expand_as(inp.logprobs)
    return -w * inp.advantages[:, None] * inp.logprobs, _weight_stats(w, inp.mask, kept.expand_as(w))


@register("reinforce")
def reinforce(inp: PolicyInputs, cfg: LossConfig):
    """−A·π_θ,t."""
    return -inp.advantages[:, None] * inp.logprobs, {}


# ----------------------------------------------------------------------------- advantages, KL, aggregation


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, kind: str, eps: float = 1e-6) -> torch.Tensor:
    """Per-sequence advantages from a group baseline.

    `drgrpo`: R − mean of the group; `grpo`: (R − mean) / (std + eps), std unbiased.
    """
    groups = int(group_index.max()) + 1
    count = torch.zeros(groups).index_add_(0, group_index, torch.ones_like(rewards))
    mean = torch.zeros(groups).index_add_(0, group_index, rewards) / count
    centred = rewards - mean[group_index]
    if kind == "drgrpo":
        return centred
    if kind == "grpo":
        var = torch.zeros(groups).index_add_(0, group_index, centred**2) / (count - 1).clamp(min=1)
        return centred / (var.sqrt()[group_index] + eps)
    raise ValueError(f"unknown advantage estimator {kind!r}; expected one of {', '.join(ADVANTAGES)}")


ADVANTAGES = ("drgrpo", "grpo")
KL_ESTIMATORS = ("k1", "k3")
AGGREGATIONS = ("seq_mean_token_sum_norm", "token_mean", "seq_mean_token_mean")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(π_θ‖π_ref) estimate on tokens sampled from the policy."""
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")


def aggregate(
    token_loss: torch.Tensor, mask: torch.Tensor, mode: str, num_sequences: int, num_tokens: int, max_length: int
) -> torch.Tensor:
    """Reduce per-token losses of a micro-batch to its share of the mini-batch loss.

    The normalisers are the mini-batch's, so summing micro-batch results gives the
    mini-batch loss (gradient accumulation is exact).
    - `token_mean`: Σ loss / tokens in the mini-batch
    - `seq_mean_token_mean`: mean over sequences of each sequence's token mean
    - `seq_mean_token_sum_norm`: mean over sequences of Σ_t loss / max_length
    """
    m = mask.to(token_loss.dtype)
    summed = token_loss * m
    if mode == "token_mean":
        return summed.sum() / max(num_tokens, 1)
    if mode == "seq_mean_token_mean":
        return (summed.sum(-1) / m.sum(-1).clamp(min=1)).sum() / max(num_sequences, 1)
    if mode == "seq_mean_token_sum_norm":
        return summed.sum() / (max_length * max(num_sequences, 1))
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {', '.join(AGGREGATIONS)}")
