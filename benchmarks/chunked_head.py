"""The LM head whole against a chunk at a time (`trainer.chunked_head`): update time and peak memory.

    python benchmarks/chunked_head.py --model <SmolLM2-135M-Instruct dir> --shape 8,8,64 --steps 3 --rounds 2

Each arm runs in a process of its own (its peak RSS is its own), `--rounds` times, the arms alternating:
your-own-task's rewards through `parity.train` (`vs_trl.py --custom-task`'s), FP32, one micro-batch per
step, the given threads. Prints each run's update times (the trainer's part of each step) and peak RSS, and
writes them with the machine (processor, its flags, the matmul paths) to `--json`.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = ("never", "always")


def one_run(model: str, shape: tuple[int, int, int], arm: str, steps: int, threads: int) -> dict:
    import vs_trl
    from parity.rl import step

    prompts, group, tokens = shape
    work = vs_trl.Work(model, vs_trl._eval_problems(256, chat=True), prompts, group, tokens, "fp32", steps,
                       chat=True, custom=True, threads=threads)  # fmt: skip
    vs_trl._threads(work)
    times = []
    update = step.LocalBackend.update

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return update(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - start)

    step.LocalBackend.update = timed
    with tempfile.TemporaryDirectory() as tmp:
        vs_trl.parity_custom(work, Path(tmp), trainer__chunked_head=arm)
    return {"arm": arm, "update_s": times, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--shape", default="8,8,64", help="prompts,group,new tokens")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # a child process's arm
    args = parser.parse_args()
    shape = tuple(int(n) for n in args.shape.split(","))
    if args.arm:
        print(json.dumps(one_run(args.model, shape, args.arm, args.steps, args.threads)))
        return 0
    from agents_vs_trl import machine

    runs = []
    for _ in range(args.rounds):
        for arm in ARMS:
            child = [sys.executable, __file__, *sys.argv[1:], "--arm", arm]
            out = subprocess.run(child, capture_output=True, text=True, check=True, cwd=Path(__file__).parent)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            times = runs[-1]["update_s"]
            print(f"{arm:>6}: update {statistics.median(times):.2f} s (median of {len(times)}), "
                  f"peak RSS {runs[-1]['peak_rss_mb']:,.0f} MB", flush=True)  # fmt: skip
    record = {"shape": args.shape, "threads": args.threads, "machine": machine(), "runs": runs}
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
