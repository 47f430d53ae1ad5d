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

With `--model DIR` (`run_writeup`): the write-up's experiment at its own settings on a real
checkpoint — FP32 trainer, BF16 rollout, ε = 0.2, one update per rollout, the shipped chat
questions through the model's chat template — in the arms of `writeup_arms`, for several seeds.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from parity import config as config_mod
from parity import stopping
from parity.commands.prompts import CHAT_QUESTIONS
from parity.commands.report import Panel, load_history, plot_bars, plot_beta_distribution, plot_curves
from parity.config import ConfigError
from parity.distributed.driver import backend_for
from parity.engines import kernels
from parity.engines.models.io import export_state, load_config, load_model, resolve_model_dir
from parity.engines.sampler import Sampler
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import load_tokenizer
from parity.outdir import check_output_dir, claim_output_dir, write_output, write_output_json
from parity.rl.data import DataError, prompt_limit
from parity.rl.diagnostics import PROB_BIN_EDGES, gap_metrics
from parity.rl.loop import Run
from parity.rl.problems import ArithmeticTask
from parity.rl.train_config import MAX_SEED, MICRO_BATCH_TOKENS, TrainConfig
from parity.rundir import remove_run

TARGET_LENGTH = 2.0
BUILTIN_STEPS = 60
WRITEUP_STEPS = 25
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
            "algorithm.probe=true",
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


# The folders `parity phantom --out DIR` makes in DIR (`outdir.py`), beside its files.
PHANTOM_FOLDERS = ("one-update", "runs")


def check_runs(steps: int, seeds: tuple[int, ...] = (0,), option: str = "--seeds") -> None:
    """Refuse --steps and --seeds (or --seed) that no run could take, before anything is written."""
    if steps < 1:
        raise ConfigError(f"--steps: must be >= 1, got {steps}")
    if not seeds or any(not 0 <= s <= MAX_SEED for s in seeds):
        raise ConfigError(f"{option}: expected seeds in [0, {MAX_SEED}], comma-separated, got {list(seeds) or 'none'}")


def train_length_task(
    run_dir: Path, steps: int, seed: int, overrides: tuple[str, ...], progress: bool = False
) -> list[dict]:
    """Train on the length task in `run_dir`, replacing what is there."""
    cfg = _config(run_dir, steps, seed, overrides)
    remove_run(run_dir)
    with stopping.deferred("after the run's step under way"):  # an asynchronous arm runs on Ray
        return Run.create(cfg, progress=progress, backend=backend_for(cfg)).train(should_stop=stopping.requested)


def finished_run(run_dir: Path, cfg: TrainConfig) -> bool:
    """`run_dir` holds a run of exactly `cfg` with all its steps logged."""
    config_file = run_dir / "config.yaml"
    if not config_file.is_file() or config_file.read_text() != config_mod.dump_yaml(cfg):
        return False
    try:
        return len(load_history(run_dir)) == cfg.steps
    except DataError:
        return False


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
    base = load_model(model_dir, kernels.numerics(device))  # its weights, for the sampler
    sampler = Sampler(
        base.config,
        rollout_precision,
        "fp32",
        tok.eos_ids,
        tok.pad_id,
        score_old=True,
        probe=True,
        micro_batch_tokens=MICRO_BATCH_TOKENS["cpu"],
        numerics=kernels.numerics(device),
    )
    sampler.load_weights(export_state(base), version=0)
    problems = ArithmeticTask().problems(num_prompts, seed=seed, split="eval")
    prompts = [tok.encode_prompt(p.prompt) for p in problems]
    batch = sampler.generate(prompts, 4, SamplingParams(max_new_tokens=96), seed=seed)
    sampler.fill_old_logprobs(batch)
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
    check_runs(steps, (seed,), "--seed")
    bad_eps = [e for e in eps_sweep if not 0 < e < math.inf]
    if bad_eps or not eps_sweep:
        raise ConfigError(f"--eps: expected clip epsilons > 0, comma-separated, got {bad_eps or 'none'}")
    check_output_dir(out, "phantom")
    start = time.perf_counter()
    beta, probs, parts_bf16 = mismatch_parts("builtin", 64, seed, "bf16", device)
    claim_output_dir(out, "phantom", folders=PHANTOM_FOLDERS)
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
    write_output_json(out / "summary.json", summary)
    write_output(out / "report.md", render_report(summary))
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


# ----------------------------------------------------------------------------- the write-up's experiment, real model

WRITEUP_EPS = 0.2
NO_CLIP = ("algorithm.clip_low=1e9", "algorithm.clip_high=1e9")  # the clip's bounds out of reach
ASYNC = ("distributed.rollout_workers=1", "async.max_staleness=1")
# The settings of `run_writeup` that are not the write-up's own (those are in `writeup_arms`): chosen so that a
# 135M model's run fits a 2-core CPU; any of them can be overridden on the command line.
WRITEUP_SETTINGS = (
    "prompts_per_step=4",
    "rollout.group_size=8",
    "rollout.max_new_tokens=128",
    "trainer.lr=5e-5",
    "eval.every=-1",
)
WRITEUP_STEP1_PHANTOM = 0.18  # the write-up's phantom-clipped fraction at ε = 0.2, FP32 trainer, BF16 inference


def writeup_arms(with_async: bool = True, eps: float = WRITEUP_EPS) -> list[PhantomRun]:
    """The write-up's three arms (ratio against μ as TRL's AsyncGRPO takes it, clipping off, matched FP16),
    Parity's (ratio against π_old scored by the sampler), and the first two with one asynchronous worker."""
    clip = (f"algorithm.clip_low={eps}", f"algorithm.clip_high={eps}")
    mismatched = (*PAIRS["fp32/bf16"], *clip)
    arms = [
        PhantomRun("ratio vs μ", (*mismatched, "algorithm.ratio_source=rollout")),
        PhantomRun("ratio vs π_old (shadow)", (*mismatched, "algorithm.ratio_source=shadow")),
        PhantomRun("no clip", (*PAIRS["fp32/bf16"], "algorithm.ratio_source=rollout", *NO_CLIP)),
        PhantomRun("fp16 matched, ratio vs μ", (*PAIRS["fp16/fp16"], *clip, "algorithm.ratio_source=rollout")),
    ]
    if with_async:
        arms += [
            PhantomRun("async, ratio vs μ", (*mismatched, "algorithm.ratio_source=rollout", *ASYNC)),
            PhantomRun("async, ratio vs π_old (shadow)", (*mismatched, "algorithm.ratio_source=shadow", *ASYNC)),
        ]
    return arms


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.replace("π_old", "old").replace("μ", "mu")).strip("-")


def _prob_bins() -> list[str]:
    return [f"p_{lo:g}-{hi:g}" for lo, hi in zip(PROB_BIN_EDGES[:-1], PROB_BIN_EDGES[1:])]


def summarize_arm(history: list[dict]) -> dict:
    """One run of an arm: step 1's clip and phantom fractions, steps to length ≤ 2, and the run's means of
    |α|, |β|, |κ|, |β| by token probability μ and β's correlation with the advantage."""

    def mean(key: str) -> float | None:
        values = [m[key] for m in history if key in m]
        return statistics.mean(values) if values else None

    return {
        "clip_frac_step1": history[0]["clip/frac"],
        "phantom_clip_frac_step1": history[0]["phantom/clip_frac"],
        "length_step1": history[0]["response/length_mean"],
        "steps_to_length_2": steps_to_length(history),
        "final_length": history[-1]["response/length_mean"],
        "clip_frac_mean": mean("clip/frac"),
        "phantom_clip_frac_mean": mean("phantom/clip_frac"),
        "phantom_clip_frac_max": max(m["phantom/clip_frac"] for m in history),
        "alpha_abs_mean": mean("alpha/abs_mean"),
        "beta_abs_mean": mean("beta/abs_mean"),
        "kappa_abs_mean": mean("kappa/abs_mean"),
        "beta_abs_by_prob": {b: mean(f"beta/abs_mean/{b}") for b in _prob_bins()},
        "beta_adv_corr_mean": mean("beta/adv_corr"),
        "seq_abs_log_ratio_mean": mean("mismatch/seq_abs_log_ratio"),
        "step_seconds": sum(m["time/step"] for m in history),
    }


def _beta_by_bin(arm: dict) -> list[float]:
    """An arm's mean |β| in each token-probability bin, averaged over its seeds (0 where a bin had no token)."""
    return [statistics.mean(r["beta_abs_by_prob"][b] or 0.0 for r in arm["seeds"].values()) for b in _prob_bins()]


def _mean_history(histories: list[list[dict]], keys: tuple[str, ...]) -> list[dict]:
    """The step-wise mean over seeds of `keys` (the steps all runs have)."""
    steps = min(len(h) for h in histories)
    return [
        {
            "step": i + 1,
            **{k: statistics.mean(h[i][k] for h in histories) for k in keys if all(k in h[i] for h in histories)},
        }
        for i in range(steps)
    ]


def run_writeup(
    model: str,
    out: Path,
    steps: int,
    seeds: tuple[int, ...],
    overrides: tuple[str, ...] = (),
    with_async: bool = True,
    device: str = "cpu",
    prompts: tuple[str, ...] = CHAT_QUESTIONS,
    eps: float = WRITEUP_EPS,
    log=print,
) -> dict:
    """The write-up's phantom-clipping experiment on `model` (see the module's docstring): every arm of
    `writeup_arms` for every seed, `steps` steps each, on `prompts` (user messages); `overrides` are
    `parity train` keys for every run."""
    kernels.check_device(device, "--device")
    check_runs(steps, seeds)
    model_dir = resolve_model_dir(model)
    prompt_file = out / "prompts.jsonl"
    base = (f"model={model_dir}", f"task.data={prompt_file}", *WRITEUP_SETTINGS, f"device={device}")
    arms = writeup_arms(with_async, eps)
    # Every run's config, and the prompts against the model, before anything is written (a bad override, or a
    # model too short for the prompts, was refused after --out held the prompts).
    first, *_ = [_config(out, steps, seed, (*base, *arm.overrides, *overrides)) for arm in arms for seed in seeds]
    positions = load_config(model_dir).max_position_embeddings
    key, template = "rollout.max_new_tokens", first.task.chat_template
    limit = prompt_limit(load_tokenizer(model_dir), positions, first.rollout.max_new_tokens, key, template)
    for i, prompt in enumerate(prompts):
        limit.check(f"prompt {i}", prompt)
    claim_output_dir(out, "phantom", folders=PHANTOM_FOLDERS)
    write_output(prompt_file, "".join(json.dumps({"prompt": p, "answer": ""}) + "\n" for p in prompts))
    start = time.perf_counter()
    results: dict[str, dict] = {}
    curves: dict[str, list[dict]] = {}
    step_rows: list[dict] = []
    read_back = 0
    for i, arm in enumerate(arms, 1):
        runs, histories = {}, []
        for seed in seeds:
            log(f"arm {i}/{len(arms)}: {arm.name}, seed {seed}")
            run_dir, keys = out / "runs" / f"{_slug(arm.name)}-seed{seed}", (*base, *arm.overrides, *overrides)
            if finished_run(run_dir, _config(run_dir, steps, seed, keys)):  # an earlier call's: read it back
                history = load_history(run_dir)
                read_back += 1
            else:
                history = train_length_task(run_dir, steps, seed, keys, True)
            runs[str(seed)] = summarize_arm(history)
            step_rows += [{"arm": arm.name, "seed": seed, **{k: m[k] for k in STEP_KEYS if k in m}} for m in history]
            histories.append(history)
        results[arm.name] = {"overrides": list(arm.overrides), "seeds": runs}
        curves[arm.name] = _mean_history(histories, CURVE_KEYS)
    plot_curves(
        curves,
        [
            Panel("response/length_mean", "Mean response length", log=True, hline=TARGET_LENGTH, smooth=False),
            Panel("phantom/clip_frac", "Phantom clip fraction", smooth=False),
            Panel("clip/frac", "Clip fraction", smooth=False),
            Panel("beta/adv_corr", "corr(β, advantage)", smooth=False),
        ],
        out / "phantom.png",
    )
    plot_bars(
        {
            name: [
                statistics.mean(r["beta_abs_by_prob"][b] or 0.0 for r in arm["seeds"].values()) for b in _prob_bins()
            ]
            for name, arm in results.items()
        },
        [b.removeprefix("p_") for b in _prob_bins()],
        xlabel="token probability μ",
        ylabel="mean |β|",
        title="The precision gap β by token probability (mean over steps and seeds)",
        path=out / "beta_by_prob.png",
    )
    summary = {
        "model": str(model_dir),
        "steps": steps,
        "seeds": list(seeds),
        "eps": eps,
        "settings": [*WRITEUP_SETTINGS, *overrides],
        "arms": results,
        "wall_seconds": round(time.perf_counter() - start, 1),
        "runs_read_back": read_back,
    }
    write_output_json(out / "summary.json", summary)
    write_output(out / "steps.jsonl", "".join(json.dumps(row) + "\n" for row in step_rows))
    write_output(out / "report.md", render_writeup(summary))
    return summary


CURVE_KEYS = ("response/length_mean", "phantom/clip_frac", "clip/frac", "beta/adv_corr")
# The per-step record of every run (steps.jsonl).
STEP_KEYS = (
    "step",
    *CURVE_KEYS,
    "alpha/abs_mean",
    "beta/abs_mean",
    "kappa/abs_mean",
    *(f"beta/abs_mean/{b}" for b in _prob_bins()),
    "mismatch/seq_abs_log_ratio",
    "async/staleness_mean",
    "time/step",
)


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def render_writeup(summary: dict) -> str:
    arms = summary["arms"]
    bins = _prob_bins()
    rows, bin_rows = [], []
    for name, arm in arms.items():
        for seed, r in arm["seeds"].items():
            reached = r["steps_to_length_2"]
            rows.append(
                f"| {name} | {seed} | {r['phantom_clip_frac_step1']:.4f} | {r['clip_frac_step1']:.4f} | "
                f"{r['length_step1']:.1f} | {'not in ' + str(summary['steps']) if reached is None else reached} | "
                f"{r['final_length']:.1f} | {r['clip_frac_mean']:.4f} | {r['phantom_clip_frac_mean']:.4f} | "
                f"{_fmt(r['alpha_abs_mean'], '.2e')} | {_fmt(r['beta_abs_mean'], '.2e')} | "
                f"{_fmt(r['kappa_abs_mean'], '.2e')} | {_fmt(r['beta_adv_corr_mean'], '+.3f')} | "
                f"{r['step_seconds']:.0f} |"
            )
        by_bin = _beta_by_bin(arm)
        low_over_high = f"{by_bin[0] / by_bin[-1]:.0f}×" if by_bin[-1] > 0 else "—"
        bin_rows.append(f"| {name} | " + " | ".join(f"{v:.2e}" for v in by_bin) + f" | {low_over_high} |")

    def step1(name: str) -> float:
        return statistics.mean(r["phantom_clip_frac_step1"] for r in arms[name]["seeds"].values())

    def verdict(name: str) -> str:
        seeds = arms[name]["seeds"].values()
        reached = [r["steps_to_length_2"] for r in seeds]
        most = max(r["phantom_clip_frac_max"] for r in seeds)
        if all(s is None for s in reached):
            verdict = f"did not reach length ≤ 2 in {summary['steps']} steps"
        else:
            verdict = "reached length ≤ 2 at step " + ", ".join("—" if s is None else str(s) for s in reached)
        return f"{verdict}; at most {most:.1%} of a step's tokens phantom-clipped"

    first = next(iter(arms))
    return "\n".join(
        [
            f"# Phantom clipping at the write-up's settings: {Path(summary['model']).name}",
            "",
            "Reward = −length (the response's tokens, EOS included; optimum: EOS at once), `grpo` (PPO clip, "
            f"ε = {summary['eps']:g}), one update per rollout, the prompts of prompts.jsonl (by default the "
            "shipped chat questions) through the model's chat template. FP32 trainer and BF16 rollout unless the "
            f"arm says FP16. {summary['steps']} steps per run, "
            f"seeds {', '.join(str(s) for s in summary['seeds'])}; other settings: "
            f"`{' '.join(summary['settings'])}`.",
            "",
            "A token is phantom-clipped when its clip is active on the ratio against μ and not on the ratio "
            "against π_old (whichever ratio the loss uses). α = π_θ − π_old (the policy's own change), "
            "β = π_old in FP32 − the same forward in BF16 on the same weights (precision), κ = that forward − μ "
            "(engine). With one update per rollout α is 0 at every step of the synchronous arms: every clipped "
            "token there is the mismatch's doing.",
            "",
            "| arm | seed | phantom clip frac, step 1 | clip frac, step 1 | length, step 1 | steps to length ≤ 2 | "
            "final length | clip frac (mean) | phantom clip frac (mean) | mean \\|α\\| | mean \\|β\\| | mean \\|κ\\| | "
            "corr(β, A) | seconds in steps |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            "## |β| by token probability μ (mean over steps and seeds)",
            "",
            "β is 0 where both engines run in one precision (the FP16 arm): its mismatch is all κ.",
            "",
            "| arm | " + " | ".join(b.removeprefix("p_") for b in bins) + " | lowest bin / highest |",
            "|---|" + "---|" * (len(bins) + 1),
            *bin_rows,
            "",
            "## Reading",
            "",
            f"- Phantom-clipped at step 1 with the ratio against μ: {step1(first):.2%} of tokens (mean over seeds), "
            f"against the write-up's {WRITEUP_STEP1_PHANTOM:.0%}.",
            *(f"- {name}: {verdict(name)}." for name in arms),
            "",
            f"{summary['wall_seconds']:.0f} s in all"
            + (
                f", {summary['runs_read_back']} of the runs read back from an earlier call (its time not counted)."
                if summary["runs_read_back"]
                else "."
            ),
            "",
            "![length, phantom and clip fractions, corr(β, A); means over seeds](phantom.png)",
            "",
            "![|β| by token probability](beta_by_prob.png)",
            "",
            "Every run's metrics per step: steps.jsonl (one line per arm, seed and step).",
            "",
        ]
    )
