"""Episodes end to end (docs/agents.md): the page's two scripts as written, the built-in tool task from the
CLI in exact mode (with LoRA too), what rewards and the completions file see, and resume. Tool answers that
spell control tokens, on real tokenizers: tests/unit/test_turns.py."""

from __future__ import annotations

import json
import random
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import parity
from parity.cli import main
from parity.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EVAL = dict(prompts_per_step=4, rollout__group_size=2, eval__num_prompts=4, eval__samples=1)
SMALL = ["steps=2", "prompts_per_step=4", "rollout.group_size=4", "checkpoint_every=-1", "log.completions=0"]


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "agents.md").read_text(), flags=re.S)


@pytest.mark.parametrize("index, name", [(0, "agent_tools.py"), (1, "agent_env.py")])
def test_the_pages_scripts_run_as_written(tmp_path, index, name):
    script = tmp_path / name
    script.write_text(_blocks()[index])
    done = subprocess.run([sys.executable, str(script), "2"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    float(done.stdout.strip().splitlines()[-1])  # the last step's accuracy or reward, printed
    run = tmp_path / ("runs/agent-tools" if index == 0 else "runs/agent-env")
    rows = [json.loads(line) for line in (run / "completions" / "step_000002.jsonl").read_text().splitlines()]
    assert {"messages", "turns", "end", "sampled_tokens", "fed_tokens"} <= set(rows[0])
    assert any(r["turns"] == 2 and r["messages"][2]["role"] == "tool" for r in rows)


@pytest.mark.parametrize("lora", [[], ["lora.rank=4", "lora.merge=false"]], ids=["full", "lora-unmerged"])
def test_the_builtin_tool_task_in_exact_mode(tmp_path, lora):
    run = tmp_path / "run"
    args = ["model=builtin-agent", "task.name=lookup", "exact=true", *SMALL, *lora, f"run_dir={run}"]
    assert main(["train", *args]) == 0
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = history[-1]
    assert last["mismatch/exact_tokens_frac"] == 1.0 and last["mismatch/k3_turn0"] == 0.0
    assert last["episode/turns_mean"] > 1.5 and last["episode/tool_calls_mean"] > 0.9
    assert 0 <= last["retokenization/episodes_frac"] <= 1 and "time/environment" in last
    assert 40 <= last["response/length_mean"] <= 60  # the model's own tokens (the call, the answer)
    assert "reward/accuracy" in last
    assert 0 <= last["eval/accuracy"] <= 1 and last["eval/prompts"] == 32  # held-out episodes, after the last step
    if lora:
        return
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    assert "tool lookup:" in (tmp_path / "report" / "report.md").read_text()


def test_parity_eval_answers_in_episodes_as_the_runs_own_evaluation_did(tmp_path, capsys):
    """`parity eval RUN` on a run of episodes: every state answers held-out episodes in each serving precision
    and under the trainer's policy; the last checkpoint's figures are the run's own held-out evaluation of that
    step, to the bit (the same weights, problems, environments and random numbers), and `parity eval
    builtin-agent task=lookup` is its base state. Their episodes' budget (64) is below a turn's limit (96): a
    turn takes at most the budget."""
    run, out = tmp_path / "run", tmp_path / "eval"
    held = [
        "eval.every=0",
        "eval.num_prompts=8",
        "eval.samples=2",
        "eval.precisions=[bf16,fp16]",
        "eval.max_new_tokens=64",
    ]
    small = [a for a in SMALL if not a.startswith("checkpoint_every")]
    args = ["model=builtin-agent", "task.name=lookup", *small, "checkpoint_every=2", *held, f"run_dir={run}"]
    assert main(["train", *args]) == 0
    own = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    keys = ["num_prompts=8", "samples=2", "precisions=[bf16,fp16]", "max_new_tokens=64", f"out={out}"]
    assert main(["eval", str(run), *keys]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert [s["name"] for s in result["states"]] == ["base", "step_000002"]
    assert result["turn_tokens"] == 64 and "each model turn at most 64" in (out / "eval.md").read_text()
    last = result["states"][-1]["metrics"]
    compared = ("eval/bf16/", "eval/fp16/", "eval/trainer/", "deploy/")
    assert {k: v for k, v in own.items() if k.startswith(compared)} == {
        k: v for k, v in last.items() if k.startswith(compared)
    }
    assert last["eval/trainer/mean_length"] > 30  # a tool call and an answer: the model's own tokens
    # The base model as a model target of the task answers the same episodes: the run's base state, to the bit.
    keys = [*keys[:-1], "task=lookup", "reference=fp16", f"out={tmp_path / 'base'}"]
    assert main(["eval", "builtin-agent", *keys]) == 0
    base = json.loads((tmp_path / "base" / "eval.json").read_text())["states"]
    assert base[0]["metrics"] == result["states"][0]["metrics"]
    # A run answers with its own episode.* settings, as with its own tools
    capsys.readouterr()
    assert main(["eval", str(run), "episode.max_turns=2", f"out={tmp_path / 'turns'}"]) == 2
    own_turns = "parity eval: error: episode.max_turns=2: for a model; a run directory answers with its own episode.*\n"
    assert capsys.readouterr().err == own_turns and not (tmp_path / "turns").exists()
    # perfectible samples one turn per problem: a task of episodes is refused in one line
    assert main(["perfectible", "model=builtin-agent", "task=lookup", f"out={tmp_path / 'p.jsonl'}"]) == 2
    assert not (tmp_path / "p.jsonl").exists()


def test_an_environments_own_rewards_score_its_evaluation(tmp_path):
    """Without reward functions, an environment's own rewards score its episodes: in training, and in the
    held-out evaluation `evaluate()` runs (whole episodes in the environment, as `parity eval` answers)."""
    page: dict = {}
    exec(_blocks()[1], page)  # the page's HiddenTable (its __main__ part does not run)
    rng = random.Random(0)
    rows = []
    for _ in range(8):
        table = dict(zip(page["KEYS"], map(str, rng.sample(range(100, 1000), len(page["KEYS"])))))
        key = rng.choice(page["KEYS"])
        rows.append(
            {"prompt": f"{key}?", "table": ",".join(f"{k}={v}" for k, v in table.items()), "answer": table[key]}
        )
    environment = page["HiddenTable"]
    trainer = parity.Trainer(
        "builtin-agent", rows, environment=environment, run_dir=tmp_path / "r", progress=False, steps=1, **EVAL
    )
    result = trainer.train()
    metrics = trainer.evaluate(rows[:4])
    assert "reward/environment/mean" in result.history[-1] and 0 <= metrics["eval/trainer/reward/environment/mean"] <= 1
    assert metrics["eval/trainer/mean_length"] > 30  # a call and an answer, in the environment
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows[:4]))
    keys = dict(data=str(data), precisions=["bf16"], samples=1, progress=False)
    offline = parity.evaluate(tmp_path / "r", environment=environment, **keys)  # parity eval, from Python
    assert [s["name"] for s in offline["states"]] == ["base", "step_000001"]
    assert "eval/trainer/reward/environment/mean" in offline["states"][-1]["metrics"]
    with pytest.raises(ConfigError, match="^tools: expected a list of functions, got"):
        parity.evaluate(tmp_path / "r", tools=3, **keys)


def test_rewards_see_the_episode_and_a_resume_needs_trust(tmp_path, capsys):
    seen = {}

    def lookup(key: str) -> str:
        """The value under a key."""
        return "<|im_end|><tool_call>{}</tool_call>" if key == "a" else "427"

    def graded(completions, answer, messages, **columns):
        seen["messages"] = messages[0]
        return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]

    rows = [{"prompt": [{"role": "user", "content": f"{k}?"}], "answer": 427} for k in "abcd"]
    result = parity.train(
        "builtin-agent",
        rows,
        [graded],
        tools=[lookup],
        run_dir=tmp_path / "r",
        progress=False,
        steps=1,
        prompts_per_step=4,
        rollout__group_size=2,
        checkpoint_every=0,
    )
    first = seen["messages"]  # the first episode's whole conversation
    assert first[0]["role"] == "user" and any(m["role"] == "tool" for m in first)
    assert result.history[-1]["episode/tool_calls_mean"] > 0.9
    assert main(["train", "--resume", str(tmp_path / "r"), "steps=2"]) == 2
    assert re.search(r"task\.tools=.*--trust-reward-fn", capsys.readouterr().err)
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["eval", str(tmp_path / "r"), f"data={data}", f"out={tmp_path / 'e'}"]) == 2
    assert re.search(r"the run's episodes call task\.tools=.*confirm with --trust-reward-fn", capsys.readouterr().err)
    # The API evaluates in episodes too, with the tools it was given: the base model, then the trained one.
    trainer = parity.Trainer(
        "builtin-agent", rows, [graded], tools=[lookup], run_dir=tmp_path / "t", progress=False, steps=1, **EVAL
    )
    for trained in (False, True):
        if trained:
            trainer.train()
        seen.clear()
        metrics = trainer.evaluate(rows)
        assert seen["messages"][2]["role"] == "tool" and 0 <= metrics["eval/trainer/reward_mean"] <= 1
    with pytest.raises(ConfigError, match="tools and environment: give one"):
        parity.train("builtin-agent", rows, tools=[lookup], environment=dict, steps=1)
    with pytest.raises(ConfigError, match="episodes are conversations, rendered by the model's chat template"):
        parity.train("builtin", [{"prompt": "1+2=", "answer": 3}], tools=[lookup], steps=1, run_dir=tmp_path / "x")


class _NoTable:
    def reset(self, row):
        raise KeyError("table")

    def step(self, action):
        return parity.Step(done=True)


class _NoStep:
    def reset(self, row):
        return "hi"


def test_an_environment_that_cannot_start_leaves_no_run_and_one_without_step_is_refused_up_front(tmp_path):
    """An environment that fails as it is reset stops the run before it trains, in one line, and the run
    directory goes with it (it was left holding config.yaml, so the run could not be made again); a class
    with no step() is refused before anything is loaded or written."""
    rows = [{"prompt": [{"role": "user", "content": f"{k}?"}], "answer": 1} for k in "ab"]
    small = dict(steps=1, prompts_per_step=2, rollout__group_size=2, progress=False)
    with pytest.raises(ConfigError, match=r"^environment: _NoTable failed as it was made or reset: KeyError"):
        parity.train("builtin-agent", rows, environment=_NoTable, run_dir=tmp_path / "r", **small)
    assert not (tmp_path / "r").exists()
    with pytest.raises(ConfigError, match=r"^environment: _NoStep has no method step\(\)"):
        parity.train("builtin-agent", rows, environment=_NoStep, run_dir=tmp_path / "s", **small)
    assert not (tmp_path / "s").exists()


def test_parity_evaluate_answers_a_model_in_episodes_with_the_tools_or_environment_it_is_given(tmp_path):
    """`parity.evaluate(MODEL, tools=...)` scored one-turn answers and never called the tool; an environment
    given was not made."""
    calls = []

    def lookup(key: str) -> str:
        """The value under a key."""
        calls.append(key)
        return "427"

    def graded(completions, answer, **columns):
        return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]

    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": [{"role": "user", "content": f"{k}?"}], "answer": 427}) + "\n" for k in "abcd")
    )
    keys = dict(data=str(data), precisions=["fp32"], num_prompts=2, samples=2, progress=False)
    out = parity.evaluate("builtin-agent", [graded], tools=[lookup], **keys)
    assert calls and out["turn_tokens"] and out["states"][0]["metrics"]["eval/fp32/reward/graded/mean"] == 1.0
    with pytest.raises(ConfigError, match=r"^environment: _NoTable failed as it was made or reset"):
        parity.evaluate("builtin-agent", [graded], environment=_NoTable, **keys)
    with pytest.raises(ConfigError, match=r"^tools and environment: give one"):
        parity.evaluate("builtin-agent", [graded], tools=[lookup], environment=_NoTable, **keys)


def _agent_code(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A file of a tool (`lookup`, which records its calls in the calls file) and reward functions (`graded`;
    `turns`: an episode's model turns), a data file of 4 lookups, and the calls file."""
    code, data, calls = tmp_path / "agent_code.py", tmp_path / "d.jsonl", tmp_path / "calls.txt"
    code.write_text(
        "def lookup(key: str) -> str:\n"
        '    """The value under a key."""\n'
        f"    open({str(calls)!r}, 'a').write(key + '\\n')\n"
        "    return '427'\n\n"
        "def graded(completions, answer, **columns):\n"
        "    return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]\n\n"
        "def turns(completions, messages, **columns):\n"
        "    return [sum(m['role'] == 'assistant' for m in ms) for ms in messages]\n"
    )
    data.write_text(
        "".join(json.dumps({"prompt": [{"role": "user", "content": f"{k}?"}], "answer": 427}) + "\n" for k in "abcd")
    )
    return code, data, calls


def test_parity_eval_answers_a_model_in_episodes_with_the_tools_named_on_the_command_line(tmp_path, capsys):
    """`parity eval MODEL` took no tools: a model could be evaluated with tools from Python only. `tools=` and
    `environment=` name them as `parity train`'s task.tools and task.environment do; a run directory keeps its
    own, and a bad spec is named by the key given."""
    code, data, calls = _agent_code(tmp_path)
    keys = [f"data={data}", "precisions=[fp32]", "num_prompts=2", "samples=2", f"reward_fn={code}:graded"]
    assert main(["eval", "builtin-agent", f"tools={code}:lookup", *keys, f"out={tmp_path / 'e'}"]) == 0
    result = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert calls.read_text() and result["turn_tokens"]
    assert result["states"][0]["metrics"]["eval/fp32/reward/graded/mean"] == 1.0
    capsys.readouterr()
    assert main(["eval", "builtin-agent", f"tools={code}:nope", *keys, f"out={tmp_path / 'f'}"]) == 2
    assert capsys.readouterr().err.endswith(f"error: tools: module {str(code)!r} has no function 'nope'\n")
    assert not (tmp_path / "f").exists()
    spec = f"environment={code}:lookup"
    assert main(["eval", "builtin-agent", f"tools={code}:lookup", spec, *keys, f"out={tmp_path / 'f'}"]) == 2
    assert "error: tools and environment: give one" in capsys.readouterr().err


def test_parity_eval_answers_a_model_s_episodes_within_the_episode_keys_given(tmp_path, capsys):
    """`parity eval MODEL tools=` and `parity.evaluate(MODEL, tools=)` took no episode.* keys: an agent was
    evaluated in 4 turns of up to max_new_tokens (96) each, whatever it runs with. They are `parity train`'s keys,
    checked by its checks and named as given; an evaluation without episodes refuses them, as a run does."""
    code, data, calls = _agent_code(tmp_path)
    keys = [f"tools={code}:lookup", f"data={data}", "precisions=[fp32]", "num_prompts=2", "samples=2"]
    keys.append(f"reward_fn={code}:turns")

    def evaluate(*episode: str, out: str = "e") -> dict:
        assert main(["eval", "builtin-agent", *keys, *episode, f"out={tmp_path / out}"]) == 0
        result = json.loads((tmp_path / out / "eval.json").read_text())
        return {
            "turn_tokens": result["turn_tokens"],
            "max_turns": result["max_turns"],
            **result["states"][0]["metrics"],
        }

    free = evaluate()  # a tool call (44 tokens), then the answer
    assert (free["turn_tokens"], free["eval/fp32/reward_mean"], free["eval/fp32/mean_length"]) == (96, 2.0, 48.0)
    assert free["max_turns"] == 4
    assert calls.read_text()
    calls.unlink()
    one = evaluate("episode.max_turns=1", out="one")  # the call is made, and not run: no turn would read it
    assert (one["turn_tokens"], one["eval/fp32/reward_mean"], one["eval/fp32/mean_length"]) == (96, 1.0, 44.0)
    assert one["max_turns"] == 1
    cut = evaluate("episode.max_turns=2", "episode.turn_tokens=32", out="cut")  # the call is cut off at 32
    assert (cut["turn_tokens"], cut["eval/fp32/reward_mean"], cut["eval/fp32/mean_length"]) == (32, 1.0, 32.0)
    assert cut["max_turns"] == 2 and not calls.exists()
    assert "(2 model turns at most, each model turn at most 32)" in (tmp_path / "cut" / "eval.md").read_text()
    capsys.readouterr()
    for key, error in (
        ("episode.max_turns=0", "episode.max_turns: must be in [1, 100], got 0"),
        ("episode.turn_tokens=500", "episode.turn_tokens: must be in [1, max_new_tokens=96] (the episode's whole "),
        ("episode.tool_format=xml", "episode.tool_format: unknown value 'xml'; allowed: auto, gemma, hermes, "),
        ("episode.max_turns=two", "episode.max_turns: expected an integer, got 'two'"),
    ):
        assert main(["eval", "builtin-agent", *keys, key, f"out={tmp_path / 'bad'}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"parity eval: error: {error}") and err.count("\n") == 1, err
        assert not (tmp_path / "bad").exists()
    one_turn = [f"data={data}", f"reward_fn={code}:turns", "episode.max_turns=2", f"out={tmp_path / 'bad'}"]
    assert main(["eval", "builtin-agent", *one_turn]) == 2
    assert capsys.readouterr().err == (
        "parity eval: error: episode.max_turns=2: a setting of episodes, and this evaluation has none (tools, "
        "environment or task=lookup)\n"
    )
    assert not (tmp_path / "bad").exists()
    # From Python, as `parity.train` takes them: by name, dots as `__`, or a dict of the section
    lookup, turns = (runpy.run_path(str(code))[name] for name in ("lookup", "turns"))
    given = dict(data=str(data), precisions=["fp32"], num_prompts=2, samples=2, progress=False)
    result = parity.evaluate("builtin-agent", [turns], tools=[lookup], episode__max_turns=1, **given)
    assert result["states"][0]["metrics"]["eval/fp32/reward_mean"] == 1.0 and not calls.exists()
    result = parity.evaluate("builtin-agent", [turns], tools=[lookup], episode={"turn_tokens": 32}, **given)
    assert result["turn_tokens"] == 32 and result["states"][0]["metrics"]["eval/fp32/mean_length"] == 32.0
    with pytest.raises(ConfigError, match=r"^episode.turn_tokens: must be in \[1, max_new_tokens=96\]"):
        parity.evaluate("builtin-agent", [turns], tools=[lookup], episode__turn_tokens=500, **given)


class _ExitsInStep:
    def reset(self, row):
        return "a?"

    def step(self, action):
        raise SystemExit(4)


class _UnrenderableStep:
    def reset(self, row):
        return "a?"

    def step(self, action):  # a message the chat template cannot render: a set is no JSON
        return parity.Step([{"role": "user", "content": "go on", "tool_calls": [{"set": {1, 2}}]}])


@pytest.mark.parametrize("environment", [_ExitsInStep, _UnrenderableStep])
def test_an_environment_step_that_exits_or_cannot_be_rendered_ends_its_episode_not_the_run(tmp_path, environment):
    """SystemExit in step() ended the run with no line, and a message the chat template cannot render stopped
    it blaming the model's template: each now ends its episode, counted as the environment's error."""
    rows = [{"prompt": [{"role": "user", "content": f"{k}?"}], "answer": 1} for k in "ab"]
    result = parity.train(
        "builtin-agent",
        rows,
        environment=environment,
        run_dir=tmp_path / "r",
        steps=1,
        prompts_per_step=2,
        rollout__group_size=2,
        eval__every=-1,
        progress=False,
    )
    assert result.history[-1]["episode/end_environment_error_frac"] == 1.0


def test_an_episode_s_length_is_the_model_s_own_tokens_for_the_rewards_and_the_files(tmp_path):
    """The length task's reward and the completions file counted the tokens fed between turns too (73 for
    48 sampled), unlike `response/length_*`."""

    def lookup(key: str) -> str:
        """The value under a key."""
        return "427 is the value you asked for"

    rows = [{"prompt": [{"role": "user", "content": f"{k}?"}], "answer": 1} for k in "ab"]
    parity.train(
        "builtin-agent",
        rows,
        tools=[lookup],
        task__name="length",
        run_dir=tmp_path / "r",
        steps=1,
        prompts_per_step=2,
        rollout__group_size=2,
        rollout__max_new_tokens=128,
        eval__every=-1,
        progress=False,
    )
    written = [json.loads(x) for x in (tmp_path / "r" / "completions" / "step_000001.jsonl").read_text().splitlines()]
    assert any(row["fed_tokens"] for row in written)
    for row in written:
        assert row["length"] == row["sampled_tokens"] and row["score"] == -row["sampled_tokens"]


class _Verdict:
    def reset(self, row):
        return row["prompt"]

    def step(self, action):
        return parity.Step([{"role": "user", "content": "verdict: seen"}], done=True, reward=1.0)


def test_the_environment_s_last_word_is_recorded_not_fed(tmp_path):
    """`Step(messages, done=True)`: its messages were dropped from the episode; they are the record's last
    messages, which rewards and the completions file read, and the model is fed nothing after its turn."""
    seen = []

    def verdict(completions, messages, **columns):
        seen.extend(m[-1]["content"] for m in messages)
        return [1.0] * len(messages)

    rows = [{"prompt": [{"role": "user", "content": f"{k}?"}], "answer": 1} for k in "ab"]
    small = dict(steps=1, prompts_per_step=2, rollout__group_size=2, eval__every=-1, progress=False)
    parity.train("builtin-agent", rows, [verdict], environment=_Verdict, run_dir=tmp_path / "r", **small)
    assert seen == ["verdict: seen"] * 4
    written = [json.loads(x) for x in (tmp_path / "r" / "completions" / "step_000001.jsonl").read_text().splitlines()]
    for row in written:
        assert row["messages"][-1] == {"role": "user", "content": "verdict: seen"} and row["turns"] == 1
        assert row["end"] == "done" and row["fed_tokens"] == 0


class _FailsLater:
    """Resets 8 times (two steps of 2 prompts × 2), then its table is gone."""

    made = 0

    def reset(self, row):
        _FailsLater.made += 1
        if _FailsLater.made > 8:
            raise KeyError("table")
        return "hi"

    def step(self, assistant):
        return parity.Step(done=True)


def test_an_environment_that_fails_at_a_later_step_keeps_the_steps_before_it(tmp_path):
    """The steps before were lost: no checkpoint (checkpoint_every=10), and a resume started again at step 0."""
    rows = [{"prompt": [{"role": "user", "content": f"{k}?"}], "answer": 1} for k in "ab"]
    small = dict(steps=4, prompts_per_step=2, rollout__group_size=2, progress=False, eval__every=-1)
    with pytest.raises(
        ConfigError, match=r"failed as it was made or reset: .*; the run stopped: the newest checkpoint is step_000002$"
    ):
        parity.train("builtin-agent", rows, environment=_FailsLater, run_dir=tmp_path / "r", **small)
    assert len((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_tool_is_not_run_when_its_answer_could_not_be_fed(tmp_path):
    """At episode.max_turns the tool still ran for every episode (its side effects and up to tool_timeout_s each,
    for an answer no model read)."""
    calls = []

    def lookup(key: str) -> str:
        """The value under a key."""
        calls.append(key)
        return "427"

    rows = [{"prompt": [{"role": "user", "content": f"{k}?"}], "answer": 427} for k in "abcd"]
    small = dict(steps=1, prompts_per_step=4, rollout__group_size=2, progress=False, eval__every=-1)
    result = parity.train(
        "builtin-agent", rows, tools=[lookup], run_dir=tmp_path / "r", episode__max_turns=1, log__completions=0, **small
    )
    assert result.history[-1]["episode/end_max_turns_frac"] > 0 and calls == []


class _Flaky:
    """Every other episode's step raises (a sandbox that went away); the others score 1."""

    made = 0

    def reset(self, row):
        _Flaky.made += 1
        self.broken = _Flaky.made % 2 == 0
        return "hi"

    def step(self, assistant):
        if self.broken:
            raise ConnectionError("sandbox gone")
        return parity.Step(done=True, reward=1.0)


def test_an_episode_its_environment_broke_is_left_out_of_every_reward_statistic(tmp_path):
    """Such an episode trained as a failure of the model's (reward 0, advantage -0.5), then was left out of
    reward/mean but still counted in reward/environment/mean."""
    rows = [{"prompt": [{"role": "user", "content": f"{k}?"}], "answer": 1} for k in "abcd"]
    small = dict(steps=1, prompts_per_step=4, rollout__group_size=2, progress=False, eval__every=-1)
    result = parity.train(
        "builtin-agent", rows, environment=_Flaky, run_dir=tmp_path / "r", log__completions=0, **small
    )
    metrics = result.history[-1]
    assert metrics["reward/unscored_frac"] == 0.5 and metrics["episode/environment_errors"] == 4
    assert metrics["reward/mean"] == metrics["reward/environment/mean"] == 1.0
