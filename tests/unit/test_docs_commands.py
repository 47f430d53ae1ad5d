"""Every command the docs print is checked: the examples in each `parity COMMAND --help` and every
`parity ...` line of a bash block in README.md and docs/*.md. Each is parsed as the CLI parses it and
its config keys are loaded as the command loads them (an unknown key, a wrong value: the doc is
wrong); the cheap ones run to the end. What does not run here, and why, is in `NOT_RUN`."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from parity import config as config_mod
from parity.cli import build_parser, main, parse_args
from parity.cli.config_args import split_config

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Words a reader replaces with their own model, run, file or folder.
PLACEHOLDERS = ("DIR", "RUN_DIR", "MODEL_DIR", "FILE", "OUT", "CONFIG.yaml", "smollm2", "train.jsonl", "runs/my-task")
# Commands run to the end here (seconds each on the built-in model).
RUN = {"parity mismatch --locate", "parity doctor --model builtin"}
NOT_RUN = {
    "placeholder": "names a model, run, file or folder the reader provides (its keys are checked)",
    "minutes": "trains or measures for minutes on 2 cores (its keys are checked; the figures are in docs/)",
    "distributed": "starts a Ray cluster and learner processes (tests/e2e/test_distributed.py runs such runs small)",
    "synopsis": "a synopsis ([optional] parts, alternatives), not a command",
    "your-task": "tests/e2e/test_your_task.py runs docs/your-task.md's blocks as written",
}


def _doc_commands() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", path.read_text(), flags=re.S):
            joined = block.replace("\\\n", " ")
            for line in joined.splitlines():
                line = line.split(" #")[0].strip()
                if line.startswith("parity "):
                    found.append((path.name, " ".join(line.split())))
    return found


def _help_examples() -> list[tuple[str, str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    found = []
    for name, p in sub.choices.items():
        text = " ".join((p.description or "").split())
        for example in re.findall(r"Example: (parity .*?)(?:\.\s|;|\.?$)", text):
            found.append((f"parity {name} --help", example.strip()))
    return found


COMMANDS = _doc_commands() + _help_examples()


def _why_not_run(source: str, command: str) -> str | None:
    if source == "your-task.md":
        return "your-task"
    if re.search(r"\[[^\]]*(\.\.\.|\||--|=N\])", command):
        return "synopsis"
    words = shlex.split(command)
    if any(w in PLACEHOLDERS or w.split("=", 1)[-1] in PLACEHOLDERS for w in words):
        return "placeholder"
    if "distributed." in command:
        return "distributed"
    return None if command in RUN else "minutes"


def test_the_docs_have_commands_and_the_help_has_examples():
    assert len(_doc_commands()) > 20
    assert {s for s, _ in _help_examples()} >= {"parity train --help", "parity eval --help", "parity doctor --help"}


@pytest.mark.parametrize("source, command", COMMANDS, ids=[f"{s}: {c}" for s, c in COMMANDS])
def test_each_printed_command_parses_and_its_keys_load(source, command):
    if _why_not_run(source, command) == "synopsis":
        pytest.skip(NOT_RUN["synopsis"])
    argv = shlex.split(command)[1:]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            args = parse_args(argv)
        except SystemExit:
            pytest.fail(f"{source}: `{command}` does not parse: {err.getvalue().strip()}")
    keys_of = _config_class(args.command)
    if keys_of is None or (args.command == "train" and args.resume):
        return
    if args.command in ("sanity", "phantom"):  # their key=value are `parity train` keys for every run
        config, overrides = None, list(args.overrides)
    else:
        config, overrides = split_config(args)
    if config is not None:
        return  # a YAML file of the reader's
    if args.command == "eval":
        overrides = [f"target={args.target}", *overrides]
    if args.command == "mismatch" and args.model:
        overrides.append(f"model={args.model}")
    keys = [o for o in overrides if o.split("=", 1)[-1] not in PLACEHOLDERS]
    config_mod.load(keys_of, None, keys)  # a ConfigError names the bad key: the doc is wrong


def _config_class(command: str):
    if command in ("train", "sanity", "phantom"):
        from parity.rl.train_config import TrainConfig

        return TrainConfig
    if command == "eval":
        from parity.commands.evaluate import EvalConfig

        return EvalConfig
    if command == "mismatch":
        from parity.commands.mismatch import MismatchConfig

        return MismatchConfig
    if command == "perfectible":
        from parity.commands.perfectible import PerfectibleConfig

        return PerfectibleConfig
    return None


def test_every_command_not_run_has_a_reason():
    reasons = {c: _why_not_run(s, c) for s, c in COMMANDS}
    assert set(reasons.values()) <= {None, *NOT_RUN}
    assert RUN <= {c for c, why in reasons.items() if why is None}


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(RUN))
def test_the_cheap_commands_run(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(command)[1:]) == 0
