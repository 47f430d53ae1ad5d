"""The LM head's log-probabilities and their gradient on CUDA (Triton), for the trainer's plain numerics.

From the head's output h [rows, V] (any dtype), with the final soft-cap and the temperature applied in
FP32 (z = cap·tanh(h / cap) / T), the forward gives log p(token) = z[token] - logsumexp(z) and the
log-normaliser; the backward writes d log p(token) / dh times the incoming gradient g, in h's dtype:
(g·onehot(token) - g·softmax(z)) / T, times 1 - tanh² under a cap. Each pass reads the head once (and the
backward writes it once, in place if asked), where PyTorch's ops upcast the rows to FP32 and make about ten
passes over them, forward and backward: at 32k tokens of a 152k vocabulary, 30 GB moved against about 300 GB
(`trainer.HeadLogProbs`; the H200's training profile had the head's FP32 copies, adds and exps among its
costliest kernels).

Plain numerics only (`Numerics.fused_head`): the log-normaliser is summed in another order than
`torch.logsumexp`'s, which exact mode, held to the rollout engine's bits, must not do. A filtered
distribution (a top-k/top-p support per row) takes PyTorch's path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # vocabulary entries a program reads at once


@triton.jit
def running_logsumexp(top, total, z):
    """Each lane's running log-sum-exp, (largest z, sum of exp(z - largest)), after one more z per lane (-inf
    where a lane reads nothing). The Gumbel draw keeps its logits' so (`gumbel.py`)."""
    new_top = tl.maximum(top, z)
    safe = tl.where(new_top > float("-inf"), new_top, 0.0)  # a lane that has read nothing yet
    return new_top, total * tl.exp(top - safe) + tl.exp(z - safe)


@triton.jit
def lanes_logsumexp(top, total):
    """The lanes' running log-sum-exps as one: (largest, sum of exp(z - largest)); (-inf, 0) where none read."""
    largest = tl.max(top, 0)
    safe = tl.where(largest > float("-inf"), largest, 0.0)
    return largest, tl.sum(total * tl.exp(top - safe), 0)


@triton.jit
def _scaled(h, inv_cap, cap, inv_temperature, HAS_CAP: tl.constexpr):
    """(z, tanh(h / cap)): the logits the distribution is over, FP32, and the cap's tanh for the backward (h
    itself, unread, without a cap)."""
    t = h
    if HAS_CAP:
        x = h * inv_cap
        e = tl.exp(-2.0 * tl.abs(x))  # tanh from exp: no overflow at any |x|
        t = tl.where(x < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
        z = t * cap * inv_temperature
    else:
        z = h * inv_temperature
    return z, t


@triton.jit(do_not_specialize=["vocab", "stride"])
def _logprobs_kernel(
    head, tokens, picked, lse_out, vocab, stride, inv_cap, cap, inv_temperature,
    HAS_CAP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program per row: each lane keeps a running log-sum-exp of its entries, one reduction at the end.
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK,), tl.float32)
    for start in tl.range(0, vocab, BLOCK):
        ok = start + lanes < vocab
        h = tl.load(head + row * stride + start + lanes, mask=ok, other=0.0).to(tl.float32)
        z, _ = _scaled(h, inv_cap, cap, inv_temperature, HAS_CAP)
        top, total = running_logsumexp(top, total, tl.where(ok, z, float("-inf")))
    row_top, row_total = lanes_logsumexp(top, total)
    lse = row_top + tl.log(row_total)
    token = tl.load(tokens + row)
    z_token, _ = _scaled(tl.load(head + row * stride + token).to(tl.float32), inv_cap, cap, inv_temperature, HAS_CAP)
    tl.store(picked + row, z_token - lse)
    tl.store(lse_out + row, lse)


@triton.jit(do_not_specialize=["vocab", "stride_h", "stride_o"])
def _gradient_kernel(
    head, tokens, lse, grad, out, vocab, stride_h, stride_o, inv_cap, cap, inv_temperature,
    HAS_CAP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Every entry on its own (the row's log-normaliser is known): a block of one row per program, read then
    # written, so that `out` may be `head` itself.
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = columns < vocab
    h = tl.load(head + row * stride_h + columns, mask=ok, other=0.0).to(tl.float32)
    z, t = _scaled(h, inv_cap, cap, inv_temperature, HAS_CAP)
    g = tl.load(grad + row)
    d = tl.where(columns == tl.load(tokens + row), g, 0.0) - g * tl.exp(z - tl.load(lse + row))
    d = d * inv_temperature
    if HAS_CAP:
        d = d * (1.0 - t * t)
    tl.store(out + row * stride_o + columns, d.to(out.dtype.element_ty), mask=ok)


def _settings(temperature: float, cap: float | None) -> dict:
    return dict(
        inv_cap=0.0 if cap is None else 1.0 / cap,
        cap=0.0 if cap is None else float(cap),
        inv_temperature=1.0 / temperature,
        HAS_CAP=cap is not None,
    )


def logprobs(
    head: torch.Tensor, tokens: torch.Tensor, temperature: float, cap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(token) [M], the log-normaliser [M]), FP32, of the head's output `head` [M, V] (its last dimension
    contiguous) and `tokens` [M]."""
    rows, vocab = head.shape
    picked = torch.empty(rows, dtype=torch.float32, device=head.device)
    lse = torch.empty_like(picked)
    if rows:
        _logprobs_kernel[(rows,)](
            head, tokens.contiguous(), picked, lse, vocab, head.stride(0), **_settings(temperature, cap), BLOCK=BLOCK
        )
    return picked, lse


def gradient(
    head: torch.Tensor,
    tokens: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    temperature: float,
    cap: float | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """d log p(token) / d head times `grad` [M], written into `out` [M, V] (`head` itself allowed) in its dtype."""
    rows, vocab = head.shape
    if rows:
        _gradient_kernel[(rows, triton.cdiv(vocab, BLOCK))](
            head, tokens.contiguous(), lse.contiguous(), grad.float().contiguous(), out, vocab, head.stride(0),
            out.stride(0), **_settings(temperature, cap), BLOCK=BLOCK,
        )  # fmt: skip
    return out
