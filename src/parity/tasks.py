"""Tasks: problems with exactly checkable answers, and their reward functions.

The built-in task is column addition written out step by step, right to left:

    prompt    "4705+386="
    response  "5+6=11,0+8+1=9,7+3=10,4+0+1=5>5091" then EOS

Each step names the two column digits (and +1 for a carry) and their sum; the
response ends with `>` and the answer. Worked solutions are 20-70 tokens, so the
rollout/trainer mismatch has a long sequence to accumulate over.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


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


# Characters of the built-in model's vocabulary (after the special tokens).
BUILTIN_CHARS = "0123456789+=,>"
BUILTIN_SPECIALS = ("<pad>", "<eos>")
