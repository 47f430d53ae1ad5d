"""The reward path's own cost per step, against a plain Python loop calling the same reward functions.

Built-in model at `parity train`'s defaults (16 prompts x 8 samples), trained through `parity.train`'s
objects with two reward functions of your own: a batched correctness check (the data's integer answer)
and a per-sample length penalty, weights 1 and 0.5. After each step, the same functions are called again
on the step's own responses by a plain loop (decode each response, call the batched function once and
the per-sample one per completion, sum with the weights): what any trainer must do. Parity's reward path
is `time/reward` (decoding, the columns, the calls, the checks, the weighted sum, per-function metrics)
plus `time/completions` (the completions file and table); its overhead is that minus the plain loop, as
a share of the step. The two alternate step by step, so that the machine's other load falls on both.

    python benchmarks/reward_overhead.py [--steps 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def correct(prompts, completions, answer, **columns):
    return [1.0 if c.rsplit(">", 1)[-1].strip() == str(a) else 0.0 for c, a in zip(completions, answer)]


def short(prompt, completion, **columns):
    return -len(completion) / 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from parity import config
    from parity.rl.loop import Run
    from parity.rl.problems import ArithmeticTask
    from parity.rl.reward_fns import Reward
    from parity.rl.train_config import TrainConfig
    from parity.runtime import reuse_freed_memory, use_free_cores

    reuse_freed_memory()
    threads = use_free_cores()
    rows = [{"prompt": p.prompt, "answer": int(p.answer)} for p in ArithmeticTask().problems(512, seed=0)]
    rewards = [Reward(correct), Reward(short, weight=0.5)]
    with tempfile.TemporaryDirectory() as tmp:
        keys = [f"run_dir={tmp}/run", f"steps={args.steps}", "eval.every=-1", "checkpoint_every=-1"]
        keys += ["tensorboard=false"]
        keys += ["task.reward_fn=reward_overhead:correct,reward_overhead:short", "task.reward_weights=1,0.5"]
        cfg = config.load(TrainConfig, None, keys)
        run = Run.create(cfg, progress=False, rewards=rewards, datasets={"train": rows})
        captured = {}
        rollouts = run.backend.rollouts

        def capture(step, times):
            captured["step"] = rollouts(step, times)
            return captured["step"]

        run.backend.rollouts = capture
        tok = run.tokenizer
        parity_path, plain, steps = [], [], []
        try:
            for step in range(args.steps):
                metrics = run.step()
                problems, batch = captured["step"]
                t = time.perf_counter()
                lengths = batch.response_lengths.tolist()
                texts = [tok.decode(batch.response_ids[i, :n].tolist()) for i, n in enumerate(lengths)]
                groups = batch.group_index.tolist()
                prompts = [problems[g].prompt for g in groups]
                answers = [problems[g].columns["answer"] for g in groups]
                first = correct(prompts, texts, answers)
                second = [short(p, c) for p, c in zip(prompts, texts)]
                _ = [a + 0.5 * b for a, b in zip(first, second)]
                elapsed = time.perf_counter() - t
                if step >= args.warmup:
                    parity_path.append(metrics["time/reward"] + metrics["time/completions"])
                    plain.append(elapsed)
                    steps.append(metrics["time/step"])
        finally:
            run.close()
    overhead = [(p - q) / s for p, q, s in zip(parity_path, plain, steps)]
    out = {
        "processor": {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch_threads": threads},
        "steps": len(steps),
        "step_s_median": statistics.median(steps),
        "parity_reward_path_s_median": statistics.median(parity_path),
        "plain_loop_s_median": statistics.median(plain),
        "overhead_share_median": statistics.median(overhead),
        "overhead_share_max": max(overhead),
    }
    print(json.dumps(out, indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
