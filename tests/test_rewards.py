"""Reward functions and their containment: a raising or hanging reward never kills the run."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from parity.rewards import RewardError, RewardRunner
from parity.tasks import (
    DataError,
    DataOrder,
    Problem,
    extract_boxed,
    import_reward_fn,
    length_reward,
    load_problems,
    math_reward,
)

P = Problem("1+1=", "2")


def _raises(problem, response, length):
    if response == "boom":
        raise RuntimeError("boom")
    return 1.0


def _hangs(problem, response, length):
    if response == "hang":
        time.sleep(60)
    return 0.5


def _dies(problem, response, length):
    if response == "die":
        os._exit(3)
    return 0.25


@pytest.mark.parametrize("isolate", [False, True])
def test_raising_reward_is_contained(isolate):
    runner = RewardRunner(_raises, isolate=isolate)
    try:
        out = runner([(P, "ok", 1), (P, "boom", 1), (P, "ok", 1)])
    finally:
        runner.close()
    assert out.rewards == [1.0, 0.0, 1.0] and out.errors == 1 and out.timeouts == 0


def test_hanging_reward_times_out_and_the_rest_still_score():
    runner = RewardRunner(_hangs, isolate=True, timeout_s=0.5)
    start = time.time()
    try:
        out = runner([(P, "a", 1), (P, "hang", 1), (P, "b", 1)])
    finally:
        runner.close()
    assert out.rewards == [0.5, 0.0, 0.5] and out.timeouts == 1 and out.errors == 0
    assert time.time() - start < 10


def test_dying_worker_is_replaced():
    runner = RewardRunner(_dies, isolate=True)
    try:
        out = runner([(P, "die", 1), (P, "x", 1)])
    finally:
        runner.close()
    assert out.rewards == [0.0, 0.25] and out.errors == 1


def test_strict_stops_the_run():
    runner = RewardRunner(_raises, isolate=False, strict=True)
    with pytest.raises(RewardError, match="raised RuntimeError: boom.*strict=true"):
        runner([(P, "boom", 1)])


def test_non_finite_reward_counts_as_error():
    runner = RewardRunner(lambda p, r, n: float("nan"), isolate=False)
    assert runner([(P, "x", 1)]).errors == 1


def test_math_reward_and_boxed_extraction():
    assert extract_boxed(r"a \boxed{x^{2}} b \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_boxed("no box") is None
    half = Problem("q", "0.5")
    assert math_reward(half, r"so \boxed{\frac{1}{2}}", 5) == 1.0
    assert math_reward(half, r"\boxed{1/3}", 5) == 0.0
    assert math_reward(half, "0.5 without a box", 5) == 0.0


def test_length_reward():
    assert length_reward(P, "anything", 7) == -7.0


def test_user_reward_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def score(prompt, response, answer):\n    return float(answer in response)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = import_reward_fn("my_rewards:score")
    assert fn(P, "it is 2", 3) == 1.0 and fn(P, "it is 3", 3) == 0.0
    with pytest.raises(ValueError, match="expected 'module:function'"):
        import_reward_fn("my_rewards.score")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        import_reward_fn("my_rewards:nope")
    sys.modules.pop("my_rewards", None)


def test_dataset_files(tmp_path):
    jl = tmp_path / "d.jsonl"
    jl.write_text(
        json.dumps({"prompt": "1+1=", "answer": 2}) + "\n\n" + json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n"
    )
    assert load_problems(jl) == [Problem("1+1=", "2"), Problem("2+2=", "4")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": 1}\n{"prompt": 3}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: expected an object"):
        load_problems(bad)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), tmp_path / "d.parquet")
    assert load_problems(tmp_path / "d.parquet")[1] == Problem("b", "2")
    with pytest.raises(DataError, match="does not exist"):
        load_problems(tmp_path / "missing.jsonl")


def test_data_order_is_resumable():
    full = DataOrder(7, seed=3).take(20)
    first = DataOrder(7, seed=3)
    head = first.take(9)
    assert head + DataOrder(7, seed=3, position=first.position).take(11) == full
    assert sorted(full[:7]) == list(range(7))  # each epoch is a permutation
