"""Partial rollouts: a rollout worker's unfinished responses, continued on newer weights.

With responses of mixed length a step's sampling waits for its longest response while the
short ones sit finished. `PartialRollouts` keeps a pool of prompt groups on the worker and
ends each request as soon as enough whole groups are complete; the responses still being
written stay in the pool and are continued by the next request — after the weight sync
between the two, on the new weights. A response then spans weight versions, so each token
carries the version that sampled it, and μ, π_old (and the probe) of each token are taken on
those weights: every request scores what it sampled before the worker's weights are replaced,
and a continuation re-reads the response so far with the new weights (the rollout engine's
prefill) rather than keep keys and values the old weights computed. In exact mode every
segment is checked where it was sampled, so μ = π_old holds token by token across versions.

A token older than `min_version` (the request's staleness bound) is not trained on: its
response starts again from the prompt.

Episodes (tools or an environment between model turns) are paused at turn boundaries: once enough
groups are complete, a row that ends a turn gets the environment's answer in its outputs and stops
there, and a row in the middle of a turn samples it to its end. Every turn is thus sampled on one
weight version; the next request continues the episode, its environment kept, from the ids so far.
An episode with a token too old starts again with a new environment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from parity.engines.batch import FullVocab, RolloutBatch
from parity.engines.sampler import Sampler
from parity.engines.sampling import SamplingParams


@dataclass
class _Response:
    """One response in the pool: its segments so far, each sampled on one weight version."""

    prompt: list[int]
    tokens: list[torch.Tensor] = field(default_factory=list)
    rollout_logprobs: list[torch.Tensor] = field(default_factory=list)
    old_logprobs: list[torch.Tensor] = field(default_factory=list)
    probe_logprobs: list[torch.Tensor] = field(default_factory=list)
    support: list[torch.Tensor] = field(default_factory=list)
    versions: list[torch.Tensor] = field(default_factory=list)
    # Whole distributions recorded in its segments: (response steps, μ's, the trainer's), [k], [k, V], [k, V].
    full_vocab: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    ended: bool = False  # by an end-of-sequence token
    finished: bool = False  # ended, or at max_new_tokens
    # Episodes: (its environment, its record), which ids were fed between turns, and, paused at a turn
    # boundary, the token limit of its next turn
    episode: tuple[Any, Any] | None = None
    fed: list[torch.Tensor] = field(default_factory=list)
    next_limit: int | None = None

    @property
    def length(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def oldest_version(self) -> int | None:
        return int(self.versions[0][0]) if self.versions else None


@dataclass
class _Group:
    key: int  # the driver's name for the prompt
    responses: list[_Response]
    problem: Any = None  # episodes: the data row, to start an episode again

    @property
    def complete(self) -> bool:
        return all(r.finished for r in self.responses)


def _pad_cat(parts: list[torch.Tensor], width: int, fill) -> torch.Tensor:
    """Rows of different lengths ([n] or [n, K]) stacked and padded to `width` along dim 0."""
    return torch.stack([F.pad(p, [0, 0] * (p.dim() - 1) + [0, width - p.shape[0]], value=fill) for p in parts])


@dataclass
class PoolRequest:
    """One request to a worker's pool: new prompts (named by `keys`) and how many whole groups to return.
    In a pool of episodes the prompts are data rows (`rl/problems.Problem`)."""

    prompts: list[list[int]] | list[Any]
    keys: list[int]
    need: int
    group_size: int
    sampling: SamplingParams
    seed: int
    min_version: int  # a token sampled on older weights is too stale to train on: its response starts again
    full_vocab: int = 0  # `diagnostics.full_vocab_positions`


class EpisodeCalls(Protocol):
    """What the pool needs of a run's episodes (`rl/episodes.EpisodeSetup`; the engines do not import rl/).
    Its episode objects (`rl/episodes.Episodes`) hold `environments` and `episodes` by row and give the
    engine's `between`, `next_limit`, `end_turn`, `seconds` and `finish`."""

    turn_tokens: int

    def start(self, problems: list[Any], group_size: int) -> tuple[Any, list[list[int]]]: ...

    def resume(self, episodes: list[tuple[Any, Any]]) -> Any: ...


class PartialRollouts:
    """A rollout worker's pool of prompt groups, some responses unfinished (module docstring). With
    `episodes`, each response is an episode; `finish(episodes, batch)` closes a returned batch's
    (`Episodes.finish` and what the worker adds)."""

    def __init__(
        self,
        sampler: Sampler,
        episodes: EpisodeCalls | None = None,
        finish: Callable[[Any, RolloutBatch], None] | None = None,
    ):
        self.sampler, self.episodes, self.finish = sampler, episodes, finish
        self.groups: list[_Group] = []
        self.episode_seconds = 0.0  # the environments' time in this request's engine calls

    @property
    def unfinished(self) -> int:
        """Responses in the pool still being written."""
        return sum(not r.finished for g in self.groups for r in g.responses)

    def generate(
        self, request: PoolRequest, check: Callable[[RolloutBatch], None] | None = None
    ) -> tuple[RolloutBatch, list[int], int]:
        """Add the request's prompts to the pool, sample until `need` whole groups are complete and return
        them, oldest first, as one batch scored like `Sampler.fill_old_logprobs` does, with their keys and the
        number of tokens dropped as older than `min_version`. `check(segment)` runs on what this call
        sampled, before anything else (exact mode's check, where the sampling weights still are)."""
        r = request
        self.groups += [_Group(k, self._start(p, r.group_size), p) for p, k in zip(r.prompts, r.keys)]
        if r.need > len(self.groups):
            raise ValueError(f"partial rollouts: {r.need} groups wanted, {len(self.groups)} in the pool")
        dropped = 0
        for group in self.groups:  # a response with a token too old to train on starts again
            stale = [x.oldest_version is not None and x.oldest_version < r.min_version for x in group.responses]
            dropped += sum(x.length for x, old in zip(group.responses, stale) if old)
            group.responses = [self._start(group.problem, 1)[0] if old else x for x, old in zip(group.responses, stale)]
        self.episode_seconds = 0.0
        self._sample(r.need, r.sampling, r.seed, r.full_vocab, check)
        done = [g for g in self.groups if g.complete][: r.need]
        self.groups = [g for g in self.groups if not any(g is d for d in done)]
        return self._batch(done, r.sampling), [g.key for g in done], dropped

    def _start(self, prompt: list[int] | Any, group_size: int) -> list[_Response]:
        """A group's responses, not begun: on a prompt's ids, or episodes made on a data row."""
        if self.episodes is None:
            return [_Response(list(prompt)) for _ in range(group_size)]
        episodes, prompts = self.episodes.start([prompt], group_size)
        pairs = zip(episodes.environments, episodes.episodes)
        return [_Response(prompts[0], episode=pair, next_limit=self.episodes.turn_tokens) for pair in pairs]

    def _sample(
        self,
        need: int,
        sampling: SamplingParams,
        seed: int,
        full_vocab: int,
        check: Callable[[RolloutBatch], None] | None,
    ) -> None:
        """One engine call over every unfinished response, ended once `need` groups are complete."""
        open_rows = [(i, r) for i, g in enumerate(self.groups) for r in g.responses if not r.finished]
        complete_before = sum(g.complete for g in self.groups)
        if not open_rows or complete_before >= need:
            return
        group_of = torch.tensor([i for i, _ in open_rows])
        groups_open = len(self.groups) - complete_before

        def enough(finished: torch.Tensor) -> bool:
            still_open = torch.zeros(len(self.groups), dtype=torch.long).index_add(
                0, group_of, (~finished.cpu()).long()
            )
            completed_now = groups_open - int((still_open > 0).sum())
            return complete_before + completed_now >= need

        responses = [r for _, r in open_rows]
        max_new = sampling.max_new_tokens
        budgets = [max_new - r.length for r in responses]
        prompts = [r.prompt + [int(t) for seg in r.tokens for t in seg] for r in responses]
        if self.episodes is None:
            episodes = None
            segment = self.sampler.engine.generate(prompts, 1, sampling, seed, full_vocab, budgets, enough)
        else:  # each episode's environment and record go on where the last call left them
            episodes = self.episodes.resume([r.episode for r in responses])
            limits = [min(r.next_limit, b) for r, b in zip(responses, budgets)]
            segment = self.sampler.engine.generate(
                prompts, 1, sampling, seed, full_vocab, limits, enough, episodes.between, budgets
            )
            self.episode_seconds += episodes.seconds
        self.sampler.fill_old_logprobs(segment)
        if segment.full_vocab is not None:
            self.sampler.fill_full_vocab(segment)
        if check is not None:
            check(segment)
        lengths = segment.response_lengths.tolist()
        prefix = [r.length for r in responses]
        for i, (response, n) in enumerate(zip(responses, lengths)):
            response.tokens.append(segment.response_ids[i, :n].cpu())
            response.rollout_logprobs.append(segment.rollout_logprobs[i, :n].cpu())
            for name in ("old_logprobs", "probe_logprobs", "support"):
                values = getattr(segment, name)
                if values is not None:
                    getattr(response, name).append(values[i, :n].cpu())
            response.versions.append(torch.full((n,), segment.weight_version, dtype=torch.long))
            response.ended = not bool(segment.truncated[i])
            response.finished = response.ended or response.length >= max_new
            if episodes is not None:
                fed = segment.env_mask[i, :n].cpu()
                response.fed.append(fed)
                if not episodes.episodes[i].end and bool(fed[-1]):  # paused at a turn boundary
                    response.next_limit = episodes.next_limit[i]
                elif not episodes.episodes[i].end:  # its last turn stopped without the environment
                    episodes.end_turn(i, segment.response_ids[i, :n].tolist(), bool(segment.truncated[i]))
                response.finished = bool(episodes.episodes[i].end)
        record = segment.full_vocab
        if record is not None:
            for j, row in enumerate(record.rows.tolist()):
                steps = record.steps[j].cpu()
                trainer = None if record.trainer_logprobs is None else record.trainer_logprobs[j].cpu()
                shifted = torch.where(steps >= 0, steps + prefix[row], steps)
                responses[row].full_vocab.append((shifted, record.rollout_logprobs[j].cpu(), trainer))

    def _batch(self, groups: list[_Group], sampling: SamplingParams) -> RolloutBatch:
        """The complete groups as one rollout batch, each response's segments joined."""
        responses = [r for g in groups for r in g.responses]
        width = max(r.length for r in responses)

        def joined(name: str, fill) -> torch.Tensor | None:
            if not getattr(responses[0], name):
                return None
            return _pad_cat([torch.cat(getattr(r, name)) for r in responses], width, fill)

        device = self.sampler.engine.device
        support = None
        if responses[0].support:
            k = max(s.shape[1] for r in responses for s in r.support)
            rows = [torch.cat([F.pad(s, [0, k - s.shape[1]], value=-1) for s in r.support]) for r in responses]
            support = _pad_cat(rows, width, -1)
        records = [(row, *rec) for row, r in enumerate(responses) for rec in r.full_vocab]
        full_vocab = None
        if records:
            trainer = [rec[3] for rec in records]
            full_vocab = FullVocab(
                torch.tensor([rec[0] for rec in records]),
                torch.stack([rec[1] for rec in records]),
                torch.stack([rec[2] for rec in records]),
                None if any(t is None for t in trainer) else torch.stack(trainer),
            )
        versions = joined("versions", -1)
        lengths = torch.tensor([r.length for r in responses])
        batch = RolloutBatch(
            prompt_ids=[r.prompt for r in responses],
            response_ids=joined("tokens", self.sampler.engine.pad_id),
            response_mask=torch.arange(width)[None] < lengths[:, None],
            rollout_logprobs=joined("rollout_logprobs", 0.0),
            support=support,
            truncated=torch.tensor([not r.ended for r in responses]),
            group_index=torch.arange(len(groups)).repeat_interleave(len(groups[0].responses)),
            weight_version=int(versions[versions >= 0].min()),
            sampling=sampling,
            old_logprobs=joined("old_logprobs", 0.0),
            probe_logprobs=joined("probe_logprobs", 0.0),
            full_vocab=full_vocab,
            token_versions=versions,
            env_mask=joined("fed", False),
        )
        batch = _to(batch, device)
        if self.episodes is not None:
            episodes = self.episodes.resume([r.episode for r in responses])
            episodes.seconds = self.episode_seconds
            self.finish(episodes, batch)
        return batch


def _to(batch: RolloutBatch, device: torch.device) -> RolloutBatch:
    """The batch's tensors on `device` (the pool keeps them on the host)."""
    if device.type == "cpu":
        return batch
    for name, value in vars(batch).items():
        if isinstance(value, torch.Tensor):
            setattr(batch, name, value.to(device))
    if batch.full_vocab is not None:
        fv = batch.full_vocab
        batch.full_vocab = FullVocab(*(None if t is None else t.to(device) for t in vars(fv).values()))
    return batch
