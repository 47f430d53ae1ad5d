"""`parity train`'s config refused before any work, naming the key (the runs: tests/e2e/test_train.py)."""

from __future__ import annotations

import re

import pytest

from parity import config
from parity.cli import main
from parity.config import ConfigError
from parity.rl.loop import Run
from parity.rl.train_config import TrainConfig


@pytest.mark.parametrize(
    "override, message",
    [
        (["algorithm.name=ppo2"], "algorithm.name: unknown value 'ppo2'; allowed: .*grpo.*pg_seq_is"),
        (
            ["task.name=chess"],
            "task.name: unknown value 'chess'; allowed: builtin, exact, length, lookup, math, number",
        ),
        (["task.chat_template=chatml"], "task.chat_template: unknown value 'chatml'; allowed: auto, messages, none"),
        (["algorithm.clip_hi=0.3"], r"^unknown config key algorithm.clip_hi; did you mean algorithm.clip_high\?$"),
        (["steps=ten"], "steps: expected an integer, got 'ten'"),
        (
            ["rollout.precision=bf16"],
            "rollout.precision=bf16 and trainer.precision=fp16 differ.*allow_precision_mismatch",
        ),
        (["precision=fp8"], "precision: unknown value 'fp8'"),
        (["algorithm.num_minibatches=3"], "num_minibatches=3 must divide prompts_per_step=16"),
        (["rollout.group_size=1"], "advantage=drgrpo needs rollout.group_size >= 2"),
        (["task.reward_fn=nomodule"], r"task.reward_fn\[0\]: expected 'module:function'"),
        (["rollout.top_p=0"], r"rollout.top_p must be in \(0, 1\]"),
        (["device=tpu"], r"^device: unknown value 'tpu'; allowed: cpu, cuda$"),  # was a KeyError traceback
        (["lora.targets=q_proj"], r"^lora.targets=q_proj has no effect with lora.rank=0 \(LoRA off\)"),
        (["rollout.max_new_tokens=0"], r"^rollout.max_new_tokens must be >= 1, got 0$"),  # named episode.turn_tokens
        (
            ["algorithm.name=grpo_seq_geo_rs", "algorithm.ratio_source=rollout"],
            "algorithm.name=grpo_seq_geo_rs corrects by π_old/μ, which .*ratio_source=rollout makes 1",
        ),
        (
            ["algorithm.name=grpo_token_tis", "algorithm.ratio_source=rollout"],
            "algorithm.name=grpo_token_tis corrects by π_old/μ, .* would do nothing",
        ),
        (
            ["algorithm.token_veto=1e-4", "algorithm.ratio_source=rollout"],
            "algorithm.token_veto=0.0001 corrects by π_old/μ, .* would do nothing",
        ),
    ],
)
def test_bad_config_is_rejected_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        config.load(TrainConfig, None, override)


def test_mismatched_precisions_allowed_when_explicit():
    cfg = config.load(TrainConfig, None, ["rollout.precision=fp32", "precision=bf16", "allow_precision_mismatch=true"])
    assert (cfg.trainer_precision, cfg.rollout_precision) == ("bf16", "fp32")


def test_cli_rejects_before_work(tmp_path, capsys):
    assert main(["train", f"run_dir={tmp_path / 'r'}", "algorithm.name=nope"]) == 2
    assert "algorithm.name" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_one_process_run_refuses_a_distributed_config(tmp_path):
    """A config that asks for rollout workers must not train quietly in one process."""
    cfg = config.load(TrainConfig, None, [f"run_dir={tmp_path / 'r'}", "distributed.rollout_workers=1"])
    with pytest.raises(
        ConfigError, match="distributed.rollout_workers=1, distributed.learners=1 ask for a distributed"
    ):
        Run.create(cfg, progress=False)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("override", "given", "message"),
    [
        ("num_generations=4", {"num_generations": 4}, r"num_generations; did you mean rollout.group_size \(TRL's"),
        ("learning_rate=1e-5", {"learning_rate": 1e-5}, r"learning_rate; did you mean trainer.lr \(TRL's"),
        ("stepz=3", {"stepz": 3}, r"stepz; did you mean steps\?$"),
        ("group_size=3", {"group_size": 3}, r"group_size; did you mean rollout.group_size\?$"),
    ],
)
def test_an_unknown_key_is_answered_with_the_key_it_means_everywhere(tmp_path, capsys, override, given, message):
    """The CLI's key=value, a YAML file, the API's keys and TrainConfig(...) give the same line."""
    line = rf"^unknown config key {message}"
    with pytest.raises(ConfigError, match=line):
        config.load(TrainConfig, None, [override])
    yaml = tmp_path / "c.yaml"
    yaml.write_text(override.replace("=", ": ") + "\n")
    with pytest.raises(ConfigError, match=r"^.*c.yaml:1: " + line[1:]):
        config.load(TrainConfig, yaml)
    with pytest.raises(ConfigError, match=line):
        config.load(TrainConfig, None, None, given)
    with pytest.raises(ConfigError, match=line):
        TrainConfig(**given)
    assert main(["train", f"run_dir={tmp_path / 'r'}", override]) == 2
    assert "did you mean" in capsys.readouterr().err and not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"precision": "fp33"}, r"^precision: unknown value 'fp33'; allowed: bf16, fp16, fp32$"),
        ({"seed": "many"}, r"^seed: expected an integer, got 'many'$"),
        ({"steps": 0}, r"^steps: must be in \[1, "),
        ({"rollout": {"group_size": 1}}, r"advantage=drgrpo needs rollout.group_size >= 2"),
        ({"algorithm": {"scale_rewards": "std"}}, r"^algorithm.scale_rewards: unknown value 'std'"),
    ],
)
def test_trainconfig_checks_its_values_when_made_as_the_loader_does(given, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**given)
    with pytest.raises(ConfigError, match=message):
        config.load(TrainConfig, None, None, given)


def test_a_trainconfig_changed_after_it_is_made_resolves_as_changed():
    """Checking a TrainConfig when it is made fills nothing in: the estimator's and the task's defaults
    follow the keys as they are when the run validates it."""
    cfg = TrainConfig()
    cfg.algorithm.name, cfg.task.name = "gspo", "length"
    cfg.validate()
    assert (cfg.algorithm.advantage, cfg.algorithm.aggregation, cfg.algorithm.truncated) == (
        "grpo",
        "seq_mean_token_mean",
        "keep",
    )


def test_trainconfig_takes_sections_as_dicts_or_dataclasses_and_round_trips():
    from parity.rl.train_config import RolloutSection

    a = TrainConfig(steps=3, rollout={"group_size": 4})
    b = TrainConfig(steps=3, rollout=RolloutSection(group_size=4), algorithm={"scale_rewards": "batch"})
    assert a.steps == 3 and a.rollout.group_size == 4
    assert b.rollout.group_size == 4 and b.algorithm.advantage is None  # filled when the run validates it
    b.validate()
    assert b.algorithm.advantage == "trl_batch"
    again = config.load(TrainConfig, None, None, config.to_dict(b))
    assert config.to_dict(again) == config.to_dict(b)


@pytest.mark.parametrize(
    "override, message",
    [
        ("precision=fp8", "precision: unknown value 'fp8'; allowed: bf16, fp16, fp32"),
        ("max_new_tokens=0", "max_new_tokens: must be >= 1, got 0"),
    ],
)
def test_perfectible_refuses_a_precision_or_budget_it_cannot_sample_with(override, message):
    """Both were tracebacks raised after the problems were loaded."""
    from parity.commands.perfectible import PerfectibleConfig

    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        config.load(PerfectibleConfig, None, [override])


def test_python_files_a_run_imports_are_named_from_anywhere(tmp_path):
    """Tools and an environment in a file were kept relative, as given: a resume or `parity eval` from another
    folder could not import them."""
    from parity.rl.train_config import TrainConfig

    cfg = config.load(TrainConfig, None, ["task.reward_fn=r.py:score,mod:f", "task.tools=t.py:lookup", "steps=1"])
    cfg.task.environment = "e.py:Env"
    cfg.resolve_paths(tmp_path)
    assert cfg.task.reward_fn == [f"{tmp_path.resolve()}/r.py:score", "mod:f"]
    assert (
        cfg.task.tools == [f"{tmp_path.resolve()}/t.py:lookup"]
        and cfg.task.environment == f"{tmp_path.resolve()}/e.py:Env"
    )


def test_an_unset_turn_limit_follows_the_response_budget_of_the_config_it_is_in():
    """episode.turn_tokens unset was filled in when checked: the config, given again with a smaller
    rollout.max_new_tokens, was refused for a limit the user never set (and a larger one kept the old)."""
    from parity.rl.train_config import TrainConfig

    cfg = config.load(TrainConfig, None, None, {"model": "builtin-agent", "task.name": "lookup"})
    assert cfg.episode.turn_tokens is None and cfg.turn_tokens == cfg.rollout.max_new_tokens == 96
    for budget in (48, 200):
        again = config.load(
            TrainConfig, None, None, {**config.flatten(config.to_dict(cfg)), "rollout.max_new_tokens": budget}
        )
        assert again.turn_tokens == budget
    assert config.load(TrainConfig, None, ["episode.turn_tokens=32"]).turn_tokens == 32


def test_the_command_that_continues_a_run_confirms_its_code():
    """A stopped run of tools or reward functions said `parity train --resume DIR`, which is refused without
    --trust-reward-fn."""
    from parity.rl.train_config import TrainConfig

    assert TrainConfig().resume_command("runs/r") == "parity train --resume runs/r"
    for key in ("task.reward_fn=m:f", "task.tools=m:t"):
        assert config.load(TrainConfig, None, [key]).resume_command("r") == "parity train --resume r --trust-reward-fn"


def test_episodes_without_the_chat_template_are_refused():
    """task.chat_template=none was ignored: an episode's turns are the template's."""
    from parity.rl.train_config import TrainConfig

    with pytest.raises(ConfigError, match="^task.chat_template=none: episodes are conversations"):
        config.load(TrainConfig, None, ["model=builtin-agent", "task.tools=m:t", "task.chat_template=none"])


def test_a_misspelt_key_on_resume_is_an_unknown_key(tmp_path, capsys):
    """`--resume RUN episode.bogus=1` said "episode.bogus cannot change on resume"."""
    from parity.cli import main

    run = tmp_path / "run"
    args = ["train", f"run_dir={run}", "steps=1", "prompts_per_step=2", "rollout.group_size=2", "eval.every=-1"]
    assert main([*args, "tensorboard=false", "rollout.max_new_tokens=8"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "stepz=2"]) == 2
    assert capsys.readouterr().err.strip().endswith("unknown config key stepz; did you mean steps?")
