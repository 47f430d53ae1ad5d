"""The built-in reward functions: builtin (the arithmetic task's answer), length, exact, math (math-verify on
the last \\boxed{}), number (the answer an instruct model gives, as a number) and lookup's; `rl/tasks.py` says
which task each belongs to.

`rl/rewards.py` runs reward functions; `rl/reward_fns.py` reads your own.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal

from parity.rl.lookup import lookup_reward
from parity.rl.problems import ArithmeticTask, Problem

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


def _import_math_verify() -> None:
    """math-verify's import (0.6 s on an idle core), done as the reward's worker starts: inside the first
    sample's `reward.timeout_s` it timed out every sample of a short timeout, each in a fresh worker."""
    import logging

    import math_verify  # noqa: F401

    # The reward runner enforces the timeout; math-verify's own (signal-based) is off.
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def math_reward(problem: Problem, response: str, length: int) -> float:
    """1 if the last \\boxed{} answer equals the reference under `math-verify`."""
    _import_math_verify()
    from math_verify import parse, verify

    boxed = extract_boxed(response)
    if boxed is None:
        return 0.0
    answer = problem.answer if "\\boxed" in problem.answer else f"${problem.answer}$"
    gold = parse(answer, parsing_timeout=None)
    guess = parse(f"\\boxed{{{boxed}}}", parsing_timeout=None)
    return 1.0 if verify(gold, guess, timeout_seconds=None) else 0.0


# A number as models write it: an optional sign or "$", digits with optional thousands commas, an optional
# decimal part ("1,234.50"; the period ending a sentence is not one), units allowed after it ("360km").
# Digits inside a word ("H2O", "v1.2") are not numbers, and a "-" after a digit or a letter is an operator
# or a hyphen ("12-7"), not a sign.
_NUMBER = re.compile(r"(?<![\w.])(-?)\$?(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?!\d)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)[\s:]*(?:\*\*)?\s*", re.IGNORECASE)


def _to_number(match: re.Match) -> Decimal:
    sign, whole, fraction = match.groups()
    return Decimal(sign + whole.replace(",", "") + (fraction or ""))


def extract_number(text: str) -> Decimal | None:
    """The answer a response gives as a number: inside its last \\boxed{} if it has one, else after its last
    "answer is" (or "answer:"), else its last number; None when there is none there."""
    boxed = extract_boxed(text)
    if boxed is not None:
        text = boxed
    else:
        stated = [m.end() for m in _ANSWER_IS.finditer(text)]
        if stated and (match := _NUMBER.match(text, stated[-1])):
            return _to_number(match)
    numbers = list(_NUMBER.finditer(text))
    return _to_number(numbers[-1]) if numbers else None


def number_reward(problem: Problem, response: str, length: int) -> float:
    """1 if the response's answer (`extract_number`) equals the reference answer as a number, else 0."""
    expected = _NUMBER.fullmatch(problem.answer.strip().rstrip("."))
    if expected is None:
        raise ValueError(f"task.name=number: the answer {problem.answer!r} is not a number")
    return 1.0 if extract_number(response) == _to_number(expected) else 0.0


math_reward.prepare = _import_math_verify  # type: ignore[attr-defined]  # run by `rewards._worker` first


def lookup_task_reward(problem: Problem, response: str, length: int) -> float:
    """The built-in tool task's (`rl/lookup.py`): the episode's last answer is the hidden value."""
    return lookup_reward(response, problem.answer)
