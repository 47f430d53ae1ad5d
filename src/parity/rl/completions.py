"""Each step's completions in view: every one written to `completions/step_N.jsonl` with its rewards,
and a few printed as a table, so that a reward of 0 or a cut-off response is seen at once, not found
later by loading a checkpoint."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

from parity.files import JSONError, LineTooLong, bounded_lines, parse_json
from parity.folders import Folder
from parity.rl.data import DataError
from parity.rl.problems import Problem

COMPLETIONS_DIR = "completions"
STEP_FILE = re.compile(r"step_(\d{6,})\.jsonl")
CELL_CHARS = 60  # characters of a prompt or completion shown in the printed table


def completion_rows(
    step: int,
    problems: list[Problem],
    completions: list[str],
    scores: list[float],
    per_function: dict[str, list[float]],
    lengths: list[int],
    truncated: list[bool],
    trained: list[float],
    advantages: list[float],
    extra: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One row per completion: its problem's prompt, the text, its length, whether it was cut off at the
    length limit, the reward it trained on (`trained`: the score after `algorithm.truncated`) and its
    advantage, the score before truncation (`scores`, the reward functions' weighted total) and each reward
    function's own score (null where a function returned None, and the reward where every one did), and the
    data row's other columns (`columns`; the answer for a built-in task); `extra`: more fields per row (an
    episode's messages, turns and how it ended)."""
    rows = []
    for i, completion in enumerate(completions):
        problem = problems[i]
        row = {
            "step": step,
            "prompt": problem.prompt,
            "completion": completion,
            "length": lengths[i],
            "truncated": truncated[i],
            "reward": _score(trained[i]),
            "advantage": advantages[i],
            "score": _score(scores[i]),
        }
        row.update({f"reward/{name}": _score(values[i]) for name, values in per_function.items()})
        row["columns"] = problem.columns or {"answer": problem.answer}
        if extra is not None:
            row.update(extra[i])
        rows.append(row)
    return rows


def _score(value: float) -> float | None:
    """A score as the file holds it: None (null) for NaN, a sample not scored."""
    return None if value != value else value


def write_completions(run_dir: Path, step: int, rows: list[dict[str, Any]]) -> Path:
    name = f"{COMPLETIONS_DIR}/step_{step:06d}.jsonl"
    with Folder.open(run_dir, key="run_dir") as run:
        run.mkdir(COMPLETIONS_DIR)
        # default=str: a data column's value JSON has no form for (a Parquet date, bytes) as its text
        run.write_text(name, "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows))
    return run_dir / name


def drop_completions_after(run_dir: Path, step: int) -> None:
    """Remove the completions of steps after `step` (a killed run's steps past its checkpoint, whose metrics
    `MetricsLog.truncate_after` drops): a report would show them as the run's newest."""
    with Folder.open(run_dir, key="run_dir") as run:
        for name in run.names(COMPLETIONS_DIR):
            if (file := STEP_FILE.fullmatch(name)) and int(file[1]) > step:
                run.remove(f"{COMPLETIONS_DIR}/{name}")


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        float(value)  # the table prints it with %g
    except OverflowError:
        return False
    return True


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# The fields of a row that `markdown_table` reads, as `completion_rows` writes them; and each score (the
# first row's `reward...` keys, its advantage and score; files of earlier versions have neither) must be a
# number in every row.
NUMBERS = ("advantage", "score")
ROW_FIELDS = (
    ("step", "an integer", _is_integer),
    ("prompt", "a string or a list of messages", lambda v: isinstance(v, (str, list))),
    ("completion", "a string", lambda v: isinstance(v, str)),
    ("length", "an integer", _is_integer),
    ("truncated", "true or false", lambda v: isinstance(v, bool)),
    ("reward", "a number or null", lambda v: v is None or _is_number(v)),
)


def _row_problem(row: Any, scores: list[str]) -> str | None:
    """What keeps `row` from being a completion row with a number for each of `scores`, or None."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got a {type(row).__name__}"
    score = ("a number or null", lambda v: v is None or _is_number(v))  # null: the function returned None
    for key, kind, ok in (*ROW_FIELDS, *((k, *score) for k in scores)):
        if key not in row:
            return f"no {key!r}"
        if not ok(row[key]):
            return f"{key!r}: expected {kind}, got {row[key]!r:.60}"
    return None


def read_completions(run_dir: Path, max_line_bytes: int) -> list[dict[str, Any]]:
    """The newest step's completions a run wrote (none if it wrote none). A line cut short by a kill is left
    out; a row without the fields the table shows, or a line past `max_line_bytes`, is a DataError naming the
    file and line."""
    with Folder.open(run_dir, key="run") as run:
        names = [n for n in run.names(COMPLETIONS_DIR) if STEP_FILE.fullmatch(n)]
        if not names:
            return []
        name = f"{COMPLETIONS_DIR}/{max(names)}"
        rows: list[dict[str, Any]] = []
        scores: list[str] = []
        with run.open_read(name) as f:
            try:
                for lineno, line in enumerate(bounded_lines(f, max_line_bytes), 1):
                    try:
                        row = parse_json(line.decode("utf-8"))
                    except (JSONError, UnicodeDecodeError):
                        continue  # a line a kill cut short
                    if not rows and isinstance(row, dict):
                        scores = [k for k in row if k.startswith("reward") or k in NUMBERS]
                    problem = _row_problem(row, scores)
                    if problem is not None:
                        where = f"{run_dir / name}:{lineno}"
                        raise DataError(f"{where}: not a completion row as Parity writes them ({problem})")
                    rows.append(row)
            except LineTooLong as e:
                raise DataError(f"{run_dir / name}:{e.lineno}: {e.length:,} bytes, more than a row holds") from None
    return rows


def _cell(value: Any) -> str:
    if isinstance(value, list):  # chat messages: their contents
        value = " / ".join(str(m.get("content", m)) if isinstance(m, dict) else str(m) for m in value)
    text = " ".join(str(value).split()).replace("|", "\\|")
    return textwrap.shorten(text, CELL_CHARS, placeholder=" …") if len(text) > CELL_CHARS else text


def sample_rows(rows: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """`n` rows spread over the batch (one per prompt group before a second of any), the same each step."""
    if n >= len(rows):
        return rows
    stride = len(rows) / n
    return [rows[int(i * stride)] for i in range(n)]


def table_columns(row: dict[str, Any]) -> list[str]:
    """The numbers the table shows: the reward trained on, the advantage, and each reward function's score
    (the score before truncation where there is no function of its own: a built-in task's)."""
    shown = [k for k in ("reward", "advantage") if k in row]
    return shown + ([k for k in row if k.startswith("reward/")] or [k for k in ("score",) if k in row])


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table: prompt, completion, length (+ when cut off), the reward trained on, the
    advantage and the scores (`table_columns`)."""
    if not rows:
        return ""
    scores = table_columns(rows[0])
    lines = [
        "| prompt | completion | length | " + " | ".join(scores) + " |",
        "|---|---|---|" + "---|" * len(scores),
    ]
    for r in rows:
        length = f"{r['length']}{' (cut off)' if r['truncated'] else ''}"
        values = " | ".join("None" if r[k] is None else f"{r[k]:.3g}" for k in scores)
        lines.append(f"| {_cell(r['prompt'])} | {_cell(r['completion'])} | {length} | {values} |")
    return "\n".join(lines) + "\n"
