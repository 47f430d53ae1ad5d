"""Sampling maths: the sampling settings, the filtered distribution a token is drawn from, and the draw.

`filter_logits` defines the distribution μ is measured under (temperature, top-k, top-p): the tokens
kept, each keeping its logit. `draw` samples from that distribution on the device with static shapes
and no host read, as the rollout engine's decode step needs: top-k picks its candidates before any
sort, top-p runs over those candidates only, and the kept ids go to a buffer of fixed width instead of
a [B, V] mask. Its log-probabilities are those of `filter_logits` bit for bit (the same values reach
the same log-softmax), so the trainer can score π on the recorded support.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from parity.engines.kernels import Numerics

# Top-k's candidates: the k largest logits and this many more, for logits equal to the k-th (a tie, frequent
# in 16-bit logits), which top-k keeps as well. A step that ties more than this asks for a wider buffer
# (`RolloutEngine._widths_needed`).
TIE_ROOM = 64
# Top-p alone keeps a prefix of the whole sorted vocabulary; its kept ids first get this many columns.
TOP_P_SUPPORT = 256


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"sampling.temperature must be > 0 (use top_k=1 for greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    def top_k_on(self, vocab: int) -> bool:
        return 0 < self.top_k < vocab


def filter_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to FP32 logits [N, V]; dropped tokens get -inf. Top-k keeps every
    token tied with the k-th; top-p keeps tokens in order of logit (equal logits: lower id first) until the
    mass before a token reaches top_p. The definition `draw` computes on the device."""
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if sampling.top_k_on(logits.shape[-1]):
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop_sorted = (probs.cumsum(-1) - probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_categorical(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row of probs [N, V] by inverse CDF, from `uniforms` [N, 1] in [0, 1): [N, 1] token ids.

    One uniform number per row instead of `torch.multinomial`'s one per vocabulary
    entry, which dominates a decode step at real vocabulary sizes. The caller draws the
    numbers, so a row's draw need not depend on which other rows share its batch.
    `right=True` never returns a zero-probability token.
    """
    cdf = probs.cumsum(dim=-1)
    return torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).clamp(max=probs.shape[-1] - 1)


@dataclass(frozen=True)
class Widths:
    """Columns of a filtered draw's buffers: `candidates` logits examined per row (the whole vocabulary for
    top-p alone), `support` kept ids recorded per row."""

    candidates: int
    support: int

    @staticmethod
    def initial(sampling: SamplingParams, vocab: int) -> Widths:
        if sampling.top_k_on(vocab):
            width = min(vocab, sampling.top_k + TIE_ROOM)
            return Widths(width, width)
        # top-p alone keeps a prefix of the whole row; a top-k as wide as the vocabulary keeps all of it
        return Widths(vocab, min(vocab, TOP_P_SUPPORT) if sampling.top_p < 1.0 else vocab)


@dataclass
class Draw:
    """One step's draw for N rows: the tokens [N] and their log-probs [N]; the whole log-distribution
    [N, V] where the draw computed it (None: `log_distribution` computes rows of it); for a filtered
    distribution the kept ids [N, widths.support] (-1 after the last), and how many each row kept [N] and
    would have needed to examine [N] (beyond the widths: draw again wider)."""

    token: torch.Tensor
    logprob: torch.Tensor
    logp: torch.Tensor | None
    kept_ids: torch.Tensor | None = None
    kept: torch.Tensor | None = None
    candidates_needed: torch.Tensor | None = None


def log_distribution(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The log-distribution an unfiltered draw samples from: log-softmax(logits / temperature), [N, V]."""
    return torch.log_softmax(logits / sampling.temperature if sampling.temperature != 1.0 else logits, dim=-1)


def _pick(logp: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A token per row of log-probabilities [N, V] and its log-probability: by inverse CDF on the CPU (what the
    engine always drew), the Gumbel-max draw on CUDA (`kernels/gumbel.py`)."""
    if logp.is_cuda:
        from parity.engines.kernels import gumbel

        return gumbel.sample(logp, uniforms[:, 0], normalised=True)
    token = sample_categorical(logp.exp(), uniforms)
    return token.squeeze(-1), logp.gather(-1, token).squeeze(-1)


def draw(
    logits: torch.Tensor,
    sampling: SamplingParams,
    uniforms: torch.Tensor,
    widths: Widths | None,
    numerics: Numerics | None = None,
) -> Draw:
    """Sample one token per row of logits [N, V] (any float dtype, read as FP32) from `filter_logits`'s
    distribution with `uniforms` [N, 1]. Device ops only, fixed shapes: safe inside a CUDA graph. Unfiltered,
    `numerics` may draw in one fused pass (`Numerics.draw_unfiltered`); otherwise μ is read off the log-softmax
    of the whole row."""
    if not sampling.filtered:
        fused = None if numerics is None else numerics.draw_unfiltered(logits, uniforms[:, 0], sampling.temperature)
        if fused is not None:
            return Draw(*fused, None)
        logp = log_distribution(logits.float(), sampling)
        return Draw(*_pick(logp, uniforms), logp)
    logits = logits.float()
    z = logits / sampling.temperature if sampling.temperature != 1.0 else logits
    vocab = z.shape[-1]
    if widths.candidates >= vocab:
        values, ids = torch.sort(z, dim=-1, descending=True, stable=True)
    else:
        values, ids = torch.topk(z, widths.candidates, dim=-1)
        # topk orders equal logits as it likes: put them in id order, as the stable sort of the whole row does.
        ids, by_id = ids.sort(dim=-1)
        values, by_value = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(-1, by_value)
    keep = torch.ones_like(values, dtype=torch.bool)
    needed = None
    if sampling.top_k_on(vocab):
        kth = values[:, sampling.top_k - 1 : sampling.top_k]
        keep = values >= kth
        if widths.candidates < vocab:
            needed = (z >= kth).sum(-1)
    if sampling.top_p < 1.0:
        probs = torch.softmax(values.masked_fill(~keep, float("-inf")), dim=-1)
        keep = keep & ((probs.cumsum(-1) - probs) < sampling.top_p)
    # Kept tokens are a prefix of the candidates (by logit, ties by id).
    kept_values = values.masked_fill(~keep, float("-inf"))
    processed = torch.full_like(z, float("-inf")).scatter_(-1, ids, kept_values)
    logp = torch.log_softmax(processed, dim=-1)
    token, logprob = _pick(logp, uniforms)
    kept_ids = ids[:, : widths.support].masked_fill(~keep[:, : widths.support], -1)
    return Draw(
        token,
        logprob,
        logp,
        kept_ids.to(torch.int32),
        keep.sum(-1),
        needed,
    )


def supports_in_id_order(kept_ids: torch.Tensor) -> torch.Tensor:
    """Recorded kept ids [..., W] (-1 padded) as the trainer reads them: ascending ids, -1 after, as long
    as the most any entry kept (int64)."""
    ids = kept_ids.long()
    vocab_end = int(ids.max()) + 1 if ids.numel() else 0
    ordered = ids.masked_fill(ids < 0, vocab_end).sort(dim=-1).values
    width = int((ids >= 0).sum(-1).max()) if ids.numel() else 0
    return ordered[..., :width].masked_fill(ordered[..., :width] == vocab_end, -1)
