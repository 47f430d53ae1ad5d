"""`parity eval`: its flags and the call to `commands/evaluate.py`."""

from __future__ import annotations

import argparse
from pathlib import Path

from parity.cli.config_args import add_config_args, split_config, with_flags
from parity.outdir import held_output_dir


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "eval",
        help="held-out accuracy of a model or of every checkpoint of a run, per serving precision: the deployment gap",
        description=(
            "Answer held-out problems with the same weights served in each precision and under the trainer's "
            "policy; report accuracy, pass@k, length, the gap to the trainer's policy and the per-token KL. "
            "TARGET is a model directory ('builtin', or a Hugging Face id in the local cache), a LoRA adapter "
            "folder (its base and adapters), or a `parity train` run directory (its base model and every "
            "checkpoint it kept, scored by the run's own rewards; a run of episodes answers in whole episodes, "
            "with its tools or environment). Config keys: precisions (default "
            "[fp32,bf16,fp16]), reference (auto: a run's trainer precision, fp32 for a model), data (auto: a run's "
            "eval.data, else the task's held-out split; or a JSONL/Parquet file), task, difficulty, reward_fn "
            "(module:function, several comma-separated; default a run's own), reward_weights, num_prompts and "
            "samples (0: a run's eval.num_prompts and eval.samples, so that its own evaluation is repeated; else 64 "
            "and 8), temperature (0 = greedy), max_new_tokens (0: a run's rollout.max_new_tokens, else 96), "
            "chat_template, prompt_column and answer_column (auto: a run's task.*_column, else prompt and answer), "
            "completion_format (run: a run's, else text; or text, messages, auto), tools or environment (a model "
            "answered in episodes: module:function each, or module:Class), episode.* (a model's episodes: "
            "`parity train`'s episode.max_turns, episode.turn_tokens, ...; a run keeps its own), model, device, seed. "
            "Example: parity eval runs/my-run --trust-reward-fn precisions=fp32,bf16 --out eval-my-run"
        ),
    )
    p.add_argument("target", metavar="MODEL_OR_RUN_DIR")
    add_config_args(p, "precisions=[bf16,fp16]")
    p.add_argument("--out", help="output directory (default parity-eval); same as out=DIR")
    p.add_argument(
        "--trust-reward-fn",
        action="store_true",
        help="score a run with its own task.reward_fn, and answer its episodes with its task.tools or "
        "task.environment: Python code that Parity imports and runs",
    )
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from parity import config as cfg_mod
    from parity.commands.evaluate import EvalConfig, markdown_table, run_eval, write_outputs

    config, overrides = split_config(args)
    overrides = with_flags(overrides, {"out": args.out or None})
    cfg = cfg_mod.load(EvalConfig, config, [f"target={args.target}", *overrides])
    with held_output_dir(Path(cfg.out), "eval", "out"):  # before the evaluation: a second one is refused at once
        result = run_eval(cfg, trust_reward_fn=args.trust_reward_fn)
        write_outputs(result, Path(cfg.out))
    print(markdown_table(result))
    print(f"wrote {cfg.out}/eval.json, eval.md, eval.png")
    return 0
