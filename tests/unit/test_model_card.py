"""The model card written beside a saved model: Hub metadata that `huggingface_hub` reads, the base model by
its Hub id or not at all (never a path of this machine), and loading code for transformers or PEFT."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard, ModelCardData

from parity.rl.model_card import hub_id, model_card

METRICS = {"reward/mean": 0.5, "reward/accuracy": 0.5, "reward/correct/mean": 0.5, "eval/reward/correct/mean": 0.25}


def _config(model: str, tmp_path: Path, **more) -> dict:
    return {
        "model": model,
        "precision": "bf16",
        "run_dir": str(tmp_path / "runs" / "r"),
        "algorithm": {"name": "grpo"},
        "task": {
            "name": "builtin",
            "data": str(tmp_path / "data" / "train.jsonl"),
            "reward_fn": [f"{tmp_path}/r.py:ok"],
        },
        "eval": {"data": str(tmp_path / "data" / "eval.jsonl")},
        **more,
    }


def _model_dir(path: Path, config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    return path


def _snapshot(hub: Path, repo: str) -> Path:
    return _model_dir(hub / f"models--{repo.replace('/', '--')}" / "snapshots" / "abc123")


def test_the_base_model_is_a_hub_id_or_nothing(tmp_path):
    local = _model_dir(tmp_path / "models" / "tiny")
    assert hub_id("org/tiny-llama", _snapshot(tmp_path / "hub", "org/tiny-llama")) == "org/tiny-llama"
    # a model given as a directory: the cache folder it is a snapshot of, else the id its config records
    snapshot = _snapshot(tmp_path / "hub", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert hub_id(str(snapshot), snapshot) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    recorded = _model_dir(tmp_path / "recorded", {"model_type": "llama", "_name_or_path": "meta-llama/Llama-3.2-1B"})
    assert hub_id(str(recorded), recorded) == "meta-llama/Llama-3.2-1B"
    for i, path in enumerate(("/home/me/llama", "C:\\models\\llama", "./llama", "../org/x", "org/x/y", "org--x/y")):
        odd = _model_dir(tmp_path / f"odd{i}", {"model_type": "llama", "_name_or_path": path})
        assert hub_id(str(odd), odd) is None, path
    assert hub_id(str(local), local) is None
    assert hub_id("builtin", local) is None
    # a relative directory named like an id is a directory, not an id
    (tmp_path / "cwd" / "org" / "name").mkdir(parents=True)
    import os

    here = os.getcwd()
    os.chdir(tmp_path / "cwd")
    try:
        assert hub_id("org/name", local) is None
    finally:
        os.chdir(here)


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("known", [False, True])
def test_the_card_is_hub_metadata_without_a_path_of_this_machine(tmp_path, lora, known):
    model_dir = _snapshot(tmp_path / "hub", "org/tiny") if known else _model_dir(tmp_path / "models" / "tiny")
    text = model_card(_config(str(model_dir), tmp_path), METRICS, 3, model_dir, lora=lora)
    assert str(tmp_path) not in text and "/hub/" not in text
    card = ModelCard(text)
    assert isinstance(card.data, ModelCardData)
    data = card.data.to_dict()
    assert data["library_name"] == ("peft" if lora else "transformers")
    assert data["pipeline_tag"] == "text-generation" and "parity" in data["tags"] and "grpo" in data["tags"]
    if known:
        assert data["base_model"] == "org/tiny" and text.count("# RL fine-tuned from org/tiny\n") == 1
    else:
        assert "base_model" not in data and "# RL fine-tuned from a local model (tiny)\n" in text
    front = yaml.safe_load(text.split("---\n")[1])
    assert front == data  # nothing in the block that the Hub's reader drops
    # the config the card shows: the run's, its paths by their last part
    shown = yaml.safe_load(text.split("```yaml\n")[1].split("```")[0])
    assert shown["task"]["data"] == "train.jsonl" and shown["eval"]["data"] == "eval.jsonl"
    assert shown["task"]["reward_fn"] == ["r.py:ok"] and shown["run_dir"] == "r" and shown["precision"] == "bf16"
    assert "| eval/reward/correct/mean | 0.25 |" in text and "| reward/correct/mean | 0.5 |" in text
    # loading code: valid Python, for transformers or for PEFT on the base, in the rollout's precision
    code = re.search(r"## Usage\n\n.*?```python\n(.*?)```", text, re.S).group(1)
    compile(code, "usage", "exec")
    assert "dtype=torch.bfloat16" in code
    if lora:
        assert "PeftModel.from_pretrained(" in code
        assert ('base = "org/tiny"' if known else 'base = "BASE_MODEL"') in code
    else:
        assert "AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)" in code and "peft" not in code


def test_the_built_in_model_has_no_base_model(tmp_path):
    from parity.engines.models.io import BUILTIN_DIR

    text = model_card(_config("builtin", tmp_path), {}, 1, BUILTIN_DIR)
    assert "base_model" not in ModelCard(text).data.to_dict() and str(BUILTIN_DIR) not in text
    assert "# RL fine-tuned from Parity's `builtin` model\n" in text and "for 1 step:" in text
