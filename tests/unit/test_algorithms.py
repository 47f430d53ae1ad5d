"""Each estimator against its reference, written out independently here, in FP64.

For every estimator the whole loss — rejection, per-token loss, aggregation with the
estimator's default normaliser — and its gradient with respect to π_θ are compared
with a transcription of the reference code to 1e-12. The comment on each formula
names the file and lines it was transcribed from (the commits read):

    OAT   sail-sg/Precision-RL@5b04485 oat/main.py (the FP16 paper's code, on Oat)
    TRL   huggingface/trl@f2cd577 trl/trainer/grpo_trainer.py
    VERL  volcengine/verl@b178a3c verl/trainer/ppo/core_algos.py; the veto at
          volcengine/verl@2f2996b verl/trainer/ppo/rollout_corr_helper.py
    VERLRC volcengine/verl@b178a3c verl/trainer/ppo/rollout_corr_helper.py (unchanged since PR #4544, 97eac90)
    SKYRL NovaSky-AI/SkyRL@a956457 skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py
    VERLD verl-project/verl@1dda039 verl/trainer/ppo/core_algos.py (DPPO, after verl's rename; agg_loss,
          whose global_batch_size verl/trainer/ppo/ray_trainer.py 1352-1362 sets to the mini-batch's rows)
    SLIME THUDM/slime@624b824 slime/backends/megatron_utils/loss.py
"""

from __future__ import annotations

import math

import pytest
import torch

from parity.rl.algorithms import (
    ADVANTAGE_FNS,
    ESTIMATORS,
    Denominators,
    LossConfig,
    PolicyInputs,
    aggregate,
    denominators,
    group_advantages,
    kl_penalty,
    register,
    register_advantage,
    rejected_sequences,
    sequence_clipped,
    token_clipped,
)

L_MAX = 10  # the constant normaliser of seq_mean_token_sum_norm (Oat: generate_max_length)


def _batch(seed: int = 0, rows: int = 8, tokens: int = 7):
    """Random log-probs with per-row gaps of very different sizes, so that weights fall on
    both sides of every cap and band; rows of different lengths."""
    gen = torch.Generator().manual_seed(seed)
    mu = -torch.rand(rows, tokens, generator=gen, dtype=torch.float64) * 3
    scale = torch.tensor([1e-3, 3e-3, 0.05, 0.2, 0.5, 1.0, 0.004, 0.3], dtype=torch.float64)[:rows, None]
    old = mu + torch.randn(rows, tokens, generator=gen, dtype=torch.float64) * scale
    theta = old + torch.randn(rows, tokens, generator=gen, dtype=torch.float64) * 0.15
    adv = torch.randn(rows, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([7, 3, 5, 1, 7, 6, 2, 4])[:rows]
    mask = torch.arange(tokens)[None, :] < lengths[:, None]
    # A very unlikely token (w < 1e-4) in one row, for the veto.
    old[2, 1] = mu[2, 1] - 12.0
    return theta, old, mu, adv, mask


def _parity_loss(name: str, theta, old, mu, adv, mask, cfg: LossConfig, aggregation: str) -> torch.Tensor:
    """The loss as `Run.step` computes it for one mini-batch: rejection, estimator, aggregation."""
    loss_mask = mask.clone()
    rejected = rejected_sequences(name, old, mu, loss_mask, cfg)
    if rejected is not None:
        loss_mask[rejected] = False
    token_loss, _ = ESTIMATORS[name].loss(PolicyInputs(theta, old, mu, adv, loss_mask), cfg)
    return aggregate(token_loss, loss_mask, aggregation, denominators(loss_mask, L_MAX))


# ----------------------------------------------------------------------------- the references


def _ref_ppo(theta, old, adv, low, high):
    # OAT 669-675: ratio = exp(new − old); max(−A·ratio, −A·clamp(ratio, 1−clip_low, 1+clip_high))
    ratio = torch.exp(theta - old)
    return torch.max(-adv[:, None] * ratio, -adv[:, None] * torch.clamp(ratio, 1 - low, 1 + high))


def _ref_drgrpo_aggregate(per_token, mask):
    # OAT 347-351, 718-719: masked_sum(·, axis=1) / generate_max_length, then mean over sequences
    return ((per_token * mask).sum(1) / L_MAX).mean()


def _ref_seq_mean_token_mean(per_token, mask):
    # VERLD 1194-1202 (seq-mean-token-mean): per-sequence token mean over the sequences with tokens left,
    # summed, ÷ global_batch_size, every row of the mini-batch (ray_trainer.py 1352-1362). VeRL divides
    # by count + 1e-8 (a guard for empty rows: 1e-8 relative); Parity's guard, clamp(min=1), is exact
    m = mask.double()
    per_seq = (per_token * m).sum(1) / m.sum(1).clamp(min=1)
    return (per_seq * (m.sum(1) > 0)).sum() / m.shape[0]


def _ref_token_mean(per_token, mask):
    # VERLD 1170-1175 (token-mean): masked_sum(loss_mat, loss_mask) / batch_num_tokens
    m = mask.double()
    return (per_token * m).sum() / m.sum()


def _reference(name: str, theta, old, mu, adv, mask, c: LossConfig) -> torch.Tensor:
    m = mask.double()
    a = adv[:, None]
    eps_lo, eps_hi = c.clip_low, c.clip_high
    if name == "grpo":
        return _ref_drgrpo_aggregate(_ref_ppo(theta, old, adv, eps_lo, eps_hi), m)
    if name == "grpo_token_tis":
        # OAT 689-693: pg_loss_max *= exp(old − actor).clamp(max=tis_c); TRL 2596-2601 adds the lower bound
        tis = torch.exp(old - mu).clamp(min=c.cap_low, max=c.cap)
        return _ref_drgrpo_aggregate(_ref_ppo(theta, old, adv, eps_lo, eps_hi) * tis, m)
    if name == "grpo_token_mis":
        # TRL 2579-2583, 2602-2610 (token_mask): w = exp(old − sampling); w·1[min ≤ w ≤ max]
        w = torch.exp(old - mu)
        w = w * ((w >= c.cap_low) & (w <= c.cap))
        return _ref_drgrpo_aggregate(_ref_ppo(theta, old, adv, eps_lo, eps_hi) * w, m)
    if name == "grpo_seq_tis":
        # TRL 2583-2601 (sequence_truncate): exp(Σ_t (old − sampling)·mask), clamped to [min, max]
        rho = torch.exp(((old - mu) * m).sum(-1, keepdim=True)).clamp(min=c.cap_low, max=c.cap)
        return _ref_drgrpo_aggregate(_ref_ppo(theta, old, adv, eps_lo, eps_hi) * rho, m)
    if name == "grpo_seq_mis":
        # OAT 676-687: seq_is = exp(Σ (old − actor)·mask); pg_loss_max *= (seq_is <= C)·seq_is
        seq_is = torch.exp(((old - mu) * m).sum(-1, keepdim=True))
        keep = ((seq_is <= c.cap) & (seq_is >= c.cap_low)).double()
        return _ref_drgrpo_aggregate(_ref_ppo(theta, old, adv, eps_lo, eps_hi) * keep * seq_is, m)
    if name == "grpo_seq_geo_rs":
        # SKYRL 217-236: geo = exp(Σ (old − rollout)·mask / num_tokens); keep iff low ≤ geo ≤ high,
        # applied to the loss mask (l.345); its seq_mean_token_sum_norm reduction (ppo_utils.py
        # reduce_loss) is torch.mean over every row of Σ_t loss / max_seq_len: rejected rows count
        geo = torch.exp(((old - mu) * m).sum(-1) / m.sum(-1).clamp(min=1))
        kept = m * ((geo >= c.cap_low) & (geo <= c.cap)).double()[:, None]
        return ((_ref_ppo(theta, old, adv, eps_lo, eps_hi) * kept).sum(1) / L_MAX).mean()
    if name == "gspo":
        # OAT 649-667: s = exp(Σ (new.detach() − old)·mask / Σ mask); ratio = s·p/p.detach();
        # clamp to [1 − ε_low, 1 + ε_high] (3e-4, 4e-4); VERL 1311-1314 aggregates it seq-mean-token-mean
        s = torch.exp(((theta.detach() - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True))
        p = torch.exp(theta)
        ratio = s * p / p.detach()
        loss = torch.max(-a * ratio, -a * torch.clamp(ratio, 1 - eps_lo, 1 + eps_hi))
        return _ref_seq_mean_token_mean(loss, m)
    if name == "grpo_token_icepop":
        # SLIME 919-930: ice_ratio = exp(old − rollout); ice_weight = where(low ≤ r ≤ high, r, 0);
        # pg_loss · ice_weight (the loss masks unchanged: masked tokens stay in the denominator)
        r = torch.exp(old - mu)
        weight = torch.where((r >= c.cap_low) & (r <= c.cap), r, torch.zeros_like(r))
        return _ref_drgrpo_aggregate(_ref_ppo(theta, old, adv, eps_lo, eps_hi) * weight, m)
    if name == "grpo_opsm":
        # TRL 2932-2939: kl = sampling − per_token.detach(); masked mean (÷ clamp(Σ mask, 1));
        # keep = (A >= 0) | (kl <= δ); 3112: per_token_loss · keep, the mask unchanged
        kl = mu - theta.detach()
        avg = (kl * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1.0)
        keep = ((a >= 0) | (avg <= c.delta)).double()
        return _ref_drgrpo_aggregate(_ref_ppo(theta, old, adv, eps_lo, eps_hi) * keep, m)
    if name in ("grpo_seq_max_k2", "grpo_seq_max_k3"):
        # VERLRC 221-224: log_ratio clamped to ±20, k2 = 0.5·lr², k3 = exp(lr) − 1 − lr; 238-243 and
        # 320-326: max over valid tokens (−inf elsewhere), keep iff max <= threshold; the rejected rows
        # leave response_mask, and Dr.GRPO's constant denominator still counts them
        lr = torch.clamp(old - mu, min=-20.0, max=20.0)
        k = 0.5 * lr**2 if name.endswith("k2") else torch.exp(lr) - 1.0 - lr
        worst = k.masked_fill(~mask, float("-inf")).max(-1).values
        worst = torch.where(worst == float("-inf"), torch.zeros_like(worst), worst)
        kept = m * (worst <= c.delta).double()[:, None]
        return ((_ref_ppo(theta, old, adv, eps_lo, eps_hi) * kept).sum(1) / L_MAX).mean()
    if name == "cispo":
        # VERL 1747-1758: ratio = exp(clamp(log_prob − old, ±20)); clipped = clamp(ratio, 1 − low,
        # 1 + high).detach(); pg_losses = −clipped·A·log_prob
        ratio = torch.exp(torch.clamp(theta - old, min=-20.0, max=20.0))
        clipped = torch.clamp(ratio, 1 - eps_lo, 1 + eps_hi).detach()
        # its recipe leaves loss_agg_mode at the actor's default, token-mean (VERLD actor.py 165)
        return _ref_token_mean(-clipped * a * theta, m)
    if name in ("dppo_tv", "dppo_kl"):
        # VERLD 1417-1439 (dppo_tv), 1498-1523 (dppo_kl): ratio = exp(clamp(log_prob − old, ±20));
        # truncated = clamp(ratio, max=clip_ratio_c).detach(); the valid mask by the sign of A;
        # pg_losses = −A·truncated·log_prob·valid
        ratio = torch.exp(torch.clamp(theta - old, min=-20.0, max=20.0))
        truncated = torch.clamp(ratio, max=c.cap).detach()
        prob, old_prob = torch.exp(theta), torch.exp(old)
        if name == "dppo_tv":
            valid_pos = (prob - old_prob) <= eps_hi
            valid_neg = (prob - old_prob) >= -eps_lo
        else:
            binary_kl = old_prob * (old - theta) + (1 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
            )
            valid_pos = (binary_kl <= eps_hi) | (prob <= old_prob)
            valid_neg = (binary_kl <= eps_lo) | (prob >= old_prob)
        valid = torch.where(a > 0, valid_pos, valid_neg).detach().double()
        return _ref_drgrpo_aggregate(-a * truncated * theta * valid, m)
    if name == "sapo":
        # VERL 1364-1396: gate(x, τ) = sigmoid(τ(x − 1))·4/τ; τ = where(A > 0, tau_pos, tau_neg);
        # pg_losses = −gates·A, always aggregated seq-mean-token-mean
        ratio = torch.exp(torch.clamp(theta - old, min=-20.0, max=20.0))
        tau = torch.where(a > 0, torch.tensor(c.tau_pos, dtype=a.dtype), torch.tensor(c.tau_neg, dtype=a.dtype))
        gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
        return _ref_seq_mean_token_mean(-gates * a, m)
    if name in ("pg_seq_is", "pg_seq_tis", "pg_seq_mis"):
        # OAT 625-635: seq_is = exp(Σ (new.detach() − actor)·mask); −seq_is.clamp(max=C)·A·new
        seq_is = torch.exp(((theta.detach() - mu) * m).sum(-1, keepdim=True))
        if name == "pg_seq_tis":
            seq_is = seq_is.clamp(min=c.cap_low, max=c.cap)
        if name == "pg_seq_mis":  # TRL 2602-2610's mask rule on OAT's PG weight
            seq_is = seq_is * ((seq_is >= c.cap_low) & (seq_is <= c.cap))
        return _ref_drgrpo_aggregate(-seq_is * a * theta, m)
    if name == "pg_token_is":
        # OAT 636-646: token_is = exp((new.detach() − actor)·mask); −token_is·A·new
        token_is = torch.exp((theta.detach() - mu) * m)
        return _ref_drgrpo_aggregate(-token_is * a * theta, m)
    if name == "reinforce":
        # OAT 622-623: −A·new
        return _ref_drgrpo_aggregate(-a * theta, m)
    raise AssertionError(f"no reference for {name}")


def _ref_veto(old, mu, mask, threshold):
    # VERL@2f2996b rollout_corr_helper.py 656-677: reject the whole sequence if any valid token has
    # log r < log(threshold), r = exp(old − rollout)
    return (((old - mu) < math.log(threshold)) & mask).any(-1)


def _config(name: str, **kw) -> LossConfig:
    est = ESTIMATORS[name]
    values = {**est.params, **kw}
    if "clip_high" in est.params and "clip_high" not in kw:
        values["clip_high"] *= 1.4  # asymmetric ε (0.2, 0.28 for PPO), so that a swapped bound fails
    return LossConfig(**values)


def _compare(name: str, cfg: LossConfig, seed: int = 0):
    est = ESTIMATORS[name]
    aggregation = est.aggregation
    theta, old, mu, adv, mask = _batch(seed)
    mine = theta.clone().requires_grad_(True)
    loss = _parity_loss(name, mine, old, mu, adv, mask, cfg, aggregation)
    loss.backward()
    ref_theta = theta.clone().requires_grad_(True)
    ref_mask = mask.clone()
    if cfg.token_veto > 0:
        ref_mask[_ref_veto(old, mu, mask, cfg.token_veto)] = False
    # Vetoed rows leave the mask; the reference's own reduction decides whether they still count.
    ref = _reference(name, ref_theta, old, mu, adv, ref_mask, cfg)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-12, (name, loss.item(), ref.item())
    assert torch.allclose(mine.grad, ref_theta.grad, rtol=0, atol=1e-12), (name, mine.grad - ref_theta.grad)
    assert float(mine.grad.abs().sum()) > 0  # the comparison is not of two zeros


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_estimator_matches_its_reference(name):
    _compare(name, _config(name))


@pytest.mark.parametrize("name", sorted(n for n, e in ESTIMATORS.items() if "cap" in e.params and not e.reject))
def test_two_sided_bounds_match_the_reference(name):
    # TRL's vllm_importance_sampling_clip_min/max (2596-2610)
    _compare(name, _config(name, cap=2.5, cap_low=0.5))


@pytest.mark.parametrize("name", ["grpo", "grpo_seq_mis", "pg_seq_is"])
def test_token_veto_matches_the_reference(name):
    theta, old, mu, _, mask = _batch()
    assert bool(_ref_veto(old, mu, mask, 1e-4).any())  # the batch has a token to veto
    _compare(name, _config(name, token_veto=1e-4))


OPSM_TIGHT = 0.05  # at TRL's suggested 0.5 the test batch's drift masks nothing


@pytest.mark.parametrize(
    ("name", "delta"), [("grpo_opsm", OPSM_TIGHT), ("grpo_seq_max_k2", 0.5), ("grpo_seq_max_k3", 0.3)]
)
def test_thresholds_match_the_reference(name, delta):
    _compare(name, _config(name, delta=delta))


DPPO_TIGHT = {"clip_low": 0.01, "clip_high": 0.012, "cap": 1.1}  # masks and truncation both act on the test batch


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_trust_region_and_truncation_match_the_reference(name):
    _compare(name, _config(name, **DPPO_TIGHT))


def test_two_sided_cispo_matches_the_reference():
    _compare("cispo", _config("cispo", clip_low=0.2))  # VeRL's actor default; the recipe's 10 never binds


def test_registry_and_reference_defaults():
    assert set(ESTIMATORS) == {
        "grpo",
        "grpo_token_tis",
        "grpo_token_mis",
        "grpo_token_icepop",
        "grpo_seq_tis",
        "grpo_seq_mis",
        "grpo_seq_geo_rs",
        "grpo_seq_max_k2",
        "grpo_seq_max_k3",
        "grpo_opsm",
        "gspo",
        "dppo_tv",
        "dppo_kl",
        "cispo",
        "sapo",
        "pg_seq_is",
        "pg_seq_tis",
        "pg_seq_mis",
        "pg_token_is",
        "reinforce",
    }
    caps = {n: e.params.get("cap") for n, e in ESTIMATORS.items()}
    # Oat's sanity scripts: token TIS 2, GRPO-Seq-MIS 10, "seq_mis" PG scripts truncate at 3; TRL's clip_max 3.
    assert caps["grpo_token_tis"] == 2 and caps["grpo_seq_mis"] == 10 and caps["pg_seq_tis"] == 3
    assert caps["grpo_token_mis"] == 3 and caps["grpo_seq_tis"] == 3 and caps["pg_seq_mis"] == 3
    assert ESTIMATORS["grpo_seq_geo_rs"].params == {"clip_low": 0.2, "clip_high": 0.2, "cap": 1.01, "cap_low": 0.99}
    assert caps["pg_seq_is"] is caps["grpo"] is caps["pg_token_is"] is None
    assert ESTIMATORS["grpo_token_icepop"].params["cap_low"] == 0.5 and caps["grpo_token_icepop"] == 5  # IcePop's band
    assert ESTIMATORS["grpo_seq_max_k2"].params["delta"] == 2.5  # VeRL's rollout_corr.md
    assert ESTIMATORS["grpo_opsm"].params["delta"] == 0.5  # TRL's grpo_config.py
    assert ESTIMATORS["sapo"].params == {"tau_pos": 1.0, "tau_neg": 1.05}  # VeRL's actor config
    assert ESTIMATORS["gspo"].params == {"clip_low": 3e-4, "clip_high": 4e-4}
    # VeRL's recipes: DPPO's δ in the ε keys (TV 0.15, KL 0.05, C 1e4); CISPO's ε_low 10 (no lower bound)
    assert ESTIMATORS["dppo_tv"].params == {"clip_low": 0.15, "clip_high": 0.15, "cap": 10000.0}
    assert ESTIMATORS["dppo_kl"].params == {"clip_low": 0.05, "clip_high": 0.05, "cap": 10000.0}
    assert ESTIMATORS["cispo"].params == {"clip_low": 10.0, "clip_high": 0.2}
    for name in ("gspo", "sapo"):  # defined per sequence, with the group-normalised advantage
        assert ESTIMATORS[name].aggregation == "seq_mean_token_mean" and ESTIMATORS[name].advantage == "grpo"
        assert ESTIMATORS[name].aggregation_fixed
    assert [n for n, e in ESTIMATORS.items() if e.aggregation_fixed] == ["gspo", "sapo"]
    assert all(e.source for e in ESTIMATORS.values())
    # Every estimator with a clip names it; the PG family and SAPO (a soft gate) have none.
    no_clip = {n for n in ESTIMATORS if n.startswith("pg_")} | {"sapo", "reinforce"}
    assert {n for n, e in ESTIMATORS.items() if e.clipped is None} == no_clip


def test_the_new_rules_act_on_the_test_batch():
    """The reference comparisons above exercise each mask and rejection: on the test batch every
    rule drops some tokens or sequences and keeps others."""
    theta, old, mu, adv, mask = _batch()
    for name in ("grpo_seq_max_k2", "grpo_seq_max_k3"):
        rejected = rejected_sequences(name, old, mu, mask, _config(name))
        assert 0 < int(rejected.sum()) < len(rejected), name
    opsm = _config("grpo_opsm", delta=OPSM_TIGHT)
    _, stats = ESTIMATORS["grpo_opsm"].loss(PolicyInputs(theta, old, mu, adv, mask), opsm)
    assert 0 < float(stats["opsm/masked_seq_frac"]) < 1
    _, stats = ESTIMATORS["grpo_token_icepop"].loss(
        PolicyInputs(theta, old, mu, adv, mask), _config("grpo_token_icepop")
    )
    assert 0 < float(stats["is/masked_frac"]) < 1
    for name, cfg in (
        ("cispo", _config("cispo")),
        ("dppo_tv", _config("dppo_tv", **DPPO_TIGHT)),
        ("dppo_kl", _config("dppo_kl", **DPPO_TIGHT)),
    ):
        _, stats = ESTIMATORS[name].loss(PolicyInputs(theta, old, mu, adv, mask), cfg)
        assert 0 < float(stats["clip/frac"]) < 1, name


def test_cispo_keeps_the_gradient_that_ppo_clips():
    """A token whose ratio is past 1 + ε with A > 0: PPO's clip zeroes its gradient, CISPO keeps it,
    weighted by the clipped ratio."""
    theta = torch.tensor([[-0.5]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.9]], dtype=torch.float64)  # r = e^0.4 = 1.49
    inputs = PolicyInputs(theta, old, old, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 1, dtype=bool))
    ESTIMATORS["grpo"].loss(inputs, LossConfig())[0].sum().backward()
    assert theta.grad.item() == 0
    theta.grad = None
    ESTIMATORS["cispo"].loss(inputs, LossConfig(clip_low=0.2, clip_high=0.2))[0].sum().backward()
    assert math.isclose(theta.grad.item(), -1.2, rel_tol=1e-12)  # −sg(clip(r))·A = −1.2


def test_clip_zeroes_gradient_and_is_counted():
    theta = torch.tensor([[-1.0, -0.5, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, -0.9, -2.0]], dtype=torch.float64)
    adv = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = ESTIMATORS["grpo"].loss(PolicyInputs(theta, old, old, adv, mask), LossConfig(0.2, 0.3))
    loss.sum().backward()
    # Token 1: r = e^0.4 = 1.49 > 1.3 with A > 0 -> clipped, zero gradient; the others flow.
    assert theta.grad[0, 1] == 0 and theta.grad[0, 0] != 0
    assert math.isclose(float(stats["clip/frac"]), 1 / 3) and math.isclose(float(stats["clip/frac_high"]), 1 / 3)


def test_masking_drops_and_truncation_clamps():
    theta, old, mu, adv, mask = _batch()
    cfg = LossConfig(cap=1.5)
    w = torch.exp(old - mu)
    over = (w > 1.5) & mask
    assert bool(over.any())
    mis, mis_stats = ESTIMATORS["grpo_token_mis"].loss(PolicyInputs(theta, old, mu, adv, mask), cfg)
    tis, _ = ESTIMATORS["grpo_token_tis"].loss(PolicyInputs(theta, old, mu, adv, mask), cfg)
    grpo, _ = ESTIMATORS["grpo"].loss(PolicyInputs(theta, old, mu, adv, mask), cfg)
    assert (mis[over] == 0).all() and torch.allclose(tis[over], grpo[over] * 1.5)
    assert math.isclose(float(mis_stats["is/masked_frac"]), int(over.sum()) / int(mask.sum()))


def test_log_ratios_are_clamped():
    theta = torch.zeros(1, 2, dtype=torch.float64)
    mu = torch.full((1, 2), -100.0, dtype=torch.float64)
    inp = PolicyInputs(theta, theta.clone(), mu, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2, dtype=bool))
    loss, stats = ESTIMATORS["pg_seq_is"].loss(inp, LossConfig())
    assert torch.isfinite(loss).all() and math.isclose(float(stats["is/weight_max"]), math.exp(20), rel_tol=1e-9)


def test_gspo_gradient_mass_per_sequence_does_not_depend_on_length():
    """GSPO's per-sequence objective: with the same advantage and ratio, a 4-token and a
    64-token response get the same total gradient (their aggregation is per sequence)."""
    lengths = (4, 64)
    theta = torch.full((2, 64), -1.0, dtype=torch.float64, requires_grad=True)
    mask = torch.arange(64)[None, :] < torch.tensor(lengths)[:, None]
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    loss, _ = ESTIMATORS["gspo"].loss(PolicyInputs(theta, theta.detach(), theta.detach(), adv, mask), LossConfig())
    aggregate(loss, mask, ESTIMATORS["gspo"].aggregation, denominators(mask, 64)).backward()
    mass = theta.grad.abs().sum(-1)
    assert math.isclose(float(mass[0]), float(mass[1]), rel_tol=1e-12)
    # Under the L_max normaliser the long response would carry 16x the mass: why GSPO refuses it.
    theta.grad = None
    loss, _ = ESTIMATORS["gspo"].loss(PolicyInputs(theta, theta.detach(), theta.detach(), adv, mask), LossConfig())
    aggregate(loss, mask, "seq_mean_token_sum_norm", denominators(mask, 64)).backward()
    mass = theta.grad.abs().sum(-1)
    assert math.isclose(float(mass[1] / mass[0]), 16.0, rel_tol=1e-12)


def test_clip_bounds_follow_the_clip_kind():
    cfg = LossConfig(clip_low=1e-3, clip_high=2e-3)
    theta = torch.zeros(1, 2, dtype=torch.float64)
    ref = torch.full((1, 2), -0.0015, dtype=torch.float64)  # r = e^0.0015: outside GSPO's 2e-3? no; its 1e-3 yes
    adv = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert not token_clipped(theta, ref, adv, mask, LossConfig(clip_low=0.1, clip_high=0.2)).any()
    assert not sequence_clipped(theta, ref, adv, mask, cfg).any()  # 1.0015 < 1 + 2e-3
    assert sequence_clipped(theta, ref - 0.001, adv, mask, cfg).all()  # 1.0025 > 1 + 2e-3
    assert sequence_clipped(theta, -ref, -adv, mask, cfg).all()  # 0.9985 < 1 − 1e-3 with A < 0


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


def test_a_name_is_registered_once():
    """A second estimator or advantage under a taken name is refused, not silently swapped in."""
    before = (dict(ESTIMATORS), dict(ADVANTAGE_FNS))
    with pytest.raises(ValueError, match="estimator 'grpo' is already registered"):
        register("grpo", source="a second copy")
    with pytest.raises(ValueError, match="advantage estimator 'grpo' is already registered"):
        register_advantage("grpo")
    assert (ESTIMATORS, ADVANTAGE_FNS) == before


def test_aggregations_and_exact_accumulation():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    norm = denominators(mask, 4)
    assert norm == Denominators(sequences=2, tokens=5, max_length=4)
    assert math.isclose(float(aggregate(loss, mask, "token_mean", norm)), 15 / 5)
    assert math.isclose(float(aggregate(loss, mask, "seq_mean_token_mean", norm)), (2 + 4.5) / 2)
    assert math.isclose(float(aggregate(loss, mask, "seq_mean_token_sum_norm", norm)), (6 / 4 + 9 / 4) / 2)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        whole = aggregate(loss, mask, mode, norm)
        parts = aggregate(loss[:1], mask[:1], mode, norm) + aggregate(loss[1:], mask[1:], mode, norm)
        assert torch.isclose(whole, parts)


def test_rejected_sequences_stay_in_the_dr_grpo_denominator():
    """The audit's case: one group of 4 sequences x 3 tokens, 2 rejected by grpo_seq_geo_rs. Under
    seq_mean_token_sum_norm every Dr.GRPO reference (verl, SkyRL, Oat) gives a kept token
    d loss / d log π = -A / (max_length x 4) = -0.0417 at A = 0.5, however many were rejected; so does
    seq_mean_token_mean, as verl's agg_loss divides by the mini-batch's size: -A / (3 tokens x 4)."""
    old = torch.full((4, 3), -1.0, dtype=torch.float64)
    mu = old.clone()
    mu[2:] -= 5.0  # π_old/μ = e^5 per token: the geometric mean is far outside the band
    adv = torch.full((4,), 0.5, dtype=torch.float64)
    mask = torch.ones(4, 3, dtype=torch.bool)
    cfg = _config("grpo_seq_geo_rs")
    loss_mask = mask.clone()
    rejected = rejected_sequences("grpo_seq_geo_rs", old, mu, loss_mask, cfg)
    assert rejected.tolist() == [False, False, True, True]
    loss_mask[rejected] = False
    for mode, per_kept_token in (("seq_mean_token_sum_norm", -0.5 / (3 * 4)), ("seq_mean_token_mean", -0.5 / (3 * 4))):
        theta = old.clone().requires_grad_(True)
        token_loss, _ = ESTIMATORS["grpo_seq_geo_rs"].loss(PolicyInputs(theta, old, mu, adv, loss_mask), cfg)
        aggregate(token_loss, loss_mask, mode, denominators(loss_mask, 3)).backward()
        assert torch.allclose(theta.grad[:2], torch.full((2, 3), per_kept_token, dtype=torch.float64), atol=1e-15)
        assert (theta.grad[2:] == 0).all()
    assert math.isclose(-0.5 / 12, -0.0417, abs_tol=5e-5)


def _ref_agg_loss(loss_mat, loss_mask, mode: str, global_batch_size: int, loss_scale_factor: int):
    # VERLD 1170-1202, dp_size 1, with the global batch info the trainer passes: batch_num_tokens the
    # mini-batch's valid tokens, global_batch_size its rows (ray_trainer.py 1352-1362)
    m = loss_mask.double()
    if mode == "token_mean":
        return (loss_mat * m).sum() / m.sum()
    seq_mask = (m.sum(-1) > 0).double()
    if mode == "seq_mean_token_sum_norm":
        return ((loss_mat * m).sum(-1) * seq_mask).sum() / global_batch_size / loss_scale_factor
    per_seq = (loss_mat * m).sum(-1) / m.sum(-1).clamp(min=1)  # VeRL: / (count + 1e-8); see above
    return (per_seq * seq_mask).sum() / global_batch_size


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_every_aggregation_matches_verl_with_rejected_rows(mode):
    """Rows a rejection emptied count in verl's sequence means (÷ the mini-batch's rows), not in its
    token mean; loss and gradient against the transcription, micro-batched as training accumulates."""
    gen = torch.Generator().manual_seed(3)
    loss_mat = torch.randn(6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(6, 5, generator=gen) < 0.7
    mask[[1, 4]] = False  # two rejected sequences
    ref = _ref_agg_loss(loss_mat, mask, mode, global_batch_size=6, loss_scale_factor=L_MAX)
    (ref_grad,) = torch.autograd.grad(ref, loss_mat)
    norm = denominators(mask, L_MAX)
    ours = aggregate(loss_mat[:3], mask[:3], mode, norm) + aggregate(loss_mat[3:], mask[3:], mode, norm)
    (grad,) = torch.autograd.grad(ours, loss_mat)
    assert abs(float(ours.detach() - ref.detach())) < 1e-12 and torch.allclose(grad, ref_grad, rtol=0, atol=1e-12)


# The recipes, as their scripts set them (the keys Parity's defaults come from), transcribed from
# verl-project/verl@1dda039: examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh 57, 59, 76 and
# examples/cispo_trainer/run_qwen3_8b_fsdp.sh 47, 65 (no loss_agg_mode, no norm_adv_by_std_in_grpo: the
# defaults of verl/workers/config/actor.py 165, token-mean, and core_algos.py 273, True).
RECIPES = {
    "dppo_tv": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": False, "loss_agg_mode": "seq-mean-token-sum-norm"},
    "dppo_kl": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": False, "loss_agg_mode": "seq-mean-token-sum-norm"},
    "cispo": {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True, "loss_agg_mode": "token-mean"},
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_defaults_are_the_recipes(name):
    from parity import config
    from parity.rl.train_config import TrainConfig

    recipe = RECIPES[name]
    # GRPO's advantage without the std division is Dr.GRPO's (group_advantages above)
    advantage = "grpo" if recipe["norm_adv_by_std_in_grpo"] else "drgrpo"
    aggregation = recipe["loss_agg_mode"].replace("-", "_")
    resolved = config.load(TrainConfig, None, [f"algorithm.name={name}"]).algorithm
    assert (resolved.advantage, resolved.aggregation) == (advantage, aggregation)
    # a default, not a rule: another aggregation may be asked for
    other = config.load(TrainConfig, None, [f"algorithm.name={name}", "algorithm.aggregation=seq_mean_token_mean"])
    assert other.algorithm.aggregation == "seq_mean_token_mean"


def test_kl_estimators_as_losses():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    d = ref - lp.detach()
    assert torch.allclose(kl_penalty(lp, ref, "k2"), d.square() / 2)
    assert torch.allclose(kl_penalty(lp, ref, "k3"), torch.exp(d) - d - 1)
    assert (kl_penalty(lp.detach(), lp.detach(), "k3") == 0).all()
    # Both pull π_θ toward π_ref: the gradient of the penalty has the sign of log π − log π_ref.
    for est in ("k2", "k3"):
        lp.grad = None
        kl_penalty(lp, ref, est).sum().backward()
        assert (torch.sign(lp.grad) == torch.sign(lp.detach() - ref)).all()
    with pytest.raises(ValueError, match="unknown KL estimator 'k1'"):
        kl_penalty(lp, ref, "k1")
