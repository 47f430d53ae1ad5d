"""`parity.GRPOConfig`: TRL's `GRPOConfig` names and defaults (trl 1.16, trl/trainer/grpo_config.py, with the
`transformers.TrainingArguments` defaults it keeps), mapped onto Parity's keys: it returns a checked
`TrainConfig` that runs what `GRPOTrainer` would run with the same arguments, on one process. A name with
no Parity counterpart, or a value Parity cannot express, is a one-line ConfigError naming it
(docs/your-task.md, "TRL's names and reward semantics", has the table).

Counts: TRL's `max_steps`, `save_steps` and warmup count optimizer updates; a Parity step is one
generation batch, trained on in `algorithm.num_minibatches` updates per epoch for `algorithm.ppo_epochs`
epochs, so these are divided by the updates per step.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

from parity import config as config_mod
from parity.config import ConfigError, shown
from parity.rl.train_config import MAX_STEPS, TrainConfig

# TRL's names that Parity maps, with TRL's defaults (GRPOConfig's; TrainingArguments' where GRPOConfig keeps
# them). `bf16=None` is TRL's "True unless fp16", `warmup_ratio=None` no warmup by ratio.
TRL_DEFAULTS: dict[str, Any] = {
    "learning_rate": 1e-6,
    "num_generations": 8,
    "max_completion_length": 512,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "beta": 0.0,
    "use_bias_correction_kl": True,
    "epsilon": 0.2,
    "epsilon_high": None,
    "num_iterations": 1,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "generation_batch_size": None,
    "steps_per_generation": None,
    "max_steps": -1,
    "loss_type": "dapo",
    "importance_sampling_level": "token",
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "scale_rewards": "group",
    "multi_objective_aggregation": "sum_then_normalize",
    "reward_weights": None,
    "mask_truncated_completions": False,
    "lr_scheduler_type": "linear",
    "warmup_steps": 0,
    "warmup_ratio": None,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "max_grad_norm": 1.0,
    "gradient_checkpointing": True,  # transformers 5's deprecated name of activation_checkpointing
    "activation_checkpointing": None,  # None: gradient_checkpointing's value
    "logging_steps": 10,  # how often TRL logs; Parity logs every step whatever it is
    "bf16": None,
    "fp16": False,
    "seed": 42,
    "output_dir": None,
    "save_strategy": "steps",
    "save_steps": 500,
    "save_total_limit": None,
    "log_completions": False,
    "num_completions_to_print": None,
}
# TRL's names whose behaviour Parity has at one value only (TRL's default): that value is taken, another is
# refused, saying so.
FIXED: dict[str, tuple[Any, str]] = {
    "use_vllm": (False, "Parity samples with its own rollout engine"),
    "delta": (None, "Parity's PPO clip has no upper bound on r for A < 0 (INTELLECT-2's two-sided clip)"),
    "min_p": (None, "Parity samples with temperature, top_k and top_p"),
    "repetition_penalty": (1.0, "Parity samples with temperature, top_k and top_p"),
    "top_entropy_quantile": (1.0, "Parity trains on every token"),
    "off_policy_mask_threshold": (None, "Parity's off-policy sequence mask is algorithm.name=grpo_opsm"),
    "num_train_epochs": (3.0, "Parity counts steps: give max_steps"),
    "remove_unused_columns": (False, "Parity gives reward functions every column of the data"),
    "shuffle_dataset": (True, "Parity draws the prompts in a fresh seeded permutation every epoch"),
    "entropy_coef": (0.0, "Parity's losses have no entropy term"),
    "use_adaptive_entropy": (False, "Parity's losses have no entropy term"),
    "push_to_hub": (False, "push the trained model with Trainer.push_to_hub(repo_id) or parity.push_to_hub"),
    "use_liger_kernel": (False, "Parity computes the loss with its own kernels"),
    "torch_compile": (False, "Parity compiles what it compiles itself"),
    "report_to": ("none", "trackers are Parity's log.to key (wandb, trackio, mlflow)"),
}
# TRL's (and transformers') names that change nothing Parity trains or writes: taken, whatever their value.
IGNORED = frozenset(
    {
        "logging_dir",
        "logging_strategy",
        "logging_first_step",
        "run_name",
        "disable_tqdm",
        "log_level",
        "dataloader_num_workers",
        "dataloader_pin_memory",
        "dataloader_persistent_workers",
        "dataloader_prefetch_factor",
        "gradient_checkpointing_kwargs",
        "activation_checkpointing_kwargs",
        "disable_dropout",  # Parity's models run without dropout
        "do_train",
        "skip_memory_metrics",
    }
)
# The Parity key each TRL name sets alone, for a value Parity refuses to be named as the user wrote it.
SETS = {
    "rollout.group_size": "num_generations",
    "rollout.max_new_tokens": "max_completion_length",
    "rollout.temperature": "temperature",
    "rollout.top_p": "top_p",
    "rollout.top_k": "top_k",
    "trainer.lr": "learning_rate",
    "trainer.weight_decay": "weight_decay",
    "trainer.beta1": "adam_beta1",
    "trainer.beta2": "adam_beta2",
    "trainer.eps": "adam_epsilon",
    "trainer.grad_clip": "max_grad_norm",
    "algorithm.clip_low": "epsilon",
    "algorithm.clip_high": "epsilon_high",
    "algorithm.kl_coef": "beta",
    "algorithm.tau_pos": "sapo_temperature_pos",
    "algorithm.tau_neg": "sapo_temperature_neg",
    "algorithm.scale_rewards": "scale_rewards",
    "algorithm.multi_objective_aggregation": "multi_objective_aggregation",
    "task.reward_weights": "reward_weights",
    "seed": "seed",
    "run_dir": "output_dir",
    "keep_checkpoints": "save_total_limit",
}
# loss_type -> (algorithm.name, algorithm.aggregation): how TRL normalises each loss (compute_loss).
LOSS_TYPES = {
    "grpo": ("grpo", "seq_mean_token_mean"),  # each sequence's token mean, mean over sequences
    "dr_grpo": ("grpo", "seq_mean_token_sum_norm"),  # Σ loss / (sequences · max_completion_length)
    "dapo": ("grpo", "token_mean"),  # Σ loss / tokens of the whole update
    # TRL: Σ loss / tokens of each micro-batch, averaged over accumulation steps; Parity divides by the
    # update's tokens (the same with one micro-batch per update, as dapo otherwise)
    "bnpo": ("grpo", "token_mean"),
    "cispo": ("cispo", "token_mean"),
    "sapo": ("sapo", "seq_mean_token_mean"),
}


def _refuse(name: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"GRPOConfig({name}={shown(value)}): {why}")


def grpo_config(**given: Any) -> TrainConfig:
    """A `TrainConfig` from TRL's `GRPOConfig` names (TRL's defaults for those not given)."""
    unknown = [name for name in given if name not in TRL_DEFAULTS and name not in FIXED and name not in IGNORED]
    if unknown:
        close = difflib.get_close_matches(unknown[0], [*TRL_DEFAULTS, *FIXED], n=1, cutoff=0.75)
        table = 'docs/your-task.md, "TRL\'s names and reward semantics"'
        hint = f"; did you mean {close[0]}?" if close else f" (the names it maps: {table})"
        raise ConfigError(f"GRPOConfig: {', '.join(unknown)}: no Parity counterpart{hint}")
    for name, value in given.items():
        if name == "report_to" and value in ("none", None, [], ["none"]):
            continue  # transformers' spellings of no tracker
        if name in FIXED and value != FIXED[name][0]:
            fixed, why = FIXED[name]
            raise _refuse(name, value, f"{why}; only {name}={fixed!r} is taken")
    t = {**TRL_DEFAULTS, **{k: v for k, v in given.items() if k in TRL_DEFAULTS}}
    # TRL's chat form: completions as messages on chat prompts; a string prompt encoded as raw text
    keys: dict[str, Any] = {"task.completion_format": "auto", "task.chat_template": "messages"}

    # Batches: a Parity step is TRL's generation batch (generation_batch_size completions of
    # num_generations each), trained in updates of per_device_train_batch_size × gradient_accumulation_steps.
    g, per_device = t["num_generations"], t["per_device_train_batch_size"]
    accumulation = t["gradient_accumulation_steps"]
    for name in ("num_generations", "per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations"):
        if isinstance(t[name], bool) or not isinstance(t[name], int) or t[name] < 1:
            raise _refuse(name, t[name], "expected a positive integer")
    batch, per_generation = t["generation_batch_size"], t["steps_per_generation"]
    if batch is not None and per_generation is not None:
        raise _refuse("generation_batch_size", batch, "and steps_per_generation can not both be set (as in TRL)")
    if batch is None:
        per_generation = accumulation if per_generation is None else per_generation
        batch = per_device * per_generation
    elif batch % per_device:
        raise _refuse("generation_batch_size", batch, f"must be divisible by per_device_train_batch_size={per_device}")
    else:
        per_generation = batch // per_device
    if batch % g:
        raise _refuse("generation_batch_size", batch, f"must be divisible by num_generations={g}")
    if per_generation % accumulation:
        raise _refuse(
            "steps_per_generation",
            per_generation,
            f"must be a multiple of gradient_accumulation_steps={accumulation}: an update is within one generation",
        )
    update_rows = per_device * accumulation
    if update_rows % g:
        raise _refuse(
            "per_device_train_batch_size",
            per_device,
            f"× gradient_accumulation_steps={accumulation} = {update_rows} completions per update: Parity's updates "
            f"hold whole groups, a multiple of num_generations={g}",
        )
    minibatches = per_generation // accumulation
    updates = minibatches * t["num_iterations"]  # optimizer updates per Parity step
    keys.update(
        {
            "prompts_per_step": batch // g,
            "rollout.group_size": g,
            "algorithm.num_minibatches": minibatches,
            "algorithm.ppo_epochs": t["num_iterations"],
            "rollout.max_new_tokens": t["max_completion_length"],
            "rollout.temperature": t["temperature"],
            "rollout.top_p": t["top_p"],
            "rollout.top_k": t["top_k"],
        }
    )

    def of_max_steps(name: str, count: float) -> float:
        """A count below 1 is a fraction of max_steps, rounded up (transformers' warmup, save and logging)."""
        if isinstance(count, bool) or not isinstance(count, (int, float)) or count < 0:
            raise _refuse(name, count, "expected a count of steps, or a fraction of max_steps below 1")
        if 0 < count < 1:
            if t["max_steps"] == -1:
                raise _refuse(name, count, "is a fraction of max_steps: give max_steps (Parity counts steps)")
            return math.ceil(t["max_steps"] * count)
        if count != int(count) and name != "warmup_steps":  # transformers truncates a warmup of 2.5 to 2
            raise _refuse(name, count, "must be a whole number of steps when 1 or more (as in transformers)")
        return int(count)

    logging = t["logging_steps"]  # checked only: Parity logs every step
    if isinstance(logging, bool) or not isinstance(logging, (int, float)) or logging <= 0:
        raise _refuse("logging_steps", logging, "expected a positive count of steps or a fraction of them")

    def steps_of(name: str, count: int) -> int:
        count = of_max_steps(name, count)
        if count % updates:
            raise _refuse(name, count, f"counts optimizer updates; a Parity step makes {updates}: give a multiple")
        return count // updates

    if t["max_steps"] != -1:
        keys["steps"] = steps_of("max_steps", t["max_steps"])

    # The loss.
    loss_type = t["loss_type"]
    if loss_type not in LOSS_TYPES:
        raise _refuse("loss_type", loss_type, f"Parity has no such estimator (it maps {', '.join(LOSS_TYPES)})")
    name, aggregation = LOSS_TYPES[loss_type]
    if t["importance_sampling_level"] == "sequence":
        if loss_type != "grpo":
            raise _refuse(
                "importance_sampling_level", "sequence", "is GSPO, which Parity defines per sequence: loss_type='grpo'"
            )
        name = "gspo"
    elif t["importance_sampling_level"] != "token":
        raise _refuse("importance_sampling_level", t["importance_sampling_level"], "expected 'token' or 'sequence'")
    keys.update({"algorithm.name": name, "algorithm.aggregation": aggregation})
    high = t["epsilon"] if t["epsilon_high"] is None else t["epsilon_high"]
    if name == "cispo":  # TRL clamps the ratio at epsilon_high; Parity's cispo at 1 + clip_high
        if not high > 1:
            raise _refuse("epsilon_high", high, "with loss_type='cispo' caps the ratio itself: must be > 1 (TRL's 5.0)")
        keys["algorithm.clip_high"] = high - 1
    elif name == "sapo":
        keys.update({"algorithm.tau_pos": t["sapo_temperature_pos"], "algorithm.tau_neg": t["sapo_temperature_neg"]})
    else:
        keys.update({"algorithm.clip_low": t["epsilon"], "algorithm.clip_high": high})
    if t["beta"]:
        if t["use_bias_correction_kl"]:
            raise _refuse(
                "beta",
                t["beta"],
                "with use_bias_correction_kl=True (TRL's default) weighs the KL term by the ratio, which Parity's "
                "does not; pass use_bias_correction_kl=False for the k3 KL Parity computes",
            )
        keys.update({"algorithm.kl_coef": t["beta"], "algorithm.kl_estimator": "k3"})
    if t["multi_objective_aggregation"] == "normalize_then_sum":
        keys["algorithm.multi_objective_aggregation"] = "normalize_then_sum"
    else:
        keys["algorithm.multi_objective_aggregation"] = t["multi_objective_aggregation"]
        keys["algorithm.scale_rewards"] = t["scale_rewards"]
    keys["algorithm.truncated"] = "drop" if t["mask_truncated_completions"] else "keep"
    if t["reward_weights"] is not None:
        keys["task.reward_weights"] = t["reward_weights"]

    # The optimizer and its schedule.
    schedules = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
    if t["lr_scheduler_type"] not in schedules:
        raise _refuse("lr_scheduler_type", t["lr_scheduler_type"], f"Parity's schedules are {', '.join(schedules)}")
    warmup = of_max_steps("warmup_steps", t["warmup_steps"])
    if not warmup and t["warmup_ratio"]:  # transformers < 5's name
        if t["max_steps"] == -1:
            raise _refuse("warmup_ratio", t["warmup_ratio"], "needs max_steps (Parity counts steps, not epochs)")
        warmup = math.ceil(t["max_steps"] * t["warmup_ratio"])
    if t["lr_scheduler_type"] == "constant" and warmup:
        raise _refuse("warmup_steps", warmup, "with lr_scheduler_type='constant' (use 'constant_with_warmup')")
    keys.update(
        {
            "trainer.lr": t["learning_rate"],
            "trainer.lr_schedule": schedules[t["lr_scheduler_type"]],
            "trainer.warmup_steps": math.ceil(warmup / updates),
            "trainer.weight_decay": t["weight_decay"],
            "trainer.beta1": t["adam_beta1"],
            "trainer.beta2": t["adam_beta2"],
            "trainer.eps": t["adam_epsilon"],
            "trainer.grad_clip": t["max_grad_norm"],
            "trainer.activation_checkpointing": (
                t["gradient_checkpointing"] if t["activation_checkpointing"] is None else t["activation_checkpointing"]
            ),
            "seed": t["seed"],
        }
    )
    if t["fp16"] and t["bf16"]:
        raise _refuse("fp16", True, "and bf16=True: give one")
    keys["precision"] = "fp16" if t["fp16"] else "bf16" if t["bf16"] in (None, True) else "fp32"

    # The run directory, checkpoints and the completions printed.
    if t["output_dir"] is not None:
        keys["run_dir"] = t["output_dir"]
    if t["save_strategy"] == "no":
        keys["checkpoint_every"] = -1
    elif t["save_strategy"] == "steps":
        keys["checkpoint_every"] = steps_of("save_steps", t["save_steps"])
    else:
        raise _refuse("save_strategy", t["save_strategy"], "Parity saves every checkpoint_every steps: 'steps' or 'no'")
    keys["keep_checkpoints"] = MAX_STEPS if t["save_total_limit"] is None else t["save_total_limit"]
    shown_rows = t["num_completions_to_print"] or batch
    keys["log.completions"] = shown_rows if t["log_completions"] else 0
    try:
        return config_mod.load(TrainConfig, None, None, keys)
    except ConfigError as e:  # a value Parity refuses, named as the user gave it
        key = next((k for k in sorted(SETS, key=len, reverse=True) if str(e).startswith(k)), None)
        if key is None or SETS[key] not in given:
            raise
        raise _refuse(SETS[key], given[SETS[key]], str(e)) from None
