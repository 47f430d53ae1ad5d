"""Each estimator against its formula on hand-made tensors: values and gradients, masks and caps."""

from __future__ import annotations

import math

import pytest
import torch

from parity.algorithms import (
    NEEDS_OLD_LOGPROBS,
    POLICY_LOSSES,
    LossConfig,
    PolicyInputs,
    aggregate,
    group_advantages,
    kl_penalty,
)

CFG = LossConfig(clip_low=0.2, clip_high=0.3, cap=1.5)


def _inputs():
    """Two sequences (3 and 2 tokens) with ratios on both sides of the clip and IS weights on both sides of C."""
    theta = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-1.1, -0.9, -1.9], [-0.3, -1.0, 0.0]], dtype=torch.float64)
    mu = torch.tensor([[-1.0, -1.5, -1.9], [-0.1, -1.3, 0.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return theta, old, mu, adv, mask


def _run(name, theta, old, mu, adv, mask):
    lp = theta.clone().requires_grad_(True)
    loss, stats = POLICY_LOSSES[name](PolicyInputs(lp, old, mu, adv, mask), CFG)
    (loss * mask).sum().backward()
    return loss.detach() * mask, lp.grad, stats


def _ppo(theta, old, adv, low, high):
    r = torch.exp(theta - old)
    a = adv[:, None]
    return torch.maximum(-a * r, -a * r.clamp(1 - low, 1 + high))


def _expected(name, theta, old, mu, adv, mask):
    """The DESIGN.md formula, written out independently; `theta` has grad."""
    m = mask.double()
    a = adv[:, None]
    sg = theta.detach()
    if name == "grpo":
        return _ppo(theta, old, adv, CFG.clip_low, CFG.clip_high)
    if name == "grpo_token_tis":
        return _ppo(theta, old, adv, CFG.clip_low, CFG.clip_high) * torch.exp(old - mu).clamp(max=CFG.cap)
    if name == "grpo_token_mis":
        w = torch.exp(old - mu)
        return _ppo(theta, old, adv, CFG.clip_low, CFG.clip_high) * w * (w <= CFG.cap)
    rho_old = torch.exp(((old - mu) * m).sum(-1, keepdim=True))
    if name == "grpo_seq_tis":
        return _ppo(theta, old, adv, CFG.clip_low, CFG.clip_high) * rho_old.clamp(max=CFG.cap)
    if name == "grpo_seq_mis":
        return _ppo(theta, old, adv, CFG.clip_low, CFG.clip_high) * rho_old * (rho_old <= CFG.cap)
    if name == "gspo":
        s = torch.exp(((theta - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True))
        r = s.detach() * torch.exp(theta - sg)
        return torch.maximum(-a * r, -a * r.clamp(1 - CFG.gspo_clip_low, 1 + CFG.gspo_clip_high))
    rho = torch.exp(((sg - mu) * m).sum(-1, keepdim=True))
    if name == "pg_seq_is":
        return -rho * a * theta
    if name == "pg_seq_tis":
        return -rho.clamp(max=CFG.cap) * a * theta
    if name == "pg_seq_mis":
        return -rho * (rho <= CFG.cap) * a * theta
    if name == "reinforce":
        return -a * theta
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_estimator_matches_formula(name):
    theta, old, mu, adv, mask = _inputs()
    loss, grad, _ = _run(name, theta, old, mu, adv, mask)
    t = theta.clone().requires_grad_(True)
    expected = _expected(name, t, old, mu, adv, mask) * mask
    expected.sum().backward()
    assert torch.allclose(loss, expected.detach(), atol=1e-12), (loss, expected)
    assert torch.allclose(grad, t.grad, atol=1e-12), (grad, t.grad)
    assert (grad[~mask] == 0).all()


def test_registry_is_complete():
    assert set(POLICY_LOSSES) == {
        "grpo",
        "grpo_token_tis",
        "grpo_token_mis",
        "grpo_seq_tis",
        "grpo_seq_mis",
        "gspo",
        "pg_seq_is",
        "pg_seq_tis",
        "pg_seq_mis",
        "reinforce",
    }
    assert NEEDS_OLD_LOGPROBS == {n for n in POLICY_LOSSES if n.startswith(("grpo", "gspo"))}


def test_clip_zeroes_gradient_and_is_counted():
    theta, old, mu, adv, mask = _inputs()
    _, grad, stats = _run("grpo", theta, old, mu, adv, mask)
    r = torch.exp(theta - old)
    # Token (0,1): r = e^0.4 = 1.49 > 1.3 with A > 0 -> clipped, zero gradient.
    assert r[0, 1] > 1.3 and grad[0, 1] == 0
    # Token (1,1): r = e^-0.2 = 0.82 > 0.8 inside the clip -> gradient flows.
    assert grad[1, 1] != 0
    assert math.isclose(float(stats["clip_frac"]), 1 / 5) and math.isclose(float(stats["clip_frac_high"]), 1 / 5)


def test_masking_drops_and_truncation_clamps():
    theta, old, mu, adv, mask = _inputs()
    # w = exp(old - mu) at (0,1) is e^0.6 = 1.82 > C = 1.5: MIS drops the token, TIS keeps it at C.
    mis, mis_grad, mis_stats = _run("grpo_token_mis", theta, old, mu, adv, mask)
    tis, _, _ = _run("grpo_token_tis", theta, old, mu, adv, mask)
    grpo, _, _ = _run("grpo", theta, old, mu, adv, mask)
    assert mis[0, 1] == 0 and mis_grad[0, 1] == 0
    assert torch.isclose(tis[0, 1], grpo[0, 1] * 1.5)
    assert math.isclose(float(mis_stats["is_masked_frac"]), 1 / 5)


def test_log_ratios_are_clamped():
    theta = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    mu = torch.tensor([[-100.0, -100.0]], dtype=torch.float64)
    loss, _, stats = _run(
        "pg_seq_is",
        theta,
        theta.clone(),
        mu,
        torch.tensor([1.0], dtype=torch.float64),
        torch.ones(1, 2, dtype=torch.bool),
    )
    assert torch.isfinite(loss).all() and math.isclose(float(stats["is_weight_max"]), math.exp(20), rel_tol=1e-9)


def test_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    dr = group_advantages(rewards, groups, "drgrpo")
    assert torch.allclose(dr, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0, 0, 0]))
    gr = group_advantages(rewards, groups, "grpo")
    std = torch.tensor([1.0, 0.0, 0.0]).std()
    assert torch.allclose(gr[:3], dr[:3] / (std + 1e-6)) and (gr[3:] == 0).all()
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        group_advantages(rewards, groups, "ppo")


def test_aggregations_and_exact_accumulation():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    assert math.isclose(float(aggregate(loss, mask, "token_mean", 2, 5, 4)), 15 / 5)
    assert math.isclose(float(aggregate(loss, mask, "seq_mean_token_mean", 2, 5, 4)), (2 + 4.5) / 2)
    assert math.isclose(float(aggregate(loss, mask, "seq_mean_token_sum_norm", 2, 5, 4)), (6 / 4 + 9 / 4) / 2)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        whole = aggregate(loss, mask, mode, 2, 5, 4)
        parts = aggregate(loss[:1], mask[:1], mode, 2, 5, 4) + aggregate(loss[1:], mask[1:], mode, 2, 5, 4)
        assert torch.isclose(whole, parts)


def test_kl_estimators():
    lp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    assert torch.allclose(kl_penalty(lp, ref, "k1"), lp - ref)
    d = ref - lp
    assert torch.allclose(kl_penalty(lp, ref, "k3"), torch.exp(d) - d - 1)
    assert (kl_penalty(lp, lp, "k3") == 0).all()
