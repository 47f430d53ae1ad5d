"""RL estimators as pure tensor functions, each registered by name with its reference defaults.

Every policy loss takes a `PolicyInputs` (per-token log-probs of the sampled
tokens, [B, T], plus advantages and a response mask) and returns per-token
losses [B, T] and a dict of diagnostics; `aggregate` reduces them. There is no
engine or I/O in this module: a new estimator is one function and one
`@register` line, testable on hand-made tensors.

Notation (docs/design.md, "One step" and "Estimators"): π_θ = `logprobs` (with grad), π_old = `old_logprobs` (the
trainer's code path and precision on the weights that sampled), μ =
`rollout_logprobs` (the rollout engine at sampling time), A = advantage, C = `cap`,
C_min = `cap_low`. The PPO ratio is π_θ/π_old; importance weights correct π_old
against μ (the PG family, which has no π_old, weighs sg(π_θ) against μ). All
importance weights are detached. Each estimator names the reference code it
reproduces (repository, file) and the values that code runs with.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from parity.config import ConfigError, one_of

if TYPE_CHECKING:
    from parity.rl.tasks import Task

LOG_RATIO_CLAMP = 20.0  # every log-ratio is clamped before exp


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2  # ε_low of the estimator's clip (PPO, GSPO, CISPO)
    clip_high: float = 0.2  # ε_high
    cap: float = math.inf  # C: upper truncation / masking level of importance weights
    cap_low: float = 0.0  # C_min: lower level (two-sided bounds); the band of geometric rejection
    token_veto: float = 0.0  # reject a sequence if a token's exp(π_old − μ) is below this; 0 = off
    delta: float = 0.0  # δ: a trust region's radius or a masking threshold (the estimator's)
    tau_pos: float = 1.0  # SAPO's gate temperature for A > 0
    tau_neg: float = 1.05  # ... for A < 0


@dataclass
class PolicyInputs:
    logprobs: torch.Tensor  # π_θ [B, T], differentiable
    old_logprobs: torch.Tensor  # π_old [B, T], detached
    rollout_logprobs: torch.Tensor  # μ [B, T]
    advantages: torch.Tensor  # A [B]
    mask: torch.Tensor  # [B, T] bool


LossFn = Callable[[PolicyInputs, LossConfig], tuple[torch.Tensor, dict[str, torch.Tensor]]]
# (π_θ detached, reference log-probs [B, T], A [B], mask, cfg) -> [B, T] bool: the tokens whose update the
# estimator's clip or trust region changes when its ratio is taken against `reference`.
ClippedFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossConfig], torch.Tensor]
# (π_old, μ, mask, cfg) -> [B] bool: the sequences to take out of the loss before the first update.
RejectFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LossConfig], torch.Tensor]
# The LossConfig fields an estimator may own (its registry line gives their values): all but the rejection
# rule's veto, which any estimator takes. A new one is a LossConfig field and its AlgorithmConfig key.
TUNABLE = tuple(f.name for f in dataclasses.fields(LossConfig) if f.name != "token_veto")


@dataclass(frozen=True)
class Estimator:
    """A registered estimator: its loss, its rules, and the values its reference runs it with.

    The loss returns its diagnostics under their metric names (docs/metrics.md); names ending in
    `_max` are reduced over micro-batches by max, the others by mean."""

    loss: LossFn
    source: str  # the reference code: repository, file (and option)
    params: dict[str, float]  # the reference's values of the TUNABLE keys it reads; the others it refuses
    advantage: str  # default advantage estimator
    aggregation: str  # default aggregation: its reference's
    aggregation_fixed: bool  # it is defined with that aggregation only (any other is refused)
    clipped: ClippedFn | None  # its clip, against a reference (phantom clipping); None: it has none
    reject: RejectFn | None  # its sequence rejection from π_old/μ, applied before the update
    corrects_mismatch: bool  # it reads π_old/μ: meaningless when the ratio is taken against μ


ESTIMATORS: dict[str, Estimator] = {}


def register(
    name: str,
    *,
    source: str,
    params: dict[str, float] | None = None,
    advantage: str = "drgrpo",
    aggregation: str = "seq_mean_token_sum_norm",
    aggregation_fixed: bool = False,
    clipped: ClippedFn | None = None,
    reject: RejectFn | None = None,
    corrects_mismatch: bool = False,
) -> Callable[[LossFn], LossFn]:
    if set(params or {}) - set(TUNABLE):
        raise ValueError(f"{name}: params {sorted(set(params) - set(TUNABLE))} are not among {TUNABLE}")
    if name in ESTIMATORS:  # a second registration would silently replace the first's loss
        raise ValueError(f"estimator {name!r} is already registered ({ESTIMATORS[name].source})")

    def wrap(fn: LossFn) -> LossFn:
        ESTIMATORS[name] = Estimator(
            fn,
            source,
            dict(params or {}),
            advantage,
            aggregation,
            aggregation_fixed,
            clipped,
            reject,
            corrects_mismatch or bool(reject),
        )
        return fn

    return wrap


def clamped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(-1)


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _seq_sum(x, mask) / mask.sum(-1).clamp(min=1)


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over the tokens of `mask` (a diagnostic: detached in, 0-d tensor out)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


# ----------------------------------------------------------------------------- the PPO clip


def clip_ratio(kind: str, logprobs: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The ratio an estimator clips, per token [B, T], taken against `reference`.

    `token`: r_t = exp(π_θ,t − ref_t). `sequence` (GSPO): s = exp(mean_t(π_θ − ref)) applied
    per token as sg(s)·exp(π_θ,t − sg(π_θ,t)), which equals s and carries π_θ,t's gradient.
    """
    if kind == "token":
        return clamped_exp(logprobs - reference)
    if kind == "sequence":
        s = clamped_exp(_seq_mean(logprobs.detach() - reference, mask.to(logprobs.dtype)))[:, None]
        return s * torch.exp(logprobs - logprobs.detach())
    raise ValueError(f"unknown clip kind {kind!r}")


def clip_active(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """Tokens whose clipped branch is active (zero gradient): r > 1+ε_high with A > 0, or
    r < 1−ε_low with A < 0. `advantages` [B] broadcast over tokens."""
    a = advantages[:, None]
    return ((a > 0) & (ratio > 1 + clip_high)) | ((a < 0) & (ratio < 1 - clip_low))


def token_clipped(logprobs, reference, advantages, mask, cfg: LossConfig) -> torch.Tensor:
    """The PPO clip's active tokens on r_t = exp(π_θ,t − ref_t) (a `ClippedFn`)."""
    return clip_active(clip_ratio("token", logprobs, reference, mask), advantages, cfg.clip_low, cfg.clip_high)


def sequence_clipped(logprobs, reference, advantages, mask, cfg: LossConfig) -> torch.Tensor:
    """GSPO's clip's active tokens on its sequence ratio (a `ClippedFn`)."""
    return clip_active(clip_ratio("sequence", logprobs, reference, mask), advantages, cfg.clip_low, cfg.clip_high)


def _ppo_clip(
    ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """max(−A·r, −A·clip(r, 1−low, 1+high)) per token, with clip-activity fractions."""
    a = adv[:, None]
    loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - low, 1 + high))
    ratio = ratio.detach()
    active = clip_active(ratio, adv, low, high).to(ratio.dtype)
    stats = {
        "clip/frac": _token_mean(active, mask),
        "clip/frac_low": _token_mean(active * (ratio < 1 - low), mask),
        "clip/frac_high": _token_mean(active * (ratio > 1 + high), mask),
        "clip/ratio_mean": _token_mean(ratio, mask),
    }
    return loss, stats


def _grpo(inp: PolicyInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ratio = clip_ratio("token", inp.logprobs, inp.old_logprobs, inp.mask)
    return _ppo_clip(ratio, inp.advantages, cfg.clip_low, cfg.clip_high, inp.mask)


# ----------------------------------------------------------------------------- importance weights


def _token_weight(current: torch.Tensor, inp: PolicyInputs) -> torch.Tensor:
    """w_t = exp(current_t − μ_t), detached, [B, T]."""
    return clamped_exp(current.detach() - inp.rollout_logprobs)


def _seq_weight(current: torch.Tensor, inp: PolicyInputs) -> torch.Tensor:
    """ρ = exp Σ_t(current − μ) per sequence, detached, as [B, 1]."""
    return clamped_exp(_seq_sum(current.detach() - inp.rollout_logprobs, inp.mask))[:, None]


def _truncate(w: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """TIS: clamp to [C_min, C]."""
    return w.clamp(cfg.cap_low, cfg.cap)


def _kept(w: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """MIS: the weights inside [C_min, C]; the others are zeroed (they stay in the denominator)."""
    return (w >= cfg.cap_low) & (w <= cfg.cap)


def _weight_stats(weights: torch.Tensor, mask: torch.Tensor, kept: torch.Tensor | None = None) -> dict:
    weights = weights.expand(mask.shape)
    stats = {"is/weight_mean": _token_mean(weights, mask), "is/weight_max": (weights * mask).max()}
    if kept is not None:
        stats["is/masked_frac"] = _token_mean((~kept.expand(mask.shape)).to(weights.dtype), mask)
    return stats


# ----------------------------------------------------------------------------- sequence rejection
# A rejection rule reads π_old − μ, as the references do (VeRL rollout_corr_helper.py, SkyRL),
# so π_old must be known before the first update; the rejected rows of the loss mask are
# cleared, and which denominators still count them is `aggregate`'s rule.


def geometric_rejected(old_logprobs, rollout_logprobs, mask, cfg: LossConfig) -> torch.Tensor:
    """Sequences whose geometric-mean weight exp(mean_t(π_old − μ)) lies outside [C_min, C]."""
    geo = clamped_exp(_seq_mean((old_logprobs - rollout_logprobs).detach(), mask.to(old_logprobs.dtype)))
    return (geo < cfg.cap_low) | (geo > cfg.cap)


def max_divergence_rejected(estimator: str) -> RejectFn:
    """Trust-region masking: sequences whose largest per-token divergence between π_old and μ,
    k2 = (log ρ)²/2 or k3 = ρ − 1 − log ρ with log ρ = π_old − μ, exceeds δ."""

    def rejected(old_logprobs, rollout_logprobs, mask, cfg: LossConfig) -> torch.Tensor:
        log_rho = (old_logprobs - rollout_logprobs).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k = log_rho.square() / 2 if estimator == "k2" else torch.exp(log_rho) - 1 - log_rho
        return k.masked_fill(~mask.bool(), 0.0).amax(-1) > cfg.delta  # k ≥ 0: padding never decides

    return rejected


def vetoed(old_logprobs, rollout_logprobs, mask, cfg: LossConfig) -> torch.Tensor:
    """The token veto (`token_veto` > 0; VeRL's presets use 1e-4), for any estimator: sequences
    with a token whose exp(π_old,t − μ_t) is below it."""
    return (((old_logprobs - rollout_logprobs).detach() < math.log(cfg.token_veto)) & mask.bool()).any(-1)


def rejected_sequences(
    name: str, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> torch.Tensor | None:
    """Sequences [B] bool to remove from the loss before the update, or None when no rule is on:
    the estimator's own rejection and the token veto."""
    rules = [ESTIMATORS[name].reject] + [vetoed] * (cfg.token_veto > 0)
    found = [rule(old_logprobs, rollout_logprobs, mask, cfg) for rule in rules if rule is not None]
    return functools.reduce(torch.logical_or, found) if found else None


# ----------------------------------------------------------------------------- PPO family

OAT = "sail-sg/oat, oat/algorithms/ppo.py + sail-sg/Precision-RL sanity scripts"
VERL = "volcengine/verl, verl/trainer/ppo/core_algos.py"
VERL_ROLLOUT_CORR = "volcengine/verl, verl/trainer/ppo/rollout_corr_helper.py"
PPO_CLIP = {"clip_low": 0.2, "clip_high": 0.2}  # Oat's and the paper's ε, VeRL's and TRL's defaults


@register("grpo", clipped=token_clipped, params=PPO_CLIP, source=f"{OAT} (bf16_grpo.sh)")
def grpo(inp: PolicyInputs, cfg: LossConfig):
    """PPO clip on r = exp(π_θ − π_old)."""
    return _grpo(inp, cfg)


@register(
    "grpo_token_tis",
    clipped=token_clipped,
    params={**PPO_CLIP, "cap": 2.0, "cap_low": 0.0},
    corrects_mismatch=True,
    source=f"{OAT} (tis_c, bf16_grpo_tis.sh)",
)
def grpo_token_tis(inp: PolicyInputs, cfg: LossConfig):
    """grpo × clamp(exp(π_old − μ), C_min, C) per token (truncated IS)."""
    loss, stats = _grpo(inp, cfg)
    w = _truncate(_token_weight(inp.old_logprobs, inp), cfg)
    return loss * w, {**stats, **_weight_stats(w, inp.mask)}


@register(
    "grpo_token_mis",
    clipped=token_clipped,
    params={**PPO_CLIP, "cap": 3.0, "cap_low": 0.0},
    corrects_mismatch=True,
    source="huggingface/trl, trl/trainer/grpo_trainer.py (token_mask)",
)
def grpo_token_mis(inp: PolicyInputs, cfg: LossConfig):
    """grpo × w·1[C_min ≤ w ≤ C] per token, w = exp(π_old − μ) (masked IS)."""
    loss, stats = _grpo(inp, cfg)
    w = _token_weight(inp.old_logprobs, inp)
    kept = _kept(w, cfg)
    return loss * w * kept, {**stats, **_weight_stats(w * kept, inp.mask, kept)}


# IcePop (Ring-1T) is masked IS on the PPO clip, w·1[α ≤ w ≤ β] as slime's icepop_function and TRL's
# token_mask compute it: grpo_token_mis's loss with the IcePop band.
register(
    "grpo_token_icepop",
    clipped=token_clipped,
    params={**PPO_CLIP, "cap": 5.0, "cap_low": 0.5},
    corrects_mismatch=True,
    source="THUDM/slime, slime/backends/megatron_utils/loss.py (icepop_function); band [0.5, 5] of the IcePop "
    "write-up (Ring-1T), as in huggingface/trl tests/test_grpo_trainer.py (token_mask)",
)(grpo_token_mis)


@register(
    "grpo_seq_tis",
    clipped=token_clipped,
    params={**PPO_CLIP, "cap": 3.0, "cap_low": 0.0},
    corrects_mismatch=True,
    source="huggingface/trl, trl/trainer/grpo_trainer.py (sequence_truncate)",
)
def grpo_seq_tis(inp: PolicyInputs, cfg: LossConfig):
    """grpo × clamp(ρ, C_min, C), ρ = exp Σ_t(π_old − μ)."""
    loss, stats = _grpo(inp, cfg)
    rho = _truncate(_seq_weight(inp.old_logprobs, inp), cfg)
    return loss * rho, {**stats, **_weight_stats(rho, inp.mask)}


@register(
    "grpo_seq_mis",
    clipped=token_clipped,
    params={**PPO_CLIP, "cap": 10.0, "cap_low": 0.0},
    corrects_mismatch=True,
    source=f"{OAT} (ppo_use_seq_is, bf16_grpo_seq_mis.sh)",
)
def grpo_seq_mis(inp: PolicyInputs, cfg: LossConfig):
    """grpo × ρ·1[C_min ≤ ρ ≤ C], ρ = exp Σ_t(π_old − μ)."""
    loss, stats = _grpo(inp, cfg)
    rho = _seq_weight(inp.old_logprobs, inp)
    kept = _kept(rho, cfg)
    return loss * rho * kept, {**stats, **_weight_stats(rho * kept, inp.mask, kept)}


@register(
    "grpo_seq_geo_rs",
    clipped=token_clipped,
    params={**PPO_CLIP, "cap": 1.01, "cap_low": 0.99},
    reject=geometric_rejected,
    source="NovaSky-AI/SkyRL, off_policy_correction_utils.py (geo_mask); volcengine/verl, rollout_corr_helper.py",
)
def grpo_seq_geo_rs(inp: PolicyInputs, cfg: LossConfig):
    """grpo on the sequences whose geometric-mean weight exp(mean_t(π_old − μ)) lies in
    [C_min, C]; `geometric_rejected` removes the others from the loss before the update, so
    here it is the PPO clip alone."""
    return _grpo(inp, cfg)


for _k in ("k2", "k3"):
    # Trust-region masking (arXiv 2512.23075): grpo, the sequences outside the region rejected.
    register(
        f"grpo_seq_max_{_k}",
        clipped=token_clipped,
        params={**PPO_CLIP, "delta": 2.5},
        reject=max_divergence_rejected(_k),
        source=f"{VERL_ROLLOUT_CORR} (rollout_rs=seq_max_{_k}; δ 2.5 as its docs/algo/rollout_corr.md set it)",
    )(grpo)


@register(
    "grpo_opsm",
    clipped=token_clipped,
    params={**PPO_CLIP, "delta": 0.5},
    source="huggingface/trl, trl/trainer/grpo_trainer.py (get_off_policy_mask; δ 0.5 as grpo_config.py suggests)",
)
def grpo_opsm(inp: PolicyInputs, cfg: LossConfig):
    """grpo × 1[A ≥ 0 or mean_t(μ − sg(π_θ)) ≤ δ] (DeepSeek-V3.2's off-policy sequence masking):
    a sequence with a negative advantage that the policy has moved far from, counting the
    mismatch, leaves the loss and stays in the denominators. Read on every micro-batch, π_θ as it is."""
    loss, stats = _grpo(inp, cfg)
    m = inp.mask.to(loss.dtype)
    drift = _seq_mean(inp.rollout_logprobs - inp.logprobs.detach(), m)
    kept = (inp.advantages >= 0) | (drift <= cfg.delta)
    with_tokens = inp.mask.any(-1)
    stats["opsm/masked_seq_frac"] = (~kept & with_tokens).sum() / with_tokens.sum().clamp(min=1)
    return loss * kept[:, None].to(loss.dtype), stats


@register(
    "gspo",
    clipped=sequence_clipped,
    params={"clip_low": 3e-4, "clip_high": 4e-4},
    advantage="grpo",
    aggregation="seq_mean_token_mean",
    aggregation_fixed=True,
    source=f"{OAT} (use_gspo, bf16_gspo.sh); volcengine/verl, core_algos.py (gspo)",
)
def gspo(inp: PolicyInputs, cfg: LossConfig):
    """Sequence-level ratio s = exp(mean_t(π_θ − π_old)), applied per token as
    R_t = sg(s)·exp(π_θ,t − sg(π_θ,t)), clipped to [1 − 3e-4, 1 + 4e-4]. Defined with
    seq-mean-token-mean aggregation: any other weighs a sequence by its length."""
    ratio = clip_ratio("sequence", inp.logprobs, inp.old_logprobs, inp.mask)
    return _ppo_clip(ratio, inp.advantages, cfg.clip_low, cfg.clip_high, inp.mask)


def dppo_tv_outside(logprobs, reference, advantages, mask, cfg: LossConfig) -> torch.Tensor:
    """DPPO Binary-TV's masked tokens (a `ClippedFn`): the probability moved past δ on the harmful
    side, p_θ − p_ref > δ_high with A > 0 or < −δ_low otherwise (ε keys hold δ, as in VeRL)."""
    shift = torch.exp(logprobs) - torch.exp(reference)
    return torch.where(advantages[:, None] > 0, shift > cfg.clip_high, shift < -cfg.clip_low)


def dppo_kl_outside(logprobs, reference, advantages, mask, cfg: LossConfig) -> torch.Tensor:
    """DPPO Binary-KL's masked tokens (a `ClippedFn`): the KL between the Bernoulli distributions
    (p_ref, 1 − p_ref) and (p_θ, 1 − p_θ) of the sampled token past δ, moving on the harmful side."""
    p, p_ref = torch.exp(logprobs), torch.exp(reference)
    binary_kl = p_ref * (reference - logprobs) + (1 - p_ref) * torch.log((1.0 - p_ref + 1e-8) / (1.0 - p + 1e-8))
    up, down = (binary_kl > cfg.clip_high) & (p > p_ref), (binary_kl > cfg.clip_low) & (p < p_ref)
    return torch.where(advantages[:, None] > 0, up, down)


def _dppo(inp: PolicyInputs, cfg: LossConfig, *, outside: ClippedFn):
    """−A·sg(min(r, C))·π_θ on the tokens inside the trust region, r = exp(π_θ − π_old)."""
    ratio = clip_ratio("token", inp.logprobs, inp.old_logprobs, inp.mask).detach()
    masked = outside(inp.logprobs.detach(), inp.old_logprobs, inp.advantages, inp.mask, cfg)
    stats = {
        "clip/frac": _token_mean(masked.to(ratio.dtype), inp.mask),
        "clip/ratio_mean": _token_mean(ratio, inp.mask),
    }
    loss = -inp.advantages[:, None] * ratio.clamp(max=cfg.cap) * inp.logprobs
    return loss * (~masked).to(loss.dtype), stats


# VeRL's DPPO recipe (examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh): δ in the ε keys, 0.15 for
# TV and 0.05 for KL; clip_ratio_c 10000, so the truncation of r at C practically never acts; the GRPO
# advantage without the std normalisation (norm_adv_by_std_in_grpo=False: Dr.GRPO's) and
# seq-mean-token-sum-norm aggregation.
DPPO_SOURCE = f"{VERL} (compute_policy_loss_dppo_*); examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh"


for _name, _outside, _delta in (("dppo_tv", dppo_tv_outside, 0.15), ("dppo_kl", dppo_kl_outside, 0.05)):
    # DPPO (arXiv 2602.04879), Binary-TV and Binary-KL: −A·sg(min(r, C))·π_θ inside the trust region.
    register(
        _name,
        clipped=_outside,
        params={"clip_low": _delta, "clip_high": _delta, "cap": 10000.0},
        advantage="drgrpo",
        source=f"{DPPO_SOURCE} (LOSS_MODE={_name})",
    )(functools.partial(_dppo, outside=_outside))


def cispo_clipped(logprobs, reference, advantages, mask, cfg: LossConfig) -> torch.Tensor:
    """CISPO's truncated tokens: r = exp(π_θ − ref) outside [1−ε_low, 1+ε_high], whatever A's sign
    (their weight is clamped; unlike PPO's clip, their gradient still flows)."""
    ratio = clip_ratio("token", logprobs, reference, mask)
    return (ratio < 1 - cfg.clip_low) | (ratio > 1 + cfg.clip_high)


@register(
    "cispo",
    clipped=cispo_clipped,
    params={"clip_low": 10.0, "clip_high": 0.2},
    advantage="grpo",
    aggregation="token_mean",  # the recipe leaves loss_agg_mode at the actor's token-mean; MiniMax-M1's, TRL's
    source=f"{VERL} (compute_policy_loss_cispo); examples/cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh",
)
def cispo(inp: PolicyInputs, cfg: LossConfig):
    """−sg(clip(r, 1−ε_low, 1+ε_high))·A·π_θ, r = exp(π_θ − π_old) (CISPO, MiniMax-M1): the weight
    is clipped, the token's gradient is not. VeRL's recipe sets ε_low = 10, so only the upper bound
    acts (MiniMax-M1's and ScaleRL's one-sided form); ε_low < 1 gives the two-sided clip."""
    ratio = clip_ratio("token", inp.logprobs, inp.old_logprobs, inp.mask).detach()
    weight = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    stats = {
        "clip/frac": _token_mean((weight != ratio).to(ratio.dtype), inp.mask),
        "clip/ratio_mean": _token_mean(ratio, inp.mask),
    }
    return -weight * inp.advantages[:, None] * inp.logprobs, stats


@register(
    "sapo",
    params={"tau_pos": 1.0, "tau_neg": 1.05},
    advantage="grpo",
    aggregation="seq_mean_token_mean",
    aggregation_fixed=True,
    source=f"{VERL} (compute_policy_loss_sapo; actor tau_pos, tau_neg)",
)
def sapo(inp: PolicyInputs, cfg: LossConfig):
    """−f(r)·A, f(r) = σ(τ(r − 1))·4/τ, τ = τ_pos where A > 0 else τ_neg, r = exp(π_θ − π_old)
    (SAPO): a soft trust region, d f/d log π = 4σ(1−σ)·r, 1 at r = 1 and fading away from it.
    Seq-mean-token-mean only, as VeRL forces it."""
    ratio = clip_ratio("token", inp.logprobs, inp.old_logprobs, inp.mask)
    a = inp.advantages[:, None]
    tau = torch.full_like(a, cfg.tau_neg).masked_fill(a > 0, cfg.tau_pos)  # in the loss's own dtype
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    r = ratio.detach()
    sig = torch.sigmoid(tau * (r - 1))
    # The factor SAPO puts on a token's policy gradient (1 on-policy): its soft clip.
    stats = {
        "sapo/grad_weight_mean": _token_mean(4 * sig * (1 - sig) * r, inp.mask),
        "clip/ratio_mean": _token_mean(r, inp.mask),
    }
    return -gate * a, stats


# ----------------------------------------------------------------------------- policy gradient family


@register("pg_seq_is", source=f"{OAT} (use_seq_is, bf16_is_pg.sh)")
def pg_seq_is(inp: PolicyInputs, cfg: LossConfig):
    """−sg(ρ̃)·A·π_θ,t, ρ̃ = exp Σ_t(π_θ − μ)."""
    rho = _seq_weight(inp.logprobs, inp)
    return -rho * inp.advantages[:, None] * inp.logprobs, _weight_stats(rho, inp.mask)


@register(
    "pg_seq_tis",
    params={"cap": 3.0, "cap_low": 0.0},
    source=f"{OAT} (use_seq_is + seq_is_clip_max; the scripts named bf16_seq_mis.sh)",
)
def pg_seq_tis(inp: PolicyInputs, cfg: LossConfig):
    """−clamp(sg(ρ̃), C_min, C)·A·π_θ,t."""
    rho = _truncate(_seq_weight(inp.logprobs, inp), cfg)
    return -rho * inp.advantages[:, None] * inp.logprobs, _weight_stats(rho, inp.mask)


@register(
    "pg_seq_mis",
    params={"cap": 3.0, "cap_low": 0.0},
    source="huggingface/trl, trl/trainer/grpo_trainer.py (sequence_mask), on PG",
)
def pg_seq_mis(inp: PolicyInputs, cfg: LossConfig):
    """−sg(ρ̃)·1[C_min ≤ ρ̃ ≤ C]·A·π_θ,t."""
    rho = _seq_weight(inp.logprobs, inp)
    kept = _kept(rho, cfg)
    w = rho * kept
    return -w * inp.advantages[:, None] * inp.logprobs, _weight_stats(w, inp.mask, kept)


@register("pg_token_is", source=f"{OAT} (use_token_is, bf16_token_is_pg.sh)")
def pg_token_is(inp: PolicyInputs, cfg: LossConfig):
    """−sg(w̃_t)·A·π_θ,t, w̃_t = exp(π_θ,t − μ_t)."""
    w = _token_weight(inp.logprobs, inp)
    return -w * inp.advantages[:, None] * inp.logprobs, _weight_stats(w, inp.mask)


@register("reinforce", source="Williams (1992); no importance weight")
def reinforce(inp: PolicyInputs, cfg: LossConfig):
    """−A·π_θ,t."""
    return -inp.advantages[:, None] * inp.logprobs, {}


# ----------------------------------------------------------------------------- advantages

AdvantageFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rewards [B], group_index [B]) -> [B]
# (scores [B, K], weights [K], group_index [B]) -> [B]: an advantage read from each reward function's own scores
PerFunctionAdvantageFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ADVANTAGE_FNS: dict[str, AdvantageFn | PerFunctionAdvantageFn] = {}
PER_FUNCTION_ADVANTAGES: set[str] = set()  # the names whose function takes each reward function's scores
ADVANTAGE_EPS = 1e-6  # GRPO's guard against a group whose rewards are all equal
TRL_ADVANTAGE_EPS = 1e-4  # TRL's GRPOTrainer divides by (std + 1e-4)
SCALE_REWARDS = ("group", "batch", "none")  # TRL's `scale_rewards`
MULTI_OBJECTIVE = ("sum_then_normalize", "normalize_then_sum")  # TRL's `multi_objective_aggregation`


def register_advantage(name: str, per_function: bool = False) -> Callable:
    """Add an advantage estimator under `name` (the values of `algorithm.advantage`). A `per_function` one
    takes each reward function's scores and weights instead of their weighted sum."""
    if name in ADVANTAGE_FNS:
        raise ValueError(f"advantage estimator {name!r} is already registered")

    def wrap(fn):
        ADVANTAGE_FNS[name] = fn
        if per_function:
            PER_FUNCTION_ADVANTAGES.add(name)
        return fn

    return wrap


def _group_sums(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    return torch.zeros(int(group_index.max()) + 1, device=values.device, dtype=values.dtype).index_add(
        0, group_index, values
    )


def _centred(rewards: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each reward minus its group's mean, and each group's size."""
    count = _group_sums(torch.ones_like(rewards), group_index)
    return rewards - (_group_sums(rewards, group_index) / count)[group_index], count


@register_advantage("drgrpo")
def drgrpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: R − the group's mean."""
    return _centred(rewards, group_index)[0]


@register_advantage("grpo")
def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """GRPO: (R − the group's mean) / (the group's unbiased std + ε)."""
    centred, count = _centred(rewards, group_index)
    var = _group_sums(centred**2, group_index) / (count - 1).clamp(min=1)
    return centred / (var.sqrt()[group_index] + ADVANTAGE_EPS)


# ----------------------------------------------------------------------------- TRL's advantages
# huggingface/trl 1.16, trl/trainer/grpo_trainer.py (_generate_and_score_completions): a reward function
# may return None for a sample (NaN here); a sample's reward is the weighted sum over the functions that
# scored it, NaN where none did; such a sample is left out of every mean and std and its advantage is 0.
# Means and stds skip NaN; a std over fewer than two values is NaN, so its rows' advantages are 0 too.


def weighted_rewards(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_k weight_k · score_k over the functions that scored each sample [B]; NaN where none did."""
    summed = (scores * weights[None, :]).nansum(-1)
    return summed.masked_fill(scores.isnan().all(-1), math.nan)


def _nan_group_mean(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Each group's mean over its non-NaN values (NaN for a group with none), per row."""
    scored = ~values.isnan()
    total = _group_sums(values.nan_to_num(0.0), group_index)
    count = _group_sums(scored.to(values.dtype), group_index)
    return (total / count)[group_index]


def _nan_group_std(values: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Each group's unbiased std over its non-NaN values (NaN below two), per row."""
    scored = ~values.isnan()
    count = _group_sums(scored.to(values.dtype), group_index)
    squares = _group_sums((values - _nan_group_mean(values, group_index)).square().nan_to_num(0.0), group_index)
    return torch.where(count > 1, squares / (count - 1), math.nan).sqrt()[group_index]


def _nan_std(values: torch.Tensor) -> torch.Tensor:
    """The unbiased std of the non-NaN values of `values` (NaN below two)."""
    scored = values[~values.isnan()]
    return scored.std() if scored.numel() > 1 else values.new_tensor(math.nan)


def _trl_sum_then_normalize(rewards: torch.Tensor, group_index: torch.Tensor, scale: str) -> torch.Tensor:
    centred = rewards - _nan_group_mean(rewards, group_index)
    if scale == "group":
        centred = centred / (_nan_group_std(rewards, group_index) + TRL_ADVANTAGE_EPS)
    elif scale == "batch":
        centred = centred / (_nan_std(rewards) + TRL_ADVANTAGE_EPS)
    return centred.nan_to_num(0.0)


@register_advantage("trl_group")
def trl_group_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """TRL, scale_rewards=group: (R − the group's mean) / (the group's unbiased std + 1e-4)."""
    return _trl_sum_then_normalize(rewards, group_index, "group")


@register_advantage("trl_batch")
def trl_batch_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """TRL, scale_rewards=batch: (R − the group's mean) / (the batch's unbiased std + 1e-4)."""
    return _trl_sum_then_normalize(rewards, group_index, "batch")


@register_advantage("trl_none")
def trl_none_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """TRL, scale_rewards=none: R − the group's mean (Dr. GRPO's, with None rewards left out)."""
    return _trl_sum_then_normalize(rewards, group_index, "none")


@register_advantage("trl_normalize_then_sum", per_function=True)
def trl_normalize_then_sum_advantages(
    scores: torch.Tensor, weights: torch.Tensor, group_index: torch.Tensor
) -> torch.Tensor:
    """TRL, multi_objective_aggregation=normalize_then_sum (GDPO): each function's scores normalised in
    their group, (s − mean) / (std + 1e-4), summed with the weights, then normalised over the batch."""
    columns = [
        (s - _nan_group_mean(s, group_index)) / (_nan_group_std(s, group_index) + TRL_ADVANTAGE_EPS)
        for s in scores.unbind(-1)
    ]
    # A column whose group had under two scores is NaN there and left out of the sum; only a sample that
    # no function scored is NaN (its sum of nothing would otherwise be 0).
    summed = (torch.stack(columns, -1) * weights[None, :]).nansum(-1).masked_fill(scores.isnan().all(-1), math.nan)
    scored = summed[~summed.isnan()]
    mean = scored.mean() if scored.numel() else summed.new_tensor(math.nan)
    return ((summed - mean) / (_nan_std(summed) + TRL_ADVANTAGE_EPS)).nan_to_num(0.0)


ADVANTAGES = tuple(ADVANTAGE_FNS)


def trl_advantage(scale_rewards: str, multi_objective_aggregation: str) -> str:
    """The registered advantage that TRL's `scale_rewards` and `multi_objective_aggregation` name."""
    if multi_objective_aggregation == "normalize_then_sum":
        return "trl_normalize_then_sum"
    return f"trl_{scale_rewards}"


def group_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    kind: str,
    scores: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence advantages from a group baseline, by the registered estimator `kind`. `rewards` [B]:
    NaN for a sample no reward function scored; `scores` [B, K] and `weights` [K]: each function's scores
    (NaN: not scored) and weights, which a per-function estimator reads (None: `rewards` as one function).

    TRL's estimators (`trl_*`) treat a NaN as TRL does. The others were defined on scored samples only:
    they run on those, each group's baseline over its scored samples, and an unscored sample's advantage
    is 0; without NaN they are the estimator exactly."""
    if kind not in ADVANTAGE_FNS:
        raise ValueError(f"unknown advantage estimator {kind!r}; expected one of {', '.join(ADVANTAGE_FNS)}")
    fn = ADVANTAGE_FNS[kind]
    if kind in PER_FUNCTION_ADVANTAGES:
        if scores is None:
            scores, weights = rewards[:, None], rewards.new_ones(1)
        return fn(scores, weights.to(scores.dtype), group_index)
    if kind.startswith("trl_"):
        return fn(rewards, group_index)
    unscored = rewards.isnan()
    if not unscored.any():
        return fn(rewards, group_index)
    advantages = torch.zeros_like(rewards)
    if not unscored.all():
        advantages[~unscored] = fn(rewards[~unscored], group_index[~unscored])
    return advantages


KL_ESTIMATORS = ("k2", "k3")
AGGREGATIONS = ("seq_mean_token_sum_norm", "token_mean", "seq_mean_token_mean")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(π_θ‖π_ref) as a loss term, on tokens sampled from the policy; d = log π_ref − log π_θ.

    `k2`: d²/2; `k3`: e^d − d − 1 (VeRL's low_var_kl, Oat's k3). k1 (−d) is no loss: its
    expected gradient is E_π[∇ log π] = 0, so it regularises nothing. d is clamped to
    ±LOG_RATIO_CLAMP (VeRL: ±20); VeRL also clamps the k3 value to [−10, 10] (no gradient beyond
    10), which Parity does not: a token that far from π_ref keeps pulling back.
    """
    d = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k2":
        return d.square() / 2
    if estimator == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")


@dataclass(frozen=True)
class Denominators:
    """A mini-batch's normalisers, shared by its micro-batches so that accumulation is exact."""

    sequences: int  # every sequence of the mini-batch, rejected ones included
    tokens: int  # tokens left in the loss
    max_length: int  # the generation budget (Dr.GRPO's constant)


def denominators(loss_mask: torch.Tensor, max_length: int) -> Denominators:
    """The normalisers of the mini-batch whose loss mask (rejected rows already cleared) is `loss_mask`."""
    return Denominators(loss_mask.shape[0], int(loss_mask.sum()), max_length)


def aggregate(token_loss: torch.Tensor, mask: torch.Tensor, mode: str, d: Denominators) -> torch.Tensor:
    """Reduce per-token losses of a micro-batch to its share of the mini-batch loss.

    The normalisers are the mini-batch's, so summing micro-batch results gives the
    mini-batch loss (gradient accumulation is exact). A sequence a rejection rule removed
    has no token in `mask`; whether it still counts follows each mode's reference:
    - `token_mean`: Σ loss / tokens left (verl token-mean, Oat, TRL): it does not;
    - `seq_mean_token_mean`: Σ over the sequences with tokens left of each one's token mean, / every
      sequence (verl seq-mean-token-mean divides by the mini-batch's size, its global_batch_size;
      TRL's mean runs over every row): it does;
    - `seq_mean_token_sum_norm`: Σ loss / (max_length · every sequence) (Dr.GRPO: verl divides
      by the mini-batch's size, SkyRL averages over every row): it does.
    Where it does, the gradient of a kept token does not grow as others are rejected.
    """
    m = mask.to(token_loss.dtype)
    summed = token_loss * m
    if mode == "token_mean":
        return summed.sum() / max(d.tokens, 1)
    if mode == "seq_mean_token_mean":
        return (summed.sum(-1) / m.sum(-1).clamp(min=1)).sum() / max(d.sequences, 1)
    if mode == "seq_mean_token_sum_norm":
        return summed.sum() / (d.max_length * max(d.sequences, 1))
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {', '.join(AGGREGATIONS)}")


# ----------------------------------------------------------------------------- the config

TRUNCATION_MODES = ("keep", "zero_reward", "drop")  # what a response cut off at the length limit gets
RATIO_SOURCES = ("recompute", "shadow", "rollout")  # what the PPO ratio is taken against


@dataclass
class AlgorithmConfig:
    """`algorithm.*`: the estimator and its keys, the advantage, the aggregation, the update's epochs and
    mini-batches, the KL loss. Unset (null) keys take the estimator's reference value (`resolve`;
    docs/training.md, "Estimators")."""

    name: str = "pg_seq_is"
    advantage: str | None = None  # the estimator's: drgrpo (the paper's recipe), grpo for gspo, cispo, sapo
    # TRL's advantage, by TRL's names (either sets advantage=trl_*): group | batch | none (true/false: TRL's
    # legacy group/none), and sum_then_normalize | normalize_then_sum
    scale_rewards: bool | str | None = None
    multi_objective_aggregation: str | None = None
    aggregation: str | None = None  # the estimator's: seq_mean_token_sum_norm (÷ L_max), cispo token_mean, ...
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
    probe: bool = False

    def resolve(self, task: Task) -> None:
        """Fill unset keys from the estimator's reference values, then check them (`task`: the built-in
        task, `rl/tasks.py`, which sets what a cut-off response gets and which treatment it refuses)."""
        a = self
        est = ESTIMATORS[a.name]
        for key in TUNABLE:
            if key in est.params:
                setattr(a, key, est.params[key] if getattr(a, key) is None else getattr(a, key))
            elif getattr(a, key) is not None:
                owners = ", ".join(n for n, e in ESTIMATORS.items() if key in e.params)
                raise ConfigError(f"algorithm.{key}: {a.name} does not use it (the estimators that do: {owners})")
        if "cap_low" in est.params and not 0 <= a.cap_low < a.cap:  # both finite: config._coerce refuses inf and NaN
            raise ConfigError(f"algorithm.cap_low={a.cap_low}, algorithm.cap={a.cap}: need 0 <= cap_low < cap")
        self._resolve_trl_advantage()
        a.advantage = est.advantage if a.advantage is None else a.advantage
        a.aggregation = est.aggregation if a.aggregation is None else a.aggregation
        if a.truncated is None:
            a.truncated = task.truncated
        one_of("algorithm.advantage", a.advantage, ADVANTAGES)
        one_of("algorithm.aggregation", a.aggregation, AGGREGATIONS)
        one_of("algorithm.truncated", a.truncated, TRUNCATION_MODES)
        if est.aggregation_fixed and a.aggregation != est.aggregation:
            raise ConfigError(
                f"algorithm.aggregation={a.aggregation}: {a.name} is defined per sequence ({est.aggregation}); "
                "any other aggregation weighs each sequence by its length (VeRL forces it, TRL warns)"
            )
        if a.kl_estimator == "k1":
            raise ConfigError(
                "algorithm.kl_estimator=k1: as a loss term k1 has zero expected gradient (E[∇ log π] = 0), so it "
                "regularises nothing; use k2 or k3"
            )
        one_of("algorithm.kl_estimator", a.kl_estimator, KL_ESTIMATORS)
        if a.truncated in task.refused_truncation:
            raise ConfigError(f"algorithm.truncated={a.truncated} {task.refused_truncation[a.truncated]}")
        for key in (k for k in TUNABLE if k != "cap_low"):  # cap_low may be 0
            value = getattr(a, key)
            if value is not None and not value > 0:
                raise ConfigError(f"algorithm.{key}: must be > 0, got {value}")
        if not 0 <= a.token_veto < 1:
            raise ConfigError(f"algorithm.token_veto: must be in [0, 1) (0 = off; VeRL uses 1e-4), got {a.token_veto}")
        one_of("algorithm.ratio_source", a.ratio_source, RATIO_SOURCES)
        if a.ratio_source == "rollout" and (est.corrects_mismatch or a.token_veto > 0):
            rule = f"algorithm.name={a.name}" if est.corrects_mismatch else f"algorithm.token_veto={a.token_veto:g}"
            raise ConfigError(
                f"{rule} corrects by π_old/μ, which algorithm.ratio_source=rollout makes 1 (π_old is μ there), "
                "so it would do nothing; use ratio_source=recompute or shadow"
            )

    def _resolve_trl_advantage(self) -> None:
        """TRL's `scale_rewards` and `multi_objective_aggregation` name one of the `trl_*` advantages; set
        either, or `advantage=trl_*`, and the three agree in config.yaml."""
        a = self
        if a.scale_rewards is None and a.multi_objective_aggregation is None:
            if a.advantage is not None and a.advantage.startswith("trl_") and a.advantage in ADVANTAGE_FNS:
                split = a.advantage == "trl_normalize_then_sum"
                a.multi_objective_aggregation = MULTI_OBJECTIVE[split]
                a.scale_rewards = None if split else a.advantage.removeprefix("trl_")
            return
        if isinstance(a.scale_rewards, bool):  # TRL's legacy spelling
            a.scale_rewards = "group" if a.scale_rewards else "none"
        if a.multi_objective_aggregation is None:
            a.multi_objective_aggregation = "sum_then_normalize"
        one_of("algorithm.multi_objective_aggregation", a.multi_objective_aggregation, MULTI_OBJECTIVE)
        if a.multi_objective_aggregation == "normalize_then_sum":
            if a.scale_rewards is not None:
                raise ConfigError(
                    f"algorithm.scale_rewards={a.scale_rewards}: no effect with algorithm.multi_objective_aggregation="
                    "normalize_then_sum, which normalises each function in its group and the sum over the batch"
                )
        else:
            a.scale_rewards = "group" if a.scale_rewards is None else a.scale_rewards
            one_of("algorithm.scale_rewards", a.scale_rewards, SCALE_REWARDS)
        chosen = trl_advantage(a.scale_rewards, a.multi_objective_aggregation)
        if a.advantage is not None and a.advantage != chosen:
            raise ConfigError(
                f"algorithm.advantage={a.advantage}: algorithm.scale_rewards / multi_objective_aggregation (TRL's "
                f"keys) choose advantage {chosen}; set one or the other"
            )
        a.advantage = chosen

    def build(self) -> Algorithm:
        """The resolved keys (`resolve` first) as the step reads them, once: the estimator and its loss settings."""
        a = self
        loss = LossConfig(token_veto=a.token_veto, **{k: getattr(a, k) for k in TUNABLE if getattr(a, k) is not None})
        return Algorithm(
            a.name, ESTIMATORS[a.name], loss, a.aggregation, a.ppo_epochs, a.num_minibatches, a.ratio_source,
            a.kl_coef, a.kl_estimator,
        )  # fmt: skip


@dataclass(frozen=True)
class Algorithm:
    """An `AlgorithmConfig` resolved (`AlgorithmConfig.build`): what one step's updates compute with."""

    name: str
    estimator: Estimator
    loss: LossConfig  # the estimator's parameters, as its loss function takes them
    aggregation: str
    ppo_epochs: int
    num_minibatches: int
    ratio_source: str
    kl_coef: float
    kl_estimator: str

    @property
    def rejects(self) -> bool:
        """Whether π_old must be known before the first update (a rejection shapes the loss mask)."""
        return self.estimator.reject is not None or self.loss.token_veto > 0

    def rejected(self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor):
        """`rejected_sequences` under this algorithm's rules."""
        return rejected_sequences(self.name, old_logprobs, rollout_logprobs, mask, self.loss)
