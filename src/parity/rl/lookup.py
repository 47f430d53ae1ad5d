"""The built-in tool task, `lookup`: its problems, its tool and its reward.

A problem names a key, one of the 16 letters a..p, and holds a hidden table that maps every key to a
3-digit value of its own (16 distinct values, drawn afresh for each problem). The value cannot be
guessed or memorised: the model has to call the tool and copy what it answers. One episode, in the
chat format of `builtin-agent` (docs/builtin.md, "The agent model"):

    user       c?
    assistant  <tool_call>{"name":"lookup","arguments":{"key":"c"}}</tool_call>   then end of turn
    tool       427
    assistant  427                                                                 then end of turn

The reward is 1 when the final assistant message is the table's value for the prompt's key, else 0.
Nothing here runs an episode: the episode engine calls `lookup_tool(table)` and `lookup_reward`.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass

TOOL_NAME = "lookup"
# The tool as a chat template's `tools` list holds it (builtin-agent's template lists none).
LOOKUP_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "The value stored under a key of the hidden table.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}
KEYS = "abcdefghijklmnop"
VALUES = range(100, 1000)  # 3-digit values
SPLITS = ("train", "eval")
HELD_OUT = 8  # one (key, answer) pair in HELD_OUT is the eval split's, never the train split's


@dataclass(frozen=True)
class LookupProblem:
    """One problem: the prompt's messages, the key it asks for, the hidden table and the answer."""

    prompt: list[dict[str, str]]
    key: str
    table: dict[str, str]
    answer: str

    def row(self) -> dict[str, object]:
        """The problem as a data row: the table as one compact string column (`table_text`)."""
        return {"prompt": self.prompt, "key": self.key, "table": table_text(self.table), "answer": self.answer}


def table_text(table: dict[str, str]) -> str:
    """A table as one string, `a=427,b=115,...`, in key order (`parse_table` reads it back)."""
    return ",".join(f"{key}={value}" for key, value in sorted(table.items()))


def parse_table(text: str) -> dict[str, str]:
    """The table `table_text` wrote."""
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"lookup table: expected 'key=value,...', got {text!r}")
    return {key: value for key, value in pairs}


def prompt_messages(key: str) -> list[dict[str, str]]:
    """The user's question for `key`: one message, `c?`."""
    return [{"role": "user", "content": f"{key}?"}]


def _held_out(key: str, answer: str) -> bool:
    return zlib.crc32(f"{key}={answer}".encode()) % HELD_OUT == 0


def lookup_problems(n: int, seed: int, split: str = "train") -> list[LookupProblem]:
    """`n` seeded problems. `split="eval"` holds the problems whose (key, answer) pair falls in a held-out
    eighth that `split="train"` never produces (the two also draw from different random streams)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if n < 0:
        raise ValueError(f"lookup_problems: n must be >= 0, got {n}")
    rng = random.Random(f"lookup:{split}:{seed}")
    out: list[LookupProblem] = []
    while len(out) < n:
        table = dict(zip(KEYS, (str(v) for v in rng.sample(VALUES, len(KEYS)))))
        key = rng.choice(KEYS)
        if _held_out(key, table[key]) == (split == "eval"):
            out.append(LookupProblem(prompt_messages(key), key, table, table[key]))
    return out


def lookup(table: dict[str, str], key: object) -> str:
    """The tool: the table's value for `key`, or an error text for a key it lacks."""
    if isinstance(key, str) and key in table:
        return table[key]
    return f"no key {key}" if isinstance(key, str) else "no key"


def lookup_tool(table: dict[str, str]) -> Callable[..., str]:
    """The tool bound to one problem's table, called with the call's arguments: `tool(key="c")`. A call
    without `key`, or with other arguments, gets an error text rather than an exception."""

    def tool(**arguments: object) -> str:
        if set(arguments) != {"key"}:
            return "expected one argument, key"
        return lookup(table, arguments["key"])

    return tool


def lookup_reward(final_answer: str, answer: str) -> float:
    """1.0 when the final assistant message's text (surrounding whitespace ignored) is `answer`, else 0.0."""
    return 1.0 if final_answer.strip() == answer else 0.0
