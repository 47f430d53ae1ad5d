"""The built-in model: `parity build-model` trains a loadable one, and the shipped one's accuracy is spread
(the built-in task: tests/unit/test_builtin.py)."""

from __future__ import annotations

import pytest
import torch

from parity.builtin.build import BuildConfig, accuracy_spread, build_model
from parity.engines import kernels
from parity.engines.models.io import BUILTIN_DIR, load_model


def test_build_model_command_writes_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "m"
    spread = build_model(out, BuildConfig(steps=3, eval_problems=4, eval_samples=2), log=lambda _: None)
    assert set(spread) == {"mean_accuracy", "spread_fraction", "solved_fraction", "unsolved_fraction"}
    assert load_model(out, kernels.numerics()).config == load_model(BUILTIN_DIR, kernels.numerics()).config
    assert AutoModelForCausalLM.from_pretrained(out) is not None


@pytest.mark.slow
def test_shipped_model_accuracy_is_spread():
    """At temperature 1 over 16 samples, >= 30% of held-out problems have accuracy in [0.2, 0.8]."""
    torch.manual_seed(0)
    spread = accuracy_spread(load_model("builtin", kernels.numerics()), BUILTIN_DIR, problems=128, samples=16, seed=123)
    assert spread["spread_fraction"] >= 0.3, spread
