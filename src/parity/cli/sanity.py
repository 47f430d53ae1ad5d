"""`parity sanity`: its flags and the call to `commands/sanity.py`."""

from __future__ import annotations

import argparse
from pathlib import Path

from parity.outdir import held_output_dir
from parity.rl.problems import DIFFICULTIES


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sanity",
        help="the sanity test: BF16 vs FP16 and estimators on the perfectible set (the main job)",
        description=(
            "Build (or reuse) the perfectible set of a model (the built-in one by default) and task, train the model "
            "on it under a matrix of precisions and estimators, and write summary.json, report.md and plots."
        ),
    )
    p.add_argument("--out", default="parity-sanity", help="output directory (default parity-sanity)")
    p.add_argument("--quick", action="store_true", help="fewer, smaller steps: a first look in about a minute")
    p.add_argument("--runs", help="comma-separated PRECISION/ESTIMATOR, e.g. fp16/pg_seq_is,bf16/grpo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="builtin", help="model directory, or 'builtin' (default)")
    p.add_argument(
        "--task",
        choices=("builtin", "exact", "math", "number"),
        help="the checker and its generated problems (default: builtin for the built-in model, number otherwise)",
    )
    p.add_argument("--max-new-tokens", type=int, default=96, help="longest response, everywhere (default 96)")
    p.add_argument(
        "--difficulty",
        choices=tuple(DIFFICULTIES),
        default="standard",
        help="--task number: the generated word problems' level (easy: one step, numbers below 16; worked: "
        "the easy problems asking for step-by-step working, answered at length)",
    )
    p.add_argument("--candidates", type=int, help="problems the perfectible search tries (default 256)")
    p.add_argument(
        "--lo",
        type=float,
        help="the perfectible set's lowest base accuracy (default 0.2; lower it for a model that rarely solves the "
        "task; the search is not repeated for it)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        help="training runs at once, each in its own process (default: one per core, at most 4; 1 on a GPU)",
    )
    p.add_argument("--device", default="cpu", help="where every model runs: cpu (default) or cuda")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="`parity train` keys for every run, after the test's own (e.g. trainer.lr=1e-5 steps=30)",
    )
    p.set_defaults(func=cmd_sanity)


def cmd_sanity(args: argparse.Namespace) -> int:
    from parity.commands.sanity import DEFAULT_RUNS, SanityOptions, parse_runs, run_sanity

    options = SanityOptions(
        out=Path(args.out),
        runs=parse_runs(args.runs or ",".join(DEFAULT_RUNS)),
        quick=args.quick,
        seed=args.seed,
        model=args.model,
        task=args.task,
        max_new_tokens=args.max_new_tokens,
        difficulty=args.difficulty,
        candidates=args.candidates,
        lo=args.lo,
        overrides=tuple(args.overrides),
        jobs=args.jobs,
        device=args.device,
    )
    with held_output_dir(options.out, "sanity"):  # before the search and the runs: a second one is refused at once
        summary = run_sanity(options)
    from parity.commands.report import summary_table

    print(summary_table(summary["runs"]))
    print(f"wrote {args.out}/summary.json, report.md and plots ({summary['wall_seconds']:.0f} s)")
    return 0
