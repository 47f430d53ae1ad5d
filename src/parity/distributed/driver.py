"""`parity train` across processes: rollout workers on Ray, learners under torch.distributed.

`RayBackend` is the backend (`parity.rl.loop.Backend`) of a run whose engines are elsewhere; the step itself
(`Run.step`, the pieces in `parity.rl.step`) is the one-process run's. This process keeps the data, the
rewards, the metrics, the checkpoints and a pipeline of rollout requests:

    step s:  collect the samples for step s (sampled at version s − staleness, π_old scored
             by the worker that sampled them) ─► rewards, advantages ─► every learner trains
             on its share ─► learners export version s+1 (checksummed) ─► workers load and
             verify it ─► request the samples for step s + 1 + max_staleness

Requests to a worker run in the order they were made, so a request made after the sync of
version v samples with version ≥ v: samples for step s+1+k come from version ≥ s+1 and are at
most k versions old when trained on. With k = 0 sampling and training alternate (synchronous,
on-policy); with k ≥ 1 the workers sample the next steps while the learners train.
A worker that dies is restarted by Ray, loads the newest weights, and repeats exactly the
requests it lost (same prompts, same seeds), so no sample is lost or counted twice.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from parity import config as config_mod
from parity.config import ConfigError
from parity.distributed.actors import Learner, RolloutWorker, WorkerRestarted
from parity.distributed.cluster import LocalCluster, import_ray, join, require_cpus
from parity.distributed.requests import Pools, Request, Shard, WholeGroups
from parity.engines.batch import RolloutBatch, concat_batches
from parity.engines.models.io import load_config, load_model
from parity.engines.models.modules import CausalLM
from parity.engines.sampler import ExactnessError
from parity.folders import Folder
from parity.rl.checkpoint import (
    SHARDED_DIR,
    CheckpointError,
    RunState,
    restore_latest,
    save_checkpoint,
    verify_checkpoint,
)
from parity.rl.loop import Backend, Run
from parity.rl.problems import Problem
from parity.rl.reward_fns import Reward
from parity.rl.step import LocalBackend, Prepared, RunParts, TrainingError, UpdatePlan, UpdateResult, resolve_old
from parity.rl.train_config import TrainConfig

RESTART_POLL_S = 1.0  # how long one wait for a restarting worker's answer lasts
RESTART_NOTE_EVERY_S = 30.0  # how often a long wait says so


def _worker_gone() -> tuple[type[Exception], ...]:
    """What Ray raises for a call on an actor that died (or is being restarted)."""
    import ray

    return (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def _actor_state(actor) -> str | None:
    """Ray's state of an actor as its control store (GCS) holds it: ALIVE, RESTARTING, DEAD, ...;
    None where this Ray cannot say (the call is Ray's internal one: its public state API needs the
    dashboard, which a run's own cluster does not start)."""
    try:
        from ray._private import state

        return state.actors(actor_id=actor._actor_id.hex())["State"]
    except Exception:  # noqa: BLE001 - a Ray without this call: the wait is bounded by the timeout alone
        return None


# A run's own cluster may put more processes than CPUs on a machine (a test's worker and two learners on 2 cores);
# far more only takes minutes to start, each process loading the model, and then runs out of memory.
PROCESSES_PER_CPU = 4
LEARNER_DEATH_WAIT_S = 10.0  # how long a failed step waits for Ray to report a learner's death


def _actor_death(ref) -> str | None:
    """The name of the error if the actor behind `ref` died (within LEARNER_DEATH_WAIT_S), else None."""
    import ray

    try:
        ray.get(ref, timeout=LEARNER_DEATH_WAIT_S)
    except ray.exceptions.RayActorError as e:
        return type(e).__name__
    except Exception:  # failed some other way, or still running: not a death
        return None
    return None


class RayBackend:
    """Samples on Ray rollout workers, trains on FSDP2 learners. The learners hold the trained state (the
    weights, AdamW, the loss scaler and version); this process holds no model but the one an evaluation
    that scores with the trainer's code path loads when it first runs."""

    loads_own_model = True

    def __init__(self, parts: RunParts):
        self.parts = parts
        self.eval_model: CausalLM | None = None
        self.cfg, self.model_dir, self.run_dir = parts.cfg, parts.model_dir, parts.run_dir
        self.step = 0  # the step under way (0-based), for messages
        self.cluster, self.workers, self.learners = None, [], []
        try:
            self._start()
        except BaseException:  # a start that fails or is interrupted leaves no Ray process running
            self.close()
            raise

    def _start(self) -> None:
        ray = import_ray()
        parts, cfg, d = self.parts, self.cfg, self.cfg.distributed
        processes = d.rollout_workers + d.learners
        # Threads: the cores shared among the processes that compute at the same time (the
        # workers only overlap the learners when they may sample ahead).
        busy = d.learners + (d.rollout_workers if cfg.async_.max_staleness else 0)
        threads = d.threads or max(1, (os.cpu_count() or 1) // busy)
        if not ray.is_initialized():
            if d.address:
                join(d.address, d.connect_timeout_s)
                require_cpus(d.address, processes)
            else:  # a cluster of this machine for this run (and so ended by it): `parity train` needs no setup
                cpus = os.cpu_count() or 1
                if processes > PROCESSES_PER_CPU * cpus:
                    raise ConfigError(
                        f"distributed.rollout_workers + distributed.learners: {processes} processes, each with its "
                        f"model, on this machine's {cpus} CPUs; at most {PROCESSES_PER_CPU * cpus} "
                        f"({PROCESSES_PER_CPU} per CPU) in the cluster a run starts for itself"
                    )
                self.cluster = LocalCluster(num_cpus=max(cpus, processes))
        model_dir = str(self.model_dir)
        worker_cls = ray.remote(num_cpus=1, max_restarts=-1, max_task_retries=0)(RolloutWorker)
        if cfg.async_.partial_rollouts and load_config(self.model_dir).num_experts:
            raise ConfigError(
                f"async.partial_rollouts={cfg.async_.partial_rollouts} with a mixture-of-experts model: a continued "
                "response's routing record would span weight versions, which routing replay cannot take; set it to 0"
            )
        self.workers = [worker_cls.remote(i, model_dir, cfg, threads) for i in range(d.rollout_workers)]
        learner_cls = ray.remote(num_cpus=1, max_restarts=0)(Learner)
        self.learners = [learner_cls.remote(r, d.learners, model_dir, cfg, threads) for r in range(d.learners)]
        host, port = ray.get(self.learners[0].rendezvous.remote())
        self._learners_call("setup", host, port)
        try:
            self.worker_pids = ray.get([w.pid.remote() for w in self.workers])
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, ConfigError):  # the run's tools or environment cannot be imported there
                raise ConfigError(f"rollout worker: {e.cause}") from None
            raise
        self.pending: deque[Request] = deque()
        self.load_refs: list[list] = [[] for _ in self.workers]
        self.last_load: dict[str, float] = {}
        self.weights = None  # the newest (tensors ref, manifest), for restarted workers
        self.restarts = 0
        self.dropped = 0
        shape = (cfg.rollout.group_size, parts.sampling, cfg.diagnostics.full_vocab_positions)
        self.requests = (
            Pools(*shape, len(self.workers), cfg.async_.max_token_staleness)
            if cfg.async_.partial_rollouts
            else WholeGroups(*shape)
        )
        self.consumed_position = parts.data.position  # `restore` moves it
        self.step_end = time.perf_counter()
        self.sync_metrics: dict[str, float] = {}
        self.async_metrics: dict[str, float] = {}
        self._push_weights(version=0)

    def restore(self, log: Callable[[str], None]) -> RunState | None:
        """Every learner reads its own shards of the checkpoint in place (DCP reshards from any learner
        count): no process holds the trained model whole. A read that fails part way puts the learners back
        on the base model before the next checkpoint is tried."""

        def load(path: Path) -> RunState:
            problem = verify_checkpoint(path)  # here, once, not by every learner
            if problem is not None:
                raise CheckpointError(f"{path}: {problem}")
            try:
                return self._learners_call("restore", str(path))[0]
            except CheckpointError:
                self._learners_call("reset")
                raise

        state = restore_latest(self.run_dir, load, log)
        if state is not None:
            self.step = state.step
            self.consumed_position = state.data_position
            self._push_weights(version=state.step)
        return state

    def learner_weights(self) -> tuple[dict[str, torch.Tensor], int]:
        """The learners' weights, gathered (FP32, by name), and their version."""
        return self._learners_call("weights")[0]

    def evaluation_policy(self, with_model: bool) -> tuple[dict[str, torch.Tensor], int, CausalLM | None]:
        weights, version = self.learner_weights()
        if not with_model:
            return weights, version, None
        if self.eval_model is None:
            self.eval_model = load_model(self.model_dir, self.parts.numerics).float()
        with torch.no_grad():
            for name, p in self.eval_model.named_parameters():
                p.copy_(weights[name])
        return weights, version, self.eval_model

    def save(self, run_dir: Path, state: RunState, keep: int) -> Path:
        """A sharded checkpoint: the learners write their own shards (nothing is gathered), the
        driver the run's state beside them (`rl.checkpoint`)."""
        return save_checkpoint(run_dir, self._save_shards, state, self.model_dir, keep)

    def _save_shards(self, folder: Folder) -> tuple[list[str], dict[str, float], int]:
        # Each learner reaches the fresh checkpoint folder from the run's folder itself, following no link.
        parts = self._learners_call("save_shards", str(folder.root), str(folder.rel / SHARDED_DIR))
        _, scaler, version = parts[0]  # the learners agree on both
        return sorted({name for bad, _, _ in parts for name in bad}), scaler, version

    def close(self) -> None:
        if self.workers or self.learners:
            import ray

            for actor in self.workers + self.learners:
                ray.kill(actor)
        self.workers, self.learners = [], []
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None

    @property
    def data_position(self) -> int:
        return self.consumed_position  # requests made ahead are sampled again after a resume

    # -- learners ---------------------------------------------------------------

    def _learners_call(self, method: str, *args):
        """Call `method` on every learner and wait for all of them."""
        return self._wait_learners([getattr(learner, method).remote(*args) for learner in self.learners])

    def _wait_learners(self, refs: list) -> list:
        """The learners' results; a learner that died or failed stops the run cleanly."""
        import ray

        try:
            # One at a time as they finish: when a learner dies the others wait in a collective forever.
            waiting = list(refs)
            while waiting:
                done, waiting = ray.wait(waiting, num_returns=1)
                ray.get(done[0])
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            raise self._learner_died(type(e).__name__) from None
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, ExactnessError):  # before any learner stepped: no weight moved
                raise TrainingError(f"step {self.step + 1}: {e.cause}") from None
            if isinstance(e.cause, (CheckpointError, ConfigError)):  # a checkpoint that is damaged, or not this run's
                raise e.cause from None
            # A learner whose peer died fails in the collective (connection reset) before Ray reports the
            # death: name the death, the cause, when one of the others turns out dead.
            dead = next((d for d in map(_actor_death, refs) if d is not None), None)
            if dead is not None:
                raise self._learner_died(dead) from None
            raise TrainingError(f"step {self.step + 1}: a learner failed: {e.cause}") from None

    def _learner_died(self, error_name: str) -> TrainingError:
        return TrainingError(
            f"step {self.step + 1}: a learner process died ({error_name}); the run stopped. "
            f"Continue from the last checkpoint with `{self.cfg.resume_command(self.run_dir)}`"
        )

    def old_logprobs(self, batch: RolloutBatch, plan: UpdatePlan) -> tuple[torch.Tensor | None, str]:
        return resolve_old(batch, plan, None)  # the worker that sampled scored π_old

    def update(self, step: int, batch: RolloutBatch, prepared: Prepared, plan: UpdatePlan) -> UpdateResult:
        import ray

        self.step = step
        batch_ref, prepared_ref = ray.put(batch), ray.put(prepared)
        # Samples from the weights the learners hold: their first π_θ pass is checked against π_old (exact mode).
        sampled_here = batch.weight_version == step
        parts = self._learners_call("update", batch_ref, prepared_ref, plan, self.parts.order_seed(step), sampled_here)
        return UpdateResult.merge(parts)

    # -- weights to the workers -----------------------------------------------------

    def _push_weights(self, version: int) -> dict[str, float]:

        cfg = self.cfg
        refs = [
            learner.export.options(num_returns=2).remote(version, cfg.rollout_precision, cfg.trainer_precision)
            for learner in self.learners
        ]
        manifest, export_seconds = self._wait_learners([r[1] for r in refs])[0]
        self.weights = (refs[0][0], manifest)
        for i, worker in enumerate(self.workers):
            self.load_refs[i].append(worker.load_weights.remote(*self.weights))
        return {"export_seconds": export_seconds, "bytes": manifest.bytes}

    def _check_loads(self) -> None:
        """Results of finished weight loads: a failed verification stops the run naming the tensor."""
        import ray

        for refs in self.load_refs:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
            for ref in done:
                refs.remove(ref)
                try:
                    self.last_load = ray.get(ref)
                except _worker_gone():
                    continue  # the worker died; `_recover` reloads it
                except ray.exceptions.RayTaskError as e:
                    raise TrainingError(f"step {self.step + 1}: {e.cause}") from None

    def sync(self, step: int, times: dict[str, float]) -> None:
        self.step = step
        t = time.perf_counter()
        pushed = self._push_weights(version=step + 1)
        times["sync"] = time.perf_counter() - t
        self._check_loads()
        next_step = step + 1 + self.cfg.async_.max_staleness
        if next_step < self.cfg.steps:
            self._request(next_step)
        self.sync_metrics = {
            "sync/verified": self.last_load.get("verified", 0.0),
            "sync/seconds": pushed["export_seconds"] + self.last_load.get("seconds", 0.0),
            "sync/bytes": pushed["bytes"],
            "faults/worker_restarts": self.restarts,
        }

    def step_metrics(self, times: dict[str, float]) -> dict[str, float]:
        """Sync and pipeline metrics; the learners' idle time: the part of this step's wall time (since the
        previous step ended) they did not train."""
        start, self.step_end = self.step_end, time.perf_counter()
        idle = max(self.step_end - start - times["train"], 0.0)
        return {**self.sync_metrics, **self.async_metrics, "time/learner_idle": idle}

    # -- rollouts -------------------------------------------------------------------

    def _request(self, step: int) -> None:
        """Ask the workers for step `step`'s samples, whole prompt groups per worker."""
        cfg = self.cfg
        shares = [len(r) for r in torch.arange(cfg.prompts_per_step).tensor_split(len(self.workers))]
        sends = self.requests.sizes(shares)
        start = self.parts.data.position
        problems = [self.parts.problems[i] for i in self.parts.data.take(sum(sends))]
        prompts = self._prompts(problems)
        request = Request(step, problems, self.parts.data.position)
        first = 0
        for w, (n, need) in enumerate(zip(sends, shares)):
            # Worker 0 uses the single-process seed, so one worker samples what one process would.
            shard = Shard(w, prompts[first : first + n], self.parts.rollout_seed(step) + 7_777_777 * w)
            positions = list(range(start + first, start + first + n))
            self.requests.open(shard, problems[first : first + n], positions, need, step)
            first += n
            self._send(shard)
            request.shards.append(shard)
        self.pending.append(request)

    def _prompts(self, problems: list[Problem]) -> list[list[int]] | list[Problem]:
        """What a worker samples from: the prompts' ids, or in a run of episodes the data rows (the worker
        renders each first prompt from what its environment's reset gives)."""
        return problems if self.cfg.episodes else [self.parts.encode(p) for p in problems]

    def _send(self, shard: Shard) -> None:
        shard.ref = self.requests.call(self.workers[shard.worker], self.worker_pids[shard.worker], shard)

    def _recover(self, worker: int) -> None:
        """After worker `worker` died: wait for Ray's restart, give it the newest weights and
        send again everything it had not delivered, in order. The wait follows Ray's view of the
        actor: while it is restarting (unavailable), up to `distributed.restart_timeout_s`; once
        Ray has given up on it (dead), not at all."""
        import ray

        limit = self.cfg.distributed.restart_timeout_s
        actor = self.workers[worker]
        started = time.monotonic()
        next_note = started + RESTART_NOTE_EVERY_S
        ref = actor.pid.remote()  # answered once the actor is back
        while True:
            try:
                pid = ray.get(ref, timeout=RESTART_POLL_S)
                break
            except ray.exceptions.GetTimeoutError:
                pass
            except ray.exceptions.RayActorError:  # sent before Ray knew the actor was down: ask again
                time.sleep(RESTART_POLL_S)
                ref = actor.pid.remote()
            if _actor_state(actor) == "DEAD":
                raise TrainingError(
                    f"step {self.step + 1}: rollout worker {worker} died and Ray gave up restarting it "
                    "(its actor is DEAD); the Ray logs (/tmp/ray/session_latest/logs) say why"
                )
            waited = time.monotonic() - started
            if waited > limit:
                raise TrainingError(
                    f"step {self.step + 1}: rollout worker {worker} died and Ray was still restarting it "
                    f"after {waited:.0f} s (its actor is {_actor_state(actor) or 'in an unknown state'}); on a "
                    f"machine this busy, raise distributed.restart_timeout_s (now {limit:g})"
                )
            if time.monotonic() > next_note:
                next_note += RESTART_NOTE_EVERY_S
                print(
                    f"step {self.step + 1}: waiting for Ray to restart rollout worker {worker} "
                    f"({waited:.0f} s of distributed.restart_timeout_s={limit:g})",
                    file=sys.stderr,
                )
        if pid == self.worker_pids[worker]:
            return
        self.worker_pids[worker] = pid
        self.restarts += 1
        print(
            f"WARNING step {self.step + 1}: rollout worker {worker} died and was restarted "
            f"(faults/worker_restarts = {self.restarts}); its unfinished requests are sampled again",
            file=sys.stderr,
        )
        self.load_refs[worker] = [self.workers[worker].load_weights.remote(*self.weights)]
        resend = [s for r in self.pending for s in r.shards if s.worker == worker and s.ref is not None]
        self.requests.lost(worker, resend, self._prompts)
        for shard in resend:
            self._send(shard)

    def rollouts(self, step: int, times: dict[str, float]) -> tuple[list[Problem], RolloutBatch]:
        import ray

        cfg = self.cfg
        self.step = step
        if not self.pending:  # the first step, or after a resume: fill the pipeline
            for ahead in range(step, min(step + 1 + cfg.async_.max_staleness, cfg.steps)):
                self._request(ahead)
        # Requests already answered before this step waited for them: how far the workers are ahead.
        queue_depth = sum(
            all(ray.wait([s.ref], timeout=0)[0] for s in request.shards) for request in list(self.pending)[1:]
        )
        request = self.pending[0]
        t = time.perf_counter()
        parts, infos = [], []
        for shard in request.shards:
            while True:
                try:
                    batch, info = ray.get(shard.ref)
                except _worker_gone():
                    self._recover(shard.worker)
                    continue
                except ray.exceptions.RayTaskError as e:
                    if isinstance(e.cause, WorkerRestarted):  # restarted while idle: recovered as if it died now
                        self._recover(shard.worker)
                        continue
                    raise TrainingError(f"step {self.step + 1}: {e.cause}") from None  # exact mode's check
                if self.step - batch.weight_version > cfg.async_.max_token_staleness:
                    self.dropped += batch.response_ids.shape[0]  # too old (only after a restart): sample again
                    self._send(shard)
                    continue
                break
            shard.ref = None
            parts.append(batch)
            infos.append(info)
        self.pending.popleft()
        problems, self.consumed_position = self.requests.delivered(request, infos, self.parts.data.position)
        times["rollout"] = time.perf_counter() - t  # the learners wait this long for samples
        times["score"] = max(i["score"] for i in infos)
        times["worker_rollout"] = max(i["rollout"] for i in infos)
        times["worker_idle"] = sum(i["idle"] for i in infos)
        self._check_loads()
        batch = concat_batches(parts) if len(parts) > 1 else parts[0]
        if batch.episodes is not None:
            times.update(batch.episodes.times())
        versions = batch.versions()
        staleness = (self.step - versions[batch.sampled_mask]).float()
        self.async_metrics = {
            "async/staleness_mean": float(staleness.mean()),
            "async/staleness_max": float(staleness.max()),
            "async/queue_depth": queue_depth,
            "async/dropped": self.dropped,
            **self.requests.metrics(versions, infos),
        }
        return problems, batch


def backend_for(cfg: TrainConfig) -> type[Backend]:
    """Where a config's engines run: in this process, or on Ray."""
    return RayBackend if cfg.distributed_mode else LocalBackend


def backend_for_run(run_dir: str | Path) -> type[Backend]:
    """The backend a run directory's config.yaml asks for (the one-process one when it cannot be read:
    `Run.resume` then says what is wrong)."""
    try:
        return backend_for(config_mod.load(TrainConfig, Path(run_dir) / "config.yaml"))
    except ConfigError:
        return LocalBackend


def open_run(
    cfg: TrainConfig | None = None,
    resume: str | Path | None = None,
    overrides: list[str] | None = None,
    trust_reward_fn: bool = False,
    progress: bool = True,
    rewards: list[Reward] | None = None,
    datasets: dict[str, list[dict]] | None = None,
    tools: list | None = None,
    environment: object = None,
) -> Run:
    """The run `parity train` and `Trainer.train` train: a new one of `cfg` (`Run.create`), or, given `resume`,
    the run in that directory continued (`Run.resume`: its saved config, with `overrides` of RESUMABLE_KEYS),
    each on the backend its config asks for. A run that has already taken all its steps comes back closed,
    with `completed` set: there is nothing to train."""
    given = dict(progress=progress, rewards=rewards, tools=tools, environment=environment)
    if resume is not None:
        run = Run.resume(resume, overrides, trust_reward_fn=trust_reward_fn, backend=backend_for_run(resume), **given)
    else:
        assert cfg is not None, "open_run: a config or a run directory to resume"
        run = Run.create(cfg, datasets=datasets, backend=backend_for(cfg), **given)
    if run.completed:
        run.close()
    return run
