"""Asynchronous training on Ray against one process: throughput, time to solve, phantom clipping.

Throughput (`--throughput`): one process (synchronous) against 1 rollout worker + 1 learner at
async.max_staleness 0, 1 and 2, on
- the built-in model on its perfectible set at `parity sanity` settings (16 prompts × 8, 96 new
  tokens, FP16), trained until the 5-step mean training accuracy reaches 95% (or --max-steps):
  samples/s and seconds to 95%;
- the 4.4M Llama (docs/design.md, "Precision semantics"; random weights: it cannot learn the task, so
  samples/s only) on the built-in arithmetic prompts, 8 prompts × 8, 16 new tokens, --llama-steps steps.
Seconds count from the first step's start (after Ray and the actors are up); the start-up
is reported apart.

Phantom clipping (`--phantom`): the length task (reward −length, grpo, ε = 0.2) with an FP32
learner and a BF16 rollout worker at staleness 1 and 2, the PPO ratio against μ (TRL's
AsyncGRPO) and against π_old scored by the worker (Parity): clip and phantom fractions,
|α|, |β|, |κ| and steps to mean length ≤ 2.

Pipeline efficiency (`--pipeline`): how close the asynchronous pipeline comes to the bound a
pipeline on separate devices can reach, on this machine: the built-in model at the throughput
workload, `--pipeline-steps` steps, each role given a core of its own (the rollout worker pinned
to core 0, the learner to core 1, one torch thread each; the driver and Ray's own processes
unpinned) at staleness 1, and the same unpinned. Reported: the median step time against
max(sampling, training) of the same steps (sampling = the worker's rollout + scoring, training =
the learners' update + the weight sync), against the one-process step on one core, and the CPU
seconds Ray's own processes (GCS, raylet, dashboard, agents, monitors) took per second of run and
to start, each kind apart: what starting fewer of them could return.

    python benchmarks/async_rl.py --throughput --phantom --pipeline --out async.json

Partial rollouts (`--partial`): 1 rollout worker + 1 learner at staleness 1 and 2, with whole
rollouts and with `async.partial_rollouts=2`, once per seed in `--seeds`, on the throughput workload
until 95% (or --max-steps) and on its long-tailed form (a quarter of the prompts answered with 1-96
tokens) for --tail-steps steps: samples/s, seconds and steps to 95%, the response lengths (mean and
longest per step: how mixed they are), token staleness, the fraction of responses continued across a
weight sync.

    python benchmarks/async_rl.py --partial --seeds 0,1 --out partial.json [--workloads long-tail]

Nothing else may run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from engines import make_llama_4m  # noqa: E402
from parity import config  # noqa: E402
from parity.commands.report import SMOOTHING, TARGET_ACCURACY, moving_average  # noqa: E402
from parity.distributed.driver import backend_for  # noqa: E402
from parity.engines import kernels  # noqa: E402
from parity.rl.loop import Run  # noqa: E402
from parity.rl.train_config import TrainConfig  # noqa: E402
from vs_trl import _perfectible_problems  # noqa: E402

MODES = {
    "one process (sync)": [],
    "1 worker + 1 learner, staleness 0": ["distributed.rollout_workers=1", "async.max_staleness=0"],
    "1 worker + 1 learner, staleness 1": ["distributed.rollout_workers=1", "async.max_staleness=1"],
    "1 worker + 1 learner, staleness 2": ["distributed.rollout_workers=1", "async.max_staleness=2"],
}


def _run(overrides: list[str], steps: int, tmp: Path, stop=None, started=None) -> dict:
    cfg = config.load(
        TrainConfig,
        None,
        [f"run_dir={tmp / 'run'}", f"steps={steps}", "checkpoint_every=-1", "tensorboard=false", *overrides],
    )
    t0 = time.perf_counter()
    run = Run.create(cfg, progress=False, backend=backend_for(cfg))
    startup = time.perf_counter() - t0
    extra = started(run) if started is not None else {}
    history, start = [], time.perf_counter()
    try:
        while run.step_count < steps:
            history.append(run.step())
            history[-1]["wall"] = time.perf_counter() - start
            if stop is not None and stop(history):
                break
        if started is not None:
            extra = started(run, extra)
    finally:
        run.backend.close()
        run.rewards.close()
        run.lock.release()
    return {"startup_s": startup, "history": history, **extra}


def _summary(result: dict) -> dict:
    h = result["history"]
    wall = h[-1]["wall"]
    samples = sum(m["train/samples"] for m in h)
    out = {
        "startup_s": round(result["startup_s"], 1),
        "steps": len(h),
        "seconds": round(wall, 1),
        "samples_per_s": round(samples / wall, 1),
        "step_s_median": round(sorted(m["time/step"] for m in h)[len(h) // 2], 3),
    }
    for key in ("time/rollout", "time/train", "time/sync", "time/learner_idle", "time/worker_idle"):
        if key in h[0]:
            out[key] = round(sum(m[key] for m in h) / len(h), 3)
    if "reward/accuracy" in h[0]:
        acc = moving_average([m["reward/accuracy"] for m in h])
        solved = next((i for i, a in enumerate(acc) if a >= TARGET_ACCURACY), None)
        out["final_accuracy"] = round(acc[-1], 3)
        out["steps_to_95"] = None if solved is None else solved + 1
        out["seconds_to_95"] = None if solved is None else round(h[solved]["wall"], 1)
    return out


def solved(h: list[dict]) -> bool:
    """The sanity test's bar: the 5-step mean training accuracy at 95%."""
    acc = moving_average([m["reward/accuracy"] for m in h])
    return len(h) >= SMOOTHING and acc[-1] >= TARGET_ACCURACY


def _builtin_workload(tmp: Path, problems: list[dict] | None = None, name: str = "perfectible") -> list[str]:
    """The throughput workload on the built-in model: its perfectible set (or `problems`) at `parity
    sanity` settings."""
    data = tmp / f"{name}.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in problems or _perfectible_problems()))
    builtin = ["precision=fp16", "prompts_per_step=16", "rollout.group_size=8", "rollout.max_new_tokens=96"]
    return builtin + [f"task.data={data}", "algorithm.name=pg_seq_is"]


def throughput(args) -> dict:
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        builtin = _builtin_workload(tmp)
        llama_dir = make_llama_4m(tmp / "llama")
        llama = [f"model={llama_dir}", "precision=fp16", "prompts_per_step=8", "rollout.group_size=8"]
        llama += ["rollout.max_new_tokens=16"]

        for name, mode in MODES.items():
            for model, base, steps, stop in (
                ("builtin (sanity set)", builtin, args.max_steps, solved),
                ("llama-4.4M", llama, args.llama_steps, None),
            ):
                run_tmp = tmp / f"run-{sum(len(r) for r in results.values())}-{model[:5]}"
                run_tmp.mkdir()
                summary = _summary(_run(base + mode + [f"seed={args.seed}"], steps, run_tmp, stop))
                results.setdefault(model, {})[name] = summary
                print(model, name, json.dumps(summary), flush=True)
    for rows in results.values():
        base = rows["one process (sync)"]["samples_per_s"]
        for row in rows.values():
            row["throughput_vs_sync"] = round(row["samples_per_s"] / base, 2)
    return results


def _long_tail_workload(tmp: Path) -> list[str]:
    """The throughput workload with a long tail: every fourth prompt loses its "=" ("954+4302" for
    "954+4302="), which the built-in model answers with 1 to 96 tokens (its arithmetic answers take
    30-46); those prompts' rewards are 0, so this workload measures samples/s only."""
    problems = _perfectible_problems()
    for p in problems[::4]:
        p["prompt"] = p["prompt"].rstrip("=")
    return _builtin_workload(tmp, problems, "long-tail")


def partial(args) -> dict:
    """Partial rollouts against whole ones at each staleness, 1 worker + 1 learner, one run per seed:
    the throughput workload until 95% (or --max-steps), and its long-tailed form for --tail-steps."""
    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        workloads = {
            "perfectible": (_builtin_workload(tmp), args.max_steps, solved),
            "long-tail": (_long_tail_workload(tmp), args.tail_steps, None),
        }
        runs = itertools.product([w for w in workloads if w in args.workloads], args.seeds, (1, 2), (0, 2))
        for i, (workload, seed, staleness, spans) in enumerate(runs):
            base, steps, stop = workloads[workload]
            name = f"{workload}, staleness {staleness}, " + (f"partial rollouts {spans}" if spans else "whole")
            mode = ["distributed.rollout_workers=1", f"async.max_staleness={staleness}"]
            mode += [f"async.partial_rollouts={spans}", f"seed={seed}"]
            run_tmp = tmp / f"run-{i}"
            run_tmp.mkdir()
            result = _run(base + mode, steps, run_tmp, stop)
            h = result["history"]
            summary = _summary(result)
            summary["seed"] = seed
            for key in ("response/length_mean", "response/length_max", "async/staleness_mean"):
                summary[key] = round(sum(m[key] for m in h) / len(h), 2)
            summary["async/staleness_max"] = max(m["async/staleness_max"] for m in h)
            if spans:
                summary["async/continued_frac"] = round(sum(m["async/continued_frac"] for m in h) / len(h), 3)
                summary["async/dropped_tokens"] = h[-1]["async/dropped_tokens"]
            rows.setdefault(name, []).append(summary)
            print(name, json.dumps(summary), flush=True)
    return rows


def phantom(args) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for staleness in (1, 2):
            for source, label in (("rollout", "ratio vs μ (TRL AsyncGRPO)"), ("shadow", "ratio vs π_old (Parity)")):
                overrides = [
                    "task.name=length",
                    "algorithm.name=grpo",
                    "algorithm.probe=true",
                    f"algorithm.ratio_source={source}",
                    "trainer.precision=fp32",
                    "rollout.precision=bf16",
                    "allow_precision_mismatch=true",
                    "prompts_per_step=8",
                    "rollout.group_size=8",
                    "distributed.rollout_workers=1",
                    f"async.max_staleness={staleness}",
                    f"seed={args.seed}",
                ]
                run_tmp = Path(tmp) / f"{staleness}-{source}"
                run_tmp.mkdir()
                h = _run(overrides, args.phantom_steps, run_tmp)["history"]
                row = {
                    key: sum(m[key] for m in h) / len(h)
                    for key in ("clip/frac", "phantom/clip_frac", "alpha/abs_mean", "beta/abs_mean", "kappa/abs_mean")
                }
                row["steps_to_length_2"] = next((m["step"] for m in h if m["response/length_mean"] <= 2), None)
                row["final_length"] = h[-1]["response/length_mean"]
                row["staleness_mean"] = sum(m["async/staleness_mean"] for m in h) / len(h)
                results[f"staleness {staleness}, {label}"] = row
                print(staleness, label, json.dumps(row), flush=True)
    return results


def _ray_processes(run) -> list:
    """Ray's own processes for this run: the driver's descendants but the run's workers and learners
    (and the reaper, which is Parity's and sleeps)."""
    import psutil
    import ray

    mine = set(run.backend.worker_pids) | set(ray.get([learner.pid.remote() for learner in run.backend.learners]))
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in mine and "parity.distributed.cluster" not in " ".join(p.cmdline())
    ]


# Ray's processes by what they are, from their command lines; the first match names one.
RAY_ROLES = (
    ("gcs_server", "GCS"),
    ("raylet", "raylet"),
    ("log_monitor", "log monitor"),
    ("autoscaler/_private/monitor", "autoscaler monitor"),
    ("DashboardAgent", "dashboard agent"),
    ("dashboard/agent", "dashboard agent"),
    ("RuntimeEnvAgent", "runtime-env agent"),
    ("runtime_env/agent", "runtime-env agent"),
    ("dashboard/dashboard.py", "API server (dashboard off)"),
)


def _ray_role(cmdline: str) -> str:
    return next((name for key, name in RAY_ROLES if key in cmdline), "other Ray worker")


def _cpu_seconds(procs: list) -> dict[str, float]:
    """CPU seconds each kind of process has used since it started, summed over its processes."""
    import psutil

    by_role: dict[str, float] = {}
    for p in procs:
        try:
            t, role = p.cpu_times(), _ray_role(" ".join(p.cmdline()))
        except psutil.Error:
            continue
        by_role[role] = by_role.get(role, 0.0) + t.user + t.system
    return by_role


def pipeline(args) -> dict:
    import ray

    def pinned(run, before=None):
        """At the start: pin the worker to core 0 and the learner to core 1; at the end: Ray's CPU seconds."""
        if before is None:
            os.sched_setaffinity(run.backend.worker_pids[0], {0})
            os.sched_setaffinity(ray.get(run.backend.learners[0].pid.remote()), {1})
            return accounting(run)
        return accounting(run, before)

    def accounting(run, before=None):
        """At the start: Ray's processes and the CPU seconds they took to start; at the end: per second of run."""
        procs = before["procs"] if before else _ray_processes(run)
        now = {"procs": procs, "cpu": _cpu_seconds(procs), "t": time.perf_counter()}
        if before is None:
            return now
        seconds = now["t"] - before["t"]
        per_s = {role: (cpu - before["cpu"].get(role, 0.0)) / seconds for role, cpu in now["cpu"].items()}
        return {
            "ray_cpu_s_per_s": sum(per_s.values()),
            "ray_cpu_s_per_s_by_process": per_s,
            "ray_start_cpu_s_by_process": before["cpu"],
        }

    base = ["precision=fp16", "prompts_per_step=16", "rollout.group_size=8", "rollout.max_new_tokens=96"]
    base += ["eval.every=-1", f"seed={args.seed}"]
    distributed = ["distributed.rollout_workers=1", "async.max_staleness=1", "distributed.threads=1"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cores = os.sched_getaffinity(0)
        threads = torch.get_num_threads()
        os.sched_setaffinity(0, {0})  # one process on one core: its threads follow
        torch.set_num_threads(1)
        try:
            (tmp / "one").mkdir()
            one = _run(base, args.pipeline_steps, tmp / "one")
        finally:
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)
        results["one process, one core"] = {"step_s_median": statistics.median(m["time/step"] for m in one["history"])}
        for name, hook in (("worker on core 0, learner on core 1", pinned), ("unpinned", accounting)):
            (tmp / name[:8]).mkdir()
            r = _run(base + distributed, args.pipeline_steps, tmp / name[:8], started=hook)
            h = r["history"][1:]  # the first step waits for the pipeline to fill
            sampling = [m["time/worker_rollout"] + m["time/score"] for m in h]
            training = [m["time/train"] + m["time/sync"] for m in h]
            step = statistics.median(m["time/step"] for m in h)
            bound = statistics.median(max(a, b) for a, b in zip(sampling, training))
            results[name] = {
                "step_s_median": step,
                "sampling_s_median": statistics.median(sampling),
                "training_s_median": statistics.median(training),
                "bound_s_median": bound,
                "step_over_bound": step / bound,
                "ray_cpu_s_per_s": r["ray_cpu_s_per_s"],
                "ray_cpu_s_per_s_by_process": r["ray_cpu_s_per_s_by_process"],
                "ray_start_cpu_s_by_process": r["ray_start_cpu_s_by_process"],
                "learner_idle_s_median": statistics.median(m["time/learner_idle"] for m in h),
            }
        one_core = results["one process, one core"]["step_s_median"]
        for row in results.values():
            row["speedup_vs_one_core"] = one_core / row["step_s_median"]
        print(json.dumps(results, indent=2), flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--throughput", action="store_true")
    parser.add_argument("--phantom", action="store_true")
    parser.add_argument("--pipeline", action="store_true")
    parser.add_argument("--partial", action="store_true")
    parser.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], default=[0])
    parser.add_argument("--tail-steps", type=int, default=30)
    parser.add_argument("--workloads", type=lambda v: v.split(","), default=["perfectible", "long-tail"])
    parser.add_argument("--pipeline-steps", type=int, default=30)
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--llama-steps", type=int, default=30)
    parser.add_argument("--phantom-steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out = {"numerics": kernels.numerics("cpu").describe()}  # the processor every figure was measured on
    if args.throughput:
        out["throughput"] = throughput(args)
    if args.phantom:
        out["phantom"] = phantom(args)
    if args.pipeline:
        out["pipeline"] = pipeline(args)
    if args.partial:
        out["partial"] = partial(args)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
