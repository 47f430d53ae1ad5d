"""Sampling a token per row on CUDA over the vocabulary (Triton): the Gumbel-max draw.

argmax_v (z_v + g_v), with g_v = -log(-log u_v) and u_v uniform, is a draw from softmax(z): no
cumulative sum over the vocabulary (a [B, V] scan was the decode step's costliest kernel), no
normaliser before the draw. The noise of row i comes from a counter-based generator (Philox, four
numbers per call) seeded by that row's own number for the step (`uniforms[i]`, drawn per (row, step) as
the engine draws every number), so a row's token never depends on which rows share its batch. Given raw logits, the same
pass keeps a running log-sum-exp and returns the token's log-probability; given log-probabilities
(exact mode's log-softmax, or a filtered distribution with -inf outside its support), it reads the
token's own.

Each row's vocabulary is split into spans of `SPAN` entries, one program each, so that a batch of a
few rows still fills the GPU (one program per row ran 128 programs over 19M entries at batch 128); a
second pass picks each row's best span. The noise of entry v is the same whichever span holds it, and
ties go to the lowest entry as in one pass, so the token is the same for any span.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from parity.engines.kernels.head import lanes_logsumexp, running_logsumexp

BLOCK = 1024  # entries a program reads at once: 8 per thread, its running state in registers
SPAN = 8192  # entries per program: 19 programs per row at Qwen2's 151,936


@triton.jit(do_not_specialize=["vocab", "stride", "span", "spans"])
def _gumbel_span_kernel(
    scores,
    uniforms,
    keys,
    indices,
    picked,
    tops,
    totals,
    vocab,
    stride,
    span,
    spans,
    scale,
    NORMALISED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Each lane keeps its own best key and running log-sum-exp over the span; one reduction at the end.
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    seed = (tl.load(uniforms + row) * 2147483647.0).to(tl.int32)
    lanes = tl.arange(0, BLOCK)
    quads = tl.arange(0, BLOCK // 4)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_index = tl.full((BLOCK,), 2147483647, tl.int32)
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK,), tl.float32)
    first = part * span
    end = tl.minimum(first + span, vocab)
    for start in tl.range(first, end, BLOCK):
        v = start + lanes
        ok = v < end
        z = tl.load(scores + row * stride + v, mask=ok, other=float("-inf")).to(tl.float32) * scale
        # One Philox call gives four numbers: entry 4i + j takes the j-th of counter i, whichever span holds it.
        r0, r1, r2, r3 = tl.randint4x(seed, start // 4 + quads)
        bits = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))
        noise = -tl.log(-tl.log(tl.uint_to_uniform_float(bits)))
        key = tl.where(ok & (z > float("-inf")), z + noise, float("-inf"))
        take = key > best  # strictly: a lane keeps its earliest entry of equal keys
        best = tl.where(take, key, best)
        best_index = tl.where(take, v, best_index)
        if not NORMALISED:  # a running log-sum-exp of the logits, per lane (z is -inf where a lane reads none)
            top, total = running_logsumexp(top, total, z)
    span_best = tl.max(best, 0)
    # the lowest entry among equal keys, as one pass over the row keeps
    index = tl.min(tl.where(best == span_best, best_index, 2147483647), 0)
    index = tl.where(span_best > float("-inf"), index, first)
    out = row * spans + part
    tl.store(keys + out, span_best)
    tl.store(indices + out, index.to(tl.int64))
    tl.store(picked + out, tl.load(scores + row * stride + index).to(tl.float32) * scale)
    if not NORMALISED:
        span_top, span_total = lanes_logsumexp(top, total)
        tl.store(tops + out, span_top)
        tl.store(totals + out, span_total)


def sample(scores: torch.Tensor, uniforms: torch.Tensor, normalised: bool, temperature: float = 1.0, span: int = SPAN):
    """One token per row of `scores` [N, V] (logits, scaled by 1/temperature here; or with `normalised` the
    log-probabilities themselves), from each row's number `uniforms` [N]: (tokens [N] int64, their
    log-probabilities [N] FP32). `span`: vocabulary entries per program (the token does not depend on it)."""
    if span % 4:
        raise ValueError(f"span must be a multiple of 4 (one Philox call per 4 entries), got {span}")
    n, vocab = scores.shape
    spans = triton.cdiv(vocab, span)
    keys = torch.empty(n, spans, dtype=torch.float32, device=scores.device)
    indices = torch.empty(n, spans, dtype=torch.long, device=scores.device)
    picked = torch.empty(n, spans, dtype=torch.float32, device=scores.device)
    tops = torch.empty(n, spans, dtype=torch.float32, device=scores.device)
    totals = torch.empty(n, spans, dtype=torch.float32, device=scores.device)
    if n:
        scale = 1.0 if normalised else 1.0 / temperature
        _gumbel_span_kernel[(n, spans)](
            scores, uniforms.contiguous(), keys, indices, picked, tops, totals, vocab, scores.stride(0), span,
            spans, scale, NORMALISED=normalised, BLOCK=min(BLOCK, triton.next_power_of_2(span)),
        )  # fmt: skip
    best = keys.argmax(-1, keepdim=True)  # the first of equal keys: the lowest entry, as one pass keeps
    tokens, logprobs = indices.gather(-1, best)[:, 0], picked.gather(-1, best)[:, 0]
    if normalised:
        return tokens, logprobs
    top = tops.max(-1, keepdim=True).values
    return tokens, logprobs - top[:, 0] - (totals * torch.exp(tops - top)).sum(-1).log()
