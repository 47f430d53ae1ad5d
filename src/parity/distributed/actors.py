"""The processes of a distributed run: rollout workers and learners (Ray actors).

`RolloutWorker` runs Parity's `Sampler`: the rollout engine samples (μ), then the same
worker scores its own samples with the trainer's code path and precision on the weights
that sampled (π_old), so the learners, who have moved on by the time the samples arrive,
keep no old weights. `Learner` is one rank of a torch.distributed group whose `Trainer`
holds an FSDP2-sharded (`fully_shard`) model; every learner runs `train_on_batch` on its
share of each mini-batch and the sharded optimizer sums their gradients.

These classes are plain Python; `parity.distributed.driver` makes them Ray actors.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from pathlib import Path

import torch

from parity.config import ConfigError
from parity.engines import kernels
from parity.engines.batch import RolloutBatch
from parity.engines.models.io import load_config, load_model
from parity.engines.models.modules import CausalLM
from parity.engines.partial import PartialRollouts, PoolRequest
from parity.engines.precision import to_dtype
from parity.engines.sampler import ExactnessError, check_first_pass
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import load_tokenizer
from parity.engines.trainer import Trainer
from parity.folders import Folder
from parity.rl.checkpoint import RunState, load_checkpoint, local_parameters, non_finite_tensors, save_shards
from parity.rl.episodes import Episodes, episode_setup
from parity.rl.problems import Problem
from parity.rl.step import Prepared, UpdatePlan, UpdateResult, build_sampler, train_on_batch
from parity.rl.train_config import CHUNKED_HEAD_MODES, TrainConfig
from parity.runtime import reuse_freed_memory


def _set_process_threads(threads: int | None) -> None:
    """An actor process's torch threads, and freed memory returned to the system (None: leave the process
    as it is, as when a test builds the actor in its own process)."""
    if threads is not None:
        torch.set_num_threads(threads)
        reuse_freed_memory()


def load_sharded(model_dir: Path, mesh, numerics: kernels.Numerics, precision: str) -> CausalLM:
    """The model in `model_dir` sharded by FSDP2 over `mesh` (each decoder layer, then the root), this
    process reading only its own rows of every weight: no learner holds the base model whole.

    A decoder layer gathers its weights in the trainer precision (`MixedPrecisionPolicy`: half the bytes of
    FP32) and reduces their gradients in FP32. Every weight of a layer is used once per pass, rounded to that
    precision, so the gathered copy is the cast the model would make, bit for bit. The root (embedding, final
    norm, a tied LM head) gathers FP32 and the model casts it: a tied weight's two gradients then meet in
    FP32, as in one process, not in the 16-bit sum a 16-bit gather would give."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = to_dtype(precision)
    layer_policy = MixedPrecisionPolicy(
        param_dtype=None if dtype == torch.float32 else dtype,
        reduce_dtype=torch.float32,
        cast_forward_inputs=False,  # the RoPE angles stay FP32, as the layer is given them
    )

    def shard(model: CausalLM) -> None:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=layer_policy)
        fully_shard(model, mesh=mesh)

    return load_model(model_dir, numerics, shard=shard)


class WorkerRestarted(Exception):
    """A sampling call meant for an earlier process of this rollout worker: Ray restarted it between two of the
    driver's calls, and the driver, which has not noticed, must recover it (its pool and requests) first."""


class RolloutWorker:
    """Samples with the rollout engine and scores its own samples (π_old, the probe). Each sampling call
    names the worker process the driver sent it to (`for_pid`): a worker Ray restarted while idle would
    otherwise answer it from a new process, whose pool is empty, and the driver would never know."""

    def __init__(self, index: int, model_dir: str, cfg: TrainConfig, threads: int | None):
        _set_process_threads(threads)
        self.index = index
        self.where = f"rollout worker {index}"
        numerics = kernels.numerics("cpu", cfg.exact)
        tokenizer = load_tokenizer(model_dir)
        self.sampler = build_sampler(cfg, load_config(model_dir), tokenizer, numerics, score_old=True)
        # Episodes run here, beside the engine: the tools or environment imported from the run's config. One that
        # cannot be is said by `pid`, the driver's first call, as a ConfigError (a failed __init__ is Ray's traceback).
        self.setup_error: ConfigError | None = None
        try:
            self.episodes = episode_setup(cfg, tokenizer) if cfg.episodes else None
        except ConfigError as e:
            self.episodes, self.setup_error = None, e
        self.pool = PartialRollouts(self.sampler, self.episodes, self._finish)  # used by `generate_partial` only
        self.turn_tokens, self.retokenization = cfg.turn_tokens, cfg.episode.retokenization
        self.retokenization_logprob = cfg.episode.retokenization_logprob
        self.idle_since = time.perf_counter()

    def pid(self) -> int:
        if self.setup_error is not None:
            raise self.setup_error
        return os.getpid()

    def _check_process(self, for_pid: int) -> None:
        if for_pid != os.getpid():
            raise WorkerRestarted(f"{self.where} restarted: process {os.getpid()}, the call was for {for_pid}")

    def load_weights(self, tensors: dict[str, torch.Tensor], manifest) -> dict[str, float]:
        """Load a weight sync and check both copies against the learners' checksums
        (raises `SyncError` naming the first tensor that differs)."""
        from parity.distributed.sync import verify

        t = time.perf_counter()
        self.sampler.load_weights(tensors, manifest.version)
        verify(
            self.sampler.engine.weights.named_weights(),
            manifest.engine,
            f"{self.where} (rollout engine)",
            manifest.version,
        )
        wire = getattr(torch, manifest.wire_dtype)
        scorer = {k: v.to(wire) for k, v in self.sampler.scorer.state_dict().items()}
        verify(scorer, manifest.scorer, f"{self.where} (π_old scorer)", manifest.version)
        return {"version": manifest.version, "seconds": time.perf_counter() - t, "verified": 1.0}

    def generate(
        self,
        for_pid: int,
        prompts: list[list[int]] | list[Problem],
        group_size: int,
        sampling: SamplingParams,
        seed: int,
        full_vocab: int = 0,
    ) -> tuple[RolloutBatch, dict[str, float]]:
        """Sample `group_size` responses per prompt and score them (and the whole distribution at
        `full_vocab` positions); also how long this worker sat idle before the call and how long each
        part took. In a run of episodes `prompts` are the problems, each an episode's data row."""
        self._check_process(for_pid)
        start = time.perf_counter()
        if self.episodes is None:
            batch = self.sampler.generate(prompts, group_size, sampling, seed, full_vocab)
        else:
            episodes, first = self.episodes.start(prompts, group_size)
            limits = [self.turn_tokens] * len(episodes.episodes)
            batch = self.sampler.generate(first, group_size, sampling, seed, full_vocab, limits, episodes.between)
            self._finish(episodes, batch)
        sampled = time.perf_counter()
        self.sampler.fill_old_logprobs(batch)
        if batch.full_vocab is not None:
            self.sampler.fill_full_vocab(batch)
        self._verify(batch)
        self.idle_since, idle = time.perf_counter(), start - self.idle_since
        return batch, {"idle": idle, "rollout": sampled - start, "score": self.idle_since - sampled}

    def _finish(self, episodes: Episodes, batch: RolloutBatch) -> None:
        """A batch's episodes closed (`Episodes.finish`), and what re-tokenizing would have scored (on the
        weights this worker holds now: with partial rollouts, those of the request that ended them)."""
        episodes.finish(batch, self.retokenization)
        if self.retokenization_logprob:
            episodes.drift_logprobs(batch, self.sampler.scorer, to_dtype(self.sampler.trainer_precision))

    def generate_partial(self, for_pid: int, request: PoolRequest) -> tuple[RolloutBatch, dict]:
        """`async.partial_rollouts`: add the request's prompts to this worker's pool and return its `need`
        complete groups (`PartialRollouts.generate`); the info also holds their keys, the tokens dropped as
        too old and the responses left unfinished in the pool."""
        self._check_process(for_pid)
        start = time.perf_counter()
        batch, done, dropped = self.pool.generate(request, self._verify)
        self.idle_since, idle = time.perf_counter(), start - self.idle_since
        info = {"idle": idle, "rollout": self.idle_since - start, "score": 0.0}
        return batch, {**info, "keys": done, "dropped_tokens": dropped, "unfinished": self.pool.unfinished}

    def _verify(self, batch: RolloutBatch) -> None:
        """What the numerics promise (exact mode: μ = π_old), checked here before this worker's weights are
        replaced, so that locating works."""
        self.sampler.verify(batch, batch.old_logprobs, where=self.where)


class Learner:
    """One rank of the learner group: a Trainer over an FSDP2-sharded model."""

    def __init__(self, rank: int, world: int, model_dir: str, cfg: TrainConfig, threads: int):
        _set_process_threads(threads)
        self.rank, self.world = rank, world
        self.model_dir, self.precision, self.optim = model_dir, cfg.trainer_precision, cfg.trainer
        self.numerics = kernels.numerics(cfg.device, cfg.exact)
        self.with_reference = cfg.algorithm.kl_coef > 0  # a frozen copy of the starting model, for the KL loss
        self.trainer: Trainer | None = None
        self.reference: Trainer | None = None

    def pid(self) -> int:
        return os.getpid()

    def rendezvous(self) -> tuple[str, int]:
        """An address and free port on this node for the group's TCP rendezvous (rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, host: str, port: int) -> None:
        """Join the process group (gloo on the CPU, NCCL on CUDA; once per process) and build the trainer on the
        base model."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            device = self.numerics.device
            if device.type == "cuda":
                torch.cuda.set_device(device)
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world)
        self.mesh = init_device_mesh(self.numerics.device.type, (self.world,))
        self.reset()
        if self.with_reference:
            self.reference = Trainer(self._sharded_base(), self.precision, self.optim)
            self.reference.model.requires_grad_(False)

    def _sharded_base(self) -> CausalLM:
        model = load_sharded(Path(self.model_dir), self.mesh, self.numerics, self.precision)
        model.activation_checkpointing = self.optim.activation_checkpointing
        model.chunked_head = CHUNKED_HEAD_MODES[self.optim.chunked_head]
        return model

    def reset(self) -> None:
        """A trainer on the base model, as at the start (after a checkpoint's read failed part way)."""
        self.trainer = None  # the old one's memory goes before the new one is read
        self.trainer = Trainer(self._sharded_base(), self.precision, self.optim)
        self.trainer.grad_sum_factor = float(self.world)  # FSDP averages; the losses want the sum

    def restore(self, folder: str) -> RunState:
        """A sharded checkpoint into this learner (every learner at once; the driver verified its files): its
        own shards, read in place, never the whole model."""
        return load_checkpoint(Path(folder), self.trainer, verified=True)

    def weights(self) -> tuple[dict[str, torch.Tensor], int] | None:
        """The unsharded FP32 weights and their version on rank 0 (every rank joins the gathers), None elsewhere."""
        weights = self.trainer.full_weights()
        return (weights, self.trainer.weight_version) if self.rank == 0 else None

    def export(self, version: int, rollout_precision: str, trainer_precision: str):
        """Weights for the workers (rank 0 returns tensors and manifest; every rank joins the gathers)."""
        from parity.distributed.sync import pack_weights

        t = time.perf_counter()
        state = self.trainer.full_weights()
        if self.rank:
            return None, None
        tensors, manifest = pack_weights(state, version, rollout_precision, trainer_precision)
        return tensors, (manifest, time.perf_counter() - t)

    def save_shards(self, root: str, rel: str) -> tuple[list[str], dict[str, float], int]:
        """Write this learner's shards of the weights and AdamW state into the folder `rel` below the run's
        folder `root` (every learner at once); return the names of non-finite local tensors (then the driver
        saves nothing), the scaler and the version."""
        bad = non_finite_tensors(local_parameters(self.trainer.model))
        if not bad:
            with Folder.open(root, key="run_dir") as run, run.sub(rel, create=True) as folder:
                save_shards(self.trainer, folder.path())
        return bad, self.trainer.scaler.state_dict(), self.trainer.weight_version

    def update(
        self, batch: RolloutBatch, prepared: Prepared, plan: UpdatePlan, order_seed: int, sampled_here: bool = False
    ) -> UpdateResult:
        """This rank's share of the step's updates; non-finite weights are reported, by name. `sampled_here`:
        the batch was sampled on the weights this learner holds (staleness 0), so its first π_θ pass is what
        the numerics promise of π_old (exact mode: its bits); every learner stops before its optimizer steps
        if one's is not."""
        t = time.perf_counter()
        trainers = [self.trainer] + ([self.reference] if self.reference is not None else [])
        flops = sum(tr.matmul_flops for tr in trainers)
        # Numerics that promise no bits (plain mode) leave nothing to check, and the learners no collective to run.
        check = sampled_here and self.numerics.exact
        result = train_on_batch(
            self.trainer,
            batch,
            prepared,
            plan,
            order_seed,
            self.reference,
            rank=self.rank,
            world=self.world,
            before_first_step=functools.partial(self._check_first_pass, batch) if check else None,
        )
        result.flops = sum(tr.matmul_flops for tr in trainers) - flops
        result.seconds = time.perf_counter() - t
        result.non_finite_weights = non_finite_tensors(local_parameters(self.trainer.model))
        return result

    def _check_first_pass(
        self, batch: RolloutBatch, old: torch.Tensor, rows: torch.Tensor, first_pass: torch.Tensor
    ) -> None:
        """At staleness 0, this learner's first π_θ pass against π_old (`check_first_pass`: exact mode's bits);
        the learners agree on the outcome (a collective) so that none steps while another stops."""
        import torch.distributed as dist

        where = f"learner {self.rank} of {self.world}"
        try:
            check_first_pass(self.numerics, old, batch.sampled_mask, rows, first_pass, where)
            failed = None
        except ExactnessError as e:
            failed = e
        flags = torch.tensor([0.0 if failed is None else 1.0], device=self.numerics.device)  # NCCL: on the card
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if failed is not None:
            raise failed
        if flags.item():
            raise ExactnessError(
                f"exact=true, but another learner's first π_θ pass differs from π_old ({where} agrees)"
            )
