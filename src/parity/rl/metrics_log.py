"""The run's metrics log: `metrics.jsonl`, one line per step, and the trackers of `log.to`; a resumed run's lines
past its checkpoint dropped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from parity.config import ConfigError
from parity.files import JSONError, LineTooLong, bounded_lines, parse_json
from parity.folders import Folder
from parity.rl.trackers import Tracker

MAX_LINE_BYTES = 16 * 2**20  # a step's metrics (or a completion's row): far below this


class MetricsLog:
    """`metrics.jsonl`, one object per step with "step"; and the trackers of `log.to` (`rl/trackers.py`)."""

    NAME = "metrics.jsonl"

    def __init__(self, run_dir: Path, trackers: list[Tracker]):
        self.run_dir, self.path = run_dir, run_dir / self.NAME
        self.trackers = trackers

    def _lines(self, run: Folder) -> list[str]:
        """The file's lines, read one at a time: a line no step's metrics make (a file of gigabytes that is not the
        run's) is a one-line refusal, never held in memory."""
        if not run.is_file(self.NAME):
            return []
        with run.open_read(self.NAME) as f:
            try:
                return [line.decode(errors="replace").rstrip("\n") for line in bounded_lines(f, MAX_LINE_BYTES)]
            except LineTooLong as e:
                raise ConfigError(
                    f"{self.path}:{e.lineno}: {e.length:,} bytes, more than a step's metrics hold; not the run's log"
                ) from None

    def truncate_after(self, step: int) -> None:
        """Drop lines logged after `step` (a killed run's steps past its checkpoint)."""
        with Folder.open(self.run_dir, key="run_dir") as run:
            if run.lstat(self.NAME) is not None:
                kept = [line for line in self._lines(run) if _logged_step(line, step)]
                run.write_text(self.NAME, "".join(line + "\n" for line in kept))

    def rows(self) -> list[dict[str, Any]]:
        """The steps logged (after `truncate_after`, every line is one)."""
        with Folder.open(self.run_dir, key="run_dir") as run:
            return [parse_json(line) for line in self._lines(run)]

    def log(self, metrics: dict[str, float]) -> None:
        with Folder.open(self.run_dir, key="run_dir") as run:
            run.append_text(self.NAME, json.dumps(metrics) + "\n")
        values = {k: v for k, v in metrics.items() if k != "step"}
        for tracker in self.trackers:
            tracker.log(values, metrics["step"])

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def _logged_step(line: str, last: int) -> bool:
    """Whether `line` is a step logged at or before step `last`: a line cut short by a kill, or one that is
    not a step's metrics at all, is not."""
    try:
        row = parse_json(line)
    except JSONError:
        return False
    numbers = [row.get(k) for k in ("step", "mismatch/k3")] if isinstance(row, dict) else [None]
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers) and row["step"] <= last
