"""Asynchronous training on Ray against one process: throughput, time to solve, phantom clipping.

Throughput (`--throughput`): one process (synchronous) against 1 rollout worker + 1 learner at
async.max_staleness 0, 1 and 2, on
- the built-in model on its perfectible set at `parity sanity` settings (16 prompts × 8, 96 new
  tokens, FP16), trained until the 5-step mean training accuracy reaches 95% (or --max-steps):
  samples/s and seconds to 95%;
- the 4.4M Llama of DESIGN.md (random weights: it cannot learn the task, so samples/s only) on
  the built-in arithmetic prompts, 8 prompts × 8, 16 new tokens, --llama-steps steps.
Seconds count from the first step's start (after Ray and the actors are up); the start-up
is reported apart.

Phantom clipping (`--phantom`): the length task (reward −length, grpo, ε = 0.2) with an FP32
learner and a BF16 rollout worker at staleness 1 and 2, the PPO ratio against μ (TRL's
AsyncGRPO) and against π_old scored by the worker (Parity): clip and phantom fractions,
|α|, |β|, |κ| and steps to mean length ≤ 2.

    python benchmarks/async_rl.py --throughput --phantom --out async.json

Nothing else may run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engines import make_llama_4m  # noqa: E402
from parity import config  # noqa: E402
from parity.commands.report import SMOOTHING, TARGET_ACCURACY, moving_average  # noqa: E402
from parity.distributed.driver import run_class  # noqa: E402
from parity.rl.train_config import TrainConfig  # noqa: E402
from vs_trl import _perfectible_problems  # noqa: E402

MODES = {
    "one process (sync)": [],
    "1 worker + 1 learner, staleness 0": ["distributed.rollout_workers=1", "async.max_staleness=0"],
    "1 worker + 1 learner, staleness 1": ["distributed.rollout_workers=1", "async.max_staleness=1"],
    "1 worker + 1 learner, staleness 2": ["distributed.rollout_workers=1", "async.max_staleness=2"],
}


def _run(overrides: list[str], steps: int, tmp: Path, stop=None) -> dict:
    cfg = config.load(
        TrainConfig,
        None,
        [f"run_dir={tmp / 'run'}", f"steps={steps}", "checkpoint_every=-1", "tensorboard=false", *overrides],
    )
    t0 = time.perf_counter()
    run = run_class(cfg).create(cfg, progress=False)
    startup = time.perf_counter() - t0
    history, start = [], time.perf_counter()
    try:
        while run.step_count < steps:
            history.append(run.step())
            history[-1]["wall"] = time.perf_counter() - start
            if stop is not None and stop(history):
                break
    finally:
        run._stop_engines()
        run.rewards.close()
        run.lock.release()
    return {"startup_s": startup, "history": history}


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


def throughput(args) -> dict:
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "perfectible.jsonl"
        data.write_text("".join(json.dumps(p) + "\n" for p in _perfectible_problems()))
        builtin = ["precision=fp16", "prompts_per_step=16", "rollout.group_size=8", "rollout.max_new_tokens=96"]
        builtin += [f"task.data={data}", "algorithm.name=pg_seq_is"]
        llama_dir = make_llama_4m(tmp / "llama")
        llama = [f"model={llama_dir}", "precision=fp16", "prompts_per_step=8", "rollout.group_size=8"]
        llama += ["rollout.max_new_tokens=16"]

        def solved(h: list[dict]) -> bool:
            acc = moving_average([m["reward/accuracy"] for m in h])
            return len(h) >= SMOOTHING and acc[-1] >= TARGET_ACCURACY

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


def phantom(args) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for staleness in (1, 2):
            for source, label in (("rollout", "ratio vs μ (TRL AsyncGRPO)"), ("shadow", "ratio vs π_old (Parity)")):
                overrides = [
                    "task.name=length",
                    "algorithm.name=grpo",
                    "algorithm.shadow_forward=true",
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--throughput", action="store_true")
    parser.add_argument("--phantom", action="store_true")
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--llama-steps", type=int, default=30)
    parser.add_argument("--phantom-steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    out = {}
    if args.throughput:
        out["throughput"] = throughput(args)
    if args.phantom:
        out["phantom"] = phantom(args)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
