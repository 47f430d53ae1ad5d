"""The `parity` command (`python -m parity`). Its stop signals are taken before the commands are imported
(torch and the rest: a second or more): one then ends the process at once, in one line, as nothing has run
or been written (an exception raised into a library's import can leave it half made). Once the command has
returned they are taken again: one during the interpreter's exit (another second) leaves the command's exit
code, its outputs being written."""

from __future__ import annotations

import os
import signal
import sys

from parity.stopping import taken_signals


def main() -> int:
    command = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else ""

    def stopped_as_it_started(signum, frame) -> None:
        name = signal.Signals(signum).name
        print(f"parity{' ' + command if command else ''}: stopped by {name} as it started", file=sys.stderr)
        os._exit(128 + signum)

    taken = taken_signals()  # nohup's SIGHUP stays ignored
    for s in taken:  # until the command installs its own (`parity.cli.main`)
        signal.signal(s, stopped_as_it_started)
    from parity.cli import main as run_command

    code = run_command()

    def exit_now(signum, frame) -> None:
        sys.stdout.flush()
        os._exit(code)

    for s in taken:
        signal.signal(s, exit_now)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
