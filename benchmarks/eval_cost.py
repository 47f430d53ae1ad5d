"""What held-out evaluation and the full-vocabulary check cost a training run.

Two runs of one config (`parity train`'s defaults unless overridden), one with the full-vocabulary
check at `--positions` positions per step and one without, step in turn after a warm-up step, so that
the machine's slow spells fall on both alike. Reported: the median step time of each and their ratio
(the check's whole cost: the recording while sampling and the trainer's pass over the recorded rows),
and `time/full_vocab`'s share of the step. Then each run's held-out evaluation is timed `--evals` times
(the config's `eval.*`); at `eval.every` steps apart its share of a run is
t_eval / (eval.every × t_step + t_eval).

    python benchmarks/eval_cost.py [--steps 8] [--positions 32] [--evals 3] [--json out.json] [key=value ...]

Nothing else may run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from parity import config
from parity.engines import kernels
from parity.rl.loop import Run
from parity.rl.train_config import TrainConfig


def create(run_dir: Path, positions: int, overrides: list[str]) -> Run:
    cfg = config.load(
        TrainConfig,
        None,
        [
            f"run_dir={run_dir}",
            "steps=1000",
            "checkpoint_every=-1",
            "tensorboard=false",
            *overrides,
            f"diagnostics.full_vocab_positions={positions}",
        ],
    )
    return Run.create(cfg, progress=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--positions", type=int, default=32)
    parser.add_argument("--evals", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {p: create(Path(tmp) / f"p{p}", p, args.overrides) for p in (args.positions, 0)}
        try:
            history: dict[int, list[dict]] = {p: [] for p in runs}
            for run in runs.values():
                run.step()  # warm-up
            for s in range(args.steps):
                for p in list(runs)[s % 2 :] + list(runs)[: s % 2]:
                    history[p].append(runs[p].step())
            run = runs[args.positions]
            evals = []
            for _ in range(args.evals):
                t = time.perf_counter()
                metrics = run.evaluate()
                evals.append(time.perf_counter() - t)
        finally:
            for r in runs.values():
                r.rewards.close()
                r.lock.release()
    step = {p: statistics.median(m["time/step"] for m in h) for p, h in history.items()}
    on = history[args.positions]
    every = run.cfg.eval.every
    t_eval = statistics.median(evals)
    record = {
        "numerics": kernels.numerics(run.cfg.device).describe(),
        "cpu_flags": sorted(kernels.cpu.cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16"}),
        "threads": torch.get_num_threads(),
        "overrides": args.overrides,
        "positions": args.positions,
        "step_s_with_check": step[args.positions],
        "step_s_without": step[0],
        "check_ratio": step[args.positions] / step[0],
        "full_vocab_s": statistics.median(m["time/full_vocab"] for m in on),
        "full_vocab_share": statistics.median(m["time/full_vocab"] / m["time/step"] for m in on),
        "eval_s": t_eval,
        "eval_every": every,
        "eval_prompts": metrics["eval/prompts"],
        "eval_share": t_eval / (every * step[args.positions] + t_eval) if every > 0 else None,
    }
    print(
        f"step {record['step_s_with_check']:.3f} s with the full-vocabulary check at {args.positions} positions, "
        f"{record['step_s_without']:.3f} s without ({record['check_ratio']:.3f}x); time/full_vocab "
        f"{record['full_vocab_s'] * 1000:.1f} ms ({record['full_vocab_share']:.1%} of a step)"
    )
    share = "" if record["eval_share"] is None else f", {record['eval_share']:.1%} of a run at eval.every={every}"
    print(f"one held-out evaluation ({record['eval_prompts']} prompts): {t_eval:.2f} s{share}")
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
