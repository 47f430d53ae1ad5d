"""Training-inference mismatch metrics (DESIGN.md, "Mismatch metrics").

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
    prob_abs_diff_{mean,max}         |e^π − e^μ|
    training_ppl, rollout_ppl        exp(mean_i(−mean_t logp))
    log_ppl_abs_diff   mean_i |mean_t π − mean_t μ|
    is_ess             (Σ_i w_i)² / (N Σ_i w_i²), w_i = e^{Σ_t Δ}  (1 = no mismatch)
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0  # every log-ratio is clamped before exp (DESIGN.md)
LENGTH_BIN_EDGES = (0, 16, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096)


def _exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def mismatch_metrics(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Every mismatch metric over the response tokens selected by `mask`."""
    pi = trainer_logprobs.detach().double()
    mu = rollout_logprobs.detach().double()
    m = mask.bool()
    delta = (pi - mu).masked_fill(~m, 0.0)
    d = delta[m]
    n_tok = m.sum(-1).clamp(min=1)
    seq_delta = delta.sum(-1)
    seq_w = _exp(seq_delta)
    pi_mean = pi.masked_fill(~m, 0).sum(-1) / n_tok
    mu_mean = mu.masked_fill(~m, 0).sum(-1) / n_tok
    prob_diff = (pi[m].exp() - mu[m].exp()).abs()
    return {
        "k1": float((-d).mean()),
        "k2": float((d.square() / 2).mean()),
        "k3": float((_exp(d) - d - 1).mean()),
        "chi2_token": float(_exp(2 * d).mean() - 1),
        "chi2_seq": float(_exp(2 * seq_delta).mean() - 1),
        "seq_abs_log_ratio": float(seq_delta.abs().mean()),
        "token_abs_log_ratio_mean": float(d.abs().mean()),
        "token_abs_log_ratio_max": float(d.abs().max()),
        "prob_abs_diff_mean": float(prob_diff.mean()),
        "prob_abs_diff_max": float(prob_diff.max()),
        "training_ppl": float(torch.exp(-pi_mean).mean()),
        "rollout_ppl": float(torch.exp(-mu_mean).mean()),
        "log_ppl_abs_diff": float((pi_mean - mu_mean).abs().mean()),
        "is_ess": float(seq_w.sum().square() / (seq_w.numel() * seq_w.square().sum())),
    }


def mismatch_by_length(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """k3 and seq_abs_log_ratio per response-length bin, keyed `k3/len_LO-HI` etc."""
    lengths = mask.sum(-1)
    out: dict[str, float] = {}
    for lo, hi in zip(LENGTH_BIN_EDGES[:-1], LENGTH_BIN_EDGES[1:]):
        rows = (lengths > lo) & (lengths <= hi)
        if not bool(rows.any()):
            continue
        metrics = mismatch_metrics(trainer_logprobs[rows], rollout_logprobs[rows], mask[rows])
        out[f"k3/len_{lo + 1}-{hi}"] = metrics["k3"]
        out[f"seq_abs_log_ratio/len_{lo + 1}-{hi}"] = metrics["seq_abs_log_ratio"]
    return out
