"""TRL's reward functions as they are: completions in TRL's chat form (task.completion_format), None for
a sample a function does not score, and the line a string completion's TypeError gets."""

from __future__ import annotations

import json
import math

import pytest

from parity.rl.completions import completion_rows, markdown_table, read_completions, write_completions
from parity.rl.problems import Problem
from parity.rl.reward_fns import Reward, RewardCheckError, UserRewards, bind_all

CHAT = Problem([{"role": "user", "content": "1+1?"}], "2", {"answer": "2"})
TEXT = Problem("1+1=", "2", {"answer": "2"})


def trl_length(completions, **kwargs):
    """A TRL reward for chat prompts: each completion is a list of one assistant message."""
    return [float(len(c[0]["content"])) for c in completions]


def only_twos(completions, answer, **kwargs):
    """TRL's None: this function scores the samples whose answer is 2 only."""
    return [1.0 if a == "2" else None for a in answer]


def per_sample_none(prompt, completion, **columns):
    return None if completion == "skip" else 3.0


def _run(rewards, items, **kw):
    return UserRewards(bind_all(rewards, ["answer"]), **kw)(items)


@pytest.mark.parametrize("fmt", ["messages", "auto"])
def test_chat_prompts_get_trl_s_completions(fmt):
    out = _run([Reward(trl_length)], [(CHAT, "abc", 3), (CHAT, "hello", 5)], completion_format=fmt)
    assert out.rewards == [3.0, 5.0] and out.errors == 0


def test_auto_keeps_text_for_text_prompts_and_the_default_is_text():
    seen = []

    def record(completions, **kw):
        seen.append(completions)
        return [0.0] * len(completions)

    _run([Reward(record)], [(TEXT, "abc", 3)], completion_format="auto")
    _run([Reward(record)], [(CHAT, "abc", 3)])
    _run([Reward(record)], [(TEXT, "abc", 3)], completion_format="messages")
    assert seen == [["abc"], ["abc"], [[{"role": "assistant", "content": "abc"}]]]


@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "worker"])
def test_a_trl_reward_on_string_completions_names_the_key(isolate):
    """`c[0]["content"]` on a string: refused on the first batch, in one line that says what completions are
    and which key gives TRL's form; the same in the worker process."""
    rewards = UserRewards(bind_all([Reward(trl_length)], ["answer"]), isolate=isolate, timeout_s=60)
    try:
        with pytest.raises(RewardCheckError) as raised:
            rewards([(CHAT, "abc", 3), (CHAT, "hello", 5)])
    finally:
        rewards.close()
    line = str(raised.value)
    assert "\n" not in line
    assert "TypeError: string indices must be integers" in line
    assert "completions are strings (task.completion_format=text); task.completion_format=messages" in line


def test_a_string_completions_hint_only_for_a_type_error_of_the_function():
    def text(completions, **kw):
        return ["x"] * len(completions)

    with pytest.raises(RewardCheckError) as raised:
        _run([Reward(text)], [(TEXT, "abc", 3)])
    assert "completion_format" not in str(raised.value)


def test_none_is_not_scored_on_any_batch_including_the_first(capsys):
    rows = [(TEXT, "a", 1), (Problem("2+2=", "4", {"answer": "4"}), "b", 1), (TEXT, "skip", 1)]
    rewards = UserRewards(bind_all([Reward(only_twos), Reward(per_sample_none, weight=0.5)], ["answer"]))
    first = rewards(rows)
    assert first.errors == 0 and first.per_function["only_twos"][0] == 1.0
    assert math.isnan(first.per_function["only_twos"][1]) and math.isnan(first.per_function["per_sample_none"][2])
    # the weighted sum over the functions that scored each sample
    assert first.rewards[0] == 1.0 + 0.5 * 3.0 and first.rewards[1] == 0.5 * 3.0 and first.rewards[2] == 1.0
    assert first.weights == {"only_twos": 1.0, "per_sample_none": 0.5}
    second = rewards([(Problem("2+2=", "4", {"answer": "4"}), "skip", 1)])
    assert math.isnan(second.rewards[0]) and second.errors == 0  # no function scored it: NaN, not 0


def test_a_function_returning_none_for_the_whole_first_batch_warns(capsys):
    _run([Reward(per_sample_none)], [(TEXT, "skip", 1), (TEXT, "skip", 1)])
    assert "reward per_sample_none returned None for every completion of the first batch (2)" in capsys.readouterr().err


def test_unscored_samples_are_null_in_the_completions_file_and_table(tmp_path):
    nan = math.nan
    problems = [Problem("p", "", {}), Problem("q", "", {})]
    rows = completion_rows(
        1, problems, ["a", "b"], [1.5, nan], {"f": [1.5, nan]}, [1, 1], [False, False], [1.5, nan], [0.0, 0.0]
    )
    (tmp_path / "run").mkdir()
    path = write_completions(tmp_path / "run", 1, rows)
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert written[1]["reward"] is None and written[1]["score"] is None and written[1]["reward/f"] is None
    assert read_completions(tmp_path / "run", 10_000)[1]["reward/f"] is None
    assert "| None | 0 | None |" in markdown_table(written)  # reward, advantage, reward/f
