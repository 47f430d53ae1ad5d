"""Command-line entry points: `parity COMMAND --help` for each."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from parity.config import ConfigError
from parity.models import ModelError
from parity.rewards import RewardError
from parity.tasks import DataError


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="optional YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. sampling.top_k=5")


def _split_config(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """A first positional containing '=' is an override, not a config file."""
    overrides = list(args.overrides)
    config = args.config
    if config is not None and "=" in config:
        overrides.insert(0, config)
        config = None
    return config, overrides


def cmd_mismatch(args: argparse.Namespace) -> int:
    from parity import config as cfg_mod
    from parity.mismatch import MismatchConfig, markdown_table, run_mismatch, write_outputs

    config, overrides = _split_config(args)
    if args.model:
        overrides.append(f"model={args.model}")
    if args.out:
        overrides.append(f"out={args.out}")
    cfg = cfg_mod.load(MismatchConfig, config, overrides)
    results = run_mismatch(cfg)
    out = write_outputs(cfg, results)
    print(markdown_table(results))
    print(f"wrote {out}/mismatch.json, mismatch.md, mismatch_scatter.png, seq_log_ratio_vs_length.png")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from parity import config as cfg_mod
    from parity.loop import Run, TrainConfig, summary_line

    if args.resume:
        if args.config or args.overrides:
            raise ConfigError("--resume continues a run with its saved config.yaml; drop the config and overrides")
        run = Run.resume(args.resume)
    else:
        config, overrides = _split_config(args)
        run = Run.create(cfg_mod.load(TrainConfig, config, overrides))
    print(f"run directory: {run.run_dir}")
    history = run.train()
    print(summary_line(history))
    return 0


def cmd_build_model(args: argparse.Namespace) -> int:
    from parity.builtin.build import BuildConfig, build_model

    cfg = BuildConfig(steps=args.steps, seed=args.seed)
    spread = build_model(args.out, cfg)
    print(f"saved the model to {args.out}")
    if spread["spread_fraction"] < 0.3:
        print(f"warning: only {spread['spread_fraction']:.0%} of held-out problems have accuracy in [0.2, 0.8]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parity",
        description="RL fine-tuning of language models where the trained policy is the sampling policy.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "mismatch",
        help="offline: how far apart the rollout engine and the trainer are, per precision",
        description=(
            "Sample with the rollout engine and score the same tokens with the trainer, on the same "
            "weights, for each TRAINER/ROLLOUT precision pair; report every mismatch metric. "
            "Config keys: model, prompts, num_prompts, group_size, pairs, sampling.{temperature,top_k,"
            "top_p,max_new_tokens}, seed, out."
        ),
    )
    _add_config_args(p)
    p.add_argument("--model", help="model directory, or 'builtin' (default); same as model=DIR")
    p.add_argument("--out", help="output directory (default parity-mismatch); same as out=DIR")
    p.set_defaults(func=cmd_mismatch)

    p = sub.add_parser(
        "train",
        help="RL fine-tuning: rollout, rewards, estimator, mismatch metrics, checkpoints",
        description=(
            "Run RL fine-tuning. Config sections: rollout, trainer, algorithm, task, reward (see docs/training.md); "
            "top-level keys: model, precision, steps, prompts_per_step, seed, run_dir, checkpoint_every. "
            "Example: parity train precision=fp16 algorithm.name=grpo steps=100"
        ),
    )
    _add_config_args(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.set_defaults(func=cmd_train)

    from parity.builtin.build import BuildConfig
    from parity.models import BUILTIN_DIR

    p = sub.add_parser(
        "build-model",
        help="reproduce the built-in base model from scratch (~10 min on 2 cores)",
        description="Pretrain the built-in model on the arithmetic task and save it in Hugging Face format.",
    )
    p.add_argument("--out", default=str(BUILTIN_DIR), type=Path, help=f"output directory (default {BUILTIN_DIR})")
    p.add_argument("--steps", type=int, default=BuildConfig.steps, help="pretraining steps")
    p.add_argument("--seed", type=int, default=BuildConfig.seed)
    p.set_defaults(func=cmd_build_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ModelError, DataError, RewardError) as e:
        print(f"parity {args.command}: error: {e}", file=sys.stderr)
        return 2
