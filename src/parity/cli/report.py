"""`parity report`: its flags and the call to `commands/report.py`."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "report",
        help="plots and a summary table of `parity train` runs, side by side",
        description="Reads RUN_DIR/metrics.jsonl of each run; writes report.md, summary.json and PNG plots.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default="parity-report", help="output directory (default parity-report)")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from parity.commands.report import report_runs, summary_table

    summaries = report_runs([Path(d) for d in args.run_dirs], Path(args.out))
    print(summary_table(summaries))
    print(f"wrote {args.out}/report.md, summary.json, accuracy.png, mismatch.png")
    return 0
