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
    err = capsys.readouterr().err
    assert "reward per_sample_none returned None or NaN for every completion of the first batch (2)" in err


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


# ----------------------------------------------------------------------------- what TRL's GRPOTrainer gives too

IDS = Problem("1+1=", "2", {"answer": "2", "completion_ids": [7, 8]})  # as `score_rollouts` makes the items


def trl_arguments(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **kwargs):
    """TRL's reward with every argument its trainer gives: the metric and column it logs come back."""
    log_metric("judge/calls", float(len(completions)))
    log_metric("judge/calls", 0.0)  # logged twice in a step: the mean, as TRL logs it
    log_extra("ids", [len(ids) for ids in completion_ids])
    return [float(trainer_state.global_step + sum(ids)) for ids in completion_ids]


def history_length(completions, trainer_state, **kwargs):
    return [float(len(trainer_state.log_history))] * len(completions)


def test_a_reward_gets_trl_s_completion_ids_trainer_state_and_loggers():
    from parity.rl.callbacks import TrainerState

    rewards = UserRewards(bind_all([Reward(trl_arguments)], ["answer"]), state=lambda: TrainerState(global_step=3))
    out = rewards([(IDS, "ab", 2), (IDS, "cd", 2)])
    assert out.rewards == [18.0, 18.0] and out.errors == 0
    assert out.metrics == {"judge/calls": 1.0} and out.extra == {"ids": [2, 2]}


def test_in_the_worker_too_with_the_state_but_its_history():
    from parity.rl.callbacks import TrainerState

    state = TrainerState(global_step=1, log_history=[{"step": 1}])
    bound = bind_all([Reward(trl_arguments), Reward(history_length)], ["answer"])
    rewards = UserRewards(bound, isolate=True, timeout_s=60, state=lambda: state)
    try:
        out = rewards([(IDS, "ab", 2)])
    finally:
        rewards.close()
    assert out.per_function == {"trl_arguments": [16.0], "history_length": [0.0]}
    assert out.metrics == {"judge/calls": 0.5} and out.extra == {"ids": [2]}


def test_a_per_sample_function_logs_its_samples_value():
    def per_sample(prompt, completion, completion_ids, log_extra, **kw):
        log_extra("first", completion_ids[0])
        return 1

    other = Problem("1+1=", "2", {"answer": "2", "completion_ids": [9]})
    out = _run([Reward(per_sample)], [(IDS, "ab", 2), (other, "c", 1)])
    assert out.extra == {"first": [7, 9]} and out.rewards == [1.0, 1.0]


def test_bools_score_as_numbers_and_nan_is_not_scored_as_in_trl():
    def judged(completions, **kw):
        return [True, False, math.nan]

    out = _run([Reward(judged)], [(TEXT, "a", 1)] * 3)
    assert out.rewards[:2] == [1.0, 0.0] and math.isnan(out.rewards[2]) and out.errors == 0
    with pytest.raises(RewardCheckError, match="failed on every sample: sample 0: ValueError: reward is inf"):
        _run([Reward(lambda completions, **kw: [math.inf])], [(TEXT, "a", 1)])


def test_async_functions_are_awaited_a_per_sample_ones_calls_together():
    import asyncio

    running, most = [0], [0]

    async def judge(prompt, completion, **kw):
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0.01)
        running[0] -= 1
        if completion == "bad":
            raise ValueError("judge down")
        return len(completion)

    async def batched(completions, **kw):
        await asyncio.sleep(0)
        return [2.0] * len(completions)

    out = _run([Reward(judge), Reward(batched)], [(TEXT, "abc", 3), (TEXT, "bad", 3), (TEXT, "de", 2)])
    assert out.per_function == {"judge": [3.0, 0.0, 2.0], "batched": [2.0, 2.0, 2.0]}
    assert out.errors == 1 and "ValueError: judge down" in out.first_error and most[0] == 3


def test_async_in_a_running_event_loop_a_notebooks():
    import asyncio

    async def batched(completions, **kw):
        return [1.0] * len(completions)

    async def in_a_notebook():
        return _run([Reward(batched)], [(TEXT, "a", 1)])

    assert asyncio.run(in_a_notebook()).rewards == [1.0]


def test_columns_trl_keeps_back_and_a_column_that_would_hide_an_argument():
    from parity.rl.reward_fns import reward_columns

    problems = [Problem("p", "2", {"answer": 2, "prompt": "x", "completion": "ref", "completion_ids": [1]})]
    assert reward_columns(problems, episodes=False) == [
        "answer",
        "completion_ids",
        "log_extra",
        "log_metric",
        "trainer_state",
    ]
    for name in ("completions", "prompts", "trainer_state"):
        with pytest.raises(RewardCheckError, match=f"the data's column '{name}' has the name of an argument"):
            reward_columns([Problem("p", "2", {name: 1})], episodes=False)
    with pytest.raises(RewardCheckError, match="column 'messages'"):
        reward_columns([Problem("p", "2", {"messages": 1})], episodes=True)

    def per_sample(prompt, completion, **columns):  # TRL's prompt-completion data: "completion" is not passed
        return float(sorted(columns) == ["answer", "completion_ids", "log_extra", "log_metric", "trainer_state"])

    item = Problem("p", "2", {"answer": 2, "completion": "ref", "completion_ids": [1]})
    assert _run([Reward(per_sample)], [(item, "a", 1)]).rewards == [1.0]


def test_trl_s_reward_models_are_refused_in_one_line_saying_what_to_give(tmp_path):
    import torch

    import parity
    from parity.config import ConfigError

    class Scorer(torch.nn.Module):
        def forward(self, input_ids):
            return input_ids

    with pytest.raises(ConfigError, match=r"^Reward\(fn\): got a torch module, Scorer \(TRL's reward model\)"):
        Reward(Scorer())
    for rewards in ("trl-lib/Qwen2-0.5B-Reward", ["trl-lib/Qwen2-0.5B-Reward"]):
        with pytest.raises(ConfigError, match="a reward model by its name, as TRL takes one, is not taken"):
            parity.train("builtin", [{"prompt": "1+1=", "answer": 2}], rewards, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


class _Scorer:
    def __call__(self, prompts, completions, **kw):
        return [0.0] * len(completions)


def test_rewards_config_yaml_cannot_name_are_warned_of_and_a_class_it_named_is_refused(capsys, tmp_path):
    """A lambda, a nested function, a functools.partial or a callable object trains, but config.yaml cannot
    name it for `--resume` and `parity eval`: said when the run is made; the class such a run recorded is
    refused in one line at the resume (it was `Reward(fn): expected a function, got the class partial`)."""
    import functools

    import parity
    from parity.config import ConfigError
    from parity.rl.reward_fns import config_rewards, found_again
    from parity.rl.train_config import TrainConfig

    assert found_again(trl_length) and not found_again(functools.partial(trl_length))
    assert not found_again(_Scorer()) and not found_again(lambda completions: completions)
    rows = [{"prompt": "1+1=", "answer": 2}]
    parity.Trainer("builtin", rows, [trl_length, functools.partial(trl_length), _Scorer()])
    err = capsys.readouterr().err
    assert "trl_length: a lambda" not in err
    assert "WARNING reward function functools:partial: a lambda, a nested function" in err
    assert f"WARNING reward function {__name__}:_Scorer: a lambda" in err
    cfg = TrainConfig()
    cfg.task.reward_fn = ["functools:partial"]
    with pytest.raises(ConfigError, match=r"^task.reward_fn: functools:partial is a class, not a reward function"):
        config_rewards(cfg)


def _divides_by_zero(completions, **kw):
    return [1 / 0 for _ in completions]


def test_a_function_failing_its_first_batch_shows_its_own_traceback(capsys):
    """The run stops in one line, after the function's traceback from its own code on (it was not shown)."""
    with pytest.raises(RewardCheckError, match="failed on every sample: ZeroDivisionError"):
        _run([Reward(_divides_by_zero)], [(TEXT, "a", 1)])
    err = capsys.readouterr().err
    assert "reward _divides_by_zero: first failure, ZeroDivisionError: division by zero\nTraceback" in err
    assert "in _divides_by_zero" in err and "parity/rl/" not in err


def test_a_function_naming_no_parameter_is_called_as_trl_calls_it():
    """`def f(**kwargs)` (TRL calls by keyword) was refused as a per-sample function; a decorator without
    functools.wraps, `(*args, **kwargs)`, called its TRL function per sample, which failed."""

    def keywords_only(**kwargs):
        return [float(len(c)) for c in kwargs["completions"]]

    def decorated(*args, **kwargs):
        return only_twos(*args, **kwargs)

    out = _run([Reward(keywords_only), Reward(decorated)], [(TEXT, "abc", 3), (TEXT, "hello", 5)])
    assert out.rewards == [4.0, 6.0] and out.errors == 0


@pytest.mark.parametrize(
    "returned, line",
    [
        ({"score": 1.0}, "returned dict {'score': 1.0}, not a list of 2 numbers"),
        (["1.0", "2.0"], "returned str '1.0', not a number"),
        ([math.inf, math.inf], "ValueError: reward is inf"),
    ],
    ids=["dict", "strings", "inf"],
)
def test_what_a_function_returns_that_is_no_reward_is_one_line_without_parity_s_traceback(capsys, returned, line):
    """A string or inf was shown with a traceback through Parity's own frames, as if the function had raised."""

    def gives(completions, **kwargs):
        return returned

    with pytest.raises(RewardCheckError) as raised:
        _run([Reward(gives)], [(TEXT, "a", 1), (TEXT, "b", 1)])
    assert line in str(raised.value)
    assert "Traceback" not in capsys.readouterr().err
