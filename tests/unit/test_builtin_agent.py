"""The shipped tool-calling model, `builtin-agent`, and the lookup task it is built for."""

from __future__ import annotations

import json
import random

import pytest

from parity.builtin.agent import (
    AGENT_CHAT_TEMPLATE,
    episode,
    episode_ids,
    episode_scores,
    parse_tool_call,
    tool_call_message,
)
from parity.engines import kernels
from parity.engines.models.io import AGENT_DIR, load_model, resolve_model_dir
from parity.engines.tokenizer import load_tokenizer
from parity.rl.lookup import (
    KEYS,
    lookup,
    lookup_problems,
    lookup_reward,
    lookup_tool,
    parse_table,
    table_text,
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("builtin-agent")


def test_builtin_agent_names_the_shipped_folder(tok):
    assert resolve_model_dir("builtin-agent") == AGENT_DIR
    model = load_model("builtin-agent", kernels.numerics())
    assert model.config.vocab_size == tok.vocab_size and model.config.max_position_embeddings == 256
    assert tok.eos_ids == (1,) and tok.pad_id == 0 and tok.bos_id is None
    assert tok.chat_template == AGENT_CHAT_TEMPLATE


def _conversation() -> list[dict]:
    return [
        {"role": "user", "content": "c?"},
        tool_call_message("c"),
        {"role": "tool", "content": "427"},
        {"role": "assistant", "content": "427"},
        {"role": "user", "content": "z?"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "lookup", "arguments": '{"key":"z"}'}]},
        {"role": "tool", "content": "no key z"},
    ]


def test_chat_template_renders_chatml_with_hermes_tool_calls(tok):
    text = tok.render_chat(_conversation())
    assert text == (
        "<|im_start|>user\nc?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name":"lookup","arguments":{"key":"c"}}</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>427</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n427<|im_end|>\n"
        "<|im_start|>user\nz?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name":"lookup","arguments":{"key":"z"}}</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>no key z</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # One token per special or tool marker, one per character otherwise.
    ids = tok.encode_chat([{"role": "user", "content": "c?"}])
    assert len(ids) == len("user\nc?\nassistant\n") + 3 and ids.count(2) == 2 and ids.count(tok.eos_id) == 1
    assert len(tok.encode("<tool_call>{}</tool_call>")) == 4


def test_chat_template_renders_as_transformers_does(tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(AGENT_DIR)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]  # ignored by the template
    for messages in (_conversation(), _conversation()[:1], _conversation()[:3]):
        text = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        assert text == tok.render_chat(messages)
        ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert list(ids) == tok.encode_chat(messages)
    assert hf.decode(tok.encode("<tool_call>ab</tool_call>")) == "<tool_call>ab</tool_call>"
    # The tool markers are added tokens, not special ones (as Qwen2.5's): decoding keeps them.
    assert tok.decode(tok.encode_chat(_conversation()[:2])).count("<tool_call>") == 1


def test_lookup_problems_are_seeded_and_split():
    train = lookup_problems(400, seed=0)
    evals = lookup_problems(200, seed=0, split="eval")
    assert train == lookup_problems(400, seed=0) and train != lookup_problems(400, seed=1)
    assert not {(p.key, p.answer) for p in train} & {(p.key, p.answer) for p in evals}
    for p in train[:50] + evals[:50]:
        assert p.key in KEYS and sorted(p.table) == list(KEYS)
        assert len(set(p.table.values())) == len(KEYS) and all(len(v) == 3 and v.isdigit() for v in p.table.values())
        assert p.answer == p.table[p.key] and p.prompt == [{"role": "user", "content": f"{p.key}?"}]
        row = p.row()
        assert parse_table(row["table"]) == p.table and row["answer"] == p.answer
    assert len({p.key for p in train}) == len(KEYS)
    with pytest.raises(ValueError, match="split"):
        lookup_problems(1, seed=0, split="test")


def test_lookup_tool_and_reward():
    table = {"a": "427", "b": "115"}
    assert table_text(table) == "a=427,b=115"
    tool = lookup_tool(table)
    assert tool(key="a") == "427" and lookup(table, "b") == "115"
    assert tool(key="z") == "no key z" and tool(key=3) == "no key"
    assert tool() == tool(key="a", other=1) == "expected one argument, key"
    assert lookup_reward("427", "427") == 1.0 and lookup_reward(" 427\n", "427") == 1.0
    assert lookup_reward("115", "427") == 0.0 and lookup_reward("", "427") == 0.0


def test_parse_tool_call():
    assert parse_tool_call('<tool_call>{"name":"lookup","arguments":{"key":"c"}}</tool_call>') == {
        "name": "lookup",
        "arguments": {"key": "c"},
    }
    assert parse_tool_call("427") is None
    assert parse_tool_call('<tool_call>{"name":"lookup","arguments":{"key":"c"}</tool_call>') is None
    assert parse_tool_call('<tool_call>{"name":"lookup","arguments":"c"}</tool_call>') is None


def test_episode_loss_mask_covers_the_assistant_turns(tok):
    problem = lookup_problems(1, seed=3)[0]
    called = next(k for k in KEYS if k != problem.key)
    prompt, response, mask = episode_ids(tok, episode(problem, called))
    assert prompt == tok.encode_chat(problem.prompt)
    learned = tok.decode([t for t, m in zip(response, mask) if m])
    skipped = tok.decode([t for t, m in zip(response, mask) if not m])
    call = json.dumps({"name": "lookup", "arguments": {"key": called}}, separators=(",", ":"))
    assert learned == f"<tool_call>{call}</tool_call>{problem.table[called]}"
    assert skipped == f"\ntool\n<tool_response>{problem.table[called]}</tool_response>\nassistant\n"
    assert [t for t, m in zip(response, mask) if m].count(tok.eos_id) == 2  # each turn's end is learned


def test_shipped_model_follows_the_protocol():
    """A few seeded episodes at temperature 1: every call well-formed and every tool answer copied, while the
    key called is mostly not the prompt's (the base model RL starts from)."""
    problems = lookup_problems(8, seed=random.Random(5).randrange(1000), split="eval")
    scores = episode_scores(load_model("builtin-agent", kernels.numerics()), AGENT_DIR, problems, 4, seed=5)
    assert scores["call_rate"] == 1.0 and scores["protocol_rate"] >= 0.9
    assert scores["accuracy"] <= 0.4
