"""Command-line entry points: `parity COMMAND --help` for each. Each command's flags and the call it makes
are in its own module here (`cli/train.py`, ...); this one composes them and maps errors to exit codes."""

from __future__ import annotations

import argparse
import sys

from parity import __version__
from parity.cli import build_model, doctor, evaluate, mismatch, perfectible, phantom, report, sanity, train
from parity.config import ConfigError
from parity.distributed.cluster import ClusterStartError
from parity.engines.models.config import ModelError
from parity.rl.checkpoint import CheckpointError
from parity.rl.data import DataError
from parity.rl.loop import TrainingError
from parity.rl.rewards import Interrupted, RewardError
from parity.runtime import reuse_freed_memory, use_free_cores
from parity.stopping import Stopped, StopSignals

# `parity --help` lists the commands in this order
COMMANDS = (sanity, train, evaluate, report, perfectible, mismatch, phantom, doctor, build_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parity",
        description="RL fine-tuning of language models where the trained policy is the sampling policy.",
    )
    parser.add_argument("--version", action="version", version=f"parity {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as `main` reads it; argparse's own errors exit 2 with its usage line."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value after an option (`parity eval RUN --out DIR precisions=fp32`): argparse has already filled
    # the positionals, so they come back unparsed; they are overrides all the same.
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reuse_freed_memory()  # every command allocates tensors of a few MiB per step
    use_free_cores()  # threads for the cores other processes leave free
    # Exit codes: 2 for input that cannot be used (config, model, data, checkpoint files, an
    # unwritable path), 1 for a run that stopped because going on would train on garbage, or that
    # could not start the Ray cluster it computes on; 128 + the signal for a command that a signal
    # stopped (SIGINT, SIGTERM, SIGHUP: `parity.stopping`).
    stop = StopSignals(args.command)
    try:
        with stop.installed():
            return args.func(args)
    except Stopped:
        print(f"parity {args.command}: {stop.stopped_line()}", file=sys.stderr)
        return 128 + stop.signum
    except (ConfigError, ModelError, DataError, CheckpointError) as e:
        print(f"parity {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"parity {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except (TrainingError, RewardError) as e:
        print(f"parity {args.command}: the run stopped: {e}", file=sys.stderr)
        return 1
    except ClusterStartError as e:
        print(f"parity {args.command}: error: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:  # SIGINT or SIGTERM ended code of the user's (`rewards.bounded`)
        print(f"parity {args.command}: stopped by {e}", file=sys.stderr)
        return 128 + e.signum
