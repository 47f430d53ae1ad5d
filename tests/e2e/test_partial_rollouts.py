"""Partial rollouts: responses continued on newer weights, each token scored on the weights that sampled it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from conftest import ONE_RAY_AT_A_TIME, SMALL, metrics
from parity import config
from parity.cli import main
from parity.config import ConfigError
from parity.distributed.driver import RayBackend
from parity.engines import kernels
from parity.engines import precision as prec
from parity.engines.models.io import load_model, resolve_model_dir
from parity.engines.models.modules import CausalLM
from parity.engines.partial import PartialRollouts, PoolRequest
from parity.engines.sampler import Sampler
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import load_tokenizer
from parity.engines.trainer import sequence_logprobs
from parity.rl.episodes import episode_setup
from parity.rl.loop import Run
from parity.rl.problems import Problem, lookup_task_problems
from parity.rl.reward_fns import function_spec
from parity.rl.step import build_sampler
from parity.rl.train_config import TrainConfig
from rounds import Rounds

pytestmark = ONE_RAY_AT_A_TIME  # tests/conftest.py

# Built-in arithmetic prompts ("954+4302=" ...): the model answers some in a few tokens, rambles on others.
PROMPTS = [
    [11, 7, 6, 12, 6, 5, 2, 4, 13],
    [7, 2, 11, 6, 5, 12, 5, 6, 11, 8, 7, 13],
    [4, 3, 6, 12, 11, 10, 7, 4, 4, 13],
    [11, 4, 2, 12, 6, 11, 8, 13],
]
LATER = [[5, 10, 9, 6, 3, 6, 12, 4, 5, 6, 13]]


def _two_versions():
    """The built-in model's weights (version 0) and a moved copy (version 1)."""
    model = load_model(resolve_model_dir("builtin"), kernels.numerics())
    v0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    v1 = {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in v0.items()}
    return model.config, v0, v1


def _pool(precision: str, exact: bool):
    cfg, v0, v1 = _two_versions()
    numerics = kernels.numerics("cpu", exact)
    sampler = Sampler(cfg, precision, precision, (1,), 0, score_old=True, probe=False, micro_batch_tokens=8192,
                      numerics=numerics)  # fmt: skip
    sampler.load_weights(v0, 0)
    return PartialRollouts(sampler), sampler, numerics, cfg, v0, v1


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_continued_response_is_scored_on_the_weights_that_sampled_each_token(precision):
    """Exact mode: a request ends with responses unfinished; after a weight sync the next request continues
    them on the new weights. Every token carries its version, and μ, π_old and an independent trainer
    forward over the whole response on that version's weights agree bit for bit, token by token; the
    whole distributions recorded in each segment land at the right response positions."""
    pool, sampler, numerics, cfg, v0, v1 = _pool(precision, exact=True)
    sampling = SamplingParams(max_new_tokens=40)
    first, keys, dropped = pool.generate(PoolRequest(PROMPTS, [0, 1, 2, 3], 2, 4, sampling, 11, 0, full_vocab=8))
    assert len(keys) == 2 and dropped == 0
    assert (first.token_versions[first.response_mask] == 0).all()
    carried = pool.unfinished
    assert carried > 0  # the request ended with responses still being written

    sampler.load_weights(v1, 1)
    second, keys2, _ = pool.generate(PoolRequest(LATER, [4], 2, 4, sampling, 12, 0, full_vocab=8))
    assert keys2 == sorted(set(range(4)) - set(keys))  # the carried groups, oldest first, before the new one
    versions = second.token_versions
    spans = [row[row >= 0].unique().tolist() for row in versions]
    assert [0, 1] in spans  # some response was begun on version 0 and finished on version 1
    assert all(bool((row[row >= 0].diff() >= 0).all()) for row in versions)
    assert second.weight_version == 0
    assert (versions >= 0).eq(second.response_mask).all()

    dtype = prec.to_dtype(precision)
    for batch in (first, second):
        assert torch.equal(batch.rollout_logprobs, batch.old_logprobs)  # μ = π_old, every token
        for version, weights in ((0, v0), (1, v1)):
            model = CausalLM(cfg, numerics).requires_grad_(False)
            model.load_state_dict(weights, strict=False)
            _, scored = sequence_logprobs(
                model, batch.prompt_ids, batch.response_ids, batch.response_mask, None, 1.0, dtype
            )
            mine = batch.token_versions == version
            assert torch.equal(scored[mine], batch.old_logprobs[mine])
        record = batch.full_vocab
        if record is not None:  # the rows recorded went with the groups they belong to
            assert torch.equal(record.rollout_logprobs, record.trainer_logprobs)
            lengths = batch.response_lengths[record.rows]
            assert ((record.steps < lengths[:, None]) | (record.steps < 0)).all()
    record = second.full_vocab
    assert int(record.steps.max()) >= 32  # positions from a continued segment, shifted past the first's


def test_tokens_older_than_the_bound_start_again():
    pool, sampler, _, _, _, v1 = _pool("fp32", exact=False)
    sampling = SamplingParams(max_new_tokens=40)
    pool.generate(PoolRequest(PROMPTS, [0, 1, 2, 3], 2, 4, sampling, 11, 0))
    written = sum(r.length for g in pool.groups for r in g.responses)
    assert written > 0
    sampler.load_weights(v1, 1)
    batch, _, dropped = pool.generate(PoolRequest(LATER, [4], 2, 4, sampling, 12, min_version=1))
    assert dropped == written  # every token sampled on version 0 was too old
    assert (batch.token_versions[batch.response_mask] == 1).all()
    with pytest.raises(ValueError, match="3 groups wanted, 1 in the pool"):
        pool.generate(PoolRequest([], [], 3, 4, sampling, 13, 1))


def test_row_limits_and_a_stop_end_the_engine_where_asked():
    cfg, v0, _ = _two_versions()
    sampler = Sampler(
        cfg, "fp32", "fp32", (1,), 0, score_old=False, probe=False, micro_batch_tokens=8192, numerics=kernels.numerics()
    )
    sampler.load_weights(v0, 0)
    sampling = SamplingParams(max_new_tokens=40)
    free = sampler.engine.generate(PROMPTS, 1, sampling, 5)
    limited = sampler.engine.generate(PROMPTS, 1, sampling, 5, limits=[3, 40, 5, 40])
    assert limited.response_lengths[[0, 2]].tolist() == [min(3, int(free.response_lengths[0])),
                                                         min(5, int(free.response_lengths[2]))]  # fmt: skip
    # Same seed, same rows: the tokens before a limit are the ones sampled without it.
    for row, n in ((0, 3), (1, 40), (2, 5)):
        n = min(n, int(free.response_lengths[row]))
        assert torch.equal(limited.response_ids[row, :n], free.response_ids[row, :n])
    seen = []
    stopped = sampler.engine.generate(PROMPTS, 1, sampling, 5, stop=lambda done: seen.append(done.clone()) or True)
    assert len(seen) == 1 and int(stopped.response_lengths.max()) == 1
    with pytest.raises(ValueError, match="row limits >= 1"):
        sampler.engine.generate(PROMPTS, 1, sampling, 5, limits=[0, 1, 1, 1])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["async.partial_rollouts=2"], "asynchronous training needs rollout workers"),
        (["distributed.rollout_workers=1", "async.partial_rollouts=1"], r"0 \(off\) or in \[2, 1,000,000\]"),
    ],
)
def test_partial_rollouts_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.load(TrainConfig, None, ["prompts_per_step=8", *overrides])


@pytest.mark.slow
def test_exact_partial_rollouts_on_a_worker_and_two_learners(tmp_path, ray_cluster):
    """1 rollout worker + 2 FSDP2 learners at staleness 1 with partial rollouts over 2 versions, exact FP16:
    responses continued across weight syncs, each token at most 2 versions old, μ = π_old on every token."""
    run_dir = tmp_path / "run"
    args = [*SMALL, "steps=8", "checkpoint_every=-1", "precision=fp16", "exact=true", "distributed.rollout_workers=1"]
    args += ["distributed.learners=2", "async.max_staleness=1", "async.partial_rollouts=2"]
    assert main(["train", f"run_dir={run_dir}", *args]) == 0
    logged = metrics(run_dir)
    assert len(logged) == 8
    assert max(m["async/continued_frac"] for m in logged) > 0
    assert all(m["async/staleness_max"] <= 2 for m in logged)
    assert max(m["async/staleness_max"] for m in logged) == 2
    assert all(m["mismatch/exact_tokens_frac"] == 1.0 and m["train/samples"] == 32 for m in logged)


@pytest.mark.slow
def test_a_killed_worker_loses_no_prompt_of_its_pool(tmp_path):
    """The pool dies with its worker: the groups it held start again on the restarted worker, so every
    prompt sent is trained on once or is still on its way, and every step trains a whole batch."""
    cfg = config.load(
        TrainConfig,
        None,
        SMALL
        + [f"run_dir={tmp_path / 'r'}", "steps=6", "checkpoint_every=-1", "distributed.rollout_workers=1"]
        + ["async.max_staleness=1", "async.partial_rollouts=2"],
    )
    run = Run.create(cfg, progress=False, backend=RayBackend)
    history = []
    try:
        for step in range(cfg.steps):
            if step == 3:
                os.kill(run.backend.worker_pids[0], signal.SIGKILL)
                time.sleep(0.5)
            history.append(run.step())
        trained = sum(m["train/samples"] for m in history) // 4
        waiting = len(run.backend.requests.outstanding)
    finally:
        run.close()
    assert history[-1]["faults/worker_restarts"] == 1
    assert all(m["train/samples"] == 8 * 4 and m["async/staleness_max"] <= 2 for m in history)
    assert max(m["async/continued_frac"] for m in history[:3]) > 0  # the pool held unfinished responses
    assert trained + waiting == run.backend.requests.next_key  # none lost, none trained twice


@pytest.mark.slow
def test_a_worker_killed_while_idle_is_noticed_and_its_pool_sampled_again(tmp_path, ray_cluster):
    """A worker killed while the learners train (at staleness 0 it is idle then) and restarted by Ray before
    the driver's next call answered that call from a new process: the driver never noticed (no restart
    counted) and the groups of the dead pool were never sampled again, nor trained on. Each call now names
    the worker process it is meant for, and a new one refuses it, so the driver recovers it as it does a
    worker that dies mid-call."""
    import ray

    overrides = [f"run_dir={tmp_path / 'r'}", "steps=4", "checkpoint_every=-1", "eval.every=-1"]
    overrides += ["distributed.rollout_workers=1", "async.partial_rollouts=2"]
    run = Run.create(config.load(TrainConfig, None, SMALL + overrides), progress=False, backend=RayBackend)
    backend = run.backend
    update = backend.update

    def killed_then_update(step, *args):
        if step == 1:  # the worker's pool holds its spare groups; no call of the driver's is on its way
            os.kill(backend.worker_pids[0], signal.SIGKILL)
            while True:  # until Ray has it back: the next call goes to the new process
                try:
                    if ray.get(backend.workers[0].pid.remote(), timeout=60) != backend.worker_pids[0]:
                        break
                except ray.exceptions.RayActorError:
                    time.sleep(0.2)
        return update(step, *args)

    backend.update = killed_then_update
    try:
        history = [run.step() for _ in range(4)]
        pool = ray.get(backend.workers[0].__ray_call__.remote(lambda worker: [g.key for g in worker.pool.groups]))
        waiting = sorted(backend.requests.outstanding)
    finally:
        run.close()
    assert history[-1]["faults/worker_restarts"] == 1
    assert all(m["train/samples"] == 8 * 4 for m in history)
    assert waiting == sorted(pool)  # every prompt sent and not trained on is in the pool, none lost with it


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_episodes_pause_at_turn_boundaries_and_go_on_on_newer_weights(precision):
    """Episodes in a worker's pool, exact mode: a request ends with episodes paused at turn boundaries
    (their environments' answers already in their outputs); after a weight sync the next request goes on
    with them. Every model turn is sampled on one weight version, μ = π_old on every sampled token, and a
    trainer forward over each whole episode on the version that sampled a token gives its bits; the
    episodes' records are whole (turns, how each ended)."""
    keys = ["model=builtin-agent", f"task.environment={function_spec(Rounds)}", f"precision={precision}"]
    cfg = config.load(TrainConfig, None, [*keys, "rollout.max_new_tokens=200", "episode.max_turns=6"])
    model_dir = resolve_model_dir("builtin-agent")
    tokenizer = load_tokenizer(model_dir)
    numerics = kernels.numerics("cpu", exact=True)
    model = load_model(model_dir, numerics)
    v0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    v1 = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in v0.items()}
    sampler = build_sampler(cfg, model.config, tokenizer, numerics, score_old=True)
    sampler.load_weights(v0, 0)
    setup = episode_setup(cfg, tokenizer, environment=Rounds)
    pool = PartialRollouts(sampler, setup, lambda episodes, batch: episodes.finish(batch, True))
    problems = [
        Problem(p.prompt, p.answer, {**p.columns, "rounds": 1 + i % 2})
        for i, p in enumerate(lookup_task_problems(10, seed=3, split="train"))
    ]
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens)

    def exact_check(segment):  # what the worker checks on each segment, where it was sampled
        sampled = segment.sampled_mask
        assert torch.equal(segment.rollout_logprobs[sampled], segment.old_logprobs[sampled])

    first, keys, _ = pool.generate(PoolRequest(problems[:8], list(range(8)), 2, 4, sampling, 11, 0), exact_check)
    paused = [r for g in pool.groups for r in g.responses if not r.finished]
    assert paused and all(bool(r.fed[-1][-1]) for r in paused)  # at a turn boundary, what follows in it
    sampler.load_weights(v1, 1)
    second, keys2, _ = pool.generate(PoolRequest(problems[8:], [8, 9], 6, 4, sampling, 12, 0), exact_check)
    assert keys2 == sorted(set(range(8)) - set(keys))  # the paused ones among them

    dtype = prec.to_dtype(precision)
    continued = 0
    for batch in (first, second):
        sampled = batch.sampled_mask
        assert torch.equal(batch.rollout_logprobs[sampled], batch.old_logprobs[sampled])
        turns = batch.turn_index()
        for row in range(len(batch.prompt_ids)):
            for turn in turns[row][sampled[row]].unique().tolist():
                assert len(batch.token_versions[row][(turns[row] == turn) & sampled[row]].unique()) == 1
            continued += len(batch.token_versions[row][sampled[row]].unique()) > 1
        for version, weights in ((0, v0), (1, v1)):
            scorer = CausalLM(model.config, numerics).requires_grad_(False)
            scorer.load_state_dict(weights, strict=False)
            _, scored = sequence_logprobs(
                scorer, batch.prompt_ids, batch.response_ids, batch.response_mask, None, 1.0, dtype
            )
            mine = (batch.token_versions == version) & sampled
            assert torch.equal(scored[mine], batch.old_logprobs[mine])
        records = batch.episodes.episodes
        assert len(records) == len(batch.prompt_ids) and all(e.end for e in records)
        assert [e.turns for e in records] == [int(t.max()) + 1 for t in turns]
        assert bool(batch.truncated.eq(torch.tensor([e.truncated for e in records])).all())
    assert continued > 0  # an episode spans both versions, turn by turn


@pytest.mark.slow
def test_partial_rollouts_of_episodes_on_a_worker(tmp_path, ray_cluster):
    """The built-in tool task with partial rollouts on a rollout worker: episodes paused at turn boundaries
    go on after the weight sync, every step trains whole groups of whole episodes, and exact mode holds."""
    overrides = [f"run_dir={tmp_path / 'run'}", "model=builtin-agent", "task.name=lookup", "prompts_per_step=4"]
    rounds = f"{Path(__file__).parent / 'rounds.py'}:Rounds"  # by its path: the worker imports it from there
    overrides += [f"task.environment={rounds}", "rollout.max_new_tokens=200", "episode.max_turns=6"]
    overrides += ["rollout.group_size=4", "exact=true", "precision=fp16", "distributed.rollout_workers=1"]
    overrides += ["async.max_staleness=1", "async.partial_rollouts=2", "steps=6", "checkpoint_every=-1"]
    history = Run.create(config.load(TrainConfig, None, overrides), progress=False, backend=RayBackend).train()
    assert [m["mismatch/exact_tokens_frac"] for m in history] == [1.0] * 6
    assert all(m["train/samples"] == 16 and m["episode/turns_mean"] >= 1 for m in history)
    assert all(m["async/staleness_max"] <= 2 for m in history)
    assert max(m["async/continued_frac"] for m in history) > 0  # episodes went on on newer weights
