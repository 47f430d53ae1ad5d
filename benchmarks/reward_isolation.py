"""Where a reward that runs a torch model should run: in the training process, in a long-lived worker
started by spawn, in a worker spawned per call, or in a forked worker (what `reward.isolate=auto` used
for user rewards before).

The judge is a small transformer encoder over the completion's bytes (`judge_reward.py`, written next to
this run), called batched on a step's worth of completions of the built-in model (128 by default). The
parent runs the judge once first, as a training process runs torch before its first reward, so that
its thread pool is started when a child is forked.

    python benchmarks/reward_isolation.py [--completions 128] [--calls 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

JUDGE = """
import torch

torch.manual_seed(0)
embed = torch.nn.Embedding(256, 128)
layer = torch.nn.TransformerEncoderLayer(128, 4, 512, batch_first=True)
encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
head = torch.nn.Linear(128, 1)


@torch.no_grad()
def judged(completions, **columns):
    ids = torch.zeros(len(completions), 96, dtype=torch.long)
    for i, c in enumerate(completions):
        b = list(c.encode()[:96])
        ids[i, : len(b)] = torch.tensor(b, dtype=torch.long)
    return head(encoder(embed(ids)).mean(1)).squeeze(-1).tolist()
"""


def _completions(n: int) -> list[str]:
    from parity.rl.problems import ArithmeticTask

    problems = ArithmeticTask().problems(n, seed=0)
    return [ArithmeticTask.solution(p) for p in problems]


def _time(call, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        call()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--completions", type=int, default=128)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--fork-timeout", type=float, default=30.0)
    ap.add_argument("--json")
    args = ap.parse_args()

    from parity.rl.problems import Problem
    from parity.rl.reward_fns import Reward, UserRewards, bind_all
    from parity.rl.rewards import RewardRunner

    folder = Path(tempfile.mkdtemp())
    (folder / "judge_reward.py").write_text(JUDGE)
    sys.path.insert(0, str(folder))
    import judge_reward

    completions = _completions(args.completions)
    items = [(Problem("1+1=", "2"), c, len(c)) for c in completions]
    judge_reward.judged(completions)  # the parent's torch threads are running now, as in training

    results: dict[str, dict] = {
        "processor": {
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        },
        "completions": args.completions,
    }

    bound = bind_all([Reward(judge_reward.judged)], ["answer"])
    in_process = UserRewards(bound)
    worker = UserRewards(bound, isolate=True, timeout_s=120)
    results["spawn_worker_first_call_s"] = _time(lambda: worker(items), 1)[0]  # starts the worker

    def spawn_per_call() -> None:
        fresh = UserRewards(bound, isolate=True, timeout_s=120)
        fresh(items)
        fresh.close()

    # The arms in turn, so that the machine's other load falls on each alike.
    arms = {"in_process_s": lambda: in_process(items), "spawn_worker_call_s": lambda: worker(items)}
    arms["spawn_per_call_s"] = spawn_per_call
    for key in arms:
        results[key] = []
    for _ in range(args.calls):
        for key, call in arms.items():
            results[key] += _time(call, 1)
    worker.close()

    forked = RewardRunner(judge_reward.judged, isolate=True, timeout_s=args.fork_timeout, start="fork")
    t = time.perf_counter()
    try:
        value, failure = forked.call(completions)
        results["fork_worker"] = {
            "seconds": time.perf_counter() - t,
            "outcome": "ok" if failure is None else failure.summary,
        }
    except Exception as e:  # the start itself failing
        results["fork_worker"] = {"seconds": time.perf_counter() - t, "outcome": f"{type(e).__name__}: {e}"}
    forked.close()

    for key in ("in_process_s", "spawn_worker_call_s", "spawn_per_call_s"):
        print(f"{key}: median {statistics.median(results[key]):.3f} s over {len(results[key])} calls")
    print(f"spawn_worker_first_call_s: {results['spawn_worker_first_call_s']:.2f} s (start + first call, once)")
    print(f"fork_worker: {results['fork_worker']}")
    print(json.dumps(results["processor"]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    mp.freeze_support()
    main()
