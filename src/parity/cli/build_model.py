"""`parity build-model`: its flags and the call to `builtin/build.py` (or `builtin/agent.py` with --agent)."""

from __future__ import annotations

import argparse
from pathlib import Path

from parity.builtin.agent import AgentBuildConfig, build_agent_model
from parity.builtin.build import BuildConfig, build_model
from parity.config import check_range
from parity.engines.models.io import AGENT_DIR, BUILTIN_DIR
from parity.rl.train_config import MAX_SEED


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "build-model",
        help="reproduce the built-in base model from scratch (~3 min on 2 cores; --agent: the tool-calling one)",
        description="Pretrain the built-in model on the arithmetic task (or, with --agent, the builtin-agent "
        "model on the lookup tool task) and save it in Hugging Face format.",
    )
    p.add_argument(
        "--agent", action="store_true", help=f"build builtin-agent, the tool-calling model (default out {AGENT_DIR})"
    )
    p.add_argument("--out", type=Path, help=f"output directory (default {BUILTIN_DIR})")
    p.add_argument(
        "--steps", type=int, help=f"pretraining steps (default {BuildConfig.steps}; --agent {AgentBuildConfig.steps})"
    )
    p.add_argument("--seed", type=int, default=BuildConfig.seed)
    p.set_defaults(func=cmd_build_model)


def cmd_build_model(args: argparse.Namespace) -> int:
    # checked before the output folder, which is by default the built-in model's own, is touched
    check_range("--steps", args.steps, args.steps is None or args.steps >= 1, ">= 1")
    check_range("--seed", args.seed, 0 <= args.seed <= MAX_SEED, f"in [0, {MAX_SEED}]")
    if args.agent:
        out = args.out or AGENT_DIR
        cfg = AgentBuildConfig(steps=AgentBuildConfig.steps if args.steps is None else args.steps, seed=args.seed)
        scores = build_agent_model(out, cfg)
        print(f"saved the model to {out}")
        if scores["protocol_rate"] < 0.95 or scores["accuracy"] > 0.15:
            print(
                f"warning: protocol followed in {scores['protocol_rate']:.1%} of held-out episodes (wanted >= 95%), "
                f"accuracy {scores['accuracy']:.3f} (wanted <= 0.15)"
            )
        return 0
    out = args.out or BUILTIN_DIR
    cfg = BuildConfig(steps=BuildConfig.steps if args.steps is None else args.steps, seed=args.seed)
    spread = build_model(out, cfg)
    print(f"saved the model to {out}")
    if spread["spread_fraction"] < 0.3:
        print(f"warning: only {spread['spread_fraction']:.0%} of held-out problems have accuracy in [0.2, 0.8]")
    return 0
