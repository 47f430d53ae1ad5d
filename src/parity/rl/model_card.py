"""The model card (README.md) written beside each saved model: what it was trained from, how, in which
precision, and where its metrics stood, with the Hugging Face Hub's metadata block at its top."""

from __future__ import annotations

from typing import Any

import yaml

# The metrics a card shows, when the step logged them.
CARD_METRICS = (
    "reward/mean",
    "reward/accuracy",
    "eval/accuracy",
    "eval/reward_mean",
    "response/length_mean",
    "response/truncated_frac",
    "mismatch/k3",
)


def model_card(config: dict[str, Any], metrics: dict[str, float], step: int, base_model: str) -> str:
    """Markdown with YAML front matter: the base model, the estimator and precisions, the step, the
    step's metrics (the card's own table, and those whose names start `reward/`) and the whole config."""
    algorithm = config.get("algorithm", {}).get("name", "?")
    precision = config.get("precision", "?")
    trainer = config.get("trainer", {}).get("precision") or precision
    rollout = config.get("rollout", {}).get("precision") or precision
    meta = {"library_name": "parity", "tags": ["parity", "reinforcement-learning", algorithm], "base_model": base_model}
    shown = [k for k in CARD_METRICS if k in metrics]
    shown += sorted(k for k in metrics if k.startswith("reward/") and k.endswith("/mean") and k not in shown)
    rows = "\n".join(f"| {k} | {metrics[k]:.4g} |" for k in shown)
    task = config.get("task", {})
    rewards = ", ".join(task.get("reward_fn") or []) or f"task.name={task.get('name', '?')}"
    return (
        "---\n"
        + yaml.safe_dump(meta, sort_keys=False)
        + "---\n\n"
        + f"# RL fine-tuned from {base_model}\n\n"
        + f"Trained with Parity for {step} steps: estimator `{algorithm}`, trainer precision {trainer}, rollout "
        + f"precision {rollout}{', exact mode' if config.get('exact') else ''}; rewards: {rewards}; data: "
        + f"{task.get('data', '?')}.\n\n"
        + (f"Metrics at step {step}:\n\n| metric | value |\n|---|---|\n{rows}\n\n" if rows else "")
        + "The run's config:\n\n```yaml\n"
        + yaml.safe_dump(config, sort_keys=False)
        + "```\n"
    )
