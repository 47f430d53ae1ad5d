"""Keeping the mismatch out of the clip: the three policies, g = β + κ, phantom clipping, the collapse warning."""

from __future__ import annotations

import math
import random

import pytest
import torch

from conftest import ONE_RAY_AT_A_TIME, TINY, metrics
from parity import config
from parity.rl.algorithms import LossConfig, clip_active, token_clipped
from parity.rl.diagnostics import gap_metrics, mismatch_alarm, phantom_clip_frac
from parity.rl.loop import Run
from parity.rl.train_config import TrainConfig

SMALL = [*TINY, "rollout.max_new_tokens=48"]
PAIRS = {
    "fp32/bf16": ["precision=fp32", "rollout.precision=bf16", "allow_precision_mismatch=true"],
    "bf16/bf16": ["precision=bf16"],
    "fp16/fp16": ["precision=fp16"],
}
TIGHT_CLIP = ["algorithm.name=grpo", "algorithm.clip_low=0.001", "algorithm.clip_high=0.001"]


def _steps(tmp_path, overrides: list[str], steps: int = 2) -> list[dict]:
    cfg = config.load(TrainConfig, None, [f"run_dir={tmp_path}", *SMALL, *overrides])
    run = Run.create(cfg, progress=False)
    try:
        return [run.step() for _ in range(steps)]
    finally:
        run.rewards.close()


def test_clip_activity_and_phantom_on_hand_made_tensors():
    theta = torch.tensor([[0.25, 0.0, -0.3]])  # π_θ, with μ = 0: r vs μ = exp(π_θ)
    mu = torch.zeros(1, 3)
    adv = torch.tensor([1.0])
    cfg = LossConfig(0.2, 0.2)
    assert clip_active(torch.exp(theta - mu), adv, 0.2, 0.2).tolist() == [[True, False, False]]  # r > 1.2, A > 0
    mask = torch.ones(1, 3, dtype=torch.bool)
    # Against π_old the first token's log-ratio is 0.15 < log 1.2: its clip is the mismatch's doing.
    old = torch.tensor([[0.10, 0.0, 0.0]])
    by_gap, by_policy = (token_clipped(theta, ref, adv, mask, cfg) for ref in (mu, old))
    assert math.isclose(float(phantom_clip_frac(by_gap, by_policy, mask)), 1 / 3, rel_tol=1e-6)
    # A clip the policy change alone causes is not phantom.
    assert float(phantom_clip_frac(by_gap, by_gap, mask)) == 0.0


def test_gap_metrics_bins_and_correlation():
    beta = torch.tensor([[-0.2, 0.01], [0.3, -0.02]], dtype=torch.float64)
    mu = torch.log(torch.tensor([[0.05, 0.95], [0.05, 0.95]]))
    adv = torch.tensor([-1.0, 1.0])
    m = gap_metrics("kappa", beta, mu, adv, torch.ones(2, 2, dtype=torch.bool))
    assert math.isclose(m["kappa/abs_mean/p_0-0.1"], 0.25) and math.isclose(m["kappa/abs_mean/p_0.9-1"], 0.015)
    assert math.isclose(m["kappa/abs_max"], 0.3) and m["kappa/adv_corr"] > 0.5


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("source", ["recompute", "shadow", "rollout"])
def test_one_update_clips_only_what_the_ratio_source_lets_in(tmp_path, pair, source):
    """At one update per rollout the policy has not changed when the ratio is taken (α = 0):
    against π_old (recompute, shadow) nothing is clipped whatever the precisions; against μ
    every clipped token is phantom, so the two fractions are equal."""
    metrics = _steps(tmp_path, [*PAIRS[pair], *TIGHT_CLIP, f"algorithm.ratio_source={source}"])
    for m in metrics:
        assert m["alpha/abs_mean"] == 0.0  # the sampler's π_old is bit-identical to the trainer's pass
        if source == "rollout":
            assert m["phantom/clip_frac"] == m["clip/frac"]
        else:
            assert m["clip/frac"] == 0.0
        if pair != "fp16/fp16":  # ε = 0.001: BF16's gap alone trips the clip, in matched precision too
            assert m["phantom/clip_frac"] > 0
        assert m["train/old_logprob_pass"] == 0  # shadow: the sampler scored π_old; otherwise the first pass


def test_gap_splits_into_beta_and_kappa(tmp_path):
    (m,) = _steps(tmp_path / "probe", [*PAIRS["fp32/bf16"], "algorithm.probe=true"], steps=1)
    assert m["beta/abs_mean"] > 0 and m["kappa/abs_mean"] > 0 and m["time/score"] > 0
    assert math.isclose(m["gap/mean"], m["beta/mean"] + m["kappa/mean"], rel_tol=1e-5, abs_tol=1e-9)
    # Without the probe in mismatched precision β and κ are unknown and not logged.
    (m,) = _steps(tmp_path / "no-probe", PAIRS["fp32/bf16"], steps=1)
    assert "beta/abs_mean" not in m and "gap/abs_mean" in m
    # In matched precision β is 0 by definition and κ is the whole gap, with no probe forward.
    (m,) = _steps(tmp_path / "matched", PAIRS["bf16/bf16"], steps=1)
    assert m["beta/abs_max"] == 0.0 and m["kappa/abs_mean"] == m["gap/abs_mean"] > 0


def test_several_updates_separate_the_policy_change_from_the_gap(tmp_path):
    """With four updates per rollout α > 0 and the ratio against π_old clips; phantom clipping
    stays the part the gap adds."""
    metrics = _steps(tmp_path, [*PAIRS["bf16/bf16"], *TIGHT_CLIP, "algorithm.num_minibatches=4"], steps=1)
    (m,) = metrics
    assert m["train/old_logprob_pass"] == 1 and m["alpha/abs_mean"] > 0 and m["clip/frac"] > 0


def test_beta_larger_for_bf16_rollout_than_fp16(tmp_path):
    sizes = {}
    for rollout in ("bf16", "fp16"):
        keys = ["precision=fp32", f"rollout.precision={rollout}", "allow_precision_mismatch=true"]
        (m,) = _steps(tmp_path / rollout, [*keys, "algorithm.probe=true"], steps=1)
        sizes[rollout] = m["beta/abs_mean"]
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
            "steps=8",
            "health.alarm_window=2",
            "health.alarm_factor=0",
            "health.on_alarm=stop",
            "checkpoint_every=-1",
            *SMALL,
        ],
    )
    run = Run.create(cfg, progress=False)
    history = run.train()
    assert history[-1]["health/mismatch_alarm"] == 1 and len(history) < 8
    assert (tmp_path / "checkpoints").is_dir()  # stop saves a checkpoint first


@pytest.mark.slow
def test_phantom_command_end_to_end(tmp_path):
    import json

    from parity.cli import main

    out = tmp_path / "phantom"
    assert main(["phantom", "--out", str(out), "--steps", "1", "--eps", "0.001"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    one = summary["one_update"]
    assert len(one) == 9
    for name, row in one.items():
        if name.endswith("rollout"):
            assert row["phantom/clip_frac"] == row["clip/frac"] > 0
        else:
            assert row["clip/frac"] == 0 and row["phantom/clip_frac"] > 0
    runs = summary["runs"]
    assert len(runs) == 6
    assert runs["fp32-train/bf16-roll, ratio vs rollout, ε=0.001"]["phantom_clip_frac_mean"] > 0.0
    assert summary["base_parts_bf16_rollout"]["beta/abs_mean"] > summary["base_parts_fp16_rollout"]["beta/abs_mean"]
    for name in ("report.md", "phantom.png", "beta.png"):
        assert (out / name).stat().st_size > 0


@ONE_RAY_AT_A_TIME
@pytest.mark.slow
def test_writeup_experiment_on_a_checkpoint(llama_dir, tmp_path, ray_cluster):
    """`parity phantom --model`'s arms on a real (tiny) checkpoint, synchronous and on Ray: with one update per
    rollout every clip of the ratio against μ is phantom, the ratio against π_old clips nothing at step 1, the
    clip can be switched off, and matched FP16 has no precision gap β."""
    import functools
    import json

    from parity.commands.phantom import run_writeup

    out = tmp_path / "writeup"
    small = ("prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=16")
    writeup = functools.partial(
        run_writeup,
        str(llama_dir),
        out,
        seeds=(0,),
        overrides=small,
        prompts=("12+34=", "hello ", "7+8=", "abc"),
        eps=0.001,
        log=lambda _: None,
    )
    summary = writeup(steps=2)
    arms = {name: arm["seeds"]["0"] for name, arm in summary["arms"].items()}
    assert list(arms) == [
        "ratio vs μ",
        "ratio vs π_old (shadow)",
        "no clip",
        "fp16 matched, ratio vs μ",
        "async, ratio vs μ",
        "async, ratio vs π_old (shadow)",
    ]
    for name in ("ratio vs μ", "async, ratio vs μ"):
        assert arms[name]["phantom_clip_frac_step1"] == arms[name]["clip_frac_step1"] > 0
    for name in ("ratio vs π_old (shadow)", "async, ratio vs π_old (shadow)"):
        assert arms[name]["clip_frac_step1"] == 0 < arms[name]["phantom_clip_frac_step1"]
    assert arms["no clip"]["clip_frac_mean"] == arms["no clip"]["phantom_clip_frac_mean"] == 0
    assert arms["fp16 matched, ratio vs μ"]["beta_abs_mean"] == 0 < arms["ratio vs μ"]["beta_abs_mean"]
    assert any(v for v in arms["ratio vs μ"]["beta_abs_by_prob"].values())
    report = (out / "report.md").read_text()
    assert "against the write-up's 18%" in report and "| no clip | 0 |" in report
    for name in ("summary.json", "phantom.png", "beta_by_prob.png", "prompts.jsonl"):
        assert (out / name).stat().st_size > 0
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [(r["arm"], r["step"]) for r in steps] == [(name, step) for name in arms for step in (1, 2)]
    assert steps[0]["phantom/clip_frac"] == arms["ratio vs μ"]["phantom_clip_frac_step1"]
    # Called again, the finished runs are read back, not trained again; a changed setting trains anew.
    logged = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/metrics.jsonl")}
    again = writeup(steps=2, with_async=False)
    assert {name: arm["seeds"]["0"] for name, arm in again["arms"].items()} == {k: arms[k] for k in list(arms)[:4]}
    assert {p: p.stat().st_mtime_ns for p in out.glob("runs/*/metrics.jsonl")} == logged
    writeup(steps=3, with_async=False)
    assert len(metrics(out / "runs" / "no-clip-seed0")) == 3


def test_phantom_refuses_overrides_without_a_model(capsys):
    from parity.cli import main

    assert main(["phantom", "trainer.lr=1e-6"]) == 2
    assert "go with --model DIR" in capsys.readouterr().err
