"""Tasks: datasets of problems and the reward functions that score responses.

The built-in task is column addition written out step by step, right to left:

    prompt    "4705+386="
    response  "5+6=11,0+8+1=9,7+3=10,4+0+1=5>5091" then EOS

Each step names the two column digits (and +1 for a carry) and their sum; the
response ends with `>` and the answer. Worked solutions are 20-70 tokens, so the
rollout/trainer mismatch has a long sequence to accumulate over.
"""

from __future__ import annotations

import importlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class ArithmeticTask:
    """Addition of two numbers with `min_digits`..`max_digits` digits (the longer operand).

    `split="eval"` draws from a held-out eighth of the problem space that
    `split="train"` never produces, so evaluation problems are never seen in training.
    """

    name = "arithmetic"

    def __init__(self, min_digits: int = 3, max_digits: int = 6):
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"task digits: need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        self.min_digits, self.max_digits = min_digits, max_digits

    @staticmethod
    def _held_out(a: int, b: int) -> bool:
        return (a * 1_000_003 + b * 7919) % 8 == 0

    def _draw(self, rng: random.Random) -> tuple[int, int]:
        n = rng.randint(self.min_digits, self.max_digits)
        m = rng.randint(1, n)
        a = rng.randint(10 ** (n - 1), 10**n - 1)
        b = rng.randint(0 if m == 1 else 10 ** (m - 1), 10**m - 1)
        return (a, b) if rng.random() < 0.5 else (b, a)

    def problems(self, n: int, seed: int, split: str = "train") -> list[Problem]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rng = random.Random(f"{self.name}:{split}:{seed}")
        out: list[Problem] = []
        while len(out) < n:
            a, b = self._draw(rng)
            if self._held_out(a, b) == (split == "eval"):
                out.append(Problem(prompt=f"{a}+{b}=", answer=str(a + b)))
        return out

    @staticmethod
    def solution(problem: Problem, slip: tuple[int, int] | None = None) -> str:
        """The worked solution (EOS not included).

        `slip=(step, wrong_sum)` writes `wrong_sum` at that step and carries on
        consistently from it, as a person who made one slip would; the built-in
        model is pretrained on some such solutions so that it makes random slips.
        """
        a, b = problem.prompt.rstrip("=").split("+")
        width = max(len(a), len(b))
        da, db = a.zfill(width)[::-1], b.zfill(width)[::-1]
        steps, digits, carry = [], [], 0
        for i, (x, y) in enumerate(zip(da, db)):
            s = int(x) + int(y) + carry
            if slip is not None and slip[0] == i:
                s = slip[1]
            steps.append(f"{x}+{y}{'+1' if carry else ''}={s}")
            digits.append(str(s % 10))
            carry = s // 10
        answer = ("1" if carry else "") + "".join(reversed(digits))
        return ",".join(steps) + ">" + (answer.lstrip("0") or "0")

    @staticmethod
    def num_steps(problem: Problem) -> int:
        return max(len(x) for x in problem.prompt.rstrip("=").split("+"))

    @staticmethod
    def extract_answer(response: str) -> str | None:
        if ">" not in response:
            return None
        return response.rsplit(">", 1)[1].strip()

    def reward(self, problem: Problem, response: str) -> float:
        return 1.0 if self.extract_answer(response) == problem.answer else 0.0


class DataError(ValueError):
    """A dataset file that cannot be used; the message names the file and line."""


def load_problems(path: str | Path) -> list[Problem]:
    """Problems from a JSONL or Parquet file with string fields `prompt` and `answer`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"task.data: file {str(path)!r} does not exist")
    rows: list[tuple[str, object]] = []  # (where, row)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        missing = {"prompt", "answer"} - set(table.column_names)
        if missing:
            raise DataError(f"{path}: missing column(s) {sorted(missing)}; need 'prompt' and 'answer'")
        rows = [(f"{path}: row {i}", r) for i, r in enumerate(table.select(["prompt", "answer"]).to_pylist())]
    else:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
    problems = []
    for where, row in rows:
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "answer" not in row:
            raise DataError(f"{where}: expected an object with a string 'prompt' and an 'answer'")
        problems.append(Problem(prompt=row["prompt"], answer=str(row["answer"])))
    if not problems:
        raise DataError(f"{path}: no problems found")
    return problems


class DataOrder:
    """Which problem comes next: a fresh seeded permutation every epoch.

    The whole state is `position`, so a resumed run draws exactly the same prompts.
    """

    def __init__(self, num_items: int, seed: int, position: int = 0):
        self.num_items, self.seed, self.position = num_items, seed, position
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            epoch, offset = divmod(self.position, self.num_items)
            if epoch != self._epoch:
                gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
                self._epoch, self._perm = epoch, torch.randperm(self.num_items, generator=gen)
            out.append(int(self._perm[offset]))
            self.position += 1
        return out


# ----------------------------------------------------------------------------- rewards
# A reward function takes (problem, response text, response length in tokens).
RewardFn = Callable[[Problem, str, int], float]

_BOXED = re.compile(r"\\boxed\s*\{")


def extract_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} in `text` (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def builtin_reward(problem: Problem, response: str, length: int) -> float:
    return ArithmeticTask().reward(problem, response)


def length_reward(problem: Problem, response: str, length: int) -> float:
    """−(response length in tokens, EOS included): the optimum is to stop at once."""
    return -float(length)


def exact_reward(problem: Problem, response: str, length: int) -> float:
    return 1.0 if response.strip() == problem.answer.strip() else 0.0


def math_reward(problem: Problem, response: str, length: int) -> float:
    """1 if the last \\boxed{} answer equals the reference under `math-verify`."""
    import logging

    from math_verify import parse, verify

    # The reward runner enforces the timeout; math-verify's own (signal-based) is off.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    boxed = extract_boxed(response)
    if boxed is None:
        return 0.0
    answer = problem.answer if "\\boxed" in problem.answer else f"${problem.answer}$"
    gold = parse(answer, parsing_timeout=None)
    guess = parse(f"\\boxed{{{boxed}}}", parsing_timeout=None)
    return 1.0 if verify(gold, guess, timeout_seconds=None) else 0.0


REWARDS: dict[str, RewardFn] = {
    "builtin": builtin_reward,
    "length": length_reward,
    "exact": exact_reward,
    "math": math_reward,
}
TRUSTED_REWARDS = {"builtin", "length", "exact"}  # fast, pure: run in-process


def import_reward_fn(spec: str) -> RewardFn:
    """`module:function` -> the function, called as fn(prompt, response, answer) -> float."""
    if spec.count(":") != 1:
        raise ValueError(f"task.reward_fn: expected 'module:function', got {spec!r}")
    module_name, fn_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"task.reward_fn: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"task.reward_fn: {module_name!r} has no function {fn_name!r}")

    def reward(problem: Problem, response: str, length: int) -> float:
        return float(fn(problem.prompt, response, problem.answer))

    reward.__qualname__ = spec
    return reward


# Characters of the built-in model's vocabulary (after the special tokens).
BUILTIN_CHARS = "0123456789+=,>"
BUILTIN_SPECIALS = ("<pad>", "<eos>")
