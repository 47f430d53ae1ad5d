"""`parity train`'s config refused before any work, naming the key (the runs: tests/e2e/test_train.py)."""

from __future__ import annotations

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
        (["task.chat_template=chatml"], "task.chat_template: unknown value 'chatml'; allowed: auto, none"),
        (["algorithm.clip_hi=0.3"], "unknown config key algorithm.clip_hi; allowed keys here: .*clip_high"),
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
