"""`parity build-model`: its flags and the call to `builtin/build.py`."""

from __future__ import annotations

import argparse
from pathlib import Path

from parity.builtin.build import BuildConfig, build_model
from parity.engines.models.io import BUILTIN_DIR


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "build-model",
        help="reproduce the built-in base model from scratch (~3 min on 2 cores)",
        description="Pretrain the built-in model on the arithmetic task and save it in Hugging Face format.",
    )
    p.add_argument("--out", default=str(BUILTIN_DIR), type=Path, help=f"output directory (default {BUILTIN_DIR})")
    p.add_argument("--steps", type=int, default=BuildConfig.steps, help="pretraining steps")
    p.add_argument("--seed", type=int, default=BuildConfig.seed)
    p.set_defaults(func=cmd_build_model)


def cmd_build_model(args: argparse.Namespace) -> int:
    cfg = BuildConfig(steps=args.steps, seed=args.seed)
    spread = build_model(args.out, cfg)
    print(f"saved the model to {args.out}")
    if spread["spread_fraction"] < 0.3:
        print(f"warning: only {spread['spread_fraction']:.0%} of held-out problems have accuracy in [0.2, 0.8]")
    return 0
