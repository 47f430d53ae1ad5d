"""`parity phantom`: the phantom-clipping experiment on the length task.

A trainer in FP32 and a rollout engine in BF16, PPO clip (`grpo`), reward =
−length (optimum: EOS at once). With the ratio taken against the rollout's μ
(`ratio_source=rollout`, as asynchronous trainers do) the precision gap β sits
inside the ratio; `recompute` and `shadow` keep it out; matched FP16 shrinks it.
Each run logs the mean response length and `phantom/clip_frac`; a final sweep of
ε with `ratio_source=rollout` finds where β alone starts to trip the clip.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from parity import config as config_mod
from parity.diagnostics import beta_metrics
from parity.files import atomic_write_json, atomic_write_text
from parity.loop import Run, TrainConfig
from parity.models import load_model, load_tokenizer, resolve_model_dir
from parity.report import Panel, plot_beta_distribution, plot_curves
from parity.rollout import RolloutEngine, SamplingParams
from parity.tasks import ArithmeticTask
from parity.trainer import OptimConfig, Trainer

TARGET_LENGTH = 2.0


@dataclass(frozen=True)
class PhantomRun:
    name: str
    overrides: tuple[str, ...]


MISMATCHED = ("precision=fp32", "rollout.precision=bf16", "allow_precision_mismatch=true")


def default_runs(eps_sweep: tuple[float, ...]) -> list[PhantomRun]:
    runs = [
        PhantomRun("fp32-train/bf16-roll, ratio vs rollout μ", (*MISMATCHED, "algorithm.ratio_source=rollout")),
        PhantomRun("fp32-train/bf16-roll, ratio vs recompute", (*MISMATCHED, "algorithm.ratio_source=recompute")),
        PhantomRun("fp32-train/bf16-roll, ratio vs shadow", (*MISMATCHED, "algorithm.ratio_source=shadow")),
        PhantomRun("fp16 matched, ratio vs rollout μ", ("precision=fp16", "algorithm.ratio_source=rollout")),
    ]
    for eps in eps_sweep:
        runs.append(
            PhantomRun(
                f"fp32-train/bf16-roll, ratio vs rollout μ, ε={eps:g}",
                (
                    *MISMATCHED,
                    "algorithm.ratio_source=rollout",
                    f"algorithm.clip_low={eps}",
                    f"algorithm.clip_high={eps}",
                ),
            )
        )
    return runs


def steps_to_length(history: list[dict], target: float = TARGET_LENGTH) -> int | None:
    return next((m["step"] for m in history if m["response/length_mean"] <= target), None)


def beta_distribution(
    model: str, num_prompts: int, seed: int, rollout_precision: str = "bf16"
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Token-level β = π^{FP32} − π^{P_roll} (trainer code path, same weights) on samples
    drawn by a rollout engine in `rollout_precision`."""
    model_dir = resolve_model_dir(model)
    tok = load_tokenizer(model_dir)
    base = load_model(model_dir)
    trainer = Trainer(base, "fp32", OptimConfig())
    engine = RolloutEngine(base.config, rollout_precision, tok.eos_id, tok.pad_id)
    engine.load_weights(*trainer.export_weights())
    prompts = [tok.encode(p.prompt) for p in ArithmeticTask().problems(num_prompts, seed=seed, split="eval")]
    batch = engine.generate(prompts, 4, SamplingParams(max_new_tokens=96), seed=seed)
    with torch.no_grad():
        args = (batch.prompt_ids, batch.response_ids, batch.response_mask)
        beta = trainer.logprobs(*args) - trainer.logprobs(*args, precision=rollout_precision)
    stats = beta_metrics(beta, batch.rollout_logprobs, torch.zeros(beta.shape[0]), batch.response_mask)
    stats.pop("beta/adv_corr")
    return beta[batch.response_mask], batch.rollout_logprobs[batch.response_mask].exp(), stats


def run_phantom(out: Path, steps: int, eps_sweep: tuple[float, ...], seed: int = 0, log=print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    beta, probs, beta_stats = beta_distribution("builtin", 64, seed, "bf16")
    plot_beta_distribution(beta, probs, out / "beta.png")
    beta_fp16 = beta_distribution("builtin", 64, seed, "fp16")[2]
    histories: dict[str, list[dict]] = {}
    runs = default_runs(eps_sweep)
    for i, run in enumerate(runs, 1):
        run_dir = out / "runs" / f"run{i}"
        shutil.rmtree(run_dir, ignore_errors=True)
        cfg = config_mod.load(
            TrainConfig,
            None,
            [
                "task.name=length",
                "algorithm.name=grpo",
                "algorithm.shadow_forward=true",
                f"steps={steps}",
                "prompts_per_step=8",
                "rollout.group_size=8",
                f"seed={seed}",
                f"run_dir={run_dir}",
                "checkpoint_every=-1",
                "tensorboard=false",
                *run.overrides,
            ],
        )
        log(f"run {i}/{len(runs)}: {run.name}")
        histories[run.name] = Run.create(cfg).train()
    plot_curves(
        histories,
        [
            Panel("response/length_mean", "Mean response length (length task)", log=True, hline=TARGET_LENGTH),
            Panel("phantom/clip_frac", "Phantom clip fraction"),
        ],
        out / "phantom.png",
    )
    summary = {
        "steps": steps,
        "base_beta": beta_stats,
        "base_beta_fp16_rollout": beta_fp16,
        "runs": {
            name: {
                "steps_to_length_2": steps_to_length(h),
                "final_length": h[-1]["response/length_mean"],
                "phantom_clip_frac_mean": sum(m.get("phantom/clip_frac", 0.0) for m in h) / len(h),
                "phantom_clip_frac_first10": sum(m.get("phantom/clip_frac", 0.0) for m in h[:10]) / min(10, len(h)),
                "beta_abs_mean": sum(m["beta/abs_mean"] for m in h) / len(h),
                "clip_frac_first10": sum(m.get("clip/frac", 0.0) for m in h[:10]) / min(10, len(h)),
            }
            for name, h in histories.items()
        },
        "wall_seconds": round(time.perf_counter() - start, 1),
    }
    atomic_write_json(out / "summary.json", summary)
    atomic_write_text(out / "report.md", render_report(summary))
    return summary


def render_report(summary: dict) -> str:
    b, f = summary["base_beta"], summary["base_beta_fp16_rollout"]
    rows = [
        f"| {name} | {'—' if r['steps_to_length_2'] is None else r['steps_to_length_2']} | {r['final_length']:.1f} | "
        f"{r['phantom_clip_frac_first10']:.4f} | {r['phantom_clip_frac_mean']:.4f} | {r['clip_frac_first10']:.4f} | "
        f"{r['beta_abs_mean']:.2e} |"
        for name, r in summary["runs"].items()
    ]
    bins = ", ".join(f"{k.split('/')[-1]}: {v:.2e}" for k, v in b.items() if "/p_" in k)
    return "\n".join(
        [
            "# Phantom clipping on the length task",
            "",
            f"`grpo` (PPO clip, ε = 0.2 unless stated), reward = −length, {summary['steps']} steps of 8 prompts × 8 "
            f"samples per run, {summary['wall_seconds']:.0f} s in all. Steps to length ≤ {TARGET_LENGTH:g}: the "
            "first step whose mean response length is at most 2 tokens.",
            "",
            "| run | steps to length ≤ 2 | final length | phantom clip frac (first 10 steps) | phantom clip frac "
            "(all) | clip frac (first 10) | mean \\|β\\| |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"β of the base model (FP32 trainer vs BF16, same weights, trainer code path): mean {b['beta/mean']:.2e}, "
            f"mean |β| {b['beta/abs_mean']:.2e}, max |β| {b['beta/abs_max']:.2e}; mean |β| by token probability "
            f"({bins}).",
            "",
            f"For comparison, FP32 trainer vs FP16 (same weights): mean |β| {f['beta/abs_mean']:.2e}, max |β| "
            f"{f['beta/abs_max']:.2e} — BF16's β is {b['beta/abs_mean'] / max(f['beta/abs_mean'], 1e-30):.1f}× "
            "larger on average.",
            "",
            "![length and phantom clip fraction](phantom.png)",
            "",
            "![β distribution](beta.png)",
            "",
        ]
    )
