"""The parts of a distributed run that need no cluster: the config's refusals, joining batches, and a
rollout worker's check of the weights it is sent."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import SMALL
from parity import config
from parity.config import ConfigError
from parity.distributed.actors import RolloutWorker
from parity.distributed.sync import SyncError, pack_weights
from parity.engines import kernels
from parity.engines.batch import concat_batches
from parity.engines.models.io import load_model, resolve_model_dir
from parity.engines.sampler import Sampler
from parity.engines.sampling import SamplingParams
from parity.rl.train_config import TrainConfig


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["distributed.learners=2"], "needs distributed.rollout_workers >= 1"),
        (["async.max_staleness=1"], "asynchronous training needs rollout workers"),
        (["distributed.rollout_workers=1", "distributed.learners=3"], "must divide the rows of a mini-batch"),
        (["distributed.rollout_workers=9"], "more than prompts_per_step"),
        (["async.max_staleness=-1"], r"async\.max_staleness"),
        (["distributed.address=auto"], r"distributed.address=auto: the cluster to run rollout workers"),
    ],
)
def test_bad_distributed_combinations_are_refused_before_any_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.load(TrainConfig, None, SMALL + overrides)


def test_where_and_how_long_a_distributed_run_waits_may_change_on_resume(tmp_path):
    """A run stopped because Ray took longer than distributed.restart_timeout_s to restart a worker is told to
    raise that key; `--resume RUN distributed.restart_timeout_s=...` was refused ("cannot change on resume"),
    and so was a new address for a cluster that came back elsewhere: that run could not be continued at all.
    Where the run's processes run and how long it waits for them train nothing else."""
    from parity.rl.run_setup import resumed_config

    run = tmp_path / "run"
    run.mkdir()
    cfg = config.load(TrainConfig, None, [*SMALL, f"run_dir={run}", "distributed.rollout_workers=1"])
    (run / "config.yaml").write_text(config.dump_yaml(cfg))
    changes = ["distributed.restart_timeout_s=3600", "distributed.connect_timeout_s=120", "distributed.address=auto"]
    resumed = resumed_config(run, changes, trust_code=False, note=lambda line: None)
    d = resumed.distributed
    assert (d.restart_timeout_s, d.connect_timeout_s, d.address) == (3600, 120, "auto")


# ----------------------------------------------------------------------------- pieces


def test_concat_batches_keeps_rows_and_groups():
    model_dir = resolve_model_dir("builtin")
    model = load_model(model_dir, kernels.numerics())
    sampler = Sampler(
        model.config,
        "fp32",
        "fp32",
        (2,),
        0,
        score_old=True,
        probe=False,
        micro_batch_tokens=8192,
        numerics=kernels.numerics(),
    )
    sampler.load_weights({k: v for k, v in model.state_dict().items()}, 0)
    sampling = SamplingParams(max_new_tokens=12, top_k=8)
    a = sampler.generate([[5, 6, 7]], 2, sampling, seed=1)
    b = sampler.generate([[5, 6], [9, 9, 9, 9]], 3, sampling, seed=2)
    for part in (a, b):
        sampler.fill_old_logprobs(part)
    both = concat_batches([a, b])
    assert both.response_ids.shape[0] == 2 + 6
    assert both.group_index.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert both.num_tokens == a.num_tokens + b.num_tokens
    assert torch.equal(both.rollout_logprobs[2:, : b.response_ids.shape[1]], b.rollout_logprobs)
    assert torch.equal(both.old_logprobs[:2, : a.response_ids.shape[1]], a.old_logprobs)
    assert (both.support[:2, a.support.shape[1] :] == -1).all()


def test_every_learner_runs_as_many_micro_batches_as_the_others():
    """Under FSDP2 each micro-batch's forward and backward are collectives every learner joins: a learner whose
    share packs into fewer micro-batches left the others waiting in a gather for ever (2 learners,
    trainer.micro_batch_tokens=100, hung in step 1). Here learner 0's long rows need two micro-batches of 10
    tokens, learner 1's short ones one; both now run two."""
    from parity.engines.batch import RolloutBatch
    from parity.engines.trainer import OptimConfig, Trainer
    from parity.rl.step import Prepared, UpdatePlan, train_on_batch

    lengths = torch.tensor([6, 6, 1, 1])
    mask = torch.arange(6) < lengths[:, None]
    batch = RolloutBatch(
        prompt_ids=[[1] * 4, [2] * 4, [3] * 4, [4] * 4],
        response_ids=torch.zeros(4, 6, dtype=torch.long),
        response_mask=mask,
        rollout_logprobs=torch.zeros(4, 6),
        support=None,
        truncated=torch.zeros(4, dtype=torch.bool),
        group_index=torch.tensor([0, 0, 1, 1]),
        weight_version=0,
        sampling=SamplingParams(),
    )
    prepared = Prepared(
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
        advantages=torch.tensor([0.5, -0.5, 0.5, -0.5]),
        loss_mask=mask,
        rejected=None,
        old_logprobs=torch.zeros(4, 6),
        old_source="sampler",
    )
    cfg = config.load(TrainConfig, None, ["precision=fp32"])
    plan = UpdatePlan(cfg.algorithm.build(), micro_batch_tokens=10, prompts=2, group_size=2, max_new_tokens=6)
    model = load_model(resolve_model_dir("builtin"), kernels.numerics())

    def passes(rank: int) -> list[list[int]]:  # the rows of each π_θ pass learner `rank` runs
        trainer, rows_seen = Trainer(model, "fp32", OptimConfig(lr=0.0)), []
        real = trainer.batch_logprobs
        trainer.batch_logprobs = lambda batch, rows, *args: rows_seen.append(rows.tolist()) or real(batch, rows, *args)
        train_on_batch(trainer, batch, prepared, plan, order_seed=0, rank=rank, world=2)
        return rows_seen

    assert [passes(0), passes(1)] == [[[0], [1]], [[2], [3]]]


def test_weight_sync_verification_names_the_damaged_tensor():
    """A worker loads a sync, checks both of its copies, and refuses one damaged in transit."""
    model_dir = resolve_model_dir("builtin")
    state = {k: v for k, v in load_model(model_dir, kernels.numerics()).named_parameters()}
    bf16 = config.load(TrainConfig, None, ["precision=bf16"])
    worker = RolloutWorker(0, str(model_dir), bf16, threads=None)
    tensors, manifest = pack_weights(state, 3, "bf16", "bf16")
    assert manifest.wire_dtype == "bfloat16" and manifest.engine == manifest.scorer
    assert worker.load_weights(tensors, manifest)["verified"] == 1.0
    assert worker.sampler.weight_version == 3

    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][3, 5] += 1.0  # one value damaged after the checksums were taken
    with pytest.raises(SyncError, match=re.escape(f"v3: {name} in rollout worker 0 (rollout engine)")):
        worker.load_weights(tensors, manifest)

    # Mixed precisions send FP32 (the π_old scorer needs the master weights) with two checksum sets.
    tensors, manifest = pack_weights(state, 4, "bf16", "fp32")
    assert manifest.wire_dtype == "float32" and manifest.engine != manifest.scorer
    mixed = ["rollout.precision=bf16", "trainer.precision=fp32", "allow_precision_mismatch=true"]
    mixed.append("algorithm.probe=true")
    worker = RolloutWorker(1, str(model_dir), config.load(TrainConfig, None, mixed), threads=None)
    assert worker.load_weights(tensors, manifest)["verified"] == 1.0


def test_a_workers_tools_that_cannot_be_imported_are_its_first_answer_not_a_failed_start(tmp_path):
    """A rollout worker whose episodes' code cannot be imported failed in __init__, which the driver met as
    Ray's ActorDiedError, a traceback; the worker now starts and `pid`, the driver's first call, raises it."""
    cfg = config.load(TrainConfig, None, ["model=builtin-agent", f"task.tools={tmp_path / 'gone.py'}:lookup"])
    worker = RolloutWorker(0, str(resolve_model_dir("builtin-agent")), cfg, threads=None)
    with pytest.raises(ConfigError, match=r"^task.tools: importing '.*gone.py' failed: FileNotFoundError"):
        worker.pid()


def test_a_script_s_run_started_again_as_its_code_is_imported_by_name_is_refused(tmp_path):
    """An unguarded script's tools, imported by name in a rollout worker, ran the script's `parity.train` again
    there: a second run, waiting for ever on the first one's cluster."""
    from parity.rl.reward_fns import import_reward_fn

    script = tmp_path / "train_agent.py"
    script.write_text("import parity\n\ndef lookup(key):\n    return key\n\nparity.train('builtin-agent')\n")
    with pytest.raises(ConfigError, match=r"parity.Trainer was called as Parity imported .*train_agent.py:lookup"):
        import_reward_fn(f"{script}:lookup", key="task.tools")
    assert not (tmp_path / "runs").exists()


def test_a_tool_a_rollout_worker_cannot_import_by_name_is_refused_up_front(tmp_path):
    import parity

    def lookup(key: str) -> str:
        """The value under a key."""
        return key

    rows = [{"prompt": [{"role": "user", "content": "a?"}], "answer": 1}]
    with pytest.raises(ConfigError, match=r"^tool '.*lookup': distributed.rollout_workers=1 import it by name"):
        parity.Trainer("builtin-agent", rows, tools=[lookup], distributed__rollout_workers=1, run_dir=tmp_path / "r")


def test_more_processes_than_a_machine_holds_are_refused_before_the_cluster_starts(tmp_path, monkeypatch, capsys):
    """64 rollout workers on 2 CPUs were accepted: minutes of start-up, Ray's workers aborting, then out of memory."""
    from parity.cli import main

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    args = ["model=builtin", "prompts_per_step=64", "rollout.group_size=2", "distributed.rollout_workers=64"]
    assert main(["train", *args, f"run_dir={tmp_path / 'r'}"]) == 2
    assert "65 processes, each with its model, on this machine's 2 CPUs; at most 8" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
