"""Your own task in Python (docs/your-task.md): the API, reward functions in both forms with the data's
columns, their checks, completions in view, schedules, trackers, model cards, evaluation and resume."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import parity
from conftest import TINY
from parity.cli import main
from parity.config import ConfigError
from parity.engines.models.config import ModelError
from parity.engines.models.io import resolve_model_dir
from parity.engines.tokenizer import load_tokenizer
from parity.engines.trainer import scheduled_lr
from parity.rl.callbacks import CallbackError
from parity.rl.data import DataError
from parity.rl.reward_fns import RewardCheckError

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(steps=1, prompts_per_step=4, rollout__group_size=4, rollout__max_new_tokens=40, tensorboard=False)
CLI_SMALL = [*TINY, "rollout.max_new_tokens=40"]
ROWS = [{"prompt": f"{a}+{b}=", "answer": a + b, "level": a % 3} for a in range(100, 140) for b in range(10, 13)]


def _rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batched_and_per_sample_rewards_get_typed_columns_weights_and_metrics(tmp_path):
    seen = {}

    def correct(prompts, completions, answer, level):
        seen.update(answer=answer, level=level, prompts=prompts)
        return [1.0 if c.rsplit(">", 1)[-1].strip() == str(a) else 0.0 for c, a in zip(completions, answer)]

    def short(prompt, completion, **columns):
        seen["columns"] = sorted(columns)
        return -len(completion) / 100

    result = parity.train(
        "builtin", ROWS, [correct, parity.Reward(short, weight=0.5)], run_dir=tmp_path / "r", progress=False, **SMALL
    )  # no eval: the rows hold no held-out split, and none is generated for your rewards
    assert all(type(a) is int for a in seen["answer"]) and all(type(v) is int for v in seen["level"])
    assert len(seen["prompts"]) == 16  # **columns: the data's, and what TRL gives besides them
    assert seen["columns"] == ["answer", "completion_ids", "level", "log_extra", "log_metric", "trainer_state"]
    metrics = result.history[-1]
    for name in ("correct", "short"):
        assert f"reward/{name}/mean" in metrics and f"reward/{name}/std" in metrics
    assert "reward/accuracy" not in metrics  # the sum of your rewards is no accuracy
    rows = _rows_of(tmp_path / "r" / "completions" / "step_000001.jsonl")
    assert len(rows) == 16
    for row in rows:
        assert row["score"] == pytest.approx(row["reward/correct"] + 0.5 * row["reward/short"])
        assert row["reward"] == pytest.approx(0 if row["truncated"] else row["score"])  # truncated=zero_reward
    assert metrics["reward/short/mean"] == pytest.approx(sum(r["reward/short"] for r in rows) / 16)
    # config.yaml records the functions by where they are defined, with their weights
    saved = (tmp_path / "r" / "config.yaml").read_text()
    assert f"{__name__}:test_batched_and_per_sample_rewards_get_typed_columns_weights_and_metrics" in saved
    assert "- 0.5" in saved and str((tmp_path / "r" / "data" / "train.jsonl").resolve()) in saved


def test_a_reward_asking_for_a_missing_column_is_refused_before_anything_is_written(tmp_path):
    def grade(completions, solution):
        return [0.0] * len(completions)

    with pytest.raises(ConfigError, match=r"^reward grade: parameter 'solution' is not a column of the data \(it has"):
        parity.train("builtin", ROWS, [grade], run_dir=tmp_path / "r", progress=False, **SMALL)
    assert not (tmp_path / "r").exists()


def test_a_batched_reward_of_the_wrong_length_stops_the_cli_before_training(tmp_path, capsys):
    (tmp_path / "bad_reward.py").write_text("def score(prompts, completions, **kw):\n    return [1.0]\n")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    argv = ["train", f"run_dir={tmp_path / 'r'}", f"task.data={data}", f"task.reward_fn={tmp_path}/bad_reward.py:score"]
    assert main([*argv, *CLI_SMALL, "steps=2"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "parity train: error: reward score (batched) on the first batch of 16 completions: returned 1 values for 16 "
        "completions; it must return a list of one number per completion; nothing was trained"
    )
    assert not (tmp_path / "r").exists()


def test_a_reward_returning_text_is_named(tmp_path):
    def label(prompt, completion):
        return "good"

    with pytest.raises(RewardCheckError, match=r"^reward label \(per-sample\) .*: sample 0: returned str 'good'"):
        parity.train("builtin", ROWS, [label], run_dir=tmp_path / "r", progress=False, **SMALL)


def test_column_mapping_for_the_prompt_and_the_builtin_rewards_answer(tmp_path, capsys):
    rows = [{"question": r["prompt"], "solution": r["answer"]} for r in ROWS]
    result = parity.train(
        "builtin",
        rows,
        run_dir=tmp_path / "r",
        progress=False,
        task__prompt_column="question",
        task__answer_column="solution",
        **SMALL,
    )
    assert "reward/accuracy" in result.history[-1]  # the built-in reward compared with `solution`
    # Without the mapping: the key to set and the columns there are, naming the row given, not Parity's copy of it
    line = (
        "train dataset row 0: no prompt column 'prompt' (task.prompt_column=prompt; the row has 'question', "
        "'solution'): set task.prompt_column to the column that holds the prompt"
    )
    with pytest.raises(DataError, match=f"^{re.escape(line)}$"):
        parity.train("builtin", rows, run_dir=tmp_path / "r2", progress=False, **SMALL)
    assert not (tmp_path / "r2").exists()
    with pytest.raises(DataError, match=r"^eval dataset row 0: no prompt column 'prompt' \(task.prompt_column="):
        parity.train("builtin", ROWS, eval_dataset=rows, run_dir=tmp_path / "r3", progress=False, **SMALL)
    # the same from the command line, on a JSONL file: one line, exit 2, nothing written
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    capsys.readouterr()
    assert main(["train", f"task.data={data}", f"run_dir={tmp_path / 'r4'}", *CLI_SMALL]) == 2
    err = capsys.readouterr().err
    assert err == f"parity train: error: {data}:1: {line.split(': ', 1)[1]}\n" and not (tmp_path / "r4").exists()


def test_the_parity_script_imports_a_reward_module_from_the_working_directory(tmp_path):
    (tmp_path / "myreward.py").write_text(
        "def score(prompt, completion, answer):\n    return float(len(completion) % 2)\n"
    )
    script = Path(sys.executable).parent / "parity"
    args = [str(script), "train", "run_dir=r", "steps=1", "task.reward_fn=myreward:score", "log.completions=0"]
    done = subprocess.run([*args, *CLI_SMALL], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "reward/score/mean" in (tmp_path / "r" / "metrics.jsonl").read_text()


def test_completions_table_printed_and_off(tmp_path, capfd):
    parity.train("builtin", None, run_dir=tmp_path / "a", progress=False, log__completions=3, **SMALL)
    out = capfd.readouterr()
    table = [line for line in (out.out + out.err).splitlines() if line.startswith("| ")]
    assert table[0] == "| prompt | completion | length | reward | advantage | score |" and len(table) == 1 + 3
    parity.train("builtin", None, run_dir=tmp_path / "b", progress=False, log__completions=0, **SMALL)
    out = capfd.readouterr()
    assert "| prompt |" not in out.out + out.err
    assert (tmp_path / "b" / "completions" / "step_000001.jsonl").is_file()  # written either way


def test_learning_rate_schedules():
    assert [scheduled_lr(1.0, "constant", 2, s, 6) for s in range(6)] == [0, 0.5, 1, 1, 1, 1]
    assert [scheduled_lr(1.0, "linear", 0, s, 4) for s in range(4)] == [1, 0.75, 0.5, 0.25]
    cosine = [scheduled_lr(1.0, "cosine", 1, s, 5) for s in range(5)]
    assert cosine[:2] == [0.0, 1.0] and cosine[2] == pytest.approx(0.5 + 0.5 * 0.7071067811865476)
    assert all(a > b for a, b in zip(cosine[1:], cosine[2:])) and cosine[-1] > 0


def test_the_schedule_reaches_the_optimizer(tmp_path):
    keys = {**SMALL, "steps": 3, "checkpoint_every": -1, "eval__every": -1}
    result = parity.train(
        "builtin", None, run_dir=tmp_path / "r", progress=False, trainer__lr_schedule="linear", **keys
    )
    assert [m["trainer/lr"] for m in result.history] == pytest.approx([2e-4, 2e-4 * 2 / 3, 2e-4 / 3])


def test_callbacks_see_steps_and_evaluations_and_can_stop(tmp_path):
    class Stop(parity.Callback):
        def __init__(self):
            self.steps, self.evals = [], []

        def on_step_end(self, step, metrics):
            self.steps.append(step)
            return step == 2

        def on_eval(self, step, metrics):
            self.evals.append((step, "eval/accuracy" in metrics))

    stop = Stop()
    keys = {**SMALL, "steps": 5, "eval__every": 1, "eval__num_prompts": 2, "eval__samples": 2}
    result = parity.train("builtin", None, callbacks=[stop], run_dir=tmp_path / "r", progress=False, **keys)
    assert stop.steps == [1, 2] and stop.evals == [(1, True), (2, True)]
    assert result.model_dir == tmp_path / "r" / "checkpoints" / "step_000002" / "model"


# ----------------------------------------------------------------------------- misuse of the API


def _any_value(tmp_path: Path) -> dict[str, object]:
    """One value of every kind a caller may pass by mistake, made fresh (the generator is used up once read)."""

    class Plain:
        pass

    class Unprintable:
        def __repr__(self):
            raise RuntimeError("no repr")

    return {
        "None": None,
        "bool": True,
        "int": 5,
        "float": 0.5,
        "nan": float("nan"),
        "str": "text",
        "bytes": b"text",
        "Path": tmp_path / "somewhere",
        "list": [1],
        "tuple": (1,),
        "set": {1},
        "dict": {"a": 1},
        "generator": (i for i in range(2)),
        "object": Plain(),
        "unprintable": Unprintable(),
        "class": Plain,
        "function": lambda *args, **kwargs: None,
        "ndarray": np.zeros((40, 40)),  # a repr of many lines; its truth value raises
        "np.float32": np.float32(0.5),
    }


# For each argument, the kinds of value it takes (whose contents are then checked as they are used); every
# other kind is refused with one line that starts with the argument's name.
TRAIN_TAKES = {
    "model": {"str", "Path"},
    "dataset": {"None", "str", "Path", "list", "tuple", "set", "ndarray"},  # rows, checked as written
    "eval_dataset": {"None", "str", "Path", "list", "tuple", "set", "ndarray"},
    "rewards": {"None", "function"},
    "config": {"None", "str", "Path", "dict"},  # a dict of keys, checked key by key
    "callbacks": {"None"},
    "resume": {"None", "str", "Path"},
    "progress": {"bool"},
}


def _refused(function, args: dict[str, object], argument: str) -> None:
    """`function(**args)` raises a ConfigError of one line that starts with the argument's name."""
    with pytest.raises(ConfigError) as e:
        function(**args)
    line = str(e.value)
    assert re.match(rf"{re.escape(argument)}(\[\d+\])?: ", line), f"{argument}={type(args[argument])}: {line}"
    assert "\n" not in line and len(line) < 300, line


@pytest.mark.parametrize("argument", sorted(TRAIN_TAKES))
def test_every_argument_of_train_of_a_kind_it_does_not_take_is_one_line_before_anything_is_written(tmp_path, argument):
    for kind in sorted(set(_any_value(tmp_path)) - TRAIN_TAKES[argument]):
        args = {"run_dir": tmp_path / "r", "progress": False, **SMALL, argument: _any_value(tmp_path)[kind]}
        _refused(parity.train, args, argument)
        assert not (tmp_path / "r").exists() and not (tmp_path / "somewhere").exists()


def test_misused_train_keys_and_configs_are_one_line(tmp_path):
    run = tmp_path / "r"
    cases = [
        (dict(nonsense=1), r"^unknown config key nonsense; allowed keys here: "),
        (dict(num_generations=4), r"^unknown config key num_generations; did you mean rollout.group_size \(TRL's"),
        (dict(rollout__group_sise=4), r"^unknown config key rollout.group_sise; did you mean rollout.group_size\?$"),
        (dict(config={1: 2}), r"^config: a key is int 1; keys are names"),
        (dict(config={"trainer": 5}), r"^trainer: expected a mapping of trainer.\* keys, got 5$"),
        (dict(trainer__lr=np.ones(3)), r"^trainer.lr: expected a number, got array\(\[1., 1., 1.\]\)$"),
        (dict(resume=run, model="elsewhere"), r"^resume: a resumed run keeps its model, config and data"),
        (dict(dataset={"train": ROWS}), r"^dataset: a mapping \(train\); pass one split"),
        (dict(callbacks=[parity.Callback]), r"^callbacks\[0\]: the class Callback, not a callback; pass an instance"),
    ]
    for given, message in cases:
        with pytest.raises(ConfigError, match=message):
            parity.train(**{"run_dir": run, "progress": False, **SMALL, **given})
        assert not run.exists()


def test_callbacks_of_the_wrong_shape_are_refused_before_the_run_starts(tmp_path):
    class NoHooks:
        def on_step(self, step, metrics):
            pass

    class NotAMethod:
        on_step_end = 3

    class NoArguments(parity.Callback):
        def on_step_end(self):
            pass

    class OneArgument:
        def on_eval(self, metrics):
            pass

    cases = [
        (NoHooks(), r"^callbacks: expected a callback \(an object with on_step_end or on_eval, or transformers' "
                    r"TrainerCallback events\) or a list of them, got NoHooks object$"),
        ([NoHooks()], r"^callbacks\[0\]: NoHooks object has neither on_step_end\(step, metrics\) nor on_eval"),
        (NotAMethod(), r"^callbacks\[0\]: NotAMethod.on_step_end is int 3, not a method$"),
        (NoArguments(), r"^callbacks\[0\]: NoArguments.on_step_end\(\) cannot be called as on_step_end\(step, "),
        ([parity.Callback(), OneArgument()], r"^callbacks\[1\]: OneArgument.on_eval\(metrics\) cannot be called as"),
    ]  # fmt: skip
    for callbacks, message in cases:
        with pytest.raises(ConfigError, match=message):
            parity.train(callbacks=callbacks, run_dir=tmp_path / "r", progress=False, **SMALL)
        assert not (tmp_path / "r").exists()


EVALUATE_TAKES = {"target": {"str", "Path"}, "rewards": TRAIN_TAKES["rewards"], "out": {"None", "str", "Path"}}
EVALUATE_TAKES["progress"] = {"bool"}
PUSH_TAKES = {"model_dir": {"str", "Path"}, "repo_id": {"str"}, "token": {"None", "str"}, "private": {"bool"}}
REWARD_TAKES = {"fn": {"function"}, "weight": {"int", "float", "np.float32"}, "name": {"None", "str"}}
REWARD_TAKES["batched"] = {"None", "bool"}


@pytest.mark.parametrize("argument", sorted(EVALUATE_TAKES))
def test_every_argument_of_evaluate_of_a_kind_it_does_not_take_is_one_line_before_it_runs(tmp_path, argument):
    for kind in sorted(set(_any_value(tmp_path)) - EVALUATE_TAKES[argument]):
        args = {"target": "builtin", "out": tmp_path / "e", "progress": False, argument: _any_value(tmp_path)[kind]}
        _refused(parity.evaluate, args, argument)
        assert not (tmp_path / "e").exists()
    (tmp_path / "e").write_text("a file")
    with pytest.raises(ConfigError, match=r"^out .*/e: a file, not a folder$"):
        parity.evaluate("builtin", out=tmp_path / "e", progress=False)  # before the evaluation, not after


@pytest.mark.parametrize("argument", sorted(PUSH_TAKES))
def test_every_argument_of_push_to_hub_of_a_kind_it_does_not_take_is_one_line(tmp_path, argument):
    for kind in sorted(set(_any_value(tmp_path)) - PUSH_TAKES[argument]):
        args = {
            "model_dir": tmp_path,
            "repo_id": "me/my-model",
            "token": "x",
            "private": True,
            argument: _any_value(tmp_path)[kind],
        }
        _refused(parity.push_to_hub, args, argument)


@pytest.mark.parametrize("argument", sorted(REWARD_TAKES))
def test_every_argument_of_reward_of_a_kind_it_does_not_take_is_one_line(tmp_path, argument):
    def score(completions, **columns):
        return [0.0] * len(completions)

    for kind in sorted(set(_any_value(tmp_path)) - REWARD_TAKES[argument]):
        with pytest.raises(ConfigError) as e:
            parity.Reward(**{"fn": score, argument: _any_value(tmp_path)[kind]})
        line = str(e.value)
        assert line.startswith(f"Reward({argument})" if argument == "fn" else f"Reward(score, {argument}=...): ")
        assert "\n" not in line and len(line) < 300, line
    with pytest.raises(ConfigError, match=r"^Reward\(score, weight=...\): expected a finite number, got float inf$"):
        parity.Reward(score, weight=float("inf"))
    assert parity.Reward(score, weight=np.float64(0.5)).weight == 0.5 and parity.Reward(score, weight=2).weight == 2.0


def test_a_single_function_and_a_single_callback_are_taken_as_lists_and_callbacks_get_copies(tmp_path):
    """`rewards=fn` and `callbacks=obj` mean a list of one; NumPy numbers are keys' plain values; a callback
    that mutates the metrics it is given changes nothing that Parity logs or another callback sees."""

    def length(completions, **columns):
        return [len(c) / 10 for c in completions]

    class Vandal(parity.Callback):
        def on_step_end(self, step, metrics):
            metrics.clear()
            metrics["step"] = "mine"
            return torch.tensor(False)  # a torch bool answers as a bool does

    class Recorder(parity.Callback):
        def __init__(self):
            self.seen = []

        def on_step_end(self, step, metrics):
            self.seen.append(dict(metrics))
            return np.bool_(False)  # a comparison's NumPy bool answers as a bool does

    recorder = Recorder()
    result = parity.train(
        "builtin", ROWS, length, callbacks=(Vandal(), recorder), run_dir=tmp_path / "r", progress=False,
        **{**SMALL, "steps": np.int64(1), "rollout__group_size": np.int32(4)},
    )  # fmt: skip
    assert recorder.seen == result.history == _rows_of(tmp_path / "r" / "metrics.jsonl")
    assert result.history[0]["step"] == 1 and "reward/length/mean" in result.history[0]

    recorder = Recorder()
    result = parity.train("builtin", None, None, callbacks=recorder, run_dir=tmp_path / "b", progress=False, **SMALL)
    assert "reward/accuracy" in result.history[0] and len(recorder.seen) == 1  # rewards=None: the task's own


@pytest.mark.parametrize("hook", ["on_step_end", "on_eval"])
def test_a_raising_callback_stops_the_run_after_a_checkpoint_and_the_run_resumes(tmp_path, hook):
    class Broken(parity.Callback):
        def on_step_end(self, step, metrics):
            if hook == "on_step_end":
                raise ValueError("no\nthreshold")

        def on_eval(self, step, metrics):
            if hook == "on_eval":
                raise KeyError("eval/accuracy")

    keys = {**SMALL, "steps": 2, "eval__every": 1, "eval__num_prompts": 2, "eval__samples": 2}
    with pytest.raises(CallbackError) as e:
        parity.train("builtin", None, callbacks=[Broken()], run_dir=tmp_path / "r", progress=False, **keys)
    raised = "ValueError: no threshold" if hook == "on_step_end" else "KeyError: 'eval/accuracy'"
    assert str(e.value) == (
        f"step 1: callback Broken.{hook} raised {raised}; the run stopped: the newest checkpoint is step_000001"
    )
    assert isinstance(e.value.__cause__, (ValueError, KeyError))  # the callback's own, with its traceback
    assert [row["step"] for row in _rows_of(tmp_path / "r" / "metrics.jsonl")] == [1]
    result = parity.train(resume=tmp_path / "r", progress=False)
    assert [m["step"] for m in result.history] == [2]


@pytest.mark.parametrize("answer", [np.array([1.0, 2.0]), "stop", 1])
def test_an_answer_that_is_no_yes_or_no_stops_the_run_after_a_checkpoint(tmp_path, answer):
    class Answers(parity.Callback):
        def on_step_end(self, step, metrics):
            return answer

    with pytest.raises(CallbackError) as e:
        parity.train("builtin", None, callbacks=Answers(), run_dir=tmp_path / "r", progress=False, **SMALL)
    assert re.fullmatch(
        r"step 1: callback Answers.on_step_end returned \w+ .+; return True to stop the run, False or None to go on; "
        r"the run stopped: the newest checkpoint is step_000001",
        str(e.value),
    )


def _usage(card: str) -> str:
    """The Python of a model card's usage section."""
    return re.search(r"## Usage\n\n.*?```python\n(.*?)```", card, re.S).group(1)


def test_model_card_is_written_and_transformers_loads_the_model(tmp_path, llama_dir, monkeypatch):
    transformers = pytest.importorskip("transformers")
    rows = [{"prompt": "what is 2 plus 3?", "answer": 5}] * 4
    result = parity.train(
        llama_dir, rows, [lambda completions, **kw: [float(len(c)) for c in completions]], run_dir=tmp_path / "r",
        progress=False, precision="fp32", eval__every=-1, **SMALL,
    )  # fmt: skip
    card = (result.model_dir / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "base_model" not in card and str(llama_dir) not in card and str(tmp_path) not in card  # a local model
    assert "trainer precision fp32" in card and "| reward/<lambda>/mean |" in card and "lr_schedule: constant" in card
    model = transformers.AutoModelForCausalLM.from_pretrained(result.model_dir)
    assert model.config.num_hidden_layers == 2
    # the card's own loading code, run in its folder
    monkeypatch.chdir(result.model_dir)
    loaded: dict = {}
    exec(_usage(card), loaded)
    assert loaded["model"].config.num_hidden_layers == 2 and loaded["model"].dtype == torch.float32
    assert loaded["tokenizer"]("2 plus 3")["input_ids"]


def test_a_model_by_its_hugging_face_id_from_the_local_cache(tmp_path, llama_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--someone--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in llama_dir.iterdir():  # the cache's own layout: snapshot files link to blobs
        shutil.copy(f, repo / "blobs" / f.name)
        (snapshot / f.name).symlink_to(Path("../../blobs") / f.name)
    assert resolve_model_dir("someone/tiny-llama") == snapshot
    result = parity.train("someone/tiny-llama", None, run_dir=tmp_path / "r", progress=False, eval__every=-1, **SMALL)
    from huggingface_hub import ModelCard

    card = (result.model_dir / "README.md").read_text()
    assert ModelCard(card).data.base_model == "someone/tiny-llama" and str(tmp_path) not in card
    with pytest.raises(ModelError, match=r"^model 'someone/absent': no such directory, and not in the local Hugging"):
        resolve_model_dir("someone/absent")
    assert main(["train", "model=someone/absent"]) == 2


def test_push_to_hub_without_a_token_is_one_line(tmp_path, monkeypatch):
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    result = parity.train("builtin", None, run_dir=tmp_path / "r", progress=False, **SMALL)
    with pytest.raises(ConfigError, match=r"^push_to_hub: no token; pass token=\.\.\. or set HF_TOKEN"):
        parity.push_to_hub(result.model_dir, "me/my-model")
    with pytest.raises(ConfigError, match=r"is not a saved model"):
        parity.push_to_hub(tmp_path, "me/my-model", token="x")


@pytest.mark.parametrize("tracker", ["wandb", "mlflow", "trackio"])
def test_trackers_log_offline(tmp_path, monkeypatch, tracker):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # trackio's local store (read at its import)
    if tracker == "trackio" and "trackio" in sys.modules:
        pytest.skip("trackio was imported before this test: its store is fixed at import")
    pytest.importorskip(tracker)
    keys = {**SMALL, "steps": 2, "eval__every": -1}
    parity.train("builtin", None, run_dir=tmp_path / "r", progress=False, log__to=[tracker], **keys)
    if tracker == "wandb":
        assert list((tmp_path / "r" / "wandb").glob("offline-run-*/run-*.wandb"))
    elif tracker == "mlflow":
        assert list((tmp_path / "r" / "mlruns").glob("*/*/metrics/reward.mean"))
    else:
        assert (tmp_path / "trackio" / "parity.db").is_file()


def test_a_wandb_run_resumes_offline_and_says_how_where_wandb_cannot_start(tmp_path, monkeypatch, capsys):
    """A run started with log.to=wandb under WANDB_MODE=offline resumes (W&B's own links in wandb/ are its
    own); resumed in a shell without the offline mode and without an account, it stops in one line saying
    that the run logs to W&B and how to go on, having written nothing; and it resumes without W&B."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # no account: no key, no netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = tmp_path / "r"
    args = [f"run_dir={run}", "steps=1", "log.to=wandb", "eval.every=-1", "log.completions=0", *CLI_SMALL]
    assert main(["train", *args]) == 0
    assert main(["train", "--resume", str(run), "steps=2"]) == 0
    # in a process of its own: W&B keeps the mode of its first run for the life of a process
    monkeypatch.delenv("WANDB_MODE")
    command = [sys.executable, "-m", "parity", "train", "--resume", str(run), "steps=3"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    err = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert err[-1].startswith("parity train: error: log.to: wandb could not start: ") and len(err) == 2  # and a note
    assert err[-1].endswith(
        "; the run logs to W&B (log.to=wandb): set WANDB_MODE=offline to keep its W&B files in the run's wandb/ "
        "without an account or the network (`wandb sync` uploads them later), log in (`wandb login`), or leave W&B "
        "out (log.to=[], which --resume also takes)"
    )
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    assert main(["train", "--resume", str(run), "steps=3", "log.to=[]"]) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3


def test_an_uninstalled_tracker_is_refused(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert main(["train", f"run_dir={tmp_path / 'r'}", "log.to=wandb"]) == 2
    assert capsys.readouterr().err.strip() == (
        "parity train: error: log.to: wandb is not installed (pip install wandb), or leave it out"
    )
    assert not (tmp_path / "r").exists()


def test_resume_from_another_folder_with_a_moved_data_file(tmp_path, monkeypatch, capsys):
    """A moved file is given again by task.data (the refusal says so); a file of other problems is refused
    (the run's data position counted in the first: it went on through another file's rows)."""
    origin, elsewhere = tmp_path / "origin", tmp_path / "elsewhere"
    origin.mkdir(), elsewhere.mkdir()
    (origin / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    monkeypatch.chdir(origin)
    assert main(["train", "run_dir=r", "task.data=train.jsonl", "steps=1", *CLI_SMALL]) == 0
    assert f"data: {origin / 'train.jsonl'}" in (origin / "r" / "config.yaml").read_text()
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--resume", str(origin / "r"), "steps=2"]) == 0
    shutil.move(origin / "train.jsonl", elsewhere / "moved.jsonl")
    capsys.readouterr()
    assert main(["train", "--resume", str(origin / "r"), "steps=3"]) == 2  # the data is gone: one line
    assert capsys.readouterr().err.splitlines()[-1].endswith("if the run's data moved, give its place: task.data=PATH")
    (elsewhere / "other.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:40]))
    config = (origin / "r" / "config.yaml").read_text()
    assert main(["train", "--resume", str(origin / "r"), "steps=3", "task.data=other.jsonl"]) == 2
    assert "not the problems the run trained on (its step 2 checkpoint records others)" in capsys.readouterr().err
    assert (origin / "r" / "config.yaml").read_text() == config
    assert main(["train", "--resume", str(origin / "r"), "steps=3", "task.data=moved.jsonl"]) == 0
    assert f"data: {elsewhere / 'moved.jsonl'}" in (origin / "r" / "config.yaml").read_text()
    steps = [json.loads(x)["step"] for x in (origin / "r" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_parity_eval_on_a_custom_reward_run_with_its_eval_data(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scores.py").write_text(
        "def closeness(completions, answer, **kw):\n"
        "    return [1.0 if c.rsplit('>', 1)[-1].strip() == str(a) else 0.0 for c, a in zip(completions, answer)]\n"
    )
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:60]))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[60:]))
    keys = ["run_dir=r", "task.data=train.jsonl", "eval.data=test.jsonl", "task.reward_fn=scores:closeness"]
    assert main(["train", *keys, "steps=1", *CLI_SMALL]) == 0
    capsys.readouterr()
    args = ["eval", "r", "precisions=fp32", "num_prompts=4", "samples=2", "--out", "e"]
    assert main(args) == 2
    assert "confirm with --trust-reward-fn" in capsys.readouterr().err
    assert main([*args, "--trust-reward-fn"]) == 0
    result = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert result["data"] == str(tmp_path / "test.jsonl") and result["task"] == "reward functions: closeness"
    assert [s["name"] for s in result["states"]] == ["base", "step_000001"]
    assert f"({tmp_path / 'test.jsonl'})" in (tmp_path / "e" / "eval.md").read_text()


def test_parity_eval_on_a_lora_adapter_folder(tmp_path, llama_dir):
    rows = [{"prompt": f"what is {a} plus 2?", "answer": a + 2} for a in range(8)]
    result = parity.train(
        llama_dir, rows, run_dir=tmp_path / "r", progress=False, precision="fp32", lora__rank=4, task__name="exact",
        eval__every=-1, **SMALL,
    )  # fmt: skip
    assert result.model_dir.name == "adapter" and (result.model_dir / "README.md").is_file()
    # the card's PEFT loading code, on its base (a local one: the card names none), run in the adapter's folder
    card = (result.model_dir / "README.md").read_text()
    assert "base_model" not in card and "library_name: peft" in card
    pytest.importorskip("peft")
    here = Path.cwd()
    os.chdir(result.model_dir)
    try:
        loaded: dict = {}
        exec(_usage(card).replace('"BASE_MODEL"', repr(str(llama_dir))), loaded)
    finally:
        os.chdir(here)
    assert type(loaded["model"]).__name__ == "PeftModelForCausalLM" and loaded["model"].peft_config["default"].r == 4
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = parity.evaluate(
        result.model_dir, task="exact", data=str(data), precisions=["fp32"], samples=2, progress=False
    )
    assert out["adapter"] == str(result.model_dir) and [s["name"] for s in out["states"]] == ["base", "adapter"]


# ----------------------------------------------------------------------------- rewards that run a model


@pytest.mark.slow
@pytest.mark.parametrize("isolate", ["auto", "always"])
def test_a_judge_model_reward(tmp_path, monkeypatch, isolate):
    """The trial's judge: a torch model loaded at import scores each completion; in this process by
    default, and in a spawned worker with reward.isolate=always (a forked one hung in the forward)."""
    (tmp_path / "judge_reward.py").write_text(
        "import torch\n\n"
        "torch.manual_seed(0)\n"
        "judge = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))\n\n\n"
        "@torch.no_grad()\n"
        "def judged(completions, **columns):\n"
        "    counts = [torch.bincount(torch.tensor(list(c.encode()) or [0]), minlength=256) for c in completions]\n"
        "    return judge(torch.stack(counts).float()).squeeze(-1).tolist()\n"
    )
    monkeypatch.chdir(tmp_path)
    keys = ["run_dir=r", "steps=2", "task.reward_fn=judge_reward:judged", f"reward.isolate={isolate}", "eval.every=-1"]
    assert main(["train", *keys, "reward.timeout_s=120", *CLI_SMALL]) == 0
    metrics = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["reward/errors"] == 0 and m["reward/timeouts"] == 0 for m in metrics)
    assert len({m["reward/judged/mean"] for m in metrics}) == 2  # real, varying scores


# ----------------------------------------------------------------------------- the docs page, as written


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


@pytest.mark.slow
def test_the_your_task_page_runs_as_written(tmp_path, llama_dir):
    """docs/your-task.md's script and commands, with a small random Llama as the script's argument."""
    pytest.importorskip("datasets")
    page = (ROOT / "docs" / "your-task.md").read_text()
    script = _blocks(page, "python")[0]
    assert len(script.strip().splitlines()) <= 25
    (tmp_path / "my_task.py").write_text(script)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    commands = _blocks(page, "bash")[0].strip().splitlines()
    assert commands[0] == "python my_task.py"
    commands[0] = f"python my_task.py {llama_dir}"
    for command in commands:
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
    run = tmp_path / "runs" / "my-task"
    assert (run / "checkpoints" / "step_000006" / "model" / "README.md").is_file()
    assert (tmp_path / "runs" / "my-task-eval" / "eval.md").is_file()
    assert list((run / "completions").glob("step_*.jsonl"))


@pytest.mark.slow
def test_the_coming_from_trl_example_runs_as_written(tmp_path, llama_dir):
    """docs/your-task.md's Trainer script, with a small random Llama as its argument: a transformers callback,
    a peft.LoraConfig, evaluate() and save_model() as a TRL user writes them."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    page = (ROOT / "docs" / "your-task.md").read_text()
    script = next(block for block in _blocks(page, "python") if "parity.Trainer(" in block)
    (tmp_path / "from_trl.py").write_text(script)
    done = subprocess.run([sys.executable, "from_trl.py", str(llama_dir)], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("step ") and "/4: reward" in line] == [
        f"step {i}/4" for i in range(1, 5)
    ]
    assert any("'eval/fp16/reward_mean'" in line for line in lines)
    adapter = tmp_path / "runs" / "from-trl-adapter"
    assert lines[-1] == "runs/from-trl-adapter"
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(llama_dir), adapter)
    assert model.peft_config["default"].r == 16


def test_report_labels_a_mean_reward_and_shows_the_newest_completions(tmp_path, capsys):
    def length(completions, **columns):
        return [len(c) / 10 for c in completions]

    parity.train("builtin", ROWS, [length], run_dir=tmp_path / "custom", progress=False, **{**SMALL, "steps": 2})
    parity.train("builtin", None, run_dir=tmp_path / "builtin", progress=False, **SMALL)
    assert main(["report", str(tmp_path / "custom"), str(tmp_path / "builtin"), "--out", str(tmp_path / "rep")]) == 0
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "| run | accuracy or mean reward: start → final (best) |" in report
    row = next(line for line in report.splitlines() if line.startswith("| custom |"))
    assert row.split(" | ")[1].endswith(" mean reward") and "| builtin |" in report
    assert (
        "## custom: completions of step 2" in report
        and "| prompt | completion | length | reward | advantage | reward/length |" in report
    )


def test_trl_rewards_and_names_run_unchanged(tmp_path):
    """From TRL as it is: GRPOConfig's names, a reward written for chat prompts (`c[0]["content"]`) and one
    that returns None for the samples it does not score, on chat prompts (builtin-agent has a chat template)."""

    def n_chars(completions, **kwargs):
        return [float(len(c[0]["content"])) for c in completions]

    def even_only(completions, answer, **kwargs):  # scores the completions of even length only
        return [None if len(c[0]["content"]) % 2 else float(a) for c, a in zip(completions, answer)]

    chat = [({"role": "user", "content": f"{a}+{b}="}, a + b) for a in range(1, 9) for b in (1, 2)]
    rows = [{"prompt": [message], "answer": answer} for message, answer in chat]
    trl = parity.GRPOConfig(
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=16,
        learning_rate=1e-5,
        max_steps=2,
        reward_weights=[1.0, 0.5],
        logging_steps=1,
        bf16=False,
        save_strategy="no",
    )
    result = parity.train(
        "builtin-agent", rows, [n_chars, even_only], config=trl, run_dir=tmp_path / "r", progress=False
    )
    assert len(result.history) == 2
    answers = {json.dumps(r["prompt"]): r["answer"] for r in rows}
    for step in (1, 2):
        written = _rows_of(tmp_path / "r" / "completions" / f"step_{step:06d}.jsonl")
        assert len(written) == 8
        for row in written:
            assert row["reward/n_chars"] == len(row["completion"])
            if len(row["completion"]) % 2:
                assert row["reward/even_only"] is None and row["reward"] == row["reward/n_chars"]
            else:
                answer = answers[json.dumps(row["prompt"])]
                assert row["reward"] == pytest.approx(row["reward/n_chars"] + 0.5 * answer)
        scored = [r["reward/even_only"] for r in written if r["reward/even_only"] is not None]
        metrics = result.history[step - 1]
        if scored:  # averaged over the samples it scored
            assert metrics["reward/even_only/mean"] == pytest.approx(sum(scored) / len(scored))
        else:
            assert "reward/even_only/mean" not in metrics
    saved = (tmp_path / "r" / "config.yaml").read_text()
    assert "advantage: trl_group" in saved and "completion_format: auto" in saved and "aggregation: token_mean" in saved
    # The same reward given strings (Parity's default): refused on the first batch, in a line naming the key
    small = {k: v for k, v in SMALL.items() if k != "rollout__max_new_tokens"}
    with pytest.raises(RewardCheckError, match=r"string indices must be integers.* \(completions are strings \(task"):
        parity.train("builtin-agent", rows, n_chars, run_dir=tmp_path / "s", progress=False, **small)
    assert not (tmp_path / "s").exists()


def test_trl_s_reward_arguments_reach_the_metrics_and_the_completions_files(tmp_path):
    """`completion_ids` are the tokens the completion decodes from, `trainer_state` the steps done, and
    what `log_metric` and `log_extra` get lands in metrics.jsonl and the completions files, as in TRL."""
    tokenizer = load_tokenizer(resolve_model_dir("builtin"))
    steps_seen = []

    def judged(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **kwargs):
        assert [tokenizer.decode(ids) for ids in completion_ids] == completions
        steps_seen.append(trainer_state.global_step)
        log_metric("judge/mean_ids", sum(map(len, completion_ids)) / len(completion_ids))
        log_extra("ids", [len(ids) for ids in completion_ids])
        return [len(ids) % 2 == 0 for ids in completion_ids]  # a bool scores 1 or 0, as in TRL

    result = parity.train("builtin", ROWS, judged, run_dir=tmp_path / "r", progress=False, **{**SMALL, "steps": 2})
    assert steps_seen == [0, 1]
    for step, metrics in enumerate(result.history, 1):
        rows = _rows_of(tmp_path / "r" / "completions" / f"step_{step:06d}.jsonl")
        assert [row["extra"]["ids"] for row in rows] == [row["length"] for row in rows]
        assert metrics["judge/mean_ids"] == pytest.approx(sum(row["length"] for row in rows) / len(rows))
        assert [row["reward/judged"] for row in rows] == [float(row["length"] % 2 == 0) for row in rows]


def test_a_data_column_named_as_a_reward_argument_is_refused_before_anything_is_written(tmp_path):
    """A column `completions` would reach a TRL reward in place of the completions: refused, naming it."""

    def correct(prompts, completions, answer):
        return [0.0] * len(completions)

    rows = [{**row, "completions": "reference"} for row in ROWS]
    with pytest.raises(RewardCheckError, match=r"^the data's column 'completions' has the name of an argument"):
        parity.train("builtin", rows, correct, run_dir=tmp_path / "r", progress=False, **SMALL)
    assert not (tmp_path / "r").exists()


def test_a_refused_run_names_the_dataset_row_and_leaves_no_folder_it_made(tmp_path, monkeypatch):
    """A bad prompt in rows held in memory is named by its row (it named the run's own copy of the data,
    already removed), and the folders made for the run go with it, parents too (`runs/` stayed)."""
    monkeypatch.chdir(tmp_path)

    def reward(prompts, completions, **kw):
        return [0.0] * len(completions)

    for prompt, what in ((None, "null"), ("", "empty"), (5, "a number")):
        with pytest.raises(DataError, match=rf"^train dataset row 1: expected .*'prompt' is {what}$"):
            parity.train("builtin", [{"prompt": "1+1="}, {"prompt": prompt}], reward, steps=1)
    with pytest.raises(RewardCheckError, match="the data's column 'completions'"):
        parity.train("builtin", [{"prompt": "1+1=", "completions": 1}], reward, run_dir="a/b/c", steps=1)
    (tmp_path / "kept").mkdir()
    with pytest.raises(RewardCheckError):
        parity.train("builtin", [{"prompt": "1+1=", "completions": 1}], reward, run_dir="kept/b/c", steps=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"] and not any((tmp_path / "kept").iterdir())


def test_a_run_outside_the_main_thread_says_its_time_limits_do_not_hold(tmp_path, capsys):
    """SIGALRM reaches the main thread only: a tool that slept past episode.tool_timeout_s there was not cut."""
    import threading

    thread = threading.Thread(target=parity.train, kwargs=dict(run_dir=tmp_path / "r", progress=False, **SMALL))
    thread.start()
    thread.join()
    assert "WARNING: this run trains outside the main thread, where the time limits" in capsys.readouterr().err
    assert (tmp_path / "r" / "metrics.jsonl").is_file()


def test_rows_given_from_python_are_named_as_given(tmp_path):
    """A NaN (pandas' missing value) in a column no reward reads named no column; a row the model cannot
    encode was named by RUN_DIR/data/train.jsonl:2, a file the refused run then removed."""
    rows = [{"prompt": "1+1=", "answer": "2", "notes": "x"}, {"prompt": "2+2=", "answer": "4", "notes": float("nan")}]
    with pytest.raises(parity.DataError, match=r"^train dataset row 1: column 'notes' holds NaN or an infinity"):
        parity.train("builtin", rows, steps=1, run_dir=tmp_path / "r", progress=False)
    chat = [{"prompt": "1+1=", "answer": "2"}, {"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"}]
    with pytest.raises(parity.DataError, match=r"^train dataset row 1: 'prompt' is a list of messages, which needs"):
        parity.train("builtin", chat, steps=1, run_dir=tmp_path / "r", progress=False)
    assert not (tmp_path / "r").exists()
