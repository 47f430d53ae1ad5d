"""Sampling a token per row on CUDA in one pass over the vocabulary (Triton): the Gumbel-max draw.

argmax_v (z_v + g_v), with g_v = -log(-log u_v) and u_v uniform, is a draw from softmax(z): no
cumulative sum over the vocabulary (a [B, V] scan was the decode step's costliest kernel), no
normaliser before the draw. The noise of row i comes from a counter-based generator seeded by that
row's own number for the step (`uniforms[i]`, drawn per (row, step) as the engine draws every
number), so a row's token never depends on which rows share its batch. Given raw logits, the same
pass keeps a running log-sum-exp and returns the token's log-probability; given log-probabilities
(exact mode's log-softmax, or a filtered distribution with -inf outside its support), it reads the
token's own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit(do_not_specialize=["vocab", "stride"])
def _gumbel_kernel(
    scores, uniforms, tokens, logprobs, vocab, stride, scale, NORMALISED: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    seed = (tl.load(uniforms + row) * 2147483647.0).to(tl.int32)
    lanes = tl.arange(0, BLOCK)
    best = tl.full((), float("-inf"), tl.float32)
    best_score = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int32)
    top = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    for start in tl.range(0, vocab, BLOCK):
        v = start + lanes
        ok = v < vocab
        z = tl.load(scores + row * stride + v, mask=ok, other=float("-inf")).to(tl.float32) * scale
        noise = -tl.log(-tl.log(tl.rand(seed, v)))
        key = tl.where(ok & (z > float("-inf")), z + noise, float("-inf"))
        chunk_best = tl.max(key, 0)
        at = tl.argmax(key, 0)
        take = chunk_best > best
        best = tl.where(take, chunk_best, best)
        best_index = tl.where(take, start + at, best_index)
        best_score = tl.where(take, tl.sum(tl.where(lanes == at, z, 0.0), 0), best_score)
        if not NORMALISED:  # a running log-sum-exp of the logits
            chunk_top = tl.max(z, 0)
            new_top = tl.maximum(top, chunk_top)
            total = total * tl.exp(top - new_top) + tl.sum(tl.where(ok, tl.exp(z - new_top), 0.0), 0)
            top = new_top
    tl.store(tokens + row, best_index.to(tl.int64))
    if NORMALISED:
        tl.store(logprobs + row, best_score)
    else:
        tl.store(logprobs + row, best_score - top - tl.log(total))


def sample(scores: torch.Tensor, uniforms: torch.Tensor, normalised: bool, temperature: float = 1.0):
    """One token per row of `scores` [N, V] (logits, scaled by 1/temperature here; or with `normalised` the
    log-probabilities themselves), from each row's number `uniforms` [N]: (tokens [N] int64, their
    log-probabilities [N] FP32)."""
    n, vocab = scores.shape
    tokens = torch.empty(n, dtype=torch.long, device=scores.device)
    logprobs = torch.empty(n, dtype=torch.float32, device=scores.device)
    if n:
        scale = 1.0 if normalised else 1.0 / temperature
        _gumbel_kernel[(n,)](
            scores, uniforms.contiguous(), tokens, logprobs, vocab, scores.stride(0), scale,
            NORMALISED=normalised, BLOCK=BLOCK,
        )  # fmt: skip
    return tokens, logprobs
