"""Clip and phantom fractions at one update per rollout, on any checkout of Parity.

The same runs as the one-update table of `parity phantom` (length task, `grpo`,
ε = 0.001, 8 prompts × 8 samples, 5 steps, seed 0, the probe on), using only the
`Run` API and config keys that exist since f81f875, so that the table before the
fidelity fix can be measured against the one after it:

    git worktree add /tmp/before f81f875
    PYTHONPATH=/tmp/before/src python benchmarks/phantom_before.py before.json

(at f81f875 there was no κ metric, and the mean |g| is `mismatch/token_abs_log_ratio_mean`).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile

from parity import config
from parity.rl.loop import Run

try:
    from parity.rl.train_config import TrainConfig
except ImportError:  # a checkout from before the config had its own module
    from parity.rl.loop import TrainConfig

PAIRS = {
    "fp32/bf16": ["precision=fp32", "rollout.precision=bf16", "allow_precision_mismatch=true"],
    "bf16/bf16": ["precision=bf16"],
    "fp16/fp16": ["precision=fp16"],
}
KEYS = ("clip/frac", "phantom/clip_frac", "alpha/abs_mean", "beta/abs_mean", "mismatch/token_abs_log_ratio_mean")


def main(out: str) -> None:
    table = {}
    for pair, keys in PAIRS.items():
        for source in ("rollout", "recompute", "shadow"):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = config.load(
                    TrainConfig,
                    None,
                    [
                        f"run_dir={tmp}/run",
                        "task.name=length",
                        "algorithm.name=grpo",
                        f"algorithm.ratio_source={source}",
                        "algorithm.probe=true",
                        "algorithm.clip_low=0.001",
                        "algorithm.clip_high=0.001",
                        "prompts_per_step=8",
                        "rollout.group_size=8",
                        "steps=5",
                        "checkpoint_every=-1",
                        "tensorboard=false",
                        *keys,
                    ],
                )
                history = Run.create(cfg, progress=False).train()
            table[f"{pair} {source}"] = {k: statistics.mean(m.get(k, float("nan")) for m in history) for k in KEYS}
            print(pair, source, table[f"{pair} {source}"], flush=True)
    with open(out, "w") as f:
        json.dump(table, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
