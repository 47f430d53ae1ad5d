"""The rollout batch: what a sampler hands the trainer, and joining several (one per worker)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from parity.engines.packing import Routing, common_prefix
from parity.engines.sampling import SamplingParams


@dataclass
class FullVocab:
    """The rollout engine's whole next-token distribution at a few sampled positions, kept while it
    sampled (`RolloutEngine.generate(full_vocab=N)`), and the trainer's at the same positions."""

    rows: torch.Tensor  # [R] output rows recorded
    steps: torch.Tensor  # [R, k] response index t of each recorded position; -1 = none (a short response)
    rollout_logprobs: torch.Tensor  # [R, k, V] FP32 log-probs μ sampled from; -inf outside the support
    trainer_logprobs: torch.Tensor | None = None  # [R, k, V] the trainer's code path on the sampling weights

    def offset(self, rows: int) -> FullVocab:
        """The same record for a batch placed after `rows` others (`concat_batches`)."""
        return FullVocab(self.rows + rows, self.steps, self.rollout_logprobs, self.trainer_logprobs)


@dataclass
class RolloutBatch:
    """B = num_prompts × group_size sampled sequences, rows grouped by prompt."""

    prompt_ids: list[list[int]]
    response_ids: torch.Tensor  # [B, T] int64, pad after the end
    response_mask: torch.Tensor  # [B, T] bool, True on generated tokens (EOS included)
    rollout_logprobs: torch.Tensor  # [B, T] float32 μ, 0 on padding
    support: torch.Tensor | None  # [B, T, K] int64 token ids (-1 = none), None = full vocabulary
    truncated: torch.Tensor  # [B] bool, True if the response hit max_new_tokens without EOS
    group_index: torch.Tensor  # [B] int64, the prompt each row answers
    weight_version: int
    sampling: SamplingParams
    # Filled by `Sampler.fill_old_logprobs` (the trainer's code path on the sampling weights):
    routing: Routing | None = None  # MoE: the experts the engine chose for every token it fed
    old_logprobs: torch.Tensor | None = None  # [B, T] π_old, trainer precision
    probe_logprobs: torch.Tensor | None = None  # [B, T] the same forward in the rollout precision
    routing_mismatch: torch.Tensor | None = None  # [MoE layers] tokens whose experts differ, π_old vs μ
    full_vocab: FullVocab | None = None  # `diagnostics.full_vocab_positions`: whole distributions compared
    # Partial rollouts: the weight version that sampled each token [B, T] (a response continued after a
    # weight sync spans versions); None when every token is `weight_version`'s.
    token_versions: torch.Tensor | None = None
    # Episodes (several model turns): [B, T] True on the tokens fed between turns (the template's text, a
    # tool's answer, the next generation prompt): context the trainer reads, never a sampled token. None: one turn.
    env_mask: torch.Tensor | None = None
    episodes: object = None  # episodes' records (`rl/episodes.EpisodeBatch`), for rewards and logs; None: one turn

    @property
    def response_lengths(self) -> torch.Tensor:
        """Tokens in each row after its prompt: sampled ones and, in an episode, those fed between turns."""
        return self.response_mask.sum(-1)

    @property
    def sampled_mask(self) -> torch.Tensor:
        """[B, T] True on the tokens the rollout engine sampled: what μ, π_old, a ratio, a clip, a loss and
        the mismatch metrics are taken over (in an episode, the model's own turns only)."""
        if self.env_mask is None:
            return self.response_mask
        return self.response_mask & ~self.env_mask

    def turn_index(self) -> torch.Tensor:
        """[B, T] the model turn (0, 1, ...) each sampled token belongs to; -1 on fed tokens and padding."""
        if self.env_mask is None:
            return torch.zeros_like(self.response_ids).masked_fill(~self.response_mask, -1)
        env = self.env_mask.long()
        starts = (env - F.pad(env, [1, 0])[:, :-1]).clamp(min=0)  # the first token of each fed span
        return starts.cumsum(-1).masked_fill(~self.sampled_mask, -1)

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())

    def micro_batches(self, rows: torch.Tensor, tokens: int) -> list[torch.Tensor]:
        """`rows` (in order) as consecutive micro-batches of at most `tokens` packed tokens each (a prompt
        counted without the longest prefix it shares with a prompt before it in the micro-batch, as `pack`
        stores it; a response in full), one row at least. The trainer and the sampler split a batch alike, so
        that π_old is scored in the trainer's shapes."""
        lengths = self.response_lengths.tolist()
        parts, current, used, prompts = [], [], 0, []
        for row in rows.tolist():
            prompt = tuple(self.prompt_ids[row])
            # The longest prefix shared with any prompt so far is shared with a neighbour in sorted order.
            at = bisect.bisect(prompts, prompt)
            shared = max((common_prefix(prompt, prompts[i]) for i in (at - 1, at) if 0 <= i < len(prompts)), default=0)
            cost = lengths[row] + len(prompt) - shared
            if current and used + cost > tokens:
                parts.append(current)
                current, used, prompts, at = [], 0, [], 0
                cost = lengths[row] + len(prompt)
            current.append(row)
            used += cost
            prompts.insert(at, prompt)
        if current:
            parts.append(current)
        return [torch.tensor(part, dtype=torch.long) for part in parts]

    def versions(self) -> torch.Tensor:
        """The weight version of every token [B, T]; -1 on padding."""
        if self.token_versions is not None:
            return self.token_versions
        return torch.full_like(self.response_ids, self.weight_version).masked_fill(~self.response_mask, -1)


def concat_batches(batches: list[RolloutBatch]) -> RolloutBatch:
    """One batch from several (each worker's share of a step), in order; responses padded to the
    longest. `weight_version` becomes the oldest of theirs."""
    width = max(b.response_ids.shape[1] for b in batches)

    def cat(name: str, fill) -> torch.Tensor | None:
        parts = [getattr(b, name) for b in batches]
        if parts[0] is None:
            return None
        padded = []
        for t in parts:
            pad = [0, 0] * (t.dim() - 2) + [0, width - t.shape[1]]
            padded.append(F.pad(t, pad, value=fill) if t.dim() > 1 else t)
        return torch.cat(padded)

    support = None
    if batches[0].support is not None:
        k = max(b.support.shape[2] for b in batches)
        support = torch.cat(
            [F.pad(b.support, [0, k - b.support.shape[2], 0, width - b.support.shape[1]], value=-1) for b in batches]
        )
    routing = None
    if batches[0].routing is not None:
        parts = [b.routing.responses for b in batches]
        responses = torch.cat([F.pad(r, [0, 0, 0, 0, 0, width - r.shape[1]], value=-1) for r in parts])
        routing = Routing([p for b in batches for p in b.routing.prompts], responses)
    offsets, groups = 0, []
    for b in batches:
        groups.append(b.group_index + offsets)
        offsets += int(b.group_index.max()) + 1
    full_vocab = None
    if batches[0].full_vocab is not None:
        starts = [sum(len(b.prompt_ids) for b in batches[:i]) for i in range(len(batches))]
        records = [b.full_vocab.offset(start) for b, start in zip(batches, starts)]
        trainer = [r.trainer_logprobs for r in records]
        full_vocab = FullVocab(
            torch.cat([r.rows for r in records]),
            torch.cat([r.steps for r in records]),
            torch.cat([r.rollout_logprobs for r in records]),
            None if any(t is None for t in trainer) else torch.cat(trainer),
        )
    return RolloutBatch(
        prompt_ids=[ids for b in batches for ids in b.prompt_ids],
        response_ids=cat("response_ids", 0),  # masked out: any id will do
        response_mask=cat("response_mask", False),
        rollout_logprobs=cat("rollout_logprobs", 0.0),
        support=support,
        truncated=torch.cat([b.truncated for b in batches]),
        group_index=torch.cat(groups),
        weight_version=min(b.weight_version for b in batches),
        sampling=batches[0].sampling,
        routing=routing,
        old_logprobs=cat("old_logprobs", 0.0),
        probe_logprobs=cat("probe_logprobs", 0.0),
        routing_mismatch=None
        if batches[0].routing_mismatch is None
        else torch.stack([b.routing_mismatch for b in batches]).mean(0),
        full_vocab=full_vocab,
        token_versions=None
        if all(b.token_versions is None for b in batches)
        else torch.cat([F.pad(b.versions(), [0, width - b.response_ids.shape[1]], value=-1) for b in batches]),
        env_mask=cat("env_mask", False),
        episodes=None if batches[0].episodes is None else type(batches[0].episodes).join([b.episodes for b in batches]),
    )
