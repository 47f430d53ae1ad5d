"""Seconds per step of a small built-in run (BF16, 8 prompts × 4 samples, 1 thread), to check that a change of
structure leaves the step's speed as it was: run it on each checkout in turns (PYTHONPATH picks the code).

    PYTHONPATH=OLD_CHECKOUT/src python benchmarks/step_time.py before
    PYTHONPATH=src python benchmarks/step_time.py after
"""

import sys
import tempfile
import time

import torch

from parity import config
from parity.rl.loop import Run
from parity.rl.train_config import TrainConfig

RUN = ["prompts_per_step=8", "rollout.group_size=4", "rollout.max_new_tokens=32", "precision=bf16", "steps=6"]
QUIET = ["tensorboard=false", "eval.every=-1", "log.completions=0"]


def main(label: str) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        run = Run.create(config.load(TrainConfig, None, [f"run_dir={out}/run", *RUN, *QUIET]), progress=False)
        try:
            run.step()  # the first step builds the kernels and caches
            start = time.perf_counter()
            for _ in range(5):
                run.step()
            print(f"{label}: {(time.perf_counter() - start) / 5:.3f} s/step")
        finally:
            run.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "this checkout")
