"""Episodes' parts without a model: tools called within bounds, what a tool's answer looks like to the
model, the records an episode keeps, and the keys that are refused."""

from __future__ import annotations

import time

import pytest

from parity import config
from parity.config import ConfigError
from parity.rl.episodes import Episode, ToolEnvironment, call_tool, tool_text
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
        (
            ["task.tools=tools:add", "distributed.rollout_workers=1", "async.partial_rollouts=2"],
            "async.partial_rollouts with episodes",
        ),
        (["task.tools=tools:add", "eval.data=x.jsonl"], "held-out evaluation samples one turn"),
    ],
)
def test_episode_keys_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.load(TrainConfig, None, overrides)
