"""Episodes' parts without a model: tools called within bounds, what a tool's answer looks like to the
model, the records an episode keeps, and the keys that are refused."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch

from parity import config
from parity.config import ConfigError
from parity.rl.episodes import Episode, Step, ToolEnvironment, call_tool, environment_step, tool_text
from parity.rl.rewards import exception_summary
from parity.rl.train_config import TrainConfig


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def broken(x: str) -> str:
    """Always fails."""
    raise RuntimeError("the database is down")


def slow(x: str) -> str:
    """Sleeps."""
    time.sleep(30)
    return x


def odd(x: str) -> object:
    """Returns something that is not text."""
    return object()


def call(name: str, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_tool_answers_become_text_the_model_reads():
    env = ToolEnvironment([add, broken, slow, odd], "prompt", timeout_s=0.5)
    assert env.reset({"prompt": "2+3?"}) == "2+3?"
    step = env.step({"role": "assistant", "content": "", "tool_calls": [call("add", a=2, b=3)]})
    assert step.messages == [{"role": "tool", "name": "add", "content": "5"}] and not step.done
    step = env.step(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call("broken", x="q"), call("slow", x="q"), call("odd", x="q"), call("nope")],
        }
    )
    texts = [m["content"] for m in step.messages]
    assert texts[0] == "error: RuntimeError: the database is down"
    assert texts[1] == "error: slow did not return within 0.5 s"
    assert texts[2] == "error: the tool returned 'object', not text or JSON"
    assert texts[3].startswith("error: no tool named 'nope'; the tools are add, broken, slow, odd")
    assert env.errors == 4
    assert env.step({"role": "assistant", "content": "5"}).done  # no call: the answer


def test_tool_text_and_arguments():
    assert tool_text({"a": [1, 2]}) == ('{"a": [1, 2]}', False)
    assert tool_text("x" * 5000)[0].endswith("[cut: 1000 more characters]")
    assert call_tool(add, "add", ["not", "a", "dict"], 1.0) == (
        "error: the arguments of add must be a JSON object, got list",
        True,
    )
    assert call_tool(add, "add", {"a": 1}, 1.0)[0].startswith("error: TypeError:")
    assert tool_text(float("nan")) == ("error: the tool returned 'float', not text or JSON", True)  # fed as NaN


async def _async_add(a: int, b: int) -> int:
    return a + b


def test_an_async_tool_is_awaited():
    """Every call of an `async def` tool failed ('the tool returned coroutine')."""
    assert call_tool(_async_add, "add", {"a": 1, "b": 2}, 1.0) == ("3", False)


def test_episode_records():
    episode = Episode([{"role": "user", "content": "c?"}], first=1)
    episode.messages += [
        {"role": "assistant", "content": "", "tool_calls": [call("lookup", key="c")]},
        {"role": "tool", "name": "lookup", "content": "427"},
        {"role": "assistant", "content": "427"},
    ]
    assert episode.answer == "427"
    assert episode.transcript() == ('assistant: [call lookup({"key": "c"})]\ntool lookup: 427\nassistant: 427')
    episode.end = "turn_cut_off"
    assert episode.truncated


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["task.environment=envs"], r"task.environment: expected 'module:name' or 'file.py:name', got 'envs'"),
        (["task.environment=envs:Env", "task.tools=tools:add"], "task.environment and task.tools: give one"),
        (["task.tools=tools:add", "episode.turn_tokens=200"], r"episode.turn_tokens: must be in \[1, rollout"),
        (["task.tools=tools:add", "episode.tool_format=json"], "episode.tool_format"),
        (["task.tools=tools:add", "episode.max_turns=0"], "episode.max_turns"),
        (["episode.max_turns=8"], r"^episode.max_turns=8: a setting of episodes, and this run has none"),  # ignored
    ],
)
def test_episode_keys_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.load(TrainConfig, None, overrides)


class _Odd:
    """An environment whose steps go wrong in every way an environment's can."""

    def __init__(self, answer):
        self.answer = answer

    def step(self, assistant):
        if self.answer == "slow":
            time.sleep(30)
        return self.answer


@pytest.mark.parametrize(
    "answer, error",
    [
        ("slow", "TimeoutError: step() did not return within episode.tool_timeout_s=0.3 s"),
        ("text", "TypeError: step() returned str, not parity.Step"),
        (Step([{"role": "tool", "content": 5}]), "TypeError: step().messages is"),
        (Step(["hi"]), "TypeError: step().messages is"),
        (Step(reward=float("nan")), "TypeError: step().reward is nan, not a finite number or None"),
        (Step(reward="1"), "TypeError: step().reward is '1', not a finite number or None"),
        (Step(done="no"), "TypeError: step().done is 'no', not True or False"),  # bool('no') ended it
    ],
)
def test_an_environment_step_that_goes_wrong_is_named(answer, error):
    with pytest.raises((TimeoutError, TypeError)) as caught:
        environment_step(_Odd(answer), {"role": "assistant", "content": "x"}, 0.3)
    assert exception_summary(caught.value).startswith(error)
    assert environment_step(_Odd(Step(reward=1)), {"role": "assistant", "content": "x"}, 1.0) == Step([], False, 1.0)
    # A NumPy or 0-d torch scalar is a number, as a reward function's is (it ended every episode, unscored).
    for number in (np.float32(0.5), torch.tensor(0.5)):
        assert environment_step(_Odd(Step(reward=number)), {"role": "assistant"}, 1.0).reward == 0.5
    with pytest.raises(TypeError, match=r"step\(\).reward is tensor\(\[1., 2.\]\), not a finite number"):
        environment_step(_Odd(Step(reward=torch.tensor([1.0, 2.0]))), {"role": "assistant"}, 1.0)


class _BadReset:
    def reset(self, row):
        raise KeyError("table")

    def step(self, action):
        return Step(done=True)


def test_an_environment_that_cannot_start_stops_the_run_in_one_line():
    from parity.rl.episodes import _new_episode

    with pytest.raises(
        ConfigError, match=r"^environment: _BadReset failed as it was made or reset: KeyError: 'table'$"
    ):
        _new_episode(_BadReset, {"prompt": "x"}, 1.0)
    with pytest.raises(ConfigError, match=r"reset\(\)'s answer is 5, not a list of messages"):
        _new_episode(lambda: type("E", (), {"reset": lambda self, row: 5, "step": lambda self, a: None})(), {}, 1.0)
    with pytest.raises(ConfigError, match=r"^environment: <lambda> has no method step\(\); an environment has"):
        _new_episode(lambda: type("E", (), {"reset": lambda self, row: "hi"})(), {}, 1.0)
    env, messages = _new_episode(lambda: ToolEnvironment([add], "prompt", 1.0), {"prompt": "2+3?"}, 1.0)
    assert messages == [{"role": "user", "content": "2+3?"}] and isinstance(env, ToolEnvironment)


class _ToolsOf:
    def __init__(self, tools):
        self._tools = tools

    @property
    def tools(self):
        if self._tools == "raise":
            raise KeyError("schema")
        return self._tools


@pytest.mark.parametrize(
    "tools, message",
    [
        ("raise", "environment: _ToolsOf.tools failed: KeyError: 'schema'"),
        ({"type": "function", "function": {"name": "f"}}, "environment: _ToolsOf.tools is dict {"),
        ([{"type": "function", "function": {}}], "a schema that names no function"),
        ([{"description": "x"}], "a schema that names no function"),
    ],
)
def test_an_environments_tools_that_cannot_be_offered_are_one_line(tools, message):
    """A raising property was a traceback, a single schema 'tool type: not a named function'."""
    from parity.rl.episodes import _schemas

    with pytest.raises(ConfigError, match=re.escape(message)):
        _schemas(_ToolsOf(tools))
    assert _schemas(_ToolsOf([{"type": "function", "function": {"name": "f"}}, {"name": "g"}, add]))[2]["function"]


def test_an_environment_whose_reset_gives_no_messages_is_refused():
    from parity.rl.episodes import _new_episode

    with pytest.raises(ConfigError, match=r"^environment: <lambda>.reset\(\) gave no first messages"):
        _new_episode(lambda: type("E", (), {"reset": lambda self, row: [], "step": lambda self, a: None})(), {}, 1.0)


def test_an_episode_its_environment_broke_is_unscored_and_its_record_is_not_the_rewards_to_edit():
    """An environment_error episode scored 0 and trained against what the model did (advantage -0.5 beside
    +0.5); and a reward that edited `messages` rewrote the completions file's record."""
    from types import SimpleNamespace

    from parity.rl.episodes import EpisodeBatch
    from parity.rl.problems import Problem
    from parity.rl.rewards import RewardResult
    from parity.rl.step import trained_rewards

    ends = ["done", "environment_error", "done", "environment_error"]
    episodes = EpisodeBatch([Episode([{"role": "user", "content": "q"}], end=end) for end in ends])
    batch = SimpleNamespace(
        response_mask=torch.ones(4, 2, dtype=torch.bool),
        truncated=torch.zeros(4, dtype=torch.bool),
        group_index=torch.tensor([0, 0, 0, 0]),
        episodes=episodes,
    )
    result = RewardResult([1.0, 0.0, 0.0, 0.0], errors=0, timeouts=0)
    rewards, advantages = trained_rewards(batch, result, "grpo", "zero_reward")
    assert rewards.isnan().tolist() == [False, True, False, True]
    assert advantages[1] == advantages[3] == 0 and advantages[0] > 0 > advantages[2]
    items = episodes.reward_items([Problem("q", "a")] * 4, [1] * 4)
    items[0][0].columns["messages"][0]["content"] = "edited by a reward"
    assert episodes.episodes[0].messages[0]["content"] == "q"


def test_text_that_is_not_utf8_is_a_tools_error_or_the_environments_in_one_line():
    """A lone surrogate (text read with errors="surrogateescape") ended the run in the tokenizer's traceback."""
    from parity.rl.episodes import _new_episode

    odd = "verdict: caf\udce9"
    assert tool_text(odd) == (
        "error: the tool's answer is not UTF-8 text: a lone surrogate '\\udce9' at character 12",
        True,
    )
    with pytest.raises(TypeError, match=r"^step\(\).messages\[0\]'s content is not UTF-8 text: a lone surrogate"):
        environment_step(_Odd(Step([{"role": "user", "content": odd}], done=True)), {"role": "assistant"}, 1.0)
    reset = type("E", (), {"reset": lambda self, row: odd, "step": lambda self, a: Step(done=True)})
    with pytest.raises(ConfigError, match=r"^environment: E.reset\(\)'s answer\[0\]'s content is not UTF-8 text"):
        _new_episode(reset, {"prompt": "x"}, 1.0)
