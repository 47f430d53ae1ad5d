"""Keeping the precision gap out of the clip: α/β metrics, phantom clipping, the collapse warning."""

from __future__ import annotations

import math
import random

import pytest
import torch

from parity import config
from parity.diagnostics import beta_metrics, clip_active, mismatch_alarm, phantom_clip_frac
from parity.loop import Run, TrainConfig

BASE = [
    "prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=48",
    "tensorboard=false",
    "algorithm.name=grpo",
    "precision=fp32",
    "rollout.precision=bf16",
    "allow_precision_mismatch=true",
]


def test_clip_activity_and_phantom_on_hand_made_tensors():
    log_r = torch.tensor([[0.25, 0.0, -0.3]])
    adv = torch.tensor([1.0])
    active = clip_active(log_r, adv, 0.2, 0.2)
    assert active.tolist() == [[True, False, False]]  # only r > 1.2 counts when A > 0
    beta = torch.tensor([[0.1, 0.0, 0.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    # Without β, log r = 0.15 < log 1.2: the clip of token 0 is phantom.
    assert math.isclose(phantom_clip_frac(log_r, beta, adv, mask, 0.2, 0.2), 1 / 3, rel_tol=1e-6)
    assert phantom_clip_frac(log_r, torch.zeros_like(beta), adv, mask, 0.2, 0.2) == 0.0


def test_beta_metrics_bins_and_correlation():
    beta = torch.tensor([[-0.2, 0.01], [0.3, -0.02]], dtype=torch.float64)
    mu = torch.log(torch.tensor([[0.05, 0.95], [0.05, 0.95]]))
    adv = torch.tensor([-1.0, 1.0])
    m = beta_metrics(beta, mu, adv, torch.ones(2, 2, dtype=torch.bool))
    assert math.isclose(m["beta/abs_mean/p_0-0.1"], 0.25) and math.isclose(m["beta/abs_mean/p_0.9-1"], 0.015)
    assert m["beta/adv_corr"] > 0.5


@pytest.mark.parametrize("source", ["recompute", "shadow", "rollout"])
def test_phantom_clip_frac_by_ratio_source(tmp_path, source):
    cfg = config.load(
        TrainConfig,
        None,
        [
            f"run_dir={tmp_path}",
            f"algorithm.ratio_source={source}",
            "algorithm.shadow_forward=true",
            "algorithm.clip_low=0.001",
            "algorithm.clip_high=0.001",
            *BASE,
        ],
    )
    run = Run.create(cfg, progress=False)
    metrics = [run.step() for _ in range(2)]
    run.rewards.close()
    for m in metrics:
        assert m["beta/abs_mean"] > 0 and "time/shadow" in m
        if source == "rollout":
            assert m["phantom/clip_frac"] > 0  # with ε = 0.001 the BF16 gap alone trips the clip
        else:
            assert m["phantom/clip_frac"] == 0.0  # β never enters the ratio: zero by construction


def test_beta_larger_for_bf16_rollout_than_fp16(tmp_path):
    sizes = {}
    for rollout in ("bf16", "fp16"):
        cfg = config.load(
            TrainConfig,
            None,
            [
                f"run_dir={tmp_path / rollout}",
                f"rollout.precision={rollout}",
                "algorithm.ratio_source=shadow",
                *BASE[:-2],
                "allow_precision_mismatch=true",
            ],
        )
        run = Run.create(cfg, progress=False)
        sizes[rollout] = run.step()["beta/abs_mean"]
        run.rewards.close()
    assert sizes["bf16"] > 3 * sizes["fp16"]


def test_alarm_fires_on_a_rising_series_not_on_flat_noise():
    rng = random.Random(0)
    flat = [1e-6 * math.exp(rng.gauss(0, 1.0)) for _ in range(200)]
    assert not any(mismatch_alarm(flat[:n], 20, 4.0) for n in range(1, 201))
    rising = [1e-6 * math.exp(0.05 * i + rng.gauss(0, 0.5)) for i in range(200)]
    fired = [n for n in range(1, 201) if mismatch_alarm(rising[:n], 20, 4.0)]
    assert fired and fired[0] < 100
    # A level shift that has settled up is not "rising" any more.
    settled = [1e-6] * 40 + [1e-5] * 60
    assert not mismatch_alarm(settled, 20, 4.0)


def test_on_alarm_stop_ends_the_run(tmp_path):
    cfg = config.load(
        TrainConfig,
        None,
        [
            f"run_dir={tmp_path}",
            "steps=6",
            "health.alarm_window=2",
            "health.alarm_factor=0",
            "health.on_alarm=stop",
            "checkpoint_every=-1",
            *BASE[:4],
        ],
    )
    run = Run.create(cfg, progress=False)
    history = run.train()
    assert history[-1]["health/mismatch_alarm"] == 1 and len(history) < 6
    assert (tmp_path / "checkpoints").is_dir()  # stop saves a checkpoint first


@pytest.mark.slow
def test_phantom_command_end_to_end(tmp_path):
    import json

    from parity.cli import main

    out = tmp_path / "phantom"
    assert main(["phantom", "--out", str(out), "--steps", "6", "--eps", "0.001"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    assert len(runs) == 5
    assert runs["fp32-train/bf16-roll, ratio vs recompute"]["phantom_clip_frac_mean"] == 0.0
    assert runs["fp32-train/bf16-roll, ratio vs shadow"]["phantom_clip_frac_mean"] == 0.0
    assert runs["fp32-train/bf16-roll, ratio vs rollout μ, ε=0.001"]["phantom_clip_frac_mean"] > 0.0
    assert summary["base_beta"]["beta/abs_mean"] > 0
    for name in ("report.md", "phantom.png", "beta.png"):
        assert (out / name).stat().st_size > 0
