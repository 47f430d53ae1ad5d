"""How a distributed run's requests for samples reach the rollout workers and come back: whole groups per
request (`WholeGroups`), or with `async.partial_rollouts` through each worker's pool of unfinished
responses (`Pools`). The driver (`driver.RayBackend`) picks one when it starts and asks it at each point
where the two differ: how many prompts a worker is sent, which call samples them, what a restarted worker
must sample again, which problems came back and where a resume starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parity.engines.partial import PoolRequest
from parity.engines.sampling import SamplingParams
from parity.rl.problems import Problem


@dataclass
class Shard:
    """One worker's part of a request."""

    worker: int
    prompts: list[list[int]] | list[Problem]
    seed: int
    ref: object = None  # the Ray ObjectRef of (RolloutBatch, timings)
    # Partial rollouts: the prompts' keys, the complete groups wanted back and the oldest version to train on.
    keys: list[int] = field(default_factory=list)
    need: int = 0
    min_version: int = 0


@dataclass
class Request:
    """One step's rollouts, split by whole prompt groups over the workers."""

    step: int
    problems: list[Problem]
    data_position: int  # the data order's position after taking these problems
    shards: list[Shard] = field(default_factory=list)


class WholeGroups:
    """Each request's groups come back whole, every response sampled on the weights the worker held."""

    def __init__(self, group_size: int, sampling: SamplingParams, full_vocab: int):
        self.group_size, self.sampling, self.full_vocab = group_size, sampling, full_vocab

    def sizes(self, shares: list[int]) -> list[int]:
        """How many prompts each worker is sent, for `shares` groups wanted back from it."""
        return shares

    def open(self, shard: Shard, problems: list[Problem], positions: list[int], need: int, step: int) -> None:
        """Record what `shard` carries (its prompts' problems and data positions) before it is sent."""

    def call(self, worker, pid: int, shard: Shard):
        """The worker's sampling call for `shard` (a Ray ObjectRef), meant for its process `pid`."""
        return worker.generate.remote(pid, shard.prompts, self.group_size, self.sampling, shard.seed, self.full_vocab)

    def lost(self, worker: int, resend: list[Shard], prompts) -> None:
        """Worker `worker` restarted: add to the first shard sent to it again what it held beyond its requests
        (`prompts` makes a worker's prompts from problems)."""

    def delivered(self, request: Request, infos: list[dict], position: int) -> tuple[list[Problem], int]:
        """The problems a request's batches answer, in order, and the data position a resume starts from
        (`position`: the data order's now)."""
        return request.problems, request.data_position

    def metrics(self, versions, infos: list[dict]) -> dict[str, float]:
        return {}


class Pools(WholeGroups):
    """`async.partial_rollouts`: each worker keeps a pool of twice the groups a request takes back, so that a
    request ends once the quickest half is complete; a response unfinished then goes on, on newer weights,
    in the next request. Every prompt sent is kept here under its key until it is trained on."""

    def __init__(self, group_size: int, sampling: SamplingParams, full_vocab: int, workers: int, max_age: int):
        super().__init__(group_size, sampling, full_vocab)
        self.max_age = max_age  # async.max_token_staleness
        # Each prompt sent and not yet trained on, by key: (problem, its data position, worker); and each
        # worker's groups beyond what its pending requests take back (its pool's spare groups).
        self.outstanding: dict[int, tuple[Problem, int, int]] = {}
        self.spare = [0] * workers
        self.next_key = 0
        self.dropped_tokens = 0

    def sizes(self, shares: list[int]) -> list[int]:
        # A worker's first request brings the spare half of its pool.
        return [n + max(n - self.spare[w], 0) for w, n in enumerate(shares)]

    def open(self, shard: Shard, problems: list[Problem], positions: list[int], need: int, step: int) -> None:
        n = len(problems)
        shard.keys = list(range(self.next_key, self.next_key + n))
        shard.need, shard.min_version = need, step - self.max_age
        for key, problem, position in zip(shard.keys, problems, positions):
            self.outstanding[key] = (problem, position, shard.worker)
        self.next_key += n
        self.spare[shard.worker] += n - need

    def call(self, worker, pid: int, shard: Shard):
        request = PoolRequest(
            shard.prompts, shard.keys, shard.need, self.group_size, self.sampling, shard.seed, shard.min_version,
            self.full_vocab,
        )  # fmt: skip
        return worker.generate_partial.remote(pid, request)

    def lost(self, worker: int, resend: list[Shard], prompts) -> None:
        if not resend:
            return
        # The worker's pool died with it: its groups from requests already answered start again.
        queued = {k for s in resend for k in s.keys}
        lost = [k for k, (_, _, w) in self.outstanding.items() if w == worker and k not in queued]
        resend[0].keys = lost + resend[0].keys
        resend[0].prompts = prompts([self.outstanding[k][0] for k in lost]) + resend[0].prompts

    def delivered(self, request: Request, infos: list[dict], position: int) -> tuple[list[Problem], int]:
        problems = [self.outstanding.pop(k)[0] for info in infos for k in info["keys"]]
        self.dropped_tokens += sum(info["dropped_tokens"] for info in infos)
        # A resume samples again from the oldest prompt not yet trained on (and some after it twice).
        return problems, min((p for _, p, _ in self.outstanding.values()), default=position)

    def metrics(self, versions, infos: list[dict]) -> dict[str, float]:
        spans = [len(row[row >= 0].unique()) for row in versions]
        return {
            "async/continued_frac": sum(n > 1 for n in spans) / len(spans),
            "async/dropped_tokens": self.dropped_tokens,
            "async/unfinished": sum(info["unfinished"] for info in infos),
        }
