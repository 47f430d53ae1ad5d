"""Which estimators clip on what, and how much of it the mismatch causes, at one update per rollout.

The one-update part of `parity phantom` for every estimator that has a clip: the length task,
an FP32 trainer and a BF16 rollout engine, ratio against π_old (`recompute`), 8 prompts × 8
samples, 5 steps, seed 0. With one update per rollout the policy has not moved when the loss is
taken (α = 0), so a token the estimator's clip catches with its ratio taken against μ and not
against π_old is the mismatch's doing (phantom). Each estimator runs at its reference values
and at a tight setting of its own clip (the same 0.001 in ratio, or in probability for DPPO-TV),
where the built-in model's small mismatch becomes visible.

    python benchmarks/estimator_phantom.py --out /tmp/estimator-phantom

writes `summary.json` and `report.md` there (the table in docs/training.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from parity.commands.phantom import ONE_UPDATE_STEPS, PAIRS, train_length_task
from parity.engines import kernels
from parity.engines.kernels.cpu import cpu_flags
from parity.outdir import claim_output_dir, write_output, write_output_json
from parity.rl.algorithms import ESTIMATORS

# The tight setting of each clip: 0.001 in the ratio (PPO, GSPO, CISPO's upper bound), in the
# probability for DPPO-TV, and its square/2 scale (a binary KL of a 0.001 shift at p ≈ ½) for DPPO-KL.
TIGHT = {
    "gspo": ("algorithm.clip_low=1e-5", "algorithm.clip_high=1e-5"),
    "dppo_kl": ("algorithm.clip_low=2e-6", "algorithm.clip_high=2e-6"),
    "cispo": ("algorithm.clip_low=0.001", "algorithm.clip_high=0.001"),
}
DEFAULT_TIGHT = ("algorithm.clip_low=0.001", "algorithm.clip_high=0.001")
KEYS = ("clip/frac", "phantom/clip_frac", "is/rejected_seq_frac", "opsm/masked_seq_frac", "is/masked_frac")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="estimator-phantom")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = claim_output_dir(Path(args.out), "estimator-phantom", folders=("runs",))
    start = time.perf_counter()
    rows = {}
    for name, est in ESTIMATORS.items():
        if est.clipped is None:
            continue
        for setting, overrides in (("reference", ()), ("tight", TIGHT.get(name, DEFAULT_TIGHT))):
            print(f"{name}, {setting}", flush=True)
            history = train_length_task(
                out / "runs" / f"{name}-{setting}",
                ONE_UPDATE_STEPS,
                args.seed,
                (*PAIRS["fp32/bf16"], f"algorithm.name={name}", "algorithm.ratio_source=recompute", *overrides),
            )
            rows[f"{name} {setting}"] = {
                k: statistics.mean(m[k] for m in history) for k in KEYS if all(k in m for m in history)
            }
            rows[f"{name} {setting}"]["clips"] = est.clipped.__name__
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma")))
    machine = {**kernels.numerics("cpu").describe(), "cpu_flags": flags, "torch": torch.__version__}
    summary = {"rows": rows, "machine": machine, "wall_seconds": round(time.perf_counter() - start, 1)}
    write_output_json(out / "summary.json", summary)
    lines = [
        "| estimator | its clip | setting | clip frac | phantom clip frac | its own rule's share |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in rows.items():
        name, setting = key.split()
        rule = next((f"{r[k]:.4f} ({k})" for k in KEYS[2:] if k in r), "—")
        lines.append(
            f"| `{name}` | `{r['clips']}` | {setting} | {r['clip/frac']:.4f} | {r['phantom/clip_frac']:.4f} | {rule} |"
        )
    write_output(out / "report.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps(summary["machine"]), f"{summary['wall_seconds']} s")


if __name__ == "__main__":
    main()
