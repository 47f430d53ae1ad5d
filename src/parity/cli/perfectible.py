"""`parity perfectible`: its flags and the call to `commands/perfectible.py`."""

from __future__ import annotations

import argparse
from pathlib import Path

from parity.cli.config_args import add_config_args, split_config


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "perfectible",
        help="problems the base model solves sometimes: sample K per problem, keep accuracy in [lo, hi]",
        description=(
            "Config keys: model, task (builtin|exact|math|number), data (builtin or JSONL/Parquet with prompt, "
            "answer), difficulty (task=number's generated problems: standard|easy|worked), chat_template "
            "(auto|messages|none), num_candidates, samples, lo, hi, max_new_tokens, truncated (as "
            "algorithm.truncated), precision, device (cpu|cuda), seed, batch_prompts, out (JSONL)."
        ),
    )
    add_config_args(p, "samples=8")
    p.set_defaults(func=cmd_perfectible)


def cmd_perfectible(args: argparse.Namespace) -> int:
    from parity import config as cfg_mod
    from parity.commands.perfectible import (
        PerfectibleConfig,
        build_or_load,
        check_out,
        filter_perfectible,
        format_histogram,
        histogram,
        search_path,
    )
    from parity.config import ConfigError
    from parity.folders import atomic_write_text

    config, overrides = split_config(args)
    cfg = cfg_mod.load(PerfectibleConfig, config, overrides)
    check_out(Path(cfg.out))
    # Through the cache that `parity sanity` reads: a search run here is not run again there.
    set_path, accuracies, cached = build_or_load(cfg)
    keep = filter_perfectible(accuracies, cfg.lo, cfg.hi)
    try:
        atomic_write_text(Path(cfg.out), set_path.read_text())
    except OSError as e:  # the search is cached: it is not run again for another out
        raise ConfigError(f"out: {e.filename or cfg.out}: {e.strerror or e}") from None
    print(format_histogram(histogram(accuracies, cfg.samples), cfg.lo, cfg.hi))
    found = f"the search of {search_path(cfg)}" if cached else "measured now"
    print(f"kept {len(keep)} of {len(accuracies)} problems ({found}) -> {cfg.out}")
    return 0
