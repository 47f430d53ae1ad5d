"""Training-inference mismatch metrics (docs/design.md, "Mismatch metrics").

All functions are pure: they take per-token log-probs of the sampled tokens,
`trainer_logprobs` (π, the trainer on the sampling weights) and `rollout_logprobs`
(μ, the rollout engine at sampling time), and a boolean response mask [B, T].
With Δ = π − μ over response tokens:

    k1                 mean(−Δ)                 KL(μ‖π) estimate (unbiased, noisy)
    k2                 mean(Δ²/2)
    k3                 mean(e^Δ − Δ − 1)         KL(μ‖π) estimate (unbiased, ≥ 0)
    chi2_token         mean(e^{2Δ}) − 1
    chi2_seq           mean_i(e^{2 Σ_t Δ}) − 1
    seq_abs_log_ratio  mean_i |Σ_t Δ|
    token_abs_log_ratio_{mean,max}   |Δ|
    exact_tokens_frac  fraction of tokens with π = μ bit for bit (1 in exact mode)
    prob_abs_diff_{mean,max}         |e^π − e^μ|
    training_ppl, rollout_ppl        exp(mean_i(−mean_t logp))
    log_ppl_diff       mean_i(mean_t μ − mean_t π)   signed, rollout minus trainer (VeRL's sign)
    log_ppl_abs_diff   mean_i |mean_t π − mean_t μ|
    ppl_ratio          mean_i exp(mean_t μ − mean_t π)   training ppl / rollout ppl per sequence
    is_ess             (Σ_i w_i)² / (N Σ_i w_i²), w_i = e^{Σ_t Δ}  (1 = no mismatch)
"""

from __future__ import annotations

import statistics

import torch

from parity.rl.algorithms import clamped_exp

LENGTH_BIN_EDGES = (0, 16, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096)


def _delta(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Δ = π − μ in FP64, 0 outside the mask."""
    return (trainer_logprobs.detach().double() - rollout_logprobs.detach().double()).masked_fill(~mask, 0.0)


def mismatch_metrics(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Every mismatch metric over the response tokens selected by `mask`."""
    pi = trainer_logprobs.detach().double()
    mu = rollout_logprobs.detach().double()
    m = mask.bool()
    delta = _delta(trainer_logprobs, rollout_logprobs, m)
    d = delta[m]
    n_tok = m.sum(-1).clamp(min=1)
    seq_delta = delta.sum(-1)
    seq_w = clamped_exp(seq_delta)
    pi_mean = pi.masked_fill(~m, 0).sum(-1) / n_tok
    mu_mean = mu.masked_fill(~m, 0).sum(-1) / n_tok
    prob_diff = (pi[m].exp() - mu[m].exp()).abs()
    return {
        "k1": float((-d).mean()),
        "k2": float((d.square() / 2).mean()),
        "k3": float((clamped_exp(d) - d - 1).mean()),
        "chi2_token": float(clamped_exp(2 * d).mean() - 1),
        "chi2_seq": float(clamped_exp(2 * seq_delta).mean() - 1),
        "seq_abs_log_ratio": float(seq_delta.abs().mean()),
        "token_abs_log_ratio_mean": float(d.abs().mean()),
        "token_abs_log_ratio_max": float(d.abs().max()),
        "exact_tokens_frac": int((trainer_logprobs.detach() == rollout_logprobs.detach())[m].sum()) / d.numel(),
        "prob_abs_diff_mean": float(prob_diff.mean()),
        "prob_abs_diff_max": float(prob_diff.max()),
        "training_ppl": float(torch.exp(-pi_mean).mean()),
        "rollout_ppl": float(torch.exp(-mu_mean).mean()),
        "log_ppl_diff": float((mu_mean - pi_mean).mean()),
        "log_ppl_abs_diff": float((pi_mean - mu_mean).abs().mean()),
        "ppl_ratio": float(clamped_exp(mu_mean - pi_mean).mean()),
        "is_ess": float(seq_w.sum().square() / (seq_w.numel() * seq_w.square().sum())),
    }


def mismatch_by_length(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """k3 and seq_abs_log_ratio per response-length bin, keyed `k3/len_LO-HI` etc."""
    m = mask.bool()
    delta = _delta(trainer_logprobs, rollout_logprobs, m)
    lengths = m.sum(-1)
    out: dict[str, float] = {}
    for lo, hi in zip(LENGTH_BIN_EDGES[:-1], LENGTH_BIN_EDGES[1:]):
        rows = (lengths > lo) & (lengths <= hi)
        if not bool(rows.any()):
            continue
        d = delta[rows][m[rows]]
        out[f"k3/len_{lo + 1}-{hi}"] = float((clamped_exp(d) - d - 1).mean())
        out[f"seq_abs_log_ratio/len_{lo + 1}-{hi}"] = float(delta[rows].sum(-1).abs().mean())
    return out


def full_vocab_metrics(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor) -> dict[str, float]:
    """The two engines' whole next-token distributions compared at the same positions: log-probs
    [..., V] (-inf outside the sampled support; a position not recorded, of a short response, is a NaN row
    on either side: the trainer's, while the engine's holds zeros there). Per position, averaged over the
    positions:

        tv                 ½ Σ_v |μ(v) − π(v)|                  total variation
        kl                 Σ_v μ(v) (log μ(v) − log π(v))        KL(μ‖π), exact over the support
        max_abs_log_ratio  max over positions and tokens of |log π(v) − log μ(v)|
        top1_agree         the most likely token is the same (fraction of positions)
    """
    mu = rollout_logprobs.detach().double().flatten(0, -2)
    pi = trainer_logprobs.detach().double().flatten(0, -2)
    recorded = ~(mu.isnan().any(-1) | pi.isnan().any(-1))
    mu, pi = mu[recorded], pi[recorded]
    if not len(mu):
        return {"positions": 0}
    # Renormalised in FP64, so that rounding in the FP32 log-probs cannot make the KL negative.
    mu, pi = mu - mu.logsumexp(-1, keepdim=True), pi - pi.logsumexp(-1, keepdim=True)
    kept = torch.isfinite(mu) & torch.isfinite(pi)
    delta = (pi - mu).where(kept, 0.0)
    p_mu = mu.exp()
    return {
        "positions": len(mu),
        "tv": float(((p_mu - pi.exp()).abs().sum(-1) / 2).mean()),
        "kl": float((p_mu * -delta).sum(-1).mean()),
        "max_abs_log_ratio": float(delta.abs().max()),
        "top1_agree": float((mu.argmax(-1) == pi.argmax(-1)).double().mean()),
    }


def batch_shape_metrics(logprobs: torch.Tensor, other: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The same tokens scored twice by the trainer in two batch shapes (micro-batch size, packing):
    the fraction of tokens whose ratio exp(a − b) leaves [0.9, 1.1] and [0.99, 1.01], and max |a − b|."""
    d = (logprobs.detach().double() - other.detach().double())[mask.bool()]
    ratio = d.exp()
    return {
        "outside_10pct": float(((ratio < 0.9) | (ratio > 1.1)).double().mean()),
        "outside_1pct": float(((ratio < 0.99) | (ratio > 1.01)).double().mean()),
        "max_abs_log_ratio": float(d.abs().max()),
        "exact_tokens_frac": float((d == 0).double().mean()),
    }


# ----------------------------------------------------------------------------- g = β + κ, phantom clipping

PROB_BIN_EDGES = (0.0, 0.1, 0.5, 0.9, 1.0)
GAP_PARTS = ("gap", "beta", "kappa")  # g = π_old − μ; β = π_old − probe; κ = probe − μ


def gap_metrics(
    name: str, gap: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """One part of the mismatch per token (`name` in GAP_PARTS): its size and sign, where it is
    large (by the token's probability μ and by response length), and its correlation with
    the advantage. Keys `{name}/mean`, `{name}/abs_mean`, `{name}/abs_max`,
    `{name}/abs_mean/p_LO-HI`, `{name}/abs_mean/len_LO-HI`, `{name}/adv_corr`."""
    m = mask.bool()
    values = gap.detach().double()
    b = values[m]
    out = {
        f"{name}/mean": float(b.mean()),
        f"{name}/abs_mean": float(b.abs().mean()),
        f"{name}/abs_max": float(b.abs().max()),
    }
    probs = rollout_logprobs.detach().exp()[m]
    for lo, hi in zip(PROB_BIN_EDGES[:-1], PROB_BIN_EDGES[1:]):
        sel = (probs >= lo) & ((probs < hi) if hi < 1 else (probs <= hi))
        if bool(sel.any()):
            out[f"{name}/abs_mean/p_{lo:g}-{hi:g}"] = float(b[sel].abs().mean())
    lengths = m.sum(-1)
    row_abs = values.abs() * m
    for lo, hi in zip(LENGTH_BIN_EDGES[:-1], LENGTH_BIN_EDGES[1:]):
        rows = (lengths > lo) & (lengths <= hi)
        if bool(rows.any()):
            out[f"{name}/abs_mean/len_{lo + 1}-{hi}"] = float(row_abs[rows].sum() / m[rows].sum())
    adv = advantages.double()[:, None].expand_as(values)[m]
    correlated = b.numel() > 1 and float(b.std()) > 0 and float(adv.std()) > 0
    out[f"{name}/adv_corr"] = float(torch.corrcoef(torch.stack([b, adv]))[0, 1]) if correlated else 0.0
    return out


def phantom_clip_frac(
    clipped_vs_rollout: torch.Tensor, clipped_vs_old: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Fraction of tokens clipped with the ratio taken against μ and not with it taken against
    π_old: the clipping that the whole mismatch g = β + κ causes and the real policy change does
    not. Independent of which ratio the loss uses; the clip is the estimator's (`Estimator.clipped`)."""
    m = mask.bool()
    return (clipped_vs_rollout & ~clipped_vs_old & m).sum() / m.sum().clamp(min=1)


# ----------------------------------------------------------------------------- collapse early warning


def mismatch_alarm(series: list[float], window: int, factor: float) -> bool:
    """A rising mismatch relative to its early level (docs/design.md, "Mismatch metrics": the collapse warning).

    Fires when, with at least 2·`window` values,
    1. the median of the last `window` values exceeds `factor` × the median of the first
       `window` values (the mismatch has grown, robustly to spikes), and
    2. the median of the last `window`/2 values exceeds the median of the `window`/2 before
       them (it is still rising, not a level shift that has settled).
    """
    if window < 2 or len(series) < 2 * window:
        return False
    early = statistics.median(series[:window])
    recent = series[-window:]
    half = window // 2
    rising = statistics.median(recent[half:]) > statistics.median(recent[:half])
    return statistics.median(recent) > factor * max(early, 1e-30) and rising
