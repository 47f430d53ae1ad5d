"""The model card (README.md) written beside each saved model: what it was trained from, how, in which
precision, where its metrics stood and how to load it, with the Hugging Face Hub's metadata block at its top.

The card is written to be published: its metadata is the Hub's (`huggingface_hub.ModelCardData` reads it), and
it holds no path of this machine. The base model is named by its Hub id when that is known (the id the run
was given, the cache folder the model is a snapshot of, or the id its config.json records) and left out
otherwise; a path in the config it shows is shortened to its last part."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import yaml

from parity.engines.models.io import SHIPPED_MODELS, ModelError, model_file, read_json
from parity.engines.precision import PRECISIONS, Precision

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
# A Hub repository id, ORG/NAME (the Hub's own rule: letters, digits, `-`, `_`, `.`, at most 96 characters each).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


def _is_hub_id(text: object) -> bool:
    return (
        isinstance(text, str)
        and HUB_ID.fullmatch(text) is not None
        and ".." not in text
        and "--" not in text
        and not text.endswith((".", "-"))
    )


def hub_id(model: str | None, model_dir: Path) -> str | None:
    """The Hub id of the model a run trained from, or None where none is known (a local directory, the
    built-in model): `model` when the run was given an id (read from the local cache), the id of the cache
    folder `model_dir` is a snapshot of (HUB/models--ORG--NAME/snapshots/REV), or an id its config.json
    records (`_name_or_path`). Never a path."""
    if model in SHIPPED_MODELS:
        return None
    if _is_hub_id(model) and not Path(model).expanduser().exists():
        return model
    snapshots, repo = model_dir.parent, model_dir.parent.parent
    if snapshots.name == "snapshots" and repo.name.startswith("models--"):
        name = repo.name.removeprefix("models--")
        if name.count("--") == 1 and _is_hub_id(name.replace("--", "/")):
            return name.replace("--", "/")
    try:
        recorded = read_json(model_file(model_dir, "config.json")).get("_name_or_path")
    except (ModelError, OSError):
        return None
    return recorded if _is_hub_id(recorded) else None


def _without_paths(value: Any) -> Any:
    """`value` (a config, nested) with every absolute path of this machine shortened to its last part."""
    if isinstance(value, dict):
        return {k: _without_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_paths(v) for v in value]
    if isinstance(value, str) and (PurePosixPath(value).is_absolute() or PureWindowsPath(value).is_absolute()):
        return PureWindowsPath(value).name if PureWindowsPath(value).drive else PurePosixPath(value).name
    return value


def usage(base: str | None, lora: bool, precision: str) -> str:
    """Loading code for the folder: transformers for a whole model, PEFT on its base for a LoRA adapter; in the
    precision the run sampled in, which is how the policy it trained behaves."""
    dtype = str(Precision(precision).dtype) if precision in PRECISIONS else "torch.float32"
    if lora:
        base_line = f'"{base}"' if base else '"BASE_MODEL"  # the base model trained on: its directory or Hub id'
        return (
            "```python\nimport torch\nfrom peft import PeftModel\nfrom transformers import AutoModelForCausalLM, "
            "AutoTokenizer\n\n"
            f"base = {base_line}\n"
            'adapter = "."  # this folder, or the Hub id it was pushed to\n'
            f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype={dtype}), adapter)\n"
            "tokenizer = AutoTokenizer.from_pretrained(base)\n"
            "```\n"
        )
    return (
        "```python\nimport torch\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        'path = "."  # this folder, or the Hub id it was pushed to\n'
        f"model = AutoModelForCausalLM.from_pretrained(path, dtype={dtype})\n"
        "tokenizer = AutoTokenizer.from_pretrained(path)\n"
        "```\n"
    )


def model_card(
    config: dict[str, Any], metrics: dict[str, float], step: int, model_dir: Path, lora: bool = False
) -> str:
    """Markdown with the Hub's metadata as YAML front matter: the base model's Hub id (`hub_id`; left out when
    unknown), the estimator and precisions, the step, the step's metrics (the card's own table, and the mean
    of each reward function, in training and held out), loading code, and the whole config without the
    paths of this machine. `model_dir`: the model the run trained from (a LoRA adapter's base)."""
    algorithm = config.get("algorithm", {}).get("name", "?")
    precision = config.get("precision", "?")
    trainer = config.get("trainer", {}).get("precision") or precision
    rollout = config.get("rollout", {}).get("precision") or precision
    base = hub_id(config.get("model"), Path(model_dir))
    meta: dict[str, Any] = {
        "library_name": "peft" if lora else "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["parity", "reinforcement-learning", algorithm] + (["lora"] if lora else []),
    }
    if base is not None:
        meta["base_model"] = base
    shown = [k for k in CARD_METRICS if k in metrics]
    shown += sorted(
        k for k in metrics if k.startswith(("reward/", "eval/reward/")) and k.endswith("/mean") and k not in shown
    )
    rows = "\n".join(f"| {k} | {metrics[k]:.4g} |" for k in shown)
    task = _without_paths(config.get("task", {}))
    rewards = ", ".join(task.get("reward_fn") or []) or f"task.name={task.get('name', '?')}"
    if base is not None:
        source = base
    elif config.get("model") in SHIPPED_MODELS:
        source = f"Parity's `{config['model']}` model"
    else:
        source = f"a local model ({Path(model_dir).name})"
    return (
        "---\n"
        + yaml.safe_dump(meta, sort_keys=False)
        + "---\n\n"
        + f"# RL fine-tuned from {source}\n\n"
        + f"{'LoRA adapters ' if lora else ''}Trained with Parity for {step} step{'s' * (step != 1)}: estimator "
        + f"`{algorithm}`, trainer "
        + f"precision {trainer}, rollout precision {rollout}{', exact mode' if config.get('exact') else ''}; rewards: "
        + f"{rewards}; data: {task.get('data', '?')}.\n\n"
        + (f"Metrics at step {step}:\n\n| metric | value |\n|---|---|\n{rows}\n\n" if rows else "")
        + f"## Usage\n\n{'With PEFT, on the base model' if lora else 'With transformers'}, in the precision the "
        + f"run sampled in ({rollout}):\n\n"
        + usage(base, lora, rollout)
        + "\n## The run's config\n\n```yaml\n"
        + yaml.safe_dump(_without_paths(config), sort_keys=False)
        + "```\n"
    )
