"""Exact mode in training runs: every step's μ = π_old, with LoRA merged and unmerged, and the runtime check
that stops a run whose engines part (the engines themselves: tests/unit/test_exact.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY
from parity import config
from parity.engines import kernels
from parity.rl.loop import Run, TrainingError
from parity.rl.train_config import TrainConfig

TINY_RUN = [*TINY, "rollout.max_new_tokens=24", "checkpoint_every=-1"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_training_with_exact_mode_has_zero_mismatch_on_every_step(tmp_path, precision):
    """10 steps, 4 optimizer updates each (π_old from a learner pass), top-k/top-p sampling."""
    cfg = config.load(
        TrainConfig,
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"precision={precision}",
            "exact=true",
            "steps=10",
            "algorithm.num_minibatches=4",
            "rollout.top_k=8",
            "rollout.top_p=0.95",
            *TINY_RUN,
        ],
    )
    history = Run.create(cfg, progress=False).train()
    assert len(history) == 10
    assert all(m["mismatch/token_abs_log_ratio_max"] == 0.0 for m in history)
    assert all(m["mismatch/exact_tokens_frac"] == 1.0 for m in history)
    assert all(m["mismatch/k3"] == 0.0 for m in history)
    assert history[-1]["weights/version"] == 40


@pytest.mark.parametrize("merge", ["true", "false"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_exact_mode_with_lora_merged_and_unmerged(tmp_path, precision, merge):
    """LoRA adapters trained in exact mode: merged, both engines multiply by W + scale·B·A as merged in
    FP32; unmerged, the rollout engine adds each projection's adapter as the trainer does. The runtime
    check stops any step where a token's μ differs from π_old, or a checked distribution anywhere."""
    overrides = [f"run_dir={tmp_path / 'run'}", "exact=true", f"precision={precision}", "lora.rank=4"]
    overrides += [f"lora.merge={merge}", "lora.targets=q_proj,v_proj,down_proj", "trainer.lr=5e-3", "steps=3"]
    # 64 tokens: the built-in task's answers fit, so rewards vary and the adapters get a gradient
    cfg = config.load(TrainConfig, None, [*overrides, *TINY_RUN, "rollout.max_new_tokens=64", "eval.every=-1"])
    run = Run.create(cfg, progress=False)
    history = run.train()
    assert [m["mismatch/exact_tokens_frac"] for m in history] == [1.0] * 3
    assert all(m["full_vocab/max_abs_log_ratio"] == 0.0 for m in history)
    trained = [p for n, p in run.backend.trainer.model.named_parameters() if n.endswith("lora_B")]
    assert trained and all(float(p.detach().abs().max()) > 0 for p in trained)  # the adapters moved off zero


def test_the_runtime_check_stops_the_run_and_names_the_stage(tmp_path):
    """A rollout engine that leaves exact mode (here: its fused RMSNorm) stops the run at the first
    step, with the stage where the engines part, before the optimizer steps: no weight moves and
    nothing is synced or saved."""
    cfg = config.load(TrainConfig, None, [f"run_dir={tmp_path / 'run'}", "exact=true", "steps=3", *TINY_RUN])
    run = Run.create(cfg, progress=False)
    run.backend.sampler.engine.numerics = kernels.numerics(exact=False)
    before = {n: p.detach().clone() for n, p in run.backend.trainer.model.named_parameters()}
    with pytest.raises(TrainingError, match=r"step 1: exact=true, but .* engines first part at layer0\.input_norm"):
        run.train()
    assert all(torch.equal(p, before[n]) for n, p in run.backend.trainer.model.named_parameters())
    assert run.backend.trainer.weight_version == 0 and not (tmp_path / "run" / "checkpoints").exists()
