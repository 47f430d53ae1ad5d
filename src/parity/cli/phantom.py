"""`parity phantom`: its flags and the call to `commands/phantom.py`."""

from __future__ import annotations

import argparse
from pathlib import Path

from parity.config import ConfigError
from parity.outdir import held_output_dir


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "phantom",
        help="the phantom-clipping experiment on the length task: the mismatch's clipping, per ratio source",
        description=(
            "On the length task (reward = -length) with PPO clip. On the built-in model: first, one update per "
            "rollout at epsilon 0.001 for FP32/BF16, BF16/BF16 and FP16/FP16 under each ratio source (rollout mu, "
            "recompute, shadow), where every clipped token is the mismatch's doing; then training runs per ratio "
            "source and matched precision, and a sweep of epsilon with the ratio against mu. With --model DIR: the "
            "write-up's experiment at its settings (FP32 trainer, BF16 rollout, epsilon 0.2, one update per "
            "rollout, chat questions through the model's chat template): ratio against mu, against pi_old "
            "(shadow), clipping off, matched FP16, and the first two with one asynchronous worker at staleness 1. "
            "The mismatch g = pi_old - mu is split into beta (precision) and kappa (engine)."
        ),
    )
    p.add_argument("--model", default="builtin", help="builtin (default) or a model directory (the write-up's runs)")
    p.add_argument("--out", default="parity-phantom", help="output directory (default parity-phantom)")
    p.add_argument("--steps", type=int, help="steps per run (default 60 on the built-in model, 25 with --model)")
    p.add_argument(
        "--eps", help="built-in model: clip epsilons for the sweep (comma-separated; default 0.02,0.005,0.001,0.0002)"
    )
    p.add_argument("--seed", type=int, help="built-in model: the seed (default 0)")
    p.add_argument("--seeds", help="with --model: the seeds, each arm once per seed (default 0,1)")
    p.add_argument("--no-async", action="store_true", help="with --model: leave out the asynchronous arms")
    p.add_argument("--device", default="cpu", help="where every model runs: cpu (default) or cuda")
    p.add_argument("overrides", nargs="*", help="with --model: parity train keys for every run, e.g. trainer.lr=1e-6")
    p.set_defaults(func=cmd_phantom)


def _listed(text: str, kind: type, option: str) -> tuple:
    """A comma-separated option's values, each of `kind` (int or float)."""
    try:
        return tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{option}: expected comma-separated {kind.__name__}s, got {text!r}") from None


def cmd_phantom(args: argparse.Namespace) -> int:
    from parity.commands import phantom

    # Each option belongs to one of the two experiments: one given to the other is refused, not ignored.
    given = {"--eps": args.eps is not None, "--seed": args.seed is not None}
    if args.model != "builtin":
        if any(given.values()):
            option = next(name for name, set_ in given.items() if set_)
            raise ConfigError(f"{option} goes with the built-in model's experiment, not --model DIR")
        seeds = _listed(args.seeds or "0,1", int, "--seeds")
        with held_output_dir(Path(args.out), "phantom"):  # before the runs: a second one is refused at once
            summary = phantom.run_writeup(
                args.model,
                Path(args.out),
                steps=phantom.WRITEUP_STEPS if args.steps is None else args.steps,
                seeds=seeds,
                overrides=tuple(args.overrides),
                with_async=not args.no_async,
                device=args.device,
            )
        for name, arm in summary["arms"].items():
            for seed, r in arm["seeds"].items():
                to2 = r["steps_to_length_2"]
                print(
                    f"{name}, seed {seed}: phantom clip frac at step 1 {r['phantom_clip_frac_step1']:.4f}, "
                    f"length <= 2 at step {to2 if to2 is not None else '-'}"
                )
        print(
            f"wrote {args.out}/report.md, summary.json, phantom.png, beta_by_prob.png ({summary['wall_seconds']:.0f} s)"
        )
        return 0
    if args.overrides or args.no_async or args.seeds is not None:
        raise ConfigError("key=value overrides, --seeds and --no-async go with --model DIR (the write-up's runs)")
    eps = _listed(args.eps or "0.02,0.005,0.001,0.0002", float, "--eps")
    with held_output_dir(Path(args.out), "phantom"):  # before the runs: a second one is refused at once
        summary = phantom.run_phantom(
            Path(args.out),
            steps=phantom.BUILTIN_STEPS if args.steps is None else args.steps,
            eps_sweep=eps,
            seed=0 if args.seed is None else args.seed,
            device=args.device,
        )
    for name, r in summary["runs"].items():
        to2 = r["steps_to_length_2"]
        print(
            f"{name}: length <= 2 at step {to2 if to2 is not None else '-'}, "
            f"phantom clip frac {r['phantom_clip_frac_mean']:.4f}"
        )
    print(f"wrote {args.out}/report.md, summary.json, phantom.png, beta.png ({summary['wall_seconds']:.0f} s)")
    return 0
