"""The trainer's update as this checkout runs it against one other way, on alternate steps of one run.

Separate processes on a shared VM differ by more than a 10% change (docs/benchmarks.md), so both arms run in
one process, switched before every update. The other arm is one of:

- `--rev REV`: `engines/packing.py` as it was at git revision REV, loaded from git beside this checkout's (the
  trainer's `pack` is switched); the stream's prompt tokens under each packing are printed too;
- `--mkl`: the trainer's FP32 matmuls by MKL (`F.linear` and its autograd) instead of oneDNN
  (`kernels.ops.on_onednn`); the rollout engine's are untouched.

The run is `benchmarks/vs_trl.py --custom-task`'s Parity side (chat prompts, two batched rewards, FP32). Prints
each arm's median update and rollout, the first step of each arm left out.

    python benchmarks/update_ab.py --model /path/to/SmolLM2-135M-Instruct (--rev 99c81c6 | --mkl) [--shape 4,4,32]
        [--steps 21]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import vs_trl  # noqa: E402


def packing_at(rev: str):
    """`parity.engines.packing` as it was at git revision `rev`, as a module of its own."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(
        ["git", "show", f"{rev}:src/parity/engines/packing.py"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / f"packing_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face model directory Parity runs")
    other = parser.add_mutually_exclusive_group(required=True)
    other.add_argument("--rev", help="the other arm: the packing of this git revision")
    other.add_argument("--mkl", action="store_true", help="the other arm: the trainer's FP32 matmuls by MKL")
    parser.add_argument("--shape", default="4,4,32", help="prompts, group size, max new tokens")
    parser.add_argument("--steps", type=int, default=21)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from parity.engines import trainer
    from parity.engines.kernels import ops
    from parity.rl import step

    names = ["this checkout", args.rev or "MKL"]
    packings = dict(zip(names, [trainer.pack, packing_at(args.rev).pack if args.rev else trainer.pack]))
    updates, rollouts, calls = {n: [] for n in names}, {n: [] for n in names}, [0]
    update, rollout = step.LocalBackend.update, step.LocalBackend.rollouts

    def arm() -> str:
        return names[calls[0] % 2]

    def timed_update(*a, **k):
        name = arm()
        trainer.pack = packings[name]
        with contextlib.ExitStack() as patched:
            if name == "MKL":
                on_onednn = ops.on_onednn
                ops.on_onednn = lambda weight: False
                patched.callback(setattr, ops, "on_onednn", on_onednn)
            start = time.perf_counter()
            try:
                return update(*a, **k)
            finally:
                updates[name].append(time.perf_counter() - start)
                calls[0] += 1

    def timed_rollouts(*a, **k):
        start = time.perf_counter()
        try:
            return rollout(*a, **k)
        finally:
            rollouts[arm()].append(time.perf_counter() - start)

    step.LocalBackend.update, step.LocalBackend.rollouts = timed_update, timed_rollouts
    prompts, group, new_tokens = (int(x) for x in args.shape.split(","))
    problems = vs_trl._eval_problems(256, chat=True)
    work = vs_trl.Work(
        args.model,
        problems,
        prompts,
        group,
        new_tokens,
        "fp32",
        args.steps,
        chat=True,
        custom=True,
        threads=args.threads,
    )
    vs_trl._threads(work)
    with tempfile.TemporaryDirectory() as tmp:
        vs_trl.parity_custom(work, Path(tmp))

    from parity.engines.tokenizer import load_tokenizer

    tok = load_tokenizer(args.model)
    rows = [tok.encode_prompt(p["prompt"]) for p in problems[:prompts] for _ in range(group)]
    for name in names:
        u, r = updates[name][1:], rollouts[name][1:]
        stream = packings[name](rows).num_tokens
        print(
            f"{name}: update median {statistics.median(u):.3f} s (n={len(u)}), rollout median "
            f"{statistics.median(r):.3f} s; the first {prompts} prompts x {group} stored as {stream} tokens"
        )


if __name__ == "__main__":
    main()
