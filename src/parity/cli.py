"""Command-line entry points: `parity COMMAND --help` for each."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path

from parity.config import ConfigError
from parity.engines.models.config import ModelError
from parity.outdir import check_output_dir
from parity.rl.checkpoint import CheckpointError, checkpoints
from parity.rl.data import DataError
from parity.rl.loop import TrainingError
from parity.rl.problems import DIFFICULTIES
from parity.rl.rewards import RewardError
from parity.runtime import reuse_freed_memory, use_free_cores


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="optional YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. precision=bf16")


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
    from parity.commands.mismatch import (
        MismatchConfig,
        distribution_table,
        located_text,
        markdown_table,
        run_mismatch,
        write_outputs,
    )

    config, overrides = _split_config(args)
    if args.model:
        overrides.append(f"model={args.model}")
    if args.out:
        overrides.append(f"out={args.out}")
    cfg = cfg_mod.load(MismatchConfig, config, overrides)
    check_output_dir(Path(cfg.out), "out")
    results = run_mismatch(cfg, locate_rows=args.locate)
    out = write_outputs(cfg, results)
    print(markdown_table(results))
    print(distribution_table(results))
    for r in results:
        if r.located is not None:
            print(located_text(r))
    print(f"wrote {out}/mismatch.json, mismatch.md, mismatch_scatter.png, seq_log_ratio_vs_length.png")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from parity import config as cfg_mod
    from parity.commands.evaluate import EvalConfig, markdown_table, run_eval, write_outputs

    config, overrides = _split_config(args)
    if args.out:
        overrides.append(f"out={args.out}")
    cfg = cfg_mod.load(EvalConfig, config, [f"target={args.target}", *overrides])
    check_output_dir(Path(cfg.out), "out")
    result = run_eval(cfg, trust_reward_fn=args.trust_reward_fn)
    write_outputs(result, Path(cfg.out))
    print(markdown_table(result))
    print(f"wrote {cfg.out}/eval.json, eval.md, eval.png")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from parity import config as cfg_mod
    from parity.distributed.cluster import JoinInterrupted
    from parity.distributed.driver import resume_class, run_class
    from parity.rl.loop import summary_line
    from parity.rl.train_config import TrainConfig

    config, overrides = _split_config(args)
    if args.resume and config is not None:
        raise ConfigError(
            f"--resume continues a run with its saved config.yaml; drop {config} (only "
            "steps=, checkpoint_every=, keep_checkpoints=, log.to=, task.data=, eval.data= and a few more may be given)"
        )
    stop = StopRequests()
    with stop.installed():
        try:
            if args.resume:
                run = resume_class(args.resume).resume(args.resume, overrides, trust_reward_fn=args.trust_reward_fn)
            else:
                cfg = cfg_mod.load(TrainConfig, config, overrides)
                run = run_class(cfg).create(cfg)
        except JoinInterrupted:  # the signal, noted by `stop`, came while the run waited for a cluster
            print(f"parity train: {stop.stopped_line()}", file=sys.stderr)
            return 128 + stop.signum
        stop.run = run
        if stop.signum is not None:  # the signal came while the run started
            run.close()
            print(f"parity train: {stop.stopped_line()}", file=sys.stderr)
            return 128 + stop.signum
        print(f"run directory: {run.run_dir}")
        if run.step_count >= run.cfg.steps:
            run.close()
            done = run.cfg.steps
            print(f"the run already completed its {done} steps; go further with --resume {run.run_dir} steps=N")
            return 0
        history = run.train(should_stop=lambda: stop.signum is not None)
        if stop.signum is not None:
            print(f"parity train: {stop.stopped_line()}", file=sys.stderr)
            return 128 + stop.signum
    print(summary_line(history))
    return 0


class StopRequests:
    """SIGINT (Ctrl-C) and SIGTERM for `parity train`. The first asks the run to stop after the step under
    way, with a checkpoint; a second stops the process at once (the newest checkpoint stays intact, and the
    run's Ray processes are reaped by `parity.distributed.cluster`). A signal is only noted where it lands:
    raising into Ray's or torch's native code is what left runs going on, or ending in tracebacks."""

    def __init__(self):
        self.signum: int | None = None
        self.run = None  # the run once started: the stop line names its newest checkpoint

    def __call__(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            when = "after the step under way, with a checkpoint" if self.run else "before the first step"
            print(f"\nparity train: {name}: stopping {when}; send it again to stop at once", file=sys.stderr)
            return
        self.signum = signum
        print(f"\nparity train: {self.stopped_line(at_once=True)}", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    @contextlib.contextmanager
    def installed(self):
        previous = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def stopped_line(self, at_once: bool = False) -> str:
        """Where the stopped run stands and how to continue it."""
        name = signal.Signals(self.signum).name
        if self.run is None:
            return f"stopped by {name} before the run started"
        saved = checkpoints(self.run.run_dir)
        newest = f"the newest checkpoint is {saved[-1].name}" if saved else "no checkpoint was written"
        when = f"during step {self.run.step_count + 1}" if at_once else f"after step {self.run.step_count}"
        return f"stopped by {name} {when}; {newest}; continue with `parity train --resume {self.run.run_dir}`"


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
    from parity.files import atomic_write_text

    config, overrides = _split_config(args)
    cfg = cfg_mod.load(PerfectibleConfig, config, overrides)
    check_out(Path(cfg.out))
    # Through the cache that `parity sanity` reads: a search run here is not run again there.
    set_path, accuracies, cached = build_or_load(cfg)
    keep = filter_perfectible(accuracies, cfg.lo, cfg.hi)
    atomic_write_text(Path(cfg.out), set_path.read_text())
    print(format_histogram(histogram(accuracies, cfg.samples), cfg.lo, cfg.hi))
    found = f"the search of {search_path(cfg)}" if cached else "measured now"
    print(f"kept {len(keep)} of {len(accuracies)} problems ({found}) -> {cfg.out}")
    return 0


def cmd_sanity(args: argparse.Namespace) -> int:
    from parity.commands.sanity import DEFAULT_RUNS, parse_runs, run_sanity

    runs = parse_runs(args.runs or ",".join(DEFAULT_RUNS))
    summary = run_sanity(
        Path(args.out),
        runs,
        quick=args.quick,
        seed=args.seed,
        model=args.model,
        task=args.task,
        max_new_tokens=args.max_new_tokens,
        difficulty=args.difficulty,
        candidates=args.candidates,
        lo=args.lo,
        overrides=args.overrides,
        jobs=args.jobs,
        device=args.device,
    )
    from parity.commands.report import summary_table

    print(summary_table(summary["runs"]))
    print(f"wrote {args.out}/summary.json, report.md and plots ({summary['wall_seconds']:.0f} s)")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from parity.commands.report import report_runs, summary_table

    summaries = report_runs([Path(d) for d in args.run_dirs], Path(args.out))
    print(summary_table(summaries))
    print(f"wrote {args.out}/report.md, summary.json, accuracy.png, mismatch.png")
    return 0


def _listed(text: str, kind: type, option: str) -> tuple:
    """A comma-separated option's values, each of `kind` (int or float)."""
    try:
        return tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{option}: expected comma-separated {kind.__name__}s, got {text!r}") from None


def cmd_phantom(args: argparse.Namespace) -> int:
    from parity.commands import phantom

    if args.model != "builtin":
        seeds = _listed(args.seeds, int, "--seeds")
        summary = phantom.run_writeup(
            args.model,
            Path(args.out),
            steps=args.steps or phantom.WRITEUP_STEPS,
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
    if args.overrides or args.no_async:
        raise ConfigError(
            "parity phantom: key=value overrides and --no-async go with --model DIR (the write-up's runs)"
        )
    eps = _listed(args.eps, float, "--eps")
    summary = phantom.run_phantom(
        Path(args.out), steps=args.steps or phantom.BUILTIN_STEPS, eps_sweep=eps, seed=args.seed, device=args.device
    )
    for name, r in summary["runs"].items():
        to2 = r["steps_to_length_2"]
        print(
            f"{name}: length <= 2 at step {to2 if to2 is not None else '-'}, "
            f"phantom clip frac {r['phantom_clip_frac_mean']:.4f}"
        )
    print(f"wrote {args.out}/report.md, summary.json, phantom.png, beta.png ({summary['wall_seconds']:.0f} s)")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from parity.commands.doctor import UNTRAINABLE, render, run_doctor

    result = run_doctor(
        args.model,
        Path(args.out) if args.out else None,
        num_prompts=args.prompts,
        chat_template=args.chat_template,
        device=args.device,
    )
    print(render(result))
    return 1 if result["recommendation"] == UNTRAINABLE else 0


def cmd_build_model(args: argparse.Namespace) -> int:
    from parity.builtin.build import BuildConfig, build_model

    cfg = BuildConfig(steps=args.steps, seed=args.seed)
    spread = build_model(args.out, cfg)
    print(f"saved the model to {args.out}")
    if spread["spread_fraction"] < 0.3:
        print(f"warning: only {spread['spread_fraction']:.0%} of held-out problems have accuracy in [0.2, 0.8]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from parity.engines.tokenizer import CHAT_TEMPLATE_MODES

    parser = argparse.ArgumentParser(
        prog="parity",
        description="RL fine-tuning of language models where the trained policy is the sampling policy.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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

    p = sub.add_parser(
        "train",
        help="RL fine-tuning: rollout, rewards, estimator, mismatch metrics, checkpoints",
        description=(
            "Run RL fine-tuning. Config sections: rollout, trainer, algorithm, task, reward, log, eval (see "
            "docs/training.md); top-level keys: model (a directory, a Hugging Face id in the local cache, or "
            "builtin), precision, steps, prompts_per_step, seed, run_dir, checkpoint_every. "
            "Example: parity train precision=fp16 algorithm.name=grpo rollout.top_k=5 steps=100"
        ),
    )
    _add_config_args(p)
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest intact checkpoint, with its saved config "
        "(only steps=, checkpoint_every=, keep_checkpoints=, log.to=, log.completions=, "
        "distributed.learners=, task.data=, eval.data= may be overridden)",
    )
    p.add_argument(
        "--trust-reward-fn",
        action="store_true",
        help="with --resume: allow the run's task.reward_fn, Python code that Parity imports and runs",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "eval",
        help="held-out accuracy of a model or of every checkpoint of a run, per serving precision: the deployment gap",
        description=(
            "Answer held-out problems with the same weights served in each precision and under the trainer's "
            "policy; report accuracy, pass@k, length, the gap to the trainer's policy and the per-token KL. "
            "TARGET is a model directory ('builtin', or a Hugging Face id in the local cache), a LoRA adapter "
            "folder (its base and adapters), or a `parity train` run directory (its base model and every "
            "checkpoint it kept, scored by the run's own rewards). Config keys: precisions (default "
            "[fp32,bf16,fp16]), reference (auto: a run's trainer precision, fp32 for a model), data (auto: a run's "
            "eval.data, else the task's held-out split; or a JSONL/Parquet file), task, difficulty, reward_fn "
            "(module:function, several comma-separated; default a run's own), reward_weights, num_prompts, "
            "samples, temperature (0 = greedy), max_new_tokens, chat_template, device, seed. "
            "Example: parity eval runs/my-run --trust-reward-fn precisions=fp32,bf16 --out eval-my-run"
        ),
    )
    p.add_argument("target", metavar="MODEL_OR_RUN_DIR")
    _add_config_args(p)
    p.add_argument("--out", help="output directory (default parity-eval); same as out=DIR")
    p.add_argument(
        "--trust-reward-fn",
        action="store_true",
        help="score a run with its own task.reward_fn, Python code that Parity imports and runs",
    )
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "report",
        help="plots and a summary table of `parity train` runs, side by side",
        description="Reads RUN_DIR/metrics.jsonl of each run; writes report.md, summary.json and PNG plots.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default="parity-report", help="output directory (default parity-report)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "perfectible",
        help="problems the base model solves sometimes: sample K per problem, keep accuracy in [lo, hi]",
        description=(
            "Config keys: model, task (builtin|exact|math|number), data (builtin or JSONL/Parquet with prompt, "
            "answer), chat_template (auto|none), num_candidates, samples, lo, hi, max_new_tokens, precision, seed, "
            "out (JSONL)."
        ),
    )
    _add_config_args(p)
    p.set_defaults(func=cmd_perfectible)

    p = sub.add_parser(
        "mismatch",
        help="offline: how far apart the rollout engine and the trainer are, per precision",
        description=(
            "Sample with the rollout engine and score the same tokens with the trainer, on the same "
            "weights, for each TRAINER/ROLLOUT precision pair; report every mismatch metric. "
            "Config keys: model, prompts, chat_template, num_prompts, group_size, pairs, "
            "sampling.{temperature,top_k,top_p,max_new_tokens}, seed, out, exact (both engines in exact mode: "
            "bit-identical log-probs, docs/exact.md), full_vocab_positions (compare the whole next-token "
            "distributions at this many positions; 0 = off), shape_micro_batch (score the same tokens again in "
            "micro-batches of this many rows: the trainer against itself; 0 = off). "
            "prompts=builtin (default) uses arithmetic problems on the built-in model and short chat questions "
            "shipped with Parity on any other; prompts=FILE.jsonl reads one JSON object per line whose "
            '"prompt" is a string or a list of {"role", "content"} messages (other fields ignored, blank lines '
            "skipped, the first num_prompts used). chat_template=auto (default) encodes each prompt with the "
            "model's chat template when it has one (a string as one user message); chat_template=none encodes "
            "raw text."
        ),
    )
    _add_config_args(p)
    p.add_argument("--model", help="model directory, or 'builtin' (default); same as model=DIR")
    p.add_argument("--out", help="output directory (default parity-mismatch); same as out=DIR")
    p.add_argument(
        "--locate",
        action="store_true",
        help="re-score each pair's worst row stage by stage in both engines and print where they first differ",
    )
    p.set_defaults(func=cmd_mismatch)

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
        "--eps", default="0.02,0.005,0.001,0.0002", help="built-in model: clip epsilons for the sweep (comma-separated)"
    )
    p.add_argument("--seed", type=int, default=0, help="built-in model: the seed")
    p.add_argument("--seeds", default="0,1", help="with --model: the seeds, each arm once per seed (default 0,1)")
    p.add_argument("--no-async", action="store_true", help="with --model: leave out the asynchronous arms")
    p.add_argument("--device", default="cpu", help="where every model runs: cpu (default) or cuda")
    p.add_argument("overrides", nargs="*", help="with --model: parity train keys for every run, e.g. trainer.lr=1e-6")
    p.set_defaults(func=cmd_phantom)

    p = sub.add_parser(
        "doctor",
        help="is this model FP16-safe? weight/activation range per layer, mismatch per precision, a recommendation",
        description=(
            "Checks a local Hugging Face model directory of any family Parity runs (Llama, Mistral, Qwen2/2.5, "
            "Qwen3, Qwen3-MoE, Gemma 2/3), or the built-in model, for FP16 safety. Example: parity doctor --model "
            "builtin"
        ),
    )
    p.add_argument("--model", default="builtin", help="model directory, or 'builtin' (default)")
    p.add_argument("--out", help="also write doctor.json and doctor.md here")
    p.add_argument("--prompts", type=int, default=8, help="how many prompts to probe with (default 8)")
    p.add_argument(
        "--chat-template",
        choices=CHAT_TEMPLATE_MODES,
        default="auto",
        help="auto (default): encode the probe prompts with the model's chat template when it has one; none: raw text",
    )
    p.add_argument("--device", default="cpu", help="where the model runs: cpu (default) or cuda")
    p.set_defaults(func=cmd_doctor)

    from parity.builtin.build import BuildConfig
    from parity.engines.models.io import BUILTIN_DIR

    p = sub.add_parser(
        "build-model",
        help="reproduce the built-in base model from scratch (~3 min on 2 cores)",
        description="Pretrain the built-in model on the arithmetic task and save it in Hugging Face format.",
    )
    p.add_argument("--out", default=str(BUILTIN_DIR), type=Path, help=f"output directory (default {BUILTIN_DIR})")
    p.add_argument("--steps", type=int, default=BuildConfig.steps, help="pretraining steps")
    p.add_argument("--seed", type=int, default=BuildConfig.seed)
    p.set_defaults(func=cmd_build_model)
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
    # unwritable path), 1 for a run that stopped because going on would train on garbage.
    try:
        return args.func(args)
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
