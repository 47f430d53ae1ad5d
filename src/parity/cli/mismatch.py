"""`parity mismatch`: its flags and the call to `commands/mismatch.py`."""

from __future__ import annotations

import argparse
from pathlib import Path

from parity.cli.config_args import add_config_args, split_config, with_flags
from parity.outdir import held_output_dir


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    add_config_args(p, "pairs=[bf16/bf16,fp16/fp16]")
    p.add_argument("--model", help="model directory, or 'builtin' (default); same as model=DIR")
    p.add_argument("--out", help="output directory (default parity-mismatch); same as out=DIR")
    p.add_argument(
        "--locate",
        action="store_true",
        help="re-score each pair's worst row stage by stage in both engines and print where they first differ",
    )
    p.set_defaults(func=cmd_mismatch)


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

    config, overrides = split_config(args)
    overrides = with_flags(overrides, {"model": args.model or None, "out": args.out or None})
    cfg = cfg_mod.load(MismatchConfig, config, overrides)
    with held_output_dir(Path(cfg.out), "mismatch", "out"):  # before the work: a second one is refused at once
        results = run_mismatch(cfg, locate_rows=args.locate)
        out = write_outputs(cfg, results)
    print(markdown_table(results))
    print(distribution_table(results))
    for r in results:
        if r.located is not None:
            print(located_text(r))
    print(f"wrote {out}/mismatch.json, mismatch.md, mismatch_scatter.png, seq_log_ratio_vs_length.png")
    return 0
