"""`parity.GRPOConfig`: TRL's GRPOConfig names and defaults mapped onto Parity's keys (rl/trl_config.py)."""

from __future__ import annotations

import pytest

import parity
from parity import config
from parity.config import ConfigError


def test_trl_defaults_map_onto_parity_keys():
    c = parity.GRPOConfig()
    assert (c.rollout.group_size, c.rollout.max_new_tokens, c.rollout.temperature) == (8, 512, 1.0)
    assert (c.prompts_per_step, c.algorithm.num_minibatches, c.algorithm.ppo_epochs) == (1, 1, 1)
    assert (c.algorithm.name, c.algorithm.aggregation) == ("grpo", "token_mean")  # loss_type="dapo"
    assert (c.algorithm.clip_low, c.algorithm.clip_high, c.algorithm.kl_coef) == (0.2, 0.2, 0.0)
    assert (c.algorithm.advantage, c.algorithm.truncated) == ("trl_group", "keep")
    assert (c.trainer.lr, c.trainer.lr_schedule, c.trainer.grad_clip, c.seed) == (1e-6, "linear", 1.0, 42)
    assert c.trainer.activation_checkpointing and c.precision == "bf16"
    assert c.task.completion_format == "auto" and c.log.completions == 0 and c.checkpoint_every == 500
    assert parity.TrainConfig().precision == "fp16"  # Parity's own defaults are Parity's


@pytest.mark.parametrize(
    ("loss_type", "name", "aggregation"),
    [
        ("grpo", "grpo", "seq_mean_token_mean"),
        ("dr_grpo", "grpo", "seq_mean_token_sum_norm"),
        ("dapo", "grpo", "token_mean"),
        ("bnpo", "grpo", "token_mean"),
        ("sapo", "sapo", "seq_mean_token_mean"),
    ],
)
def test_loss_types(loss_type, name, aggregation):
    c = parity.GRPOConfig(loss_type=loss_type)
    assert (c.algorithm.name, c.algorithm.aggregation) == (name, aggregation)


def test_batches_counts_and_the_rest():
    c = parity.GRPOConfig(
        num_generations=4,
        per_device_train_batch_size=8,
        steps_per_generation=4,
        num_iterations=2,
        max_steps=80,
        save_steps=16,
        warmup_ratio=0.1,
        max_completion_length=32,
        epsilon=0.1,
        epsilon_high=0.28,
        scale_rewards="batch",
        reward_weights=[1.0, 0.5],
        mask_truncated_completions=True,
        output_dir="runs/x",
        fp16=True,
        lr_scheduler_type="cosine",
    )
    # a generation of 8 × 4 = 32 completions (8 prompts), 4 updates of 8 rows, twice: 8 updates a step
    assert (c.prompts_per_step, c.rollout.group_size, c.algorithm.num_minibatches) == (8, 4, 4)
    assert (c.algorithm.ppo_epochs, c.steps, c.checkpoint_every, c.trainer.warmup_steps) == (2, 10, 2, 1)
    assert (c.algorithm.clip_low, c.algorithm.clip_high, c.algorithm.advantage) == (0.1, 0.28, "trl_batch")
    assert c.task.reward_weights == [1.0, 0.5] and c.algorithm.truncated == "drop"
    assert (c.run_dir, c.precision, c.trainer.lr_schedule) == ("runs/x", "fp16", "cosine")
    c = parity.GRPOConfig(loss_type="cispo", epsilon_high=5.0, multi_objective_aggregation="normalize_then_sum")
    assert (c.algorithm.name, c.algorithm.clip_high, c.algorithm.advantage) == ("cispo", 4.0, "trl_normalize_then_sum")
    sequence = dict(importance_sampling_level="sequence", loss_type="grpo")
    c = parity.GRPOConfig(**sequence, beta=0.01, use_bias_correction_kl=False)
    assert (c.algorithm.name, c.algorithm.kl_coef, c.algorithm.kl_estimator) == ("gspo", 0.01, "k3")
    assert config.to_dict(config.load(parity.TrainConfig, None, None, config.to_dict(c))) == config.to_dict(c)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"loss_type": "vespo"}, r"^GRPOConfig\(loss_type='vespo'\): Parity has no such estimator"),
        ({"loss_type": "luspo"}, r"^GRPOConfig\(loss_type='luspo'\)"),
        ({"num_generation": 4}, r"^GRPOConfig: num_generation: no Parity counterpart; did you mean num_generations\?$"),
        ({"vllm_mode": "server", "foo": 1}, r"^GRPOConfig: vllm_mode, foo: no Parity counterpart"),
        ({"use_vllm": True}, r"^GRPOConfig\(use_vllm=True\): Parity samples with its own rollout engine"),
        ({"logging_steps": 0}, r"^GRPOConfig\(logging_steps=0\): expected a positive count"),
        ({"warmup_steps": 0.1}, r"^GRPOConfig\(warmup_steps=0.1\): is a fraction of max_steps: give max_steps"),
        ({"save_steps": 2.5}, r"^GRPOConfig\(save_steps=2.5\): must be a whole number of steps"),
        ({"beta": 0.04}, r"^GRPOConfig\(beta=0.04\): with use_bias_correction_kl=True"),
        ({"loss_type": "cispo"}, r"^GRPOConfig\(epsilon_high=0.2\): with loss_type='cispo' caps the ratio"),
        ({"num_generations": 3}, r"^GRPOConfig\(generation_batch_size=8\): must be divisible by num_generations=3"),
        ({"num_generations": 16, "generation_batch_size": 32}, r"× gradient_accumulation_steps=1 = 8 completions"),
        ({"max_steps": 3, "num_iterations": 2}, r"^GRPOConfig\(max_steps=3\): counts optimizer updates"),
        # a value Parity refuses is named as the user gave it (it was named by Parity's key only)
        ({"max_completion_length": 0}, r"^GRPOConfig\(max_completion_length=0\): rollout.max_new_tokens must be >= 1"),
        ({"scale_rewards": "std"}, r"^GRPOConfig\(scale_rewards='std'\): algorithm.scale_rewards: unknown value"),
        ({"temperature": 0.0}, r"^GRPOConfig\(temperature=0.0\): rollout.temperature must be > 0"),
        ({"learning_rate": -1}, r"^GRPOConfig\(learning_rate=-1\): trainer.lr: must be > 0"),
        ({"push_to_hub": True}, r"^GRPOConfig\(push_to_hub=True\): push the trained model with Trainer.push_to_hub"),
        ({"report_to": "wandb"}, r"^GRPOConfig\(report_to='wandb'\): trackers are Parity's log.to key"),
    ],
)
def test_what_parity_cannot_express_is_one_line(given, message):
    with pytest.raises(ConfigError, match=message) as raised:
        parity.GRPOConfig(**given)
    assert "\n" not in str(raised.value)


def test_trl_s_names_that_change_nothing_parity_trains_are_taken():
    """A TRL script's config line failed on report_to="none", remove_unused_columns=False, logging_dir, ..."""
    plain = config.to_dict(parity.GRPOConfig())
    harmless = dict(
        report_to="none",
        remove_unused_columns=False,
        shuffle_dataset=True,
        entropy_coef=0.0,
        push_to_hub=False,
        logging_dir="logs",
        run_name="mine",
        disable_dropout=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    assert config.to_dict(parity.GRPOConfig(**harmless)) == plain
    assert config.to_dict(parity.GRPOConfig(report_to=[])) == plain


def test_transformers_5_s_fractions_and_names():
    """transformers 5 (TRL 1.16's): a warmup or save interval below 1 is a fraction of max_steps, rounded up;
    activation_checkpointing is gradient_checkpointing's new name and wins where given; logging_steps is
    taken at any value (TRL's default is 10; Parity logs every step)."""
    c = parity.GRPOConfig(max_steps=20, warmup_steps=0.1, save_steps=0.5, logging_steps=10)
    assert (c.trainer.warmup_steps, c.checkpoint_every) == (2, 10)
    assert parity.GRPOConfig(warmup_steps=2.5).trainer.warmup_steps == 2  # truncated, as transformers does
    assert parity.GRPOConfig().trainer.activation_checkpointing is True  # TRL's default
    off = parity.GRPOConfig(activation_checkpointing=False, gradient_checkpointing=True)
    assert off.trainer.activation_checkpointing is False
