"""`parity phantom`: the phantom-clipping experiment on the length task.

A PPO clip (`grpo`) on reward = −length (optimum: EOS at once). The mismatch
g = π_old − μ splits into β (precision: the trainer's code path in the trainer
precision against the same path in the rollout precision) and κ (engine: that
probe against the rollout engine's μ). A token is phantom-clipped when its clip
is active on the ratio against μ and not on the ratio against π_old. Two parts:

- one update per rollout, ε = 0.001, for FP32/BF16, BF16/BF16 and FP16/FP16 under
  each ratio source: the true policy change α is 0, so every clipped token is the
  mismatch's doing, and a ratio against π_old (recompute, shadow) clips nothing;
- training runs to length ≤ 2 under each ratio source, matched precisions, and a
  sweep of ε with the ratio against μ, to see when the mismatch alone stalls learning.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from parity import config as config_mod
from parity.commands.report import Panel, plot_beta_distribution, plot_curves
from parity.engines import kernels
from parity.engines.models import export_state, load_model, resolve_model_dir
from parity.engines.sampler import Sampler
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import load_tokenizer
from parity.files import atomic_write_json, atomic_write_text
from parity.rl.diagnostics import gap_metrics
from parity.rl.loop import Run
from parity.rl.tasks import ArithmeticTask
from parity.rl.train_config import TrainConfig
from parity.rundir import remove_run

TARGET_LENGTH = 2.0
ONE_UPDATE_EPS = 0.001
ONE_UPDATE_STEPS = 5
RATIO_SOURCES = ("rollout", "recompute", "shadow")
PAIRS = {
    "fp32/bf16": ("precision=fp32", "rollout.precision=bf16", "allow_precision_mismatch=true"),
    "bf16/bf16": ("precision=bf16",),
    "fp16/fp16": ("precision=fp16",),
}


@dataclass(frozen=True)
class PhantomRun:
    name: str
    overrides: tuple[str, ...]


def default_runs(eps_sweep: tuple[float, ...]) -> list[PhantomRun]:
    mismatched = PAIRS["fp32/bf16"]
    runs = [
        PhantomRun(f"fp32-train/bf16-roll, ratio vs {source}", (*mismatched, f"algorithm.ratio_source={source}"))
        for source in RATIO_SOURCES
    ]
    runs += [
        PhantomRun("bf16 matched, ratio vs rollout", (*PAIRS["bf16/bf16"], "algorithm.ratio_source=rollout")),
        PhantomRun("fp16 matched, ratio vs rollout", (*PAIRS["fp16/fp16"], "algorithm.ratio_source=rollout")),
    ]
    for eps in eps_sweep:
        runs.append(
            PhantomRun(
                f"fp32-train/bf16-roll, ratio vs rollout, ε={eps:g}",
                (
                    *mismatched,
                    "algorithm.ratio_source=rollout",
                    f"algorithm.clip_low={eps}",
                    f"algorithm.clip_high={eps}",
                ),
            )
        )
    return runs


def steps_to_length(history: list[dict], target: float = TARGET_LENGTH) -> int | None:
    return next((m["step"] for m in history if m["response/length_mean"] <= target), None)


def _config(run_dir: Path, steps: int, seed: int, overrides: tuple[str, ...]) -> TrainConfig:
    return config_mod.load(
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
            *overrides,
        ],
    )


def train_length_task(
    run_dir: Path, steps: int, seed: int, overrides: tuple[str, ...], progress: bool = False
) -> list[dict]:
    remove_run(run_dir)
    return Run.create(_config(run_dir, steps, seed, overrides), progress=progress).train()


ONE_UPDATE_KEYS = (
    "clip/frac",
    "phantom/clip_frac",
    "alpha/abs_mean",
    "gap/abs_mean",
    "beta/abs_mean",
    "kappa/abs_mean",
)


def one_update_table(out: Path, seed: int, log=print, overrides: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """At one update per rollout (α = 0) and ε = 0.001: each precision pair under each ratio
    source, the step means of the clip and phantom fractions and of |α|, |g|, |β|, |κ|."""
    table = {}
    eps = (f"algorithm.clip_low={ONE_UPDATE_EPS}", f"algorithm.clip_high={ONE_UPDATE_EPS}")
    for pair, keys in PAIRS.items():
        for source in RATIO_SOURCES:
            log(f"one update: {pair}, ratio vs {source}")
            history = train_length_task(
                out / "one-update" / f"{pair.replace('/', '-')}-{source}",
                ONE_UPDATE_STEPS,
                seed,
                (*keys, *eps, f"algorithm.ratio_source={source}", *overrides),
            )
            table[f"{pair} {source}"] = {k: statistics.mean(m[k] for m in history) for k in ONE_UPDATE_KEYS}
    return table


def mismatch_parts(
    model: str, num_prompts: int, seed: int, rollout_precision: str = "bf16", device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Token-level β (FP32 against `rollout_precision`, the trainer's code path on the same
    weights) and κ (that probe against the rollout engine's μ), on samples the engine drew."""
    model_dir = resolve_model_dir(model)
    tok = load_tokenizer(model_dir)
    base = load_model(model_dir).to(device)
    sampler = Sampler(
        base.config,
        rollout_precision,
        "fp32",
        tok.eos_ids,
        tok.pad_id,
        score_old=True,
        probe=True,
        micro_batch_size=64,
        numerics=kernels.numerics(device),
    )
    sampler.load_weights(export_state(base), version=0)
    problems = ArithmeticTask().problems(num_prompts, seed=seed, split="eval")
    prompts = [tok.encode_prompt(p.prompt) for p in problems]
    batch = sampler.generate(prompts, 4, SamplingParams(max_new_tokens=96), seed=seed)
    sampler.score_samples(batch)
    mu, mask = batch.rollout_logprobs, batch.response_mask
    beta = batch.old_logprobs - batch.probe_logprobs
    no_adv = torch.zeros(beta.shape[0], device=beta.device)
    stats = {
        **gap_metrics("beta", beta, mu, no_adv, mask),
        **gap_metrics("kappa", batch.probe_logprobs - mu, mu, no_adv, mask),
    }
    for key in ("beta/adv_corr", "kappa/adv_corr"):
        stats.pop(key)
    return beta[mask], mu[mask].exp(), stats


def run_phantom(
    out: Path, steps: int, eps_sweep: tuple[float, ...], seed: int = 0, log=print, device: str = "cpu"
) -> dict:
    """The experiment (see the module's docstring); every model runs on `device`."""
    kernels.check_device(device, "--device")
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    beta, probs, parts_bf16 = mismatch_parts("builtin", 64, seed, "bf16", device)
    plot_beta_distribution(beta.cpu(), probs.cpu(), out / "beta.png")
    parts_fp16 = mismatch_parts("builtin", 64, seed, "fp16", device)[2]
    device_key = (f"device={device}",)
    one_update = one_update_table(out, seed, log, device_key)
    histories: dict[str, list[dict]] = {}
    runs = default_runs(eps_sweep)
    for i, run in enumerate(runs, 1):
        log(f"run {i}/{len(runs)}: {run.name}")
        histories[run.name] = train_length_task(
            out / "runs" / f"run{i}", steps, seed, (*run.overrides, *device_key), True
        )
    plot_curves(
        histories,
        [
            Panel("response/length_mean", "Mean response length (length task)", log=True, hline=TARGET_LENGTH),
            Panel("phantom/clip_frac", "Phantom clip fraction"),
        ],
        out / "phantom.png",
    )

    def mean(h: list[dict], key: str, first: int | None = None) -> float:
        return statistics.mean(m[key] for m in h[:first])

    summary = {
        "steps": steps,
        "one_update": one_update,
        "base_parts_bf16_rollout": parts_bf16,
        "base_parts_fp16_rollout": parts_fp16,
        "runs": {
            name: {
                "steps_to_length_2": steps_to_length(h),
                "final_length": h[-1]["response/length_mean"],
                "clip_frac_first10": mean(h, "clip/frac", 10),
                "phantom_clip_frac_first10": mean(h, "phantom/clip_frac", 10),
                "phantom_clip_frac_mean": mean(h, "phantom/clip_frac"),
                "beta_abs_mean": mean(h, "beta/abs_mean"),
                "kappa_abs_mean": mean(h, "kappa/abs_mean"),
            }
            for name, h in histories.items()
        },
        "wall_seconds": round(time.perf_counter() - start, 1),
    }
    atomic_write_json(out / "summary.json", summary)
    atomic_write_text(out / "report.md", render_report(summary))
    return summary


def render_report(summary: dict) -> str:
    b, f = summary["base_parts_bf16_rollout"], summary["base_parts_fp16_rollout"]
    one = [
        f"| {name.replace(' ', ' | ')} | "
        + " | ".join(f"{r[k]:.4f}" if "frac" in k else f"{r[k]:.2e}" for k in ONE_UPDATE_KEYS)
        + " |"
        for name, r in summary["one_update"].items()
    ]
    rows = [
        f"| {name} | {'—' if r['steps_to_length_2'] is None else r['steps_to_length_2']} | {r['final_length']:.1f} | "
        f"{r['clip_frac_first10']:.4f} | {r['phantom_clip_frac_first10']:.4f} | {r['phantom_clip_frac_mean']:.4f} | "
        f"{r['beta_abs_mean']:.2e} | {r['kappa_abs_mean']:.2e} |"
        for name, r in summary["runs"].items()
    ]

    def bins(stats: dict, part: str) -> str:
        return ", ".join(
            f"{k.split('/')[-1]}: {v:.2e}" for k, v in stats.items() if k.startswith(f"{part}/abs_mean/p_")
        )

    return "\n".join(
        [
            "# Phantom clipping on the length task",
            "",
            "The mismatch g = π_old − μ = β + κ: β = trainer code path in the trainer precision minus the same path "
            "in the rollout precision (same weights), κ = that probe minus the rollout engine's μ. A token is "
            "phantom-clipped when its clip is active on log π_θ − μ and not on log π_θ − π_old.",
            "",
            f"## One update per rollout, ε = {ONE_UPDATE_EPS:g}",
            "",
            f"`grpo`, reward = −length, {ONE_UPDATE_STEPS} steps of 8 prompts × 8 samples each; the policy has not "
            "changed when the ratio is taken (α = 0), so every clipped token is the mismatch's doing. Means over "
            "steps.",
            "",
            "| trainer/rollout | ratio vs | clip frac | phantom clip frac | mean \\|α\\| | mean \\|g\\| | "
            "mean \\|β\\| | mean \\|κ\\| |",
            "|---|---|---|---|---|---|---|---|",
            *one,
            "",
            "## Training to length ≤ 2",
            "",
            f"`grpo` (PPO clip, ε = 0.2 unless stated), {summary['steps']} steps of 8 prompts × 8 samples per run. "
            f"Steps to length ≤ {TARGET_LENGTH:g}: the first step whose mean response length is at most 2 tokens.",
            "",
            "| run | steps to length ≤ 2 | final length | clip frac (first 10) | phantom clip frac (first 10) | "
            "phantom clip frac (all) | mean \\|β\\| | mean \\|κ\\| |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            "## The base model's mismatch, by part",
            "",
            f"FP32 trainer, BF16 rollout (64 prompts × 4 samples): mean |β| {b['beta/abs_mean']:.2e} "
            f"(max {b['beta/abs_max']:.2e}, mean β {b['beta/mean']:.2e}), mean |κ| {b['kappa/abs_mean']:.2e} "
            f"(max {b['kappa/abs_max']:.2e}). Mean |β| by token probability μ: {bins(b, 'beta')}; mean |κ|: "
            f"{bins(b, 'kappa')}.",
            "",
            f"FP32 trainer, FP16 rollout: mean |β| {f['beta/abs_mean']:.2e} (max {f['beta/abs_max']:.2e}), mean |κ| "
            f"{f['kappa/abs_mean']:.2e} — BF16's β is {b['beta/abs_mean'] / max(f['beta/abs_mean'], 1e-30):.1f}× "
            "FP16's on average.",
            "",
            f"{summary['wall_seconds']:.0f} s in all.",
            "",
            "![length and phantom clip fraction](phantom.png)",
            "",
            "![β distribution](beta.png)",
            "",
        ]
    )
