"""`parity.Trainer`, for a user of TRL (docs/your-task.md, "Coming from TRL"): train, evaluate, save_model and
push_to_hub; peft_config; transformers' callbacks and the control the run honours; resume."""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers

import parity
from parity.config import ConfigError
from parity.engines.models.io import resolve_model_dir
from parity.rl.callbacks import CallbackError
from parity.rl.train_config import TrainConfig

SMALL = dict(prompts_per_step=4, rollout__group_size=4, rollout__max_new_tokens=32, tensorboard=False)
EVAL = {"eval.num_prompts": 2, "eval.samples": 2}
ROWS = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(100, 140) for b in range(10, 13)]
IDS = torch.tensor([[1, 3, 4, 5, 6]])  # the built-in model has a vocabulary of a few symbols


def length(completions, **columns):  # varies from sample to sample: every step trains
    return [len(c) / 10 for c in completions]


def _last_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits[0, -1]


def test_train_evaluate_save_model_and_push_to_hub(tmp_path, monkeypatch):
    trainer = parity.Trainer("builtin", config=EVAL, run_dir=tmp_path / "r", progress=False, steps=2, **SMALL)
    base = trainer.evaluate()  # before training: the base model
    assert 0 <= base["eval/fp16/accuracy"] <= 1 and base["eval/prompts"] == 2 and "deploy/gap_fp16" in base
    result = trainer.train()
    assert result.run_dir == trainer.run_dir == tmp_path / "r" and [m["step"] for m in result.history] == [1, 2]
    assert trainer.state.global_step == 2 and trainer.state.log_history == result.history
    trained = trainer.evaluate()
    assert trained.keys() == base.keys()
    assert trainer.save_model() == result.model_dir == tmp_path / "r" / "checkpoints" / "step_000002" / "model"
    out = trainer.save_model(tmp_path / "out")
    assert trainer.save_model(tmp_path / "out") == out  # a model saved there before is replaced
    assert (out / "README.md").read_text() == (result.model_dir / "README.md").read_text()
    saved = transformers.AutoModelForCausalLM.from_pretrained(out)
    logits = _last_logits(saved)
    assert torch.equal(logits, _last_logits(transformers.AutoModelForCausalLM.from_pretrained(result.model_dir)))
    before = _last_logits(transformers.AutoModelForCausalLM.from_pretrained(resolve_model_dir("builtin")))
    assert not torch.equal(logits, before)  # trained
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"^output_dir: .*notes holds files that are not a saved model; choose a new"):
        trainer.save_model(tmp_path / "notes")

    # push_to_hub: parity.push_to_hub's checks, then the Hub's client with the folder; no network here
    with pytest.raises(ConfigError, match=r"^repo_id: expected a Hub repository's name"):
        trainer.push_to_hub(3)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=r"^push_to_hub: no token; pass token="):
        trainer.push_to_hub("me/tiny")
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # a port nothing listens on
    with pytest.raises(ConfigError) as e:
        trainer.push_to_hub("me/tiny", token="hf_not_a_real_token")
    assert str(e.value).startswith("push_to_hub me/tiny: ") and "\n" not in str(e.value)


def test_peft_config_trains_adapters_that_peft_loads(tmp_path):
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = parity.Trainer(
        "builtin", ROWS, length, peft_config=lora, config=EVAL, run_dir=tmp_path / "r", progress=False, steps=2,
        **SMALL,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"^evaluate: nothing held out to evaluate on .*; pass eval_dataset=$"):
        trainer.evaluate()
    result = trainer.train()
    assert result.model_dir == tmp_path / "r" / "checkpoints" / "step_000002" / "adapter"
    metrics = trainer.evaluate(ROWS[:4])
    assert metrics["eval/prompts"] == 2 and "eval/fp16/reward_mean" in metrics
    out = trainer.save_model(tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8.0, ["q_proj", "v_proj"])
    base = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_dir("builtin"))
    before = _last_logits(base)
    adapted = peft.PeftModel.from_pretrained(base, out)
    assert not torch.equal(_last_logits(adapted), before)  # PEFT loads the trained adapters onto the base


def test_evaluate_gives_completions_in_the_runs_form_before_training_too(tmp_path):
    """task.completion_format=messages: reward functions get TRL's chat form in `evaluate()` of the base model
    (a model target) as in training and in `evaluate()` of a checkpoint (the run's target)."""
    forms = []

    def chat_form(completions, **columns):
        forms.append(type(completions[0]).__name__)
        return [0.0] * len(completions)

    trainer = parity.Trainer(
        "builtin", ROWS, chat_form, config=EVAL, run_dir=tmp_path / "r", progress=False, steps=1,
        task__completion_format="messages", **SMALL,
    )  # fmt: skip
    trainer.evaluate(ROWS[:4])
    trainer.train()
    trainer.evaluate(ROWS[:4])
    assert forms and set(forms) == {"list"}


class Steer(parity.TrainerCallback):
    """Asks for an evaluation before step 2 and a checkpoint after step 1, and stops after step 3."""

    def __init__(self):
        self.events, self.saved, self.args = [], [], None

    def on_train_begin(self, args, state, control, **kwargs):
        self.args = args
        self.events.append(("train_begin", state.global_step))

    def on_step_begin(self, args, state, control, **kwargs):
        self.events.append(("step_begin", state.global_step))
        control.should_evaluate = state.global_step == 1

    def on_step_end(self, args, state, control, metrics=None, **kwargs):
        self.events.append(("step_end", state.global_step, "reward/mean" in metrics))
        control.should_save = state.global_step == 1

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.events.append(("evaluate", state.global_step, "eval/accuracy" in metrics))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", state.global_step, "eval/accuracy" in logs))
        if state.global_step == 3:
            control.should_training_stop = True

    def on_save(self, args, state, control, checkpoint=None, **kwargs):
        self.saved.append(checkpoint.name)

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(("train_end", state.global_step))


def test_the_run_honours_the_control_of_a_callback(tmp_path):
    steer = Steer()
    keys = {**SMALL, "steps": 5, "checkpoint_every": 0, "eval__every": -1, "keep_checkpoints": 5}
    trainer = parity.Trainer(callbacks=steer, config=EVAL, run_dir=tmp_path / "r", progress=False, **keys)
    result = trainer.train()
    assert [m["step"] for m in result.history] == [1, 2, 3]
    assert ["eval/accuracy" in m for m in result.history] == [False, True, False]  # eval.every=-1: asked for once
    assert steer.events == [
        ("train_begin", 0),
        ("step_begin", 0), ("step_end", 1, True), ("log", 1, False),
        ("step_begin", 1), ("step_end", 2, True), ("evaluate", 2, True), ("log", 2, True),
        ("step_begin", 2), ("step_end", 3, True), ("log", 3, False),
        ("train_end", 3),
    ]  # fmt: skip
    assert steer.saved == ["step_000001", "step_000003"]  # asked for, and the stop's
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == steer.saved
    assert isinstance(steer.args, TrainConfig) and steer.args.steps == 5 and steer.args is not trainer.config
    assert trainer.state.global_step == 3 and trainer.state.max_steps == 5


def test_a_transformers_callback_as_it_is_and_resume_from_checkpoint(tmp_path):
    class Rewards(transformers.TrainerCallback):  # what a TRL user has
        def __init__(self):
            self.logged, self.end = [], None

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logged.append((state.global_step, logs["reward/mean"]))

        def on_train_end(self, args, state, control, **kwargs):
            self.end = (state.global_step, [m["step"] for m in state.log_history])

    first = Rewards()
    parity.Trainer(callbacks=[first], run_dir=tmp_path / "r", progress=False, steps=2, eval__every=-1, **SMALL).train()
    assert [s for s, _ in first.logged] == [1, 2] and first.end == (2, [1, 2])

    again = Rewards()
    trainer = parity.Trainer(callbacks=again, run_dir=tmp_path / "r", progress=False, steps=3, eval__every=-1, **SMALL)
    with pytest.raises(ConfigError, match=r"step_000001 is not the run's newest checkpoint \(step_000002\)"):
        trainer.train(resume_from_checkpoint=tmp_path / "r" / "checkpoints" / "step_000001")
    result = trainer.train(resume_from_checkpoint=True)
    assert [m["step"] for m in result.history] == [3] and again.end == (3, [1, 2, 3])  # the earlier steps' logs too
    done = trainer.train(resume_from_checkpoint=True)  # its 3 steps taken: `open_run` closes it, nothing trains
    assert done.history == [] and done.run_dir == tmp_path / "r" and again.end == (3, [1, 2, 3])
    changed = parity.Trainer(run_dir=tmp_path / "r", progress=False, steps=4, trainer__lr=1e-3, eval__every=-1, **SMALL)
    with pytest.raises(ConfigError, match=r"trainer.lr cannot change on resume"):
        changed.train(resume_from_checkpoint=tmp_path / "r")

    # transformers' own EarlyStoppingCallback reads TrainingArguments' fields that a Parity config has not
    with pytest.raises(CallbackError) as e:
        parity.Trainer(
            callbacks=transformers.EarlyStoppingCallback(), run_dir=tmp_path / "s", progress=False, steps=2, **SMALL
        ).train()
    assert str(e.value).startswith("before step 1: callback EarlyStoppingCallback.on_train_begin raised ")
    assert str(e.value).endswith("the run stopped: no checkpoint was written (a resume starts again from step 0)")
