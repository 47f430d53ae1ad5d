"""`parity.Trainer`'s arguments and transformers' callback form (rl/callbacks.py), without a run: which form
a callback takes, the control its events set, the guarantees of the first form, and `peft_config`."""

from __future__ import annotations

import numpy as np
import peft
import pytest
import transformers

import parity
from parity.config import ConfigError
from parity.rl.callbacks import Callbacks, TrainerState, checked_callbacks, uses_events


class Events(parity.TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, metrics=None, **kwargs):
        self.seen.append(("on_step_end", state.global_step, dict(metrics)))
        metrics.clear()  # its own copy: nothing else sees this
        control.should_save = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(("on_log", state.global_step, dict(logs)))
        if logs["reward/mean"] > 0.5:
            control.should_training_stop = True


class Legacy(parity.Callback):
    def __init__(self, answer=None):
        self.answer, self.seen = answer, []

    def on_step_end(self, step, metrics):
        self.seen.append(("on_step_end", step, dict(metrics)))
        return self.answer

    def on_eval(self, step, metrics):
        self.seen.append(("on_eval", step, dict(metrics)))


class FromTransformers(transformers.TrainerCallback):
    def on_evaluate(self, args, state, control, metrics, **kwargs):
        control.should_training_stop = metrics["eval/accuracy"] < 0.1


def _hooks(*callbacks):
    return Callbacks(checked_callbacks(list(callbacks)), "the config", TrainerState(global_step=3, max_steps=5))


def test_which_form_a_callback_takes():
    class DuckEvents:  # no base class: transformers' signature on the one hook both forms name
        def on_step_end(self, args, state, control, **kwargs):
            pass

    class DuckLegacy:
        def on_step_end(self, step, metrics):
            pass

    class OnlyLog:
        def on_log(self, args, state, control, logs, **kwargs):
            pass

    assert [uses_events(c) for c in (Events(), FromTransformers(), DuckEvents(), OnlyLog())] == [True] * 4
    assert [uses_events(c) for c in (Legacy(), DuckLegacy())] == [False, False]
    assert checked_callbacks(FromTransformers())[0].__class__ is FromTransformers  # one alone is a list of one


def test_an_event_hook_that_cannot_take_its_arguments_is_one_line():
    class NoKwargs(parity.TrainerCallback):
        def on_log(self, args, state, control):
            pass

    class NotCallable(parity.TrainerCallback):
        on_save = 3

    line = r"^callbacks\[0\]: NoKwargs.on_log\(args, state, control\) cannot be called as on_log\(args, state, "
    with pytest.raises(ConfigError, match=line + r"control, logs=...\)$"):
        checked_callbacks([NoKwargs()])
    with pytest.raises(ConfigError, match=r"^callbacks\[1\]: NotCallable.on_save is int 3, not a method$"):
        checked_callbacks([Events(), NotCallable()])


def test_events_get_copies_and_set_the_control_and_the_first_form_is_called_where_it_was():
    events, legacy = Events(), Legacy(answer=np.bool_(True))
    hooks = _hooks(events, legacy)
    hooks.event("on_step_end", metrics={"reward/mean": 0.25})
    assert hooks.switch("should_save") and not hooks.switch("should_training_stop")
    assert legacy.seen == []  # the first form has no hook at transformers' on_step_end
    hooks.event("on_evaluate", metrics={"eval/accuracy": 0.5})
    hooks.event("on_log", logs={"reward/mean": 0.75})
    assert events.seen == [("on_step_end", 3, {"reward/mean": 0.25}), ("on_log", 3, {"reward/mean": 0.75})]
    assert legacy.seen == [("on_eval", 3, {"eval/accuracy": 0.5}), ("on_step_end", 3, {"reward/mean": 0.75})]
    assert hooks.switch("should_training_stop") and hooks.failure is None
    hooks.control.new_step()
    assert not hooks.switch("should_save") and hooks.switch("should_training_stop")  # a stop is not reset


def test_a_transformers_callback_returning_its_control_and_early_stopping():
    hooks = _hooks(FromTransformers())
    hooks.event("on_evaluate", metrics={"eval/accuracy": 0.05})
    assert hooks.switch("should_training_stop") and hooks.failure is None

    class Replaces(parity.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            return transformers.TrainerControl(should_evaluate=True)  # transformers' own control, returned

    hooks = _hooks(Replaces())
    hooks.event("on_step_begin")
    assert hooks.switch("should_evaluate") and hooks.failure is None


@pytest.mark.parametrize(
    ("callback", "line"),
    [
        (Legacy(answer="stop"), r"step 3: callback Legacy.on_step_end returned str 'stop'; return True to stop the "
                                r"run, False or None to go on"),
        (type("Answers", (parity.TrainerCallback,), {"on_log": lambda self, a, s, c, **k: 1})(),
         r"step 3: callback Answers.on_log returned int 1; return the control, or None"),
        (type("Sets", (parity.TrainerCallback,), {"on_log": lambda _, a, s, c, **k: setattr(c, "should_save", "y")})(),
         r"step 3: callback Sets.on_log set control.should_save to str 'y'; expected True or False"),
    ],
)  # fmt: skip
def test_an_answer_the_run_cannot_use_is_held_as_the_failure(callback, line):
    hooks = _hooks(callback)
    hooks.event("on_log", logs={"reward/mean": 0.0})
    assert hooks.failure is not None and hooks.failure[0] == line.replace("\\", "") and hooks.failure[1] is None
    assert not hooks.switch("should_save")


def test_a_raising_event_is_held_naming_when():
    class Raises(parity.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            raise KeyError("lr")

        def on_train_end(self, args, state, control, **kwargs):
            raise ValueError("late")

    hooks = _hooks(Raises(), Events())
    hooks.event("on_step_begin")
    hooks.event("on_train_end")  # the first failure is kept
    assert hooks.failure[0] == "before step 4: callback Raises.on_step_begin raised KeyError: 'lr'"
    assert isinstance(hooks.failure[1], KeyError)
    hooks = _hooks(Raises())
    hooks.event("on_train_end")
    assert hooks.failure[0] == "after step 3: callback Raises.on_train_end raised ValueError: late"


# ----------------------------------------------------------------------------- the Trainer's arguments


def test_peft_config_maps_onto_the_lora_keys():
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["v_proj", "q_proj"], task_type="CAUSAL_LM")
    trainer = parity.Trainer("builtin", peft_config=config, run_dir="unused", progress=False)
    lora = trainer.config.lora
    assert (lora.rank, lora.alpha, list(lora.targets)) == (4, 16.0, ["q_proj", "v_proj"])
    everything = parity.Trainer(peft_config=peft.LoraConfig(r=2, target_modules="all-linear"), progress=False)
    assert len(everything.config.lora.targets) == 7 and everything.config.lora.alpha == 8.0  # PEFT's default alpha


@pytest.mark.parametrize(
    ("peft_config", "line"),
    [
        (peft.LoraConfig(r=8, lora_dropout=0.05, target_modules=["q_proj"]),
         r"peft_config: lora_dropout=0.05 is not plain LoRA, which Parity trains; leave it at PEFT's default (0.0)"),
        (peft.LoraConfig(r=8, use_dora=True, target_modules=["q_proj"]),
         r"peft_config: use_dora: expected false (plain LoRA, which Parity computes), got True"),
        (peft.LoraConfig(r=8, target_modules=".*proj"), r"peft_config: target_modules: expected a list of distinct "),
        (peft.LoraConfig(r=8), r"peft_config: target_modules: expected a list of distinct names"),
        (peft.LoraConfig(r=8, target_modules=["q_proj"], init_lora_weights="gaussian"),
         r"peft_config: init_lora_weights='gaussian' is not plain LoRA"),
        (peft.IA3Config(target_modules=["q_proj"]), r"peft_config: a IA3Config \(IA3\); Parity trains LoRA adapters"),
        (peft.LoraConfig, r"peft_config: expected a peft.LoraConfig, got the class LoraConfig"),
        ({"r": 8}, r"peft_config: expected a peft.LoraConfig, got dict"),
    ],
)  # fmt: skip
def test_a_peft_field_parity_cannot_honour_is_one_line_naming_it(peft_config, line, tmp_path):
    with pytest.raises(ConfigError) as e:
        parity.Trainer("builtin", peft_config=peft_config, run_dir=tmp_path / "r", progress=False)
    assert str(e.value).startswith(line.replace("\\", "")) and "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


def test_the_trainers_arguments_are_checked_as_trains(tmp_path):
    cases = [
        (dict(callbacks=[Events]), r"^callbacks\[0\]: the class Events, not a callback; pass an instance of it$"),
        (dict(peft_config=peft.LoraConfig(r=2, target_modules=["q_proj"]), lora__rank=4),
         r"^peft_config and lora.rank: give one"),
        (dict(rewards=[3]), r"^rewards\[0\]: expected a function or a parity.Reward, got int 3$"),
        (dict(model=3), r"^model: expected a model directory"),
        # a ModelError from train() before: not the API's error, and after arguments that were all fine
        (dict(model="org/not-cached"), r"^model 'org/not-cached': no such directory, .*hf download"),
        (dict(trainer__lr="fast"), r"^trainer.lr: "),
        (dict(progress=1), r"^progress: expected True or False, got int 1$"),
    ]  # fmt: skip
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            parity.Trainer(**{"run_dir": tmp_path / "r", **kwargs})
        assert not (tmp_path / "r").exists()
    trainer = parity.Trainer(run_dir=tmp_path / "r", steps=3)
    assert trainer.run_dir == tmp_path / "r" and trainer.state.max_steps == 3 and trainer.state.global_step == 0
    for method, line in (
        (trainer.save_model, "save_model: nothing is trained yet; call train() first"),
        (lambda: trainer.push_to_hub("me/model"), "push_to_hub: nothing is trained yet; call train() first"),
        (lambda: trainer.train(resume_from_checkpoint=3), "resume_from_checkpoint: expected True or a run directory"),
    ):
        with pytest.raises(ConfigError) as e:
            method()
        assert str(e.value).startswith(line)
    with pytest.raises(ConfigError, match=r"^resume_from_checkpoint=True: no run_dir is set"):
        parity.Trainer().train(resume_from_checkpoint=True)


def test_every_name_the_package_exports_is_there():
    """`from parity import *` and the names docs/your-task.md tells users to catch (`parity.DataError`)."""
    namespace: dict = {}
    exec("from parity import *", namespace)
    assert set(parity.__all__) <= set(namespace)
    assert issubclass(parity.DataError, ValueError) and issubclass(parity.CallbackError, RuntimeError)
    assert set(parity.__all__) <= set(dir(parity))


def test_reward_weights_reach_the_plain_functions_from_the_keys_and_every_config():
    """TRL's reward_weights, one per function, by a keyword, a dict or GRPOConfig; a `parity.Reward` keeps
    its own weight (they were dropped: a keyword's always, a config's beside any `parity.Reward`)."""

    def fa(prompts, completions, **kw):
        return [0.0] * len(completions)

    def fb(prompts, completions, **kw):
        return [0.0] * len(completions)

    rows = [{"prompt": "1+1=", "answer": 2}]
    for rewards, kwargs, weights in [
        ([fa, fb], {"task__reward_weights": [2.0, 0.5]}, [2.0, 0.5]),
        ([fa, fb], {"config": {"task.reward_weights": [1.5, 0.5]}}, [1.5, 0.5]),
        ([fa, parity.Reward(fb, weight=3.0)], {"config": parity.GRPOConfig(reward_weights=[2.0, 0.5])}, [2.0, 3.0]),
    ]:
        trainer = parity.Trainer("builtin", rows, rewards, **kwargs)
        assert [r.weight for r in trainer.rewards] == trainer.config.task.reward_weights == weights
    with pytest.raises(ConfigError, match=r"^task.reward_weights: 1 weights for 2 reward functions"):
        parity.Trainer("builtin", rows, [fa, fb], task__reward_weights=[2.0])


def test_grpo_trainer_s_argument_names_are_taken_as_they_are():
    def reward(prompts, completions, **kw):
        return [0.0] * len(completions)

    rows = [{"prompt": "1+1=", "answer": 2}]
    trainer = parity.Trainer(
        model="builtin", reward_funcs=[reward], args=parity.GRPOConfig(max_steps=3), train_dataset=rows
    )
    assert trainer.config.steps == 3 and trainer.datasets["train"] == rows and trainer.rewards[0].fn is reward
    with pytest.raises(ConfigError, match=r"^reward_funcs and rewards: give one \(reward_funcs is TRL's name for it\)"):
        parity.Trainer("builtin", rows, reward, reward_funcs=[reward])
    with pytest.raises(ConfigError, match=r"^processing_class: Parity reads the tokenizer"):
        parity.Trainer("builtin", rows, reward, processing_class=object())


def test_tools_given_twice_are_refused():
    """`tools=` won over `task__tools` silently."""

    def lookup(key: str) -> str:
        """The value under a key."""
        return key

    with pytest.raises(ConfigError, match=r"^tools= and task.tools: give one"):
        parity.Trainer("builtin-agent", [{"prompt": "a?", "answer": 1}], tools=[lookup], task__tools=["m:search"])


def test_trl_s_positional_order_a_stream_and_a_folder_that_is_no_model_are_one_line(tmp_path):
    """GRPOTrainer(model, reward_funcs, args, train_dataset) by position was "train_dataset and dataset: give
    one" or a bare TypeError; an IterableDataset was read to its end (an endless one hung); a folder that is
    no model passed until train()."""
    datasets = pytest.importorskip("datasets")

    def reward(prompts, completions, **kw):
        return [0.0] * len(completions)

    def endless():
        while True:
            yield {"prompt": "1+1=", "answer": 2}

    rows = [{"prompt": "1+1=", "answer": 2}]
    order = r"^dataset: reward functions, by position in GRPOTrainer's order \(model, reward_funcs, args, train_d"
    for args, kwargs in [
        (("builtin", [reward], parity.GRPOConfig(), rows), {}),
        (("builtin", reward), {"args": parity.GRPOConfig(), "train_dataset": rows}),
    ]:
        with pytest.raises(ConfigError, match=order):
            parity.Trainer(*args, **kwargs)
    with pytest.raises(ConfigError, match=r"^Trainer: 4 arguments by position; it takes \(model, dataset, rewards\)"):
        parity.Trainer("builtin", rows, [reward], parity.GRPOConfig())
    with pytest.raises(ConfigError, match=order):  # parity.train as Trainer (it was a bare TypeError)
        parity.train("builtin", reward, parity.GRPOConfig(), rows)
    with pytest.raises(ConfigError, match=r"^train: 4 arguments by position; it takes \(model, dataset, rewards\)"):
        parity.train("builtin", rows, [reward], parity.GRPOConfig())
    for stream in (datasets.IterableDataset.from_generator(endless), endless()):
        with pytest.raises(ConfigError, match=r"^dataset: .* has no length \(a stream"):
            parity.Trainer("builtin", stream, run_dir=tmp_path / "r")
    frame = datasets.Dataset.from_list(rows).to_pandas()
    assert parity.Trainer("builtin", frame).datasets["train"] == rows
    with pytest.raises(ConfigError, match=r"no config.json; this is not a Hugging Face model directory"):
        parity.Trainer(tmp_path, rows, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_a_config_takes_its_keys_as_attributes_and_refuses_other_names():
    """`args.output_dir = ...` after GRPOConfig(...) set an attribute nothing read: the run went elsewhere."""
    config = parity.GRPOConfig(max_steps=4)
    config.steps, config.trainer.lr = 2, 1e-5
    assert (config.steps, config.trainer.lr) == (2, 1e-5)
    for name, line in [
        ("output_dir", "unknown config key output_dir; did you mean run_dir (TRL's output_dir)?"),
        ("max_steps", "unknown config key max_steps; did you mean steps (TRL's max_steps)?"),
    ]:
        with pytest.raises(ConfigError) as e:
            setattr(config, name, 1)
        assert str(e.value) == line
    with pytest.raises(ConfigError, match=r"^unknown config key lrr; did you mean lr\?$"):
        config.trainer.lrr = 1.0
    config.rollout.max_new_tokens = -5  # a key's value is checked where the config is taken
    with pytest.raises(ConfigError, match=r"^rollout.max_new_tokens must be >= 1, got -5$"):
        parity.Trainer("builtin", config=config)


def test_episode_keys_are_taken_beside_reward_functions():
    """With rewards given, the config was read before the tools were in it: every episode.* key was refused
    as "a setting of episodes, and this run has none"."""

    def lookup(key: str) -> str:
        """The value under a key."""
        return key

    def reward(prompts, completions, **kw):
        return [0.0] * len(completions)

    rows = [{"prompt": "a?", "answer": 1}]
    trainer = parity.Trainer("builtin-agent", rows, [reward], tools=[lookup], episode__max_turns=2)
    assert trainer.config.episode.max_turns == 2
    trainer = parity.Trainer("builtin-agent", rows, [reward], tools=[lookup], config={"episode": {"max_turns": 3}})
    assert trainer.config.episode.max_turns == 3


def test_evaluate_names_its_metrics_alike_before_and_after_training(tmp_path):
    """Before training, a Trainer with reward functions reported the task's accuracy; after, the functions'
    mean reward, as its run does."""

    def reward(prompts, completions, **kw):
        return [float(len(c) > 20) for c in completions]

    rows = [{"prompt": f"{a}+{a}=", "answer": 2 * a} for a in range(1, 9)]
    keys = dict(steps=1, prompts_per_step=2, rollout__group_size=2, eval__num_prompts=4, eval__samples=1)
    trainer = parity.Trainer("builtin", rows, [reward], run_dir=tmp_path / "r", progress=False, **keys)
    before = trainer.evaluate(rows)
    trainer.train()
    after = trainer.evaluate(rows)
    assert "eval/fp16/accuracy" not in before and set(before) == set(after)
