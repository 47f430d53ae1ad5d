"""`parity train`: its flags, the run it starts or resumes, and what SIGINT/SIGTERM/SIGHUP do to it."""

from __future__ import annotations

import argparse
import signal
import sys

from parity.cli.config_args import add_config_args, split_config
from parity.config import ConfigError
from parity.rl.train_config import RESUMABLE_KEYS
from parity.stopping import StopSignals

RESUMABLE = ", ".join(f"{key}=" for key in RESUMABLE_KEYS)  # the keys --resume lets a run change, as given


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "train",
        help="RL fine-tuning: rollout, rewards, estimator, mismatch metrics, checkpoints",
        description=(
            "Run RL fine-tuning. Config sections: rollout, trainer, algorithm, task, reward, log, health, diagnostics, "
            "episode, eval, distributed, async, moe, lora (see "
            "docs/training.md); top-level keys: model (a directory, a Hugging Face id in the local cache, or "
            "builtin), precision, steps, prompts_per_step, seed, run_dir, checkpoint_every. "
            "Example: parity train precision=fp16 algorithm.name=grpo rollout.top_k=5 steps=100"
        ),
    )
    add_config_args(p, "precision=bf16")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest intact checkpoint, with its saved config "
        f"(only {RESUMABLE} may be overridden; and model=, a LoRA run's base model where it is now)",
    )
    p.add_argument(
        "--trust-reward-fn",
        action="store_true",
        help="with --resume: allow the run's task.reward_fn, Python code that Parity imports and runs",
    )
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from parity import config as cfg_mod
    from parity.distributed.cluster import JoinInterrupted
    from parity.distributed.driver import open_run
    from parity.rl.loop import summary_line
    from parity.rl.rewards import Interrupted
    from parity.rl.train_config import TrainConfig

    config, overrides = split_config(args)
    if args.resume and config is not None:
        raise ConfigError(
            f"--resume continues a run with its saved config.yaml; drop {config} (only {RESUMABLE} may be given)"
        )
    stop = StopRequests()
    with stop.installed():
        try:
            if args.resume:
                run = open_run(resume=args.resume, overrides=overrides, trust_reward_fn=args.trust_reward_fn)
            else:
                run = open_run(cfg_mod.load(TrainConfig, config, overrides))
        except (JoinInterrupted, Interrupted):  # a signal, noted by `stop`, while joining a cluster or importing
            print(f"parity train: {stop.stopped_line()}", file=sys.stderr)
            return 128 + stop.signum
        stop.run = run
        if stop.signum is not None:  # the signal came while the run started
            run.close()
            print(f"parity train: {stop.stopped_line()}", file=sys.stderr)
            return 128 + stop.signum
        print(f"run directory: {run.run_dir}")
        if run.completed:  # open_run closed it
            done, again = run.cfg.steps, run.cfg.resume_command(run.run_dir)
            print(f"the run already completed its {done} steps; go further with `{again} steps=N`")
            return 0
        history = run.train(should_stop=lambda: stop.signum is not None)
        if stop.signum is not None:
            print(f"parity train: {stop.stopped_line()}", file=sys.stderr)
            return 128 + stop.signum
    print(summary_line(history))
    return 0


class StopRequests(StopSignals):
    """The stop signals (SIGINT, SIGTERM, SIGHUP) of `parity train`. The first asks the run to stop after
    the step under way, with a checkpoint; a second stops the process at once (the newest checkpoint stays
    intact, and the run's Ray processes are reaped by `parity.distributed.cluster`). A signal is only noted
    where it lands: raising into Ray's or torch's native code is what left runs going on, or ending in
    tracebacks."""

    def __init__(self):
        super().__init__("train")
        self.run = None  # the run once started: the stop line names its newest checkpoint

    def first(self) -> None:
        name = signal.Signals(self.signum).name
        when = "after the step under way, with a checkpoint" if self.run else "before the first step"
        print(f"\nparity train: {name}: stopping {when}; send it again to stop at once", file=sys.stderr)

    def stopped_line(self, at_once: bool = False) -> str:
        """Where the stopped run stands and how to continue it."""
        name = signal.Signals(self.signum).name
        if self.run is None:
            return f"stopped by {name} before the run started"
        run = self.run
        going_on = at_once and run.step_count < run.cfg.steps  # else its steps were all taken: it was closing
        when = f"during step {run.step_count + 1}" if going_on else f"after step {run.step_count}"
        resume = run.cfg.resume_command(run.run_dir)
        return f"stopped by {name} {when}; {run.newest_checkpoint()}; continue with `{resume}`"
