"""TRL's reward and advantage arithmetic, transcribed here from huggingface/trl 1.16
(trl/trainer/grpo_trainer.py, `_generate_and_score_completions`; trl/trainer/utils.py, `nanstd`) on
contiguous groups of `g` rows, and Parity's `trl_*` advantages checked against it in float64."""

from __future__ import annotations

import math

import pytest
import torch

from parity.config import ConfigError
from parity.rl.algorithms import (
    ADVANTAGE_FNS,
    PER_FUNCTION_ADVANTAGES,
    AlgorithmConfig,
    group_advantages,
    trl_advantage,
    weighted_rewards,
)
from parity.rl.tasks import TASKS


def trl_nanstd(x: torch.Tensor, dim=None, keepdim=False) -> torch.Tensor:
    """TRL's nanstd: the NaN-skipping mean of squared deviations times n/(n-1); NaN where n < 2."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    # TRL divides the integer counts, which gives torch's default float32: n/(n-1) rounded to float32 (1e-8
    # relative), which TRL's float32 rewards never resolve. Taken in the values' dtype here, for float64.
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True).to(x.dtype)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, math.nan))
    std = torch.sqrt(variance * correction)
    return std if keepdim else std.squeeze(dim) if dim is not None else std.squeeze()


def trl_advantages(scores: torch.Tensor, weights: torch.Tensor, g: int, scale: str, aggregation: str) -> torch.Tensor:
    """TRL's advantages: `scores` [B, K] (NaN where a function returned None), `weights` [K], groups of g rows."""
    unscorable = torch.isnan(scores).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (scores * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = math.nan
        mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
        if scale in ("group", "none"):
            std = trl_nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
        else:  # batch
            std = trl_nanstd(rewards).expand_as(rewards)
        advantages = rewards - mean
        if scale != "none":
            advantages = advantages / (std + 1e-4)
    else:  # normalize_then_sum
        grouped = scores.view(-1, g, scores.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = trl_nanstd(grouped, dim=1, keepdim=True)
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, scores.shape[1])
        rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = math.nan
        advantages = (rewards - torch.nanmean(rewards)) / (trl_nanstd(rewards) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def _scores(seed: int, prompts: int, g: int, k: int, none_frac: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(prompts * g, k, generator=gen, dtype=torch.float64)
    scores[torch.rand(prompts * g, k, generator=gen) < none_frac] = math.nan
    scores[1] = math.nan  # a row no function scored
    scores[:, 0][: g - 1] = math.nan  # a group where function 0 scored one row only (its std is NaN)
    scores[2 * g : 3 * g] = math.nan  # a group no function scored
    scores[3 * g : 4 * g, :] = 0.5  # a group whose rewards are all equal
    return scores


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize(
    ("scale", "aggregation"),
    [
        ("group", "sum_then_normalize"),
        ("batch", "sum_then_normalize"),
        ("none", "sum_then_normalize"),
        (None, "normalize_then_sum"),
    ],
)
def test_trl_advantages_match_trl(seed, k, scale, aggregation):
    g, prompts = 4, 6
    scores = _scores(seed, prompts, g, k, none_frac=0.3)
    weights = torch.tensor([1.0, 0.5, -2.0][:k], dtype=torch.float64)
    group_index = torch.arange(prompts).repeat_interleave(g)
    kind = trl_advantage(scale, aggregation)
    rewards = weighted_rewards(scores, weights)
    got = group_advantages(rewards, group_index, kind, scores, weights)
    want = trl_advantages(scores, weights, g, scale, aggregation)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert got[1] == 0 and (got[2 * g : 3 * g] == 0).all()  # unscored: advantage 0
    if aggregation == "sum_then_normalize":
        assert (got[3 * g : 4 * g] == 0).all()  # equal rewards: no signal


def test_weighted_rewards_is_trls_nansum():
    scores = torch.tensor([[1.0, math.nan], [math.nan, math.nan], [2.0, 3.0]], dtype=torch.float64)
    got = weighted_rewards(scores, torch.tensor([2.0, 0.5], dtype=torch.float64))
    assert got[0] == 2.0 and math.isnan(got[1]) and got[2] == 5.5


def test_trl_advantages_are_registered_and_parity_s_keep_their_values():
    assert {"trl_group", "trl_batch", "trl_none", "trl_normalize_then_sum"} <= set(ADVANTAGE_FNS)
    assert PER_FUNCTION_ADVANTAGES == {"trl_normalize_then_sum"}
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    # grpo: ε = 1e-6, unbiased std; TRL's group scaling differs only by its ε of 1e-4
    grpo = group_advantages(rewards, groups, "grpo")
    trl = group_advantages(rewards, groups, "trl_group")
    std = rewards[:3].std()
    assert grpo[0] == pytest.approx((1 - 1 / 3) / (std + 1e-6), abs=1e-12)
    assert trl[0] == pytest.approx((1 - 1 / 3) / (std + 1e-4), abs=1e-12)
    trl_none = group_advantages(rewards, groups, "trl_none")
    torch.testing.assert_close(trl_none, group_advantages(rewards, groups, "drgrpo"))


def test_parity_advantages_leave_out_unscored_rows():
    """grpo and drgrpo on a batch with a None row: the row's advantage is 0 and its group's baseline is
    that of the scored rows; without NaN they are unchanged."""
    rewards = torch.tensor([1.0, math.nan, 0.0, 3.0, 1.0, 2.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    for kind in ("grpo", "drgrpo"):
        got = group_advantages(rewards, groups, kind)
        kept = torch.tensor([0, 2, 3, 4, 5])
        assert got[1] == 0
        torch.testing.assert_close(got[kept], group_advantages(rewards[kept], groups[kept], kind))
        assert not got.isnan().any()


@pytest.mark.parametrize(
    ("keys", "advantage", "scale", "aggregation"),
    [
        ({"scale_rewards": "batch"}, "trl_batch", "batch", "sum_then_normalize"),
        ({"scale_rewards": True}, "trl_group", "group", "sum_then_normalize"),
        ({"scale_rewards": False}, "trl_none", "none", "sum_then_normalize"),
        ({"multi_objective_aggregation": "normalize_then_sum"}, "trl_normalize_then_sum", None, "normalize_then_sum"),
        ({"advantage": "trl_group"}, "trl_group", "group", "sum_then_normalize"),
        ({}, "drgrpo", None, None),
    ],
)
def test_trl_keys_choose_the_advantage(keys, advantage, scale, aggregation):
    a = AlgorithmConfig(name="grpo", **keys)
    a.resolve(TASKS["builtin"])
    assert (a.advantage, a.scale_rewards, a.multi_objective_aggregation) == (advantage, scale, aggregation)
    a.resolve(TASKS["builtin"])  # config.yaml's resolved values load again
    assert a.advantage == advantage


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"scale_rewards": "std"}, r"^algorithm.scale_rewards: unknown value 'std'; allowed: batch, group, none$"),
        ({"scale_rewards": "group", "advantage": "grpo"}, r"^algorithm.advantage=grpo: .* choose advantage trl_group"),
        (
            {"scale_rewards": "batch", "multi_objective_aggregation": "normalize_then_sum"},
            r"^algorithm.scale_rewards=batch: no effect with",
        ),
        ({"multi_objective_aggregation": "sum"}, r"^algorithm.multi_objective_aggregation: unknown value 'sum'"),
    ],
)
def test_trl_keys_refused(keys, message):
    with pytest.raises(ConfigError, match=message):
        AlgorithmConfig(name="grpo", **keys).resolve(TASKS["builtin"])
