"""What exact mode costs: step time with `exact=true` against without, rollout and train apart.

For each model and precision, training runs with and without exact mode alternate (`--rounds`
pairs, the order swapped every round so that drift on the machine falls on both), each
`--steps` steps after one warm-up step. Reported per run kind: median seconds per step of the
rollout (sampling) and of the train phase (π_old pass if any, forward, backward, optimizer),
and the exact/plain ratio of each. Exact runs must log zero mismatch on every step (the run
stops otherwise), which the benchmark also checks.

- the built-in model on its arithmetic task (16 prompts × 8 samples, up to 32 new tokens);
- the 4.4M Llama of DESIGN.md (random weights) on the same prompts, 8 prompts × 8 samples,
  16 new tokens (random weights rarely stop early, so both kinds do the same work).

Exact mode changes the numerics slightly, so the built-in model's responses differ between the
two kinds; times are also given per 1,000 sampled tokens so that length differences do not pass
for cost.

    python benchmarks/exact.py [--rounds 3] [--steps 5] [--precisions fp32,bf16,fp16] [--json out.json]

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
from parity.rl.loop import Run, TrainConfig  # noqa: E402

WORKLOADS = {
    "builtin": ["prompts_per_step=16", "rollout.group_size=8", "rollout.max_new_tokens=32"],
    "llama-4.4M": ["prompts_per_step=8", "rollout.group_size=8", "rollout.max_new_tokens=16"],
}


def run_steps(model: str, precision: str, exact: bool, steps: int, workload: list[str], tmp: Path) -> dict:
    cfg = config.load(
        TrainConfig,
        None,
        [
            f"model={model}",
            f"precision={precision}",
            f"exact={str(exact).lower()}",
            f"steps={steps + 1}",
            f"run_dir={tmp / f'{precision}-{exact}'}",
            "checkpoint_every=-1",
            "tensorboard=false",
            *workload,
        ],
    )
    run = Run.create(cfg, progress=False)
    try:
        history = [run.step() for _ in range(steps + 1)][1:]  # the first step builds kernels
    finally:
        run.rewards.close()
        run.lock.release()
    if exact and any(m["mismatch/token_abs_log_ratio_max"] != 0.0 for m in history):
        raise SystemExit(f"{model} {precision}: exact mode logged a non-zero mismatch")
    tokens = [m["train/samples"] * m["response/length_mean"] for m in history]
    return {
        "rollout_s": [m["time/rollout"] for m in history],
        "train_s": [m["time/train"] for m in history],
        "rollout_s_per_1k_tokens": [1000 * m["time/rollout"] / n for m, n in zip(history, tokens)],
        "train_s_per_1k_tokens": [1000 * m["time/train"] / n for m, n in zip(history, tokens)],
        "max_token_abs_log_ratio": max(m["mismatch/token_abs_log_ratio_max"] for m in history),
    }


def measure(model: str, precision: str, rounds: int, steps: int, workload: list[str], tmp: Path) -> dict:
    samples: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    mismatch = {False: 0.0, True: 0.0}
    for r in range(rounds):
        for exact in (False, True) if r % 2 == 0 else (True, False):
            result = run_steps(model, precision, exact, steps, workload, tmp / f"round{r}")
            mismatch[exact] = max(mismatch[exact], result.pop("max_token_abs_log_ratio"))
            for key, values in result.items():
                samples[exact].setdefault(key, []).extend(values)
    out = {"model": model, "precision": precision}
    for key in samples[False]:
        plain, exact = statistics.median(samples[False][key]), statistics.median(samples[True][key])
        out[key] = {"plain": plain, "exact": exact, "ratio": exact / plain}
    out["max_token_abs_log_ratio"] = {"plain": mismatch[False], "exact": mismatch[True]}
    return out


def table(results: list[dict]) -> str:
    lines = [
        "| model | precision | rollout s/step plain → exact | ratio | train s/step plain → exact | ratio | "
        "rollout ratio per token | train ratio per token | max token \\|Δ\\| plain → exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ro, tr = r["rollout_s"], r["train_s"]
        lines.append(
            f"| {r['model']} | {r['precision']} | {ro['plain']:.3f} → {ro['exact']:.3f} | {ro['ratio']:.2f}× | "
            f"{tr['plain']:.3f} → {tr['exact']:.3f} | {tr['ratio']:.2f}× | "
            f"{r['rollout_s_per_1k_tokens']['ratio']:.2f}× | {r['train_s_per_1k_tokens']['ratio']:.2f}× | "
            f"{r['max_token_abs_log_ratio']['plain']:.2g} → {r['max_token_abs_log_ratio']['exact']:.2g} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--precisions", default="fp32,bf16,fp16")
    parser.add_argument("--models", default="builtin,llama-4.4M")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in args.models.split(","):
            model = "builtin" if name == "builtin" else str(make_llama_4m(tmp / "llama"))
            for precision in args.precisions.split(","):
                results.append(measure(model, precision, args.rounds, args.steps, WORKLOADS[name], tmp / name))
                results[-1]["model"] = name
                print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
