"""MoE in RL: the routing mismatch between the rollout engine and the trainer, and routing replay."""

from __future__ import annotations

import pytest
import torch

from architectures import save_random_model
from conftest import metrics
from parity.engines import kernels
from parity.engines.models.io import load_model
from parity.engines.sampler import Sampler
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import load_tokenizer

PROMPTS = ["12+34=", "7+8=", "123+4567+89=", "5+5=", "99+1=", "3+4+5="]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("moe"), "qwen3_moe", seed=3)


def _sample(path, rollout: str, trainer: str, replay: bool):
    tok, model = load_tokenizer(path), load_model(path, kernels.numerics())
    sampler = Sampler(
        model.config,
        rollout,
        trainer,
        tok.eos_ids,
        tok.pad_id,
        score_old=False,
        probe=False,
        micro_batch_tokens=256,
        numerics=kernels.numerics(),
        routing_replay=replay,
    )
    sampler.load_weights(model.state_dict(), version=0)
    batch = sampler.generate([tok.encode(p) for p in PROMPTS], 4, SamplingParams(max_new_tokens=24), seed=0)
    sampler.fill_old_logprobs(batch)
    gap = (batch.old_logprobs - batch.rollout_logprobs).abs()[batch.response_mask]
    return batch, gap


def test_same_precision_routes_alike(moe_dir):
    batch, gap = _sample(moe_dir, "fp32", "fp32", replay=False)
    assert batch.routing is not None and batch.routing.responses.shape[2:] == (2, 2)  # 2 MoE layers, top-2
    assert float(batch.routing_mismatch.max()) == 0.0
    assert gap.max() < 2e-5


def test_replay_removes_the_routing_part_of_the_mismatch(moe_dir):
    """BF16 rollout against an FP32 trainer: some tokens' experts differ. Replaying the rollout's
    experts in the trainer shrinks the log-prob gap; the routing mismatch is what the trainer's
    routers would pick, so the first MoE layer's is unchanged and later ones see replayed inputs."""
    plain, plain_gap = _sample(moe_dir, "bf16", "fp32", replay=False)
    replayed, replay_gap = _sample(moe_dir, "bf16", "fp32", replay=True)
    assert torch.equal(plain.response_ids, replayed.response_ids)
    assert float(plain.routing_mismatch.mean()) > 0
    assert plain.routing_mismatch[0] == replayed.routing_mismatch[0]
    assert (replayed.routing_mismatch <= plain.routing_mismatch).all()
    assert replay_gap.max() < plain_gap.max()
    assert replay_gap.mean() < plain_gap.mean()


def test_train_with_replay_logs_routing_and_trains_the_router(moe_dir, tmp_path):
    from parity.rl.loop import Run
    from parity.rl.train_config import TrainConfig

    cfg = TrainConfig(
        model=str(moe_dir),
        precision="fp32",
        steps=2,
        prompts_per_step=4,
        tensorboard=False,
        run_dir=str(tmp_path / "run"),
    )
    cfg.rollout.group_size, cfg.rollout.max_new_tokens = 4, 12
    cfg.task.name, cfg.moe.routing_replay = "length", True
    cfg.validate()
    run = Run.create(cfg, progress=False)
    before = run.backend.trainer.model.model.layers[0].mlp.gate.weight.detach().clone()
    run.train()
    assert not torch.equal(before, run.backend.trainer.model.model.layers[0].mlp.gate.weight.detach())
    logged = metrics(tmp_path / "run")
    assert all(row["moe/routing_mismatch"] == 0.0 for row in logged)  # FP32 both sides
    assert "moe/routing_mismatch_layer1" in logged[0]


def test_replay_refused_on_a_dense_model(llama_dir, tmp_path):
    from parity.config import ConfigError
    from parity.rl.loop import Run
    from parity.rl.train_config import TrainConfig

    cfg = TrainConfig(model=str(llama_dir), precision="fp32", steps=1, tensorboard=False, run_dir=str(tmp_path / "r"))
    cfg.moe.routing_replay = True
    cfg.validate()
    with pytest.raises(ConfigError, match="moe.routing_replay=true.*no experts"):
        Run.create(cfg, progress=False)
