"""`parity sanity`: the sanity test of the research, as Parity's main job.

Keep only problems the base model solves sometimes (the perfectible set), then
train the same model on them under a matrix of precisions and estimators. Any
sound RL setup must reach near-100% training accuracy there; one that cannot
is broken. Writes summary.json, report.md and plots to the output directory.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from parity import config as config_mod
from parity.commands.mismatch import MismatchConfig, SamplingConfig, plot_mismatch_scatter, run_mismatch
from parity.commands.perfectible import (
    PerfectibleConfig,
    build_or_load,
    cache_dir,
    filter_perfectible,
    format_histogram,
    histogram,
    search_path,
)
from parity.commands.report import (
    accuracy_text,
    plot_accuracy,
    plot_histogram,
    plot_mismatch_curves,
    summarize,
    summary_table,
)
from parity.config import ConfigError
from parity.engines.precision import PRECISIONS
from parity.outdir import check_output_dir, check_writable, claim_output_dir, write_output, write_output_json
from parity.rl.algorithms import ESTIMATORS
from parity.rl.loop import Run, TrainingError
from parity.rl.train_config import TrainConfig
from parity.rundir import remove_run
from parity.stopping import worker_started

DEFAULT_RUNS = (
    "fp16/pg_seq_is",
    "bf16/pg_seq_is",
    "fp16-exact/pg_seq_is",
    "fp16/grpo",
    "bf16/grpo",
    "fp16-exact/grpo",
    "bf16/grpo_token_tis",
    "bf16/grpo_seq_mis",
)
EXACT_SUFFIX = "-exact"  # PRECISION-exact: exact mode in that precision (docs/exact.md)


@dataclass(frozen=True)
class SanitySettings:
    steps: int
    prompts_per_step: int
    group_size: int


# The paper's recipe (Precision-RL's oat/scripts/sanity/): every estimator with its reference
# defaults, Dr.GRPO advantages, zero reward without EOS, ÷ L_max — the defaults of `parity train` —
# and 4 optimizer steps per rollout (512 samples per rollout, 128 per update).
UPDATES_PER_ROLLOUT = 4

FULL = SanitySettings(steps=120, prompts_per_step=16, group_size=8)
QUICK = SanitySettings(steps=50, prompts_per_step=8, group_size=8)


def parse_runs(spec: str) -> list[tuple[str, str]]:
    """`PRECISION/ESTIMATOR,...` -> [(precision, estimator)]; a precision may carry `-exact`."""
    runs = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        parts = item.split("/")
        if len(parts) != 2 or parts[0].removesuffix(EXACT_SUFFIX) not in PRECISIONS or parts[1] not in ESTIMATORS:
            raise ConfigError(
                f"--runs: {item!r} is not PRECISION/ESTIMATOR (precisions: {', '.join(PRECISIONS)}, each also "
                f"as PRECISION{EXACT_SUFFIX} for exact mode; estimators: {', '.join(sorted(ESTIMATORS))})"
            )
        runs.append((parts[0], parts[1]))
    if not runs:
        raise ConfigError("--runs: no runs given")
    return runs


@dataclass(frozen=True)
class SanityOptions:
    """What `parity sanity` runs (its flags): the test of `model` (default: the built-in one) on `task`'s
    generated problems (default: the built-in task for the built-in model, word problems of `difficulty`
    with `task.name=number` for any other), sampling at most `max_new_tokens` per response everywhere, for
    each (precision, estimator) of `runs`. `candidates`: how many problems the perfectible search tries
    (its default when None); `lo`: the perfectible set's lowest base accuracy (its default when None);
    `overrides`: `parity train` keys (KEY=VALUE) applied to every run after the test's own, e.g.
    trainer.lr or steps. `jobs`: training runs at once (default `default_jobs`); `device`: where every
    model runs (perfectible search, base mismatch, training)."""

    out: Path
    runs: list[tuple[str, str]]
    quick: bool
    seed: int = 0
    model: str = "builtin"
    task: str | None = None
    max_new_tokens: int = 96
    difficulty: str = "standard"
    candidates: int | None = None
    lo: float | None = None
    overrides: tuple[str, ...] = ()
    jobs: int | None = None
    device: str = "cpu"


def run_sanity(options: SanityOptions, log=print) -> dict:
    """The sanity test as `options` says; writes its outputs to `options.out` and returns the summary."""
    settings = QUICK if options.quick else FULL
    task = options.task or ("builtin" if options.model == "builtin" else "number")
    check_output_dir(options.out, "sanity")
    check_writable(cache_dir(), f"the perfectible search's cache {cache_dir()} (XDG_CACHE_HOME)")
    start = time.perf_counter()

    pcfg = PerfectibleConfig(
        model=options.model,
        task=task,
        seed=options.seed,
        max_new_tokens=options.max_new_tokens,
        difficulty=options.difficulty,
        device=options.device,
    )
    if options.candidates is not None:
        pcfg.num_candidates = options.candidates
    if options.lo is not None:
        pcfg.lo = options.lo
    pcfg.validate()

    def run_config(precision: str, estimator: str, run_dir: Path) -> TrainConfig:
        keys = [
            f"model={options.model}",
            f"task.name={task}",
            f"rollout.max_new_tokens={options.max_new_tokens}",
            f"precision={precision.removesuffix(EXACT_SUFFIX)}",
            f"exact={str(precision.endswith(EXACT_SUFFIX)).lower()}",
            f"algorithm.name={estimator}",
            f"task.data={options.out / 'perfectible.jsonl'}",
            f"steps={settings.steps}",
            f"prompts_per_step={settings.prompts_per_step}",
            f"rollout.group_size={settings.group_size}",
            f"algorithm.num_minibatches={UPDATES_PER_ROLLOUT}",
            f"seed={options.seed}",
            f"run_dir={run_dir}",
            "checkpoint_every=-1",
            "tensorboard=false",
            "log.completions=0",  # every step's completions stay in each run's completions/, unprinted
            f"device={options.device}",
        ]
        return config_mod.load(TrainConfig, None, [*keys, *options.overrides])

    # Every run's config is checked before the first one starts: a bad override fails in a second.
    configs = {f"{p}/{e}": run_config(p, e, options.out / "runs" / f"{p}-{e}") for p, e in options.runs}
    jobs = default_jobs(len(configs), options.device) if options.jobs is None else options.jobs
    if jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    # The search scores a cut-off response as the runs' loss does.
    pcfg.truncated = next(iter(configs.values())).algorithm.truncated
    set_path, accuracies, cached = build_or_load(pcfg)
    keep = filter_perfectible(accuracies, pcfg.lo, pcfg.hi)
    if not keep:
        raise ConfigError(
            f"--model {options.model} --task {task}: no perfectible problem (accuracy in [{pcfg.lo}, {pcfg.hi}] over "
            f"{pcfg.samples} samples) among {len(accuracies)}, so there is nothing to train on; the accuracies "
            f"are in {search_path(pcfg)}. A larger --max-new-tokens helps when answers are cut off, a lower --lo "
            "when the model solves some problems rarely"
        )
    counts = histogram(accuracies, pcfg.samples)
    log(
        f"perfectible set: {len(keep)} of {len(accuracies)} problems ({'cached' if cached else 'measured'}): {set_path}"
    )
    log(format_histogram(counts, pcfg.lo, pcfg.hi))
    claim_output_dir(options.out, "sanity", folders=("runs",))
    write_output(options.out / "perfectible.jsonl", set_path.read_text())
    plot_histogram(counts, pcfg.lo, pcfg.hi, options.out / "perfectible_histogram.png")

    # Token-level μ vs π on the base model, per precision (exact mode apart), over the perfectible prompts.
    pairs = []
    for exact in (False, True):
        precisions = sorted({p for p, _ in options.runs if p.endswith(EXACT_SUFFIX) == exact})
        if precisions:
            mcfg = MismatchConfig(
                model=options.model,
                prompts=str(options.out / "perfectible.jsonl"),
                num_prompts=32,
                group_size=4,
                pairs=[f"{p}/{p}" for p in (p.removesuffix(EXACT_SUFFIX) for p in precisions)],
                sampling=SamplingConfig(max_new_tokens=options.max_new_tokens),
                seed=options.seed,
                exact=exact,
                device=options.device,
            )
            pairs += run_mismatch(mcfg, progress=False)
    plot_mismatch_scatter(pairs, options.out / "mismatch_scatter.png")

    histories = train_runs(configs, jobs, log)

    summaries = {name: summarize(h) for name, h in histories.items()}
    plot_accuracy(histories, options.out / "accuracy.png")
    plot_mismatch_curves(histories, options.out / "mismatch.png")
    first = next(iter(configs.values()))  # the settings every run shares
    summary = {
        "settings": {
            "model": options.model,
            "task": task,
            "difficulty": options.difficulty,
            "max_new_tokens": first.rollout.max_new_tokens,
            "quick": options.quick,
            "steps": first.steps,
            "prompts_per_step": first.prompts_per_step,
            "group_size": first.rollout.group_size,
            "updates_per_rollout": first.algorithm.num_minibatches,
            "lr": first.trainer.lr,
            "overrides": list(options.overrides),
            "seed": options.seed,
            "jobs": jobs,
            "device": options.device,
        },
        "perfectible": {
            "num_problems": len(keep),
            "num_candidates": len(accuracies),
            "samples": pcfg.samples,
            "lo": pcfg.lo,
            "hi": pcfg.hi,
            "histogram": counts,
        },
        "base_mismatch": {p.label: p.metrics for p in pairs},
        "runs": summaries,
        "wall_seconds": round(time.perf_counter() - start, 1),
    }
    write_output_json(options.out / "summary.json", summary)
    write_output(options.out / "report.md", render_report(summary))
    return summary


def default_jobs(runs: int, device: str) -> int:
    """Training runs at once: one per core on the CPU, at most 4 (each holds its own model and optimizer).
    The sanity runs' models are small, and a small model's ops gain little from a second thread: on 2 cores
    two runs of one thread each finish the set 1.56x sooner than one run of two threads at a time
    (docs/benchmarks.md). One at a time on a GPU."""
    if device != "cpu":
        return 1
    return max(1, min(runs, os.cpu_count() or 1, 4))


def _train(cfg: TrainConfig, progress: bool) -> list[dict]:
    """One run of the test; the settings its runs share are said once (`shared_settings`), not per run."""
    run = Run.create(cfg, progress=progress)
    run.announce = False
    return run.train()


def _train_in_worker(cfg: TrainConfig, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    # The run's progress bars (off) need no lock between processes. tqdm's default one is a named semaphore,
    # which a worker killed on a stop would leave to multiprocessing's resource tracker to remove, and report.
    tqdm.set_lock(threading.RLock())
    return _train(cfg, progress=False)


def shared_settings(configs: dict[str, TrainConfig]) -> str:
    """What every run trains with besides its precision and estimator (their names), on one line."""
    first = next(iter(configs.values()))

    def values(get) -> str:
        return ",".join(dict.fromkeys(str(get(c)) for c in configs.values()))

    return (
        f"{values(lambda c: c.steps)} steps of {values(lambda c: c.prompts_per_step)} prompts x "
        f"{values(lambda c: c.rollout.group_size)} samples, algorithm.advantage="
        f"{values(lambda c: c.algorithm.advantage)}, algorithm.truncated={values(lambda c: c.algorithm.truncated)} "
        f"at rollout.max_new_tokens={first.rollout.max_new_tokens}; each step's completions in "
        f"{Path(first.run_dir).parent}/RUN/completions/"
    )


def _done_line(done: int, runs: int, name: str, history: list[dict]) -> str:
    """A finished run's line: its steps and its last step's accuracy (the summary's "final" is the average of the
    last steps)."""
    last = history[-1] if history else {}
    accuracy = f", last step's accuracy {last['reward/accuracy']:.2f}" if "reward/accuracy" in last else ""
    return f"run {done}/{runs} done: {name} ({len(history)} steps{accuracy})"


def train_runs(configs: dict[str, TrainConfig], jobs: int, log=print) -> dict[str, list[dict]]:
    """Train every run, `jobs` at a time (each in its own process, with its share of the threads),
    and return their metric histories in the order of `configs`. Each run says one line when it is done
    (one at a time, its progress bar before it); its completions go to its files only."""
    for cfg in configs.values():
        remove_run(Path(cfg.run_dir))  # a previous sanity run's copy of this run
    if jobs == 1:
        log(f"training {len(configs)} runs, one at a time: {shared_settings(configs)}")
        histories = {}
        for i, (name, cfg) in enumerate(configs.items()):
            log(f"run {i + 1}/{len(configs)}: {name}")
            histories[name] = _train(cfg, progress=True)
            log(_done_line(i + 1, len(configs), name, histories[name]))
        return histories
    threads = max(1, torch.get_num_threads() // jobs)
    log(
        f"training {len(configs)} runs, {jobs} at a time ({threads} thread{'s' * (threads > 1)} each): "
        f"{shared_settings(configs)}"
    )
    done: dict[str, list[dict]] = {}
    # spawn: a forked child would inherit this process's thread pools and locks.
    spawn = multiprocessing.get_context("spawn")
    others = set(multiprocessing.active_children())
    futures = {}
    with ProcessPoolExecutor(jobs, mp_context=spawn, initializer=worker_started, initargs=(os.getpid(),)) as pool:
        try:
            for name, cfg in configs.items():
                futures[pool.submit(_train_in_worker, cfg, threads)] = name
            for future in as_completed(futures):
                name = futures[future]
                try:
                    done[name] = future.result()
                except BrokenProcessPool:
                    raise _died(configs, done, jobs) from None
                log(_done_line(len(done), len(configs), name, done[name]))
        except BaseException:  # a stop signal (`Stopped`), or a run that failed: the runs under way are abandoned
            for future in futures:
                future.cancel()
            for worker in set(multiprocessing.active_children()) - others:  # the pool's
                worker.kill()  # the pool would wait for them to finish; `shutdown` joins them
            raise
    return {name: done[name] for name in configs}


def _died(configs: dict[str, TrainConfig], done: dict[str, list[dict]], jobs: int) -> TrainingError:
    """A training process ended without a word (killed by a signal: most often the kernel's out-of-memory
    killer, as when two long-response runs of a 135M model outgrew 24 GB): say which runs, what is kept, and
    what to change."""
    lost = [name for name in configs if name not in done]
    kept = f"; finished: {', '.join(done)}" if done else ""
    return TrainingError(
        f"a training process ended abruptly (killed: out of memory? `dmesg` names the killer) while "
        f"{', '.join(lost)} had not finished{kept}; each run's metrics so far are in its metrics.jsonl under "
        f"{Path(next(iter(configs.values())).run_dir).parent}. Train fewer runs at once (--jobs {max(1, jobs - 1)}) "
        "or in less memory (trainer.micro_batch_tokens=N, trainer.activation_checkpointing=true)"
    )


def _verdict(name: str, s: dict) -> str:
    if s["steps_to_95"] is None:
        line = (
            f"- **{name}** did not reach 95% in {s['steps']} steps: training accuracy "
            f"{accuracy_text(s['initial_accuracy'])} → {accuracy_text(s['final_accuracy'])} "
            f"(best {accuracy_text(s['best_accuracy'])})."
        )
    else:
        line = f"- **{name}** reached 95% training accuracy at step {s['steps_to_95']} ({s['seconds_to_95']:.0f} s)."
    if s.get("collapse_step") is not None:
        line += (
            f" Then it collapsed: below half its best ({s['best_accuracy']:.2f}) from step {s['collapse_step']}, "
            f"{s['final_accuracy']:.2f} at the end."
        )
    return line


def _collapses(runs: dict) -> list[str]:
    """The reading's sentence on runs that collapsed after their best, if any."""
    collapsed = [name for name, s in runs.items() if s.get("collapse_step") is not None]
    if not collapsed:
        return []
    exact = [name for name in collapsed if runs[name].get("final_mismatch_k3") == 0]
    line = (
        f"Collapsed after their best: {', '.join(collapsed)} (one seed each: this says a run can collapse here, "
        "not how often)."
    )
    if exact:
        line += (
            f" {', '.join(exact)}: no mismatch (k3 0, μ equal to π_old), so what moved the policy away from the one "
            "that sampled was the updates themselves (`is/weight_max` shows by how much), not the precision gap."
        )
    return [line]


def reading(summary: dict) -> list[str]:
    """What the numbers say about FP16 vs BF16, derived from the summary (no fixed verdict)."""
    runs, base = summary["runs"], summary["base_mismatch"]
    reached = {name: s["steps_to_95"] is not None for name, s in runs.items()}
    by_prec = {p: [n for n in runs if n.startswith(p + "/")] for p in ("fp16", "bf16")}
    lines = ["## Reading", ""]
    collapses = _collapses(runs)
    if all(reached.values()) and not collapses:
        lines.append(
            "Every run reached 95% training accuracy: on this model and task BF16 and FP16 behave the same — "
            "both converge, with every estimator."
        )
    elif all(reached.values()):
        lines.append("Every run reached 95% training accuracy.")
    else:
        missed = [n for n, ok in reached.items() if not ok]
        lines.append(f"Runs that did not reach 95%: {', '.join(missed)}.")
        for p in ("fp16", "bf16"):
            if by_prec[p] and all(not reached[n] for n in by_prec[p]):
                lines.append(f"No {p.upper()} run reached 95%.")
    lines += collapses
    if "bf16" in base and "fp16" in base:
        b, f = base["bf16"], base["fp16"]
        spread = math.expm1(b["seq_abs_log_ratio"]) * 100
        lines += [
            "",
            f"The base model's BF16 mismatch is {b['k3'] / max(f['k3'], 1e-30):.0f}× FP16's in k3 and "
            f"{b['token_abs_log_ratio_mean'] / max(f['token_abs_log_ratio_mean'], 1e-30):.1f}× per token. In BF16 "
            f"the sequence log-ratio averages {b['seq_abs_log_ratio']:.2e}, so a sequence's importance weight is "
            f"typically within {spread:.1f}% of 1 (IS effective sample size {b['is_ess']:.4f}).",
        ]
        if spread < 5:
            lines.append(
                "A gap that small barely biases the gradient, so here the two precisions can be expected to train "
                "alike; the research's collapses came from long responses and large models, where the sequence "
                "log-ratio grows by orders of magnitude."
            )
        else:
            lines.append(
                "A gap that large biases the gradient of an estimator that does not correct for it; the runs above "
                "show whether it changed the outcome here (one seed each, so a difference of a few steps may be "
                "noise)."
            )
    return lines + [""]


def render_report(summary: dict) -> str:
    p, st = summary["perfectible"], summary["settings"]
    base = summary["base_mismatch"]
    # Summaries written before these settings were recorded have neither.
    lr = "" if st.get("lr") is None else f"learning rate {st['lr']:g}, "
    overrides = f" (overrides: {' '.join(st['overrides'])})" if st.get("overrides") else ""
    jobs = f" ({st['jobs']} runs at a time on {st.get('device', 'cpu')})" if st.get("jobs", 1) > 1 else ""
    lines = [
        "# Sanity test",
        "",
        f"Model {st['model']}, task {st['task']}, at most {st['max_new_tokens']} new tokens per response. "
        f"{'Quick' if st['quick'] else 'Full'} run: {st['steps']} steps of {st['prompts_per_step']} prompts × "
        f"{st['group_size']} samples per run, {st['updates_per_rollout']} optimizer steps per rollout, "
        f"{lr}seed {st['seed']}, {summary['wall_seconds']:.0f} s in all{jobs}{overrides}. "
        "The paper's recipe: each estimator with its "
        "reference defaults, Dr.GRPO advantages, zero reward without EOS, ÷ L_max (docs/training.md).",
        "",
        "## Perfectible set",
        "",
        f"{p['num_problems']} of {p['num_candidates']} held-out problems have base-model accuracy in "
        f"[{p['lo']}, {p['hi']}] over {p['samples']} samples at temperature 1.",
        "",
        "![accuracy histogram](perfectible_histogram.png)",
        "",
        "## Runs",
        "",
        summary_table(summary["runs"]),
        "Training accuracy is the 5-step moving average of the batch accuracy on the perfectible set; "
        "mismatch figures are means over the last 5 steps.",
        "",
        *[_verdict(name, s) for name, s in summary["runs"].items()],
        "",
        *reading(summary),
        "![training accuracy](accuracy.png)",
        "",
        "![mismatch during training](mismatch.png)",
        "",
        "## Mismatch of the base model, per precision",
        "",
        "| precision | k3 | mean \\|Δ\\| per token | mean \\|Σ Δ\\| per sequence |",
        "|---|---|---|---|",
        *[
            f"| {label} | {m['k3']:.2e} | {m['token_abs_log_ratio_mean']:.2e} | {m['seq_abs_log_ratio']:.2e} |"
            for label, m in base.items()
        ],
        "",
        "![token-level μ vs π](mismatch_scatter.png)",
        "",
    ]
    return "\n".join(lines)
