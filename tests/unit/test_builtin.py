"""The built-in task and model."""

from __future__ import annotations

from parity.engines.tokenizer import load_tokenizer
from parity.rl.problems import ArithmeticTask, Problem


def test_task_solutions_check_exactly():
    task = ArithmeticTask()
    p = Problem("4705+386=", "5091")
    sol = task.solution(p)
    assert sol == "5+6=11,0+8+1=9,7+3=10,4+0+1=5>5091"
    assert task.reward(p, sol) == 1.0
    assert task.reward(p, task.solution(p, slip=(1, 8))) == 0.0
    assert task.reward(p, "5+6=11>5092") == 0.0 and task.reward(p, "no answer") == 0.0


def test_task_splits_are_disjoint_and_seeded():
    task = ArithmeticTask()
    train = task.problems(500, seed=0)
    evals = task.problems(200, seed=0, split="eval")
    assert train == task.problems(500, seed=0)
    assert not {p.prompt for p in train} & {p.prompt for p in evals}


def test_solution_lengths_in_range():
    task = ArithmeticTask()
    tok = load_tokenizer("builtin")
    lengths = [len(tok.encode(task.solution(p))) + 1 for p in task.problems(500, seed=1)]
    assert 20 <= min(lengths) and max(lengths) <= 80
