"""What exact mode costs: step time with `exact=true` against without, rollout and train apart.

For each model and precision, `--rounds` pairs of training runs, one with and one without
exact mode, step in turn (`--steps` steps each after one warm-up step, the first of each pair
alternating), so that the machine's slow spells fall on both kinds alike. Reported per kind:
median seconds per step of the rollout (sampling) and of the train phase (π_old pass if any,
forward, backward, optimizer), and the exact/plain ratio of each. Exact runs must log zero
mismatch on every step (the run stops otherwise), which the benchmark also checks.

- the built-in model on its arithmetic task (16 prompts × 8 samples, up to 32 new tokens);
- the 4.4M Llama (docs/design.md, "Precision semantics"; random weights) on the same prompts, 8 prompts × 8 samples,
  16 new tokens (random weights rarely stop early, so both kinds do the same work);
- any model directory (e.g. SmolLM2-135M-Instruct) on easy word problems through its chat template,
  4 prompts × 4 samples, 64 new tokens.

With `--staleness 0,1` the runs are distributed instead (1 rollout worker + 2 FSDP2 learners on Ray
at each `async.max_staleness`): one Ray cluster per process, so the two kinds run one after the
other (`--steps` steps each after a warm-up step, the first kind alternating per round), and the
figure is the median wall time per step (`time/step`); every exact step must log
`mismatch/exact_tokens_frac` = 1 and max |Δ| = 0.

Extra `parity train` keys for every run follow the options (`lora.rank=8 lora.merge=false` measures
exact mode with LoRA).

Exact mode changes the numerics slightly, so the built-in model's responses differ between the
two kinds; times are also given per 1,000 sampled tokens so that length differences do not pass
for cost.

    python benchmarks/exact.py [--rounds 3] [--steps 5] [--precisions fp32,bf16,fp16] [--models builtin,llama-4.4M,DIR]
        [--staleness 0,1] [--json out.json] [key=value ...]

Nothing else may run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engines import make_llama_4m  # noqa: E402
from parity import config  # noqa: E402
from parity.distributed.driver import backend_for  # noqa: E402
from parity.rl.loop import Run  # noqa: E402
from parity.rl.train_config import TrainConfig  # noqa: E402

WORKLOADS = {
    "builtin": ["prompts_per_step=16", "rollout.group_size=8", "rollout.max_new_tokens=32"],
    "llama-4.4M": ["prompts_per_step=8", "rollout.group_size=8", "rollout.max_new_tokens=16"],
}
# A model directory: an instruct model's task.
DIRECTORY_WORKLOAD = [
    "task.name=number",
    "task.difficulty=easy",
    "prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=64",
]


def create(model: str, precision: str, exact: bool, steps: int, workload: list[str], run_dir: Path) -> Run:
    cfg = config.load(
        TrainConfig,
        None,
        [
            f"model={model}",
            f"precision={precision}",
            f"exact={str(exact).lower()}",
            f"steps={steps + 1}",
            f"run_dir={run_dir}",
            "checkpoint_every=-1",
            "tensorboard=false",
            "eval.every=-1",
            *workload,
        ],
    )
    return Run.create(cfg, progress=False, backend=backend_for(cfg))


def measure(model: str, precision: str, rounds: int, steps: int, workload: list[str], tmp: Path) -> dict:
    """`rounds` pairs of runs, one plain and one exact, stepping in turn (the first of each pair
    alternating), so that the machine's slow spells fall on both kinds alike."""
    history: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(rounds):
        runs = {
            exact: create(model, precision, exact, steps, workload, tmp / f"{precision}-{r}-{exact}")
            for exact in (False, True)
        }
        try:
            for exact in (False, True):
                runs[exact].step()  # the first step builds kernels
            for s in range(steps):
                for exact in (False, True) if (r + s) % 2 == 0 else (True, False):
                    history[exact].append(runs[exact].step())
        finally:
            for run in runs.values():
                run.rewards.close()
                run.lock.release()
    if any(m["mismatch/token_abs_log_ratio_max"] != 0.0 for m in history[True]):
        raise SystemExit(f"{model} {precision}: exact mode logged a non-zero mismatch")
    out = {"model": model, "precision": precision}
    for key, per_token in (("rollout", False), ("train", False), ("rollout", True), ("train", True)):
        medians = {}
        for exact, h in history.items():
            values = [
                m[f"time/{key}"] * (1000 / (m["train/samples"] * m["response/length_mean"]) if per_token else 1)
                for m in h
            ]
            medians[exact] = statistics.median(values)
        name = f"{key}_s_per_1k_tokens" if per_token else f"{key}_s"
        out[name] = {"plain": medians[False], "exact": medians[True], "ratio": medians[True] / medians[False]}
    out["max_token_abs_log_ratio"] = {
        exact: max(m["mismatch/token_abs_log_ratio_max"] for m in h)
        for exact, h in (("plain", history[False]), ("exact", history[True]))
    }
    return out


DISTRIBUTED = ["distributed.rollout_workers=1", "distributed.learners=2"]


def measure_async(
    model: str, precision: str, staleness: int, rounds: int, steps: int, workload: list[str], tmp: Path
) -> dict:
    """Distributed runs, the two kinds one after the other (one Ray cluster per process)."""
    workload = [*workload, *DISTRIBUTED, f"async.max_staleness={staleness}"]
    history: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(rounds):
        for exact in (False, True) if r % 2 == 0 else (True, False):
            run = create(model, precision, exact, steps, workload, tmp / f"{precision}-{staleness}-{r}-{exact}")
            try:
                run.step()  # start-up and the first kernels
                history[exact] += [run.step() for _ in range(steps)]
            finally:
                run.close()
    exact_steps = history[True]
    if any(m["mismatch/exact_tokens_frac"] != 1.0 or m["mismatch/token_abs_log_ratio_max"] != 0.0 for m in exact_steps):
        raise SystemExit(f"{model} {precision} staleness {staleness}: exact mode logged a non-zero mismatch")
    medians = {exact: statistics.median(m["time/step"] for m in h) for exact, h in history.items()}
    return {
        "model": model,
        "precision": precision,
        "staleness": staleness,
        "steps": len(exact_steps),
        "step_s": {"plain": medians[False], "exact": medians[True], "ratio": medians[True] / medians[False]},
        "exact_tokens_frac_min": min(m["mismatch/exact_tokens_frac"] for m in exact_steps),
        "max_token_abs_log_ratio": {
            kind: max(m["mismatch/token_abs_log_ratio_max"] for m in h)
            for kind, h in (("plain", history[False]), ("exact", history[True]))
        },
    }


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _ratio(pair: dict) -> list[str]:
    return [f"{pair['plain']:.3f} → {pair['exact']:.3f}", f"{pair['ratio']:.2f}×"]


def _largest(r: dict) -> str:
    d = r["max_token_abs_log_ratio"]
    return f"{d['plain']:.2g} → {d['exact']:.2g}"


def async_table(results: list[dict]) -> str:
    header = ["model", "precision", "staleness", "exact steps", "min exact_tokens_frac"]
    header += ["max token \\|Δ\\| plain → exact", "s/step plain → exact", "ratio"]
    rows = [
        [r["model"], r["precision"], str(r["staleness"]), str(r["steps"]), f"{r['exact_tokens_frac_min']:g}"]
        + [_largest(r), *_ratio(r["step_s"])]
        for r in results
    ]
    return _markdown(header, rows)


def table(results: list[dict]) -> str:
    header = ["model", "precision", "rollout s/step plain → exact", "ratio", "train s/step plain → exact", "ratio"]
    header += ["rollout ratio per token", "train ratio per token", "max token \\|Δ\\| plain → exact"]
    rows = [
        [r["model"], r["precision"], *_ratio(r["rollout_s"]), *_ratio(r["train_s"])]
        + [f"{r['rollout_s_per_1k_tokens']['ratio']:.2f}×", f"{r['train_s_per_1k_tokens']['ratio']:.2f}×", _largest(r)]
        for r in results
    ]
    return _markdown(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--precisions", default="fp32,bf16,fp16")
    parser.add_argument("--models", default="builtin,llama-4.4M")
    parser.add_argument("--staleness", help="distributed runs at these async.max_staleness values (e.g. 0,1)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="parity train keys for every run")
    args = parser.parse_args()
    results = []
    render = table if args.staleness is None else async_table
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in args.models.split(","):
            model = {"builtin": "builtin", "llama-4.4M": None}.get(name, name)
            model = str(make_llama_4m(tmp / "llama")) if model is None else model
            workload = [*WORKLOADS.get(name, DIRECTORY_WORKLOAD), *args.overrides]
            for precision in args.precisions.split(","):
                where = tmp / Path(name).name
                if args.staleness is None:
                    found = [measure(model, precision, args.rounds, args.steps, workload, where)]
                else:
                    found = [
                        measure_async(model, precision, int(k), args.rounds, args.steps, workload, where)
                        for k in args.staleness.split(",")
                    ]
                for r in found:
                    r["model"] = name
                    print(render([r]).splitlines()[-1], flush=True)
                results += found
    print(render(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
