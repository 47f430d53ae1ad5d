"""Sampling maths: the sampling settings, and the filtered distribution a token is drawn from.

`filter_logits` defines the distribution μ is measured under (temperature, top-k, top-p), so the
rollout engine, the exact-mode replay and any other sampler call this one function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def filter_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to FP32 logits [N, V]; dropped tokens get -inf."""
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
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


def support_ids(kept: torch.Tensor) -> torch.Tensor:
    """Token ids where `kept` [N, V] is True, as [N, K] padded with -1 (K = max count)."""
    counts = kept.sum(-1)
    k = int(counts.max()) if counts.numel() else 0
    ids = torch.sort(kept.to(torch.int8), dim=-1, descending=True, stable=True).indices[:, :k]
    return ids.masked_fill(torch.arange(k, device=kept.device) >= counts[:, None], -1)
