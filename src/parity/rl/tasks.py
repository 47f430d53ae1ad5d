"""The built-in tasks, one `Task` each, by `task.name`: its generated problems and held-out split, its reward,
and what the rest of Parity asks of it (binary or not, the truncation default and refusal, the model it needs,
episodes). Code that treats a task specially asks this registry, never the task's name.

How to add one: docs/design.md, "How to add a task".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from parity.rl.builtin_rewards import (
    RewardFn,
    builtin_reward,
    exact_reward,
    length_reward,
    lookup_task_reward,
    math_reward,
    number_reward,
)
from parity.rl.problems import ArithmeticTask, NumberTask, Problem, lookup_task_problems

EVAL_SEED = 0xE7A1  # added to the run's seed: evaluation's own random stream

# (n, seed, difficulty) -> problems
Problems = Callable[[int, int, str], list[Problem]]


def _arithmetic(n: int, seed: int, difficulty: str) -> list[Problem]:
    """The built-in arithmetic task's held-out split, which the built-in model was not pretrained on."""
    return ArithmeticTask().problems(n, seed=seed, split="eval")


def _arithmetic_heldout(n: int, seed: int, difficulty: str) -> list[Problem]:
    return ArithmeticTask().problems(n, seed=seed + EVAL_SEED, split="eval")


def _number(n: int, seed: int, difficulty: str) -> list[Problem]:
    return NumberTask(difficulty).problems(n, seed=seed, split="train")


def _number_heldout(n: int, seed: int, difficulty: str) -> list[Problem]:
    return NumberTask(difficulty).problems(n, seed=seed, split="eval")


def _lookup(n: int, seed: int, difficulty: str) -> list[Problem]:
    return lookup_task_problems(n, seed, "train")


def _lookup_heldout(n: int, seed: int, difficulty: str) -> list[Problem]:
    return lookup_task_problems(n, seed + EVAL_SEED, "eval")


@dataclass(frozen=True)
class Task:
    """One built-in task (`task.name`)."""

    name: str
    reward: RewardFn  # (problem, response text, response length in tokens) -> float
    binary: bool  # 1 for a right answer, else 0: it has a right answer, and accuracy is logged
    trusted: bool = True  # fast and pure: run in-process unless reward.isolate says otherwise
    problems: Problems = _arithmetic  # what task.data=builtin stands for
    heldout: Problems = _arithmetic_heldout  # held-out candidates (by prompt: the trained ones are removed)
    heldout_by_prompt: bool = True  # False: the prompts repeat, a held-out problem is held out otherwise
    generated: bool = False  # Parity generates its problems, with a held-out split (no data file needed)
    levels: bool = False  # task.difficulty applies to its generated problems
    truncated: str = "zero_reward"  # algorithm.truncated when unset
    refused_truncation: Mapping[str, str] = field(default_factory=dict)  # algorithm.truncated -> why refused
    refused_models: Mapping[str, str] = field(default_factory=dict)  # model -> the refusal
    episodes: bool = False  # several model turns with its own environment (rl/episodes.py)
    boxed: bool = False  # scores only \boxed{} answers: a step with none is warned of


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("builtin", builtin_reward, binary=True, generated=True),
        Task(
            "lookup",
            lookup_task_reward,
            binary=True,
            problems=_lookup,
            heldout=_lookup_heldout,
            heldout_by_prompt=False,  # its prompts repeat (16 keys): a problem is its hidden table, held out by pair
            generated=True,
            refused_models={
                "builtin": "task.name=lookup is a tool task for a chat model that calls tools; the built-in one is "
                "model=builtin-agent"
            },
            episodes=True,
        ),
        Task(
            "length",
            length_reward,
            binary=False,
            truncated="keep",  # a zero reward would be the best one
            refused_truncation={"zero_reward": "would reward the longest responses on task.name=length"},
        ),
        Task("exact", exact_reward, binary=True),
        Task("math", math_reward, binary=True, trusted=False, boxed=True),
        Task(
            "number", number_reward, binary=True, problems=_number, heldout=_number_heldout, generated=True, levels=True
        ),
    )
}


def builtin_problems(task_name: str, n: int, seed: int, difficulty: str = "standard") -> list[Problem]:
    """The generated problems `task.data=builtin` stands for: word problems of `difficulty` for
    `task.name=number` (its training split), the lookup task's tables, else the built-in arithmetic task's
    held-out split, which the built-in model was not pretrained on."""
    return TASKS[task_name].problems(n, seed, difficulty)


def difficulty_has_no_effect(difficulty: str, task_name: str, data: str) -> bool:
    """A level other than standard applies only to the generated problems of a task with levels (number)."""
    return difficulty != "standard" and (not TASKS[task_name].levels or data != "builtin")
