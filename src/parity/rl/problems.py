"""Problems and the tasks that generate them: the built-in arithmetic task and task number's word problems.

The built-in task is column addition written out step by step, right to left:

    prompt    "4705+386="
    response  "5+6=11,0+8+1=9,7+3=10,4+0+1=5>5091" then EOS

Each step names the two column digits (and +1 for a carry) and their sum; the
response ends with `>` and the answer. Worked solutions are 20-70 tokens, so the
rollout/trainer mismatch has a long sequence to accumulate over.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from typing import Any

from parity.rl.lookup import lookup_problems, table_text

# The most problems a command generates or evaluates at once: 10**9 would only hang before the first step.
MAX_PROBLEMS = 100_000


@dataclass(frozen=True)
class Problem:
    """`prompt` is text, or a list of chat messages ({"role": ..., "content": ...}) for the chat template.
    `answer` is the reference answer as text (what the built-in rewards compare with); `columns` holds every
    column of a data file's row but the prompt, each value as the file gave it (an integer stays an integer),
    for reward functions that name them."""

    prompt: str | list[dict[str, Any]]
    answer: str
    columns: dict[str, Any] = field(default_factory=dict, compare=False)


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
                out.append(Problem(prompt=f"{a}+{b}=", answer=str(a + b), columns={"answer": a + b}))
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


_NAMES = ("Sam", "Maria", "Tom", "Aisha", "Ken", "Lena", "Omar", "Priya", "Jack", "Mei")
_ITEMS = ("apple", "marble", "card", "stamp", "shell", "cookie", "book", "sticker")


def _buys(name: str, item: str, a: int, b: int) -> tuple[str, int]:
    return f"{name} has {a} {item}s and buys {b} more. How many {item}s does {name} have now?", a + b


def _gives(name: str, item: str, a: int, b: int) -> tuple[str, int]:
    return f"{name} had {a} {item}s and gave {b} of them to a friend. How many {item}s are left?", a - b


def _word_problem(rng: random.Random) -> tuple[str, int]:
    """One arithmetic word problem, drawn with `rng`, and its answer (a whole number)."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(12)
    if kind == 0:
        return _buys(name, item, rng.randint(5, 90), rng.randint(2, 60))
    if kind == 1:
        a = rng.randint(20, 150)
        return _gives(name, item, a, rng.randint(1, a - 1))
    if kind == 2:
        a, b = rng.randint(6, 48), rng.randint(3, 25)
        return f"A box holds {a} {item}s. How many {item}s are in {b} boxes?", a * b
    if kind == 3:
        b, q = rng.randint(2, 12), rng.randint(3, 30)
        return f"{b * q} {item}s are shared equally among {b} children. How many {item}s does each child get?", q
    if kind == 4:
        a, b = rng.randint(30, 120), rng.randint(2, 9)
        return f"A train travels at {a} miles per hour for {b} hours. How many miles does it travel?", a * b
    if kind == 5:
        a, b = rng.randint(5, 60), rng.randint(3, 30)
        return f"{name} reads {a} pages a day. How many pages does {name} read in {b} days?", a * b
    if kind == 6:
        a, b = rng.randint(2, 95), rng.randint(3, 40)
        return f"A shop sells notebooks at ${a} each. How many dollars do {b} notebooks cost?", a * b
    if kind == 7:
        a, b = rng.randint(10, 250), rng.randint(4, 52)
        c = rng.randint(1, a * b - 1)
        return (
            f"{name} saves ${a} every week. After {b} weeks, {name} spends ${c}. How many dollars are left?",
            a * b - c,
        )
    if kind == 8:
        a, b = rng.randint(5, 40), rng.randint(6, 30)
        c = rng.randint(1, a * b - 1)
        return (
            f"A hall has {a} rows of {b} chairs, and {c} chairs are empty. How many chairs are taken?",
            a * b - c,
        )
    if kind == 9:
        a, b = rng.randint(3, 20), rng.randint(4, 25)
        c = rng.randint(1, a * b - 1)
        return (
            f"{name} buys {a} packs of {b} {item}s and gives away {c} {item}s. How many {item}s does {name} keep?",
            a * b - c,
        )
    if kind == 10:
        a, b = rng.randint(3, 400), rng.randint(2, 300)
        return f"A rectangle is {a} cm long and {b} cm wide. What is its perimeter in centimeters?", 2 * (a + b)
    b, q = rng.randint(2, 25), rng.randint(4, 60)
    return (
        f"A tank holds {b * q} liters and fills at {b} liters per minute. How many minutes does it take to fill it?",
        q,
    )


def _easy_word_problem(rng: random.Random) -> tuple[str, int]:
    """One single-step word problem on numbers below 16 (adding, taking away, equal groups): a
    level a 135M instruct model solves some of the time."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(3)
    if kind == 0:
        return _buys(name, item, rng.randint(2, 9), rng.randint(2, 9))
    if kind == 1:
        a = rng.randint(5, 15)
        return _gives(name, item, a, rng.randint(1, a - 1))
    a, b = rng.randint(2, 5), rng.randint(2, 5)
    return f"{name} has {a} bags with {b} {item}s in each bag. How many {item}s does {name} have?", a * b


# Asked of every `worked` problem. SmolLM2-135M-Instruct answers it with 200-400 tokens of working at
# temperature 1 (a third run past 512), against about 90 for the bare question: long responses, where
# BF16's sequence-level mismatch is large, on problems the model still solves some of the time.
WORKED_REQUEST = "Explain your reasoning step by step in detail, then give the final answer."


def _worked_word_problem(rng: random.Random) -> tuple[str, int]:
    """An easy word problem that asks for its working: the same problems at `easy`, answered at length."""
    question, answer = _easy_word_problem(rng)
    return f"{question} {WORKED_REQUEST}", answer


DIFFICULTIES = {"standard": _word_problem, "easy": _easy_word_problem, "worked": _worked_word_problem}


class NumberTask:
    """Arithmetic word problems whose answer is a whole number, for instruct models: `task.name=number`.

    `split="eval"` draws from a held-out eighth of the problems (by their text) that `split="train"`
    never produces. The reward (`number_reward`) reads the answer wherever an instruct model writes it.
    `difficulty`: standard (one or two steps, numbers into the hundreds), easy (`_easy_word_problem`) or
    worked (the easy problems asking for step-by-step working: long answers).
    """

    name = "number"

    def __init__(self, difficulty: str = "standard"):
        if difficulty not in DIFFICULTIES:
            raise ValueError(f"difficulty must be one of {', '.join(DIFFICULTIES)}, got {difficulty!r}")
        self.draw = DIFFICULTIES[difficulty]

    @staticmethod
    def _held_out(prompt: str) -> bool:
        return zlib.crc32(prompt.encode("utf-8")) % 8 == 0

    def problems(self, n: int, seed: int, split: str = "train") -> list[Problem]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rng = random.Random(f"{self.name}:{split}:{seed}")
        out: list[Problem] = []
        while len(out) < n:
            prompt, answer = self.draw(rng)
            if self._held_out(prompt) == (split == "eval"):
                out.append(Problem(prompt=prompt, answer=str(answer), columns={"answer": answer}))
        return out


def lookup_task_problems(n: int, seed: int, split: str) -> list[Problem]:
    """The built-in tool task's problems (`rl/lookup.py`) as data rows: the hidden table a column."""
    return [
        Problem(p.prompt, p.answer, {"key": p.key, "table": table_text(p.table)})
        for p in lookup_problems(n, seed=seed, split=split)
    ]


# Characters of the built-in model's vocabulary (after the special tokens).
BUILTIN_CHARS = "0123456789+=,>"
BUILTIN_SPECIALS = ("<pad>", "<eos>")
