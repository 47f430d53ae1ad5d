"""Mismatch metrics against their formulas on hand-made tensors."""

from __future__ import annotations

import math

import torch

from parity.rl.diagnostics import mismatch_by_length, mismatch_metrics


def test_metrics_match_formulas():
    mu = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.7, 1.0]], dtype=torch.float64))
    delta = torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.05, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    pi = mu + delta
    m = mismatch_metrics(pi, mu, mask)
    d = [0.1, -0.2, 0.0, 0.3, 0.05]
    assert math.isclose(m["k1"], sum(-x for x in d) / 5, abs_tol=1e-9)
    assert math.isclose(m["k2"], sum(x * x / 2 for x in d) / 5, abs_tol=1e-9)
    assert math.isclose(m["k3"], sum(math.exp(x) - x - 1 for x in d) / 5, abs_tol=1e-9)
    assert math.isclose(m["chi2_token"], sum(math.exp(2 * x) for x in d) / 5 - 1, abs_tol=1e-9)
    seq = [-0.1, 0.35]
    assert math.isclose(m["seq_abs_log_ratio"], (0.1 + 0.35) / 2, abs_tol=1e-9)
    assert math.isclose(m["chi2_seq"], sum(math.exp(2 * s) for s in seq) / 2 - 1, abs_tol=1e-9)
    assert math.isclose(m["token_abs_log_ratio_max"], 0.3, abs_tol=1e-9)
    w = [math.exp(s) for s in seq]
    assert math.isclose(m["is_ess"], sum(w) ** 2 / (2 * sum(x * x for x in w)), abs_tol=1e-9)
    probs = [abs(math.exp(a + b) - math.exp(a)) for a, b in zip(mu[mask].tolist(), d)]
    assert math.isclose(m["prob_abs_diff_max"], max(probs), abs_tol=1e-6)


def test_identical_engines_give_zero_mismatch():
    mu = torch.log(torch.rand(4, 6) * 0.9 + 0.05)
    mask = torch.ones(4, 6, dtype=torch.bool)
    m = mismatch_metrics(mu.clone(), mu, mask)
    ratios = ("training_ppl", "rollout_ppl", "is_ess", "ppl_ratio", "exact_tokens_frac")
    assert all(abs(v) < 1e-12 for k, v in m.items() if k not in ratios)
    assert math.isclose(m["is_ess"], 1.0) and math.isclose(m["training_ppl"], m["rollout_ppl"])
    assert m["ppl_ratio"] == 1.0 and m["exact_tokens_frac"] == 1.0
    one_ulp_off = mu.clone()
    one_ulp_off[0, 0] = torch.nextafter(mu[0, 0], torch.tensor(0.0))
    assert mismatch_metrics(one_ulp_off, mu, mask)["exact_tokens_frac"] == 23 / 24


def test_signed_log_ppl_diff_and_ppl_ratio():
    """VeRL's definitions: rollout minus trainer mean log-prob per sequence, and its exp."""
    mu = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], dtype=torch.float64)
    pi = torch.tensor([[-1.5, -2.5], [-0.5, -0.3]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False]])
    m = mismatch_metrics(pi, mu, mask)
    per_seq = [-1.5 - -2.0, -0.5 - -0.5]  # mean_t μ − mean_t π for each row
    assert math.isclose(m["log_ppl_diff"], sum(per_seq) / 2)
    assert math.isclose(m["ppl_ratio"], sum(math.exp(x) for x in per_seq) / 2)


def test_length_bins():
    mu = torch.zeros(3, 40)
    pi = torch.full((3, 40), 0.01)
    mask = torch.zeros(3, 40, dtype=torch.bool)
    mask[0, :10] = True
    mask[1, :20] = True
    mask[2, :40] = True
    bins = mismatch_by_length(pi, mu, mask)
    assert set(bins) == {f"{m}/len_{b}" for m in ("k3", "seq_abs_log_ratio") for b in ("1-16", "17-32", "33-48")}
    assert math.isclose(bins["seq_abs_log_ratio/len_33-48"], 0.4, rel_tol=1e-6)
