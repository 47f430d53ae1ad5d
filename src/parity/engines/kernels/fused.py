"""Fused elementwise work on CUDA (Triton): RoPE on the new token's query and key heads and the cache
write of its key and value (one kernel per layer instead of nine); the trainer's RoPE, forward and backward;
RMSNorm, and the rollout engine's residual addition with it, in one pass; SiLU(gate) · up in one pass.
RMSNorm and SiLU · up run in both engines in every mode on CUDA (`Numerics.fused_rows`), with backward
kernels for the trainer, so that the engines agree on them by construction.

RoPE computes each element as PyTorch's eager ops do, operation by operation: x·cos and rotate(x)·sin
each rounded to the compute dtype, then their sum rounded (no fused multiply-add), so the roped query and
key are the bits `ops.apply_rope` gives, which exact mode needs (the prefill ropes with those eager ops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROW_BLOCK = 1024  # elements of a row RMSNorm reads at once
ACTIVATION_BLOCK = 1024  # elements of a row per program of SiLU · up
BACKWARD_PROGRAMS = 1024  # programs of RMSNorm's backward, each summing its rows' share of w's gradient
_INTS = ["heads", "kv_heads", "head_dim", "stride_qk", "stride_v", "stride_cos", "stride_kv", "stride_q"]


@triton.jit(
    do_not_specialize=_INTS,
    do_not_specialize_on_alignment=["qk", "v", "cos", "sin", "k_cache", "v_cache", "at", "q_out"],
)
def _rope_store_kernel(
    qk, v, cos, sin, k_cache, v_cache, at, q_out,
    heads, kv_heads, head_dim, stride_qk, stride_v, stride_cos, stride_kv, stride_q,
    BD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BD)
    ok = d < head_dim
    dtype = q_out.dtype.element_ty
    slot = tl.load(at + row).to(tl.int64)
    if head < heads + kv_heads:
        half = head_dim // 2
        partner = tl.where(d < half, d + half, d - half)
        base = qk + row * stride_qk + head * head_dim
        x = tl.load(base + d, mask=ok, other=0.0).to(tl.float32)
        rotated = tl.load(base + partner, mask=ok, other=0.0).to(tl.float32)
        rotated = tl.where(d < half, -rotated, rotated)
        c = tl.load(cos + row * stride_cos + d, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sin + row * stride_cos + d, mask=ok, other=0.0).to(tl.float32)
        roped = ((x * c).to(dtype).to(tl.float32) + (rotated * s).to(dtype).to(tl.float32)).to(dtype)
        if head < heads:
            tl.store(q_out + row * stride_q + head * head_dim + d, roped, mask=ok)
        else:
            tl.store(k_cache + slot * stride_kv + (head - heads) * head_dim + d, roped, mask=ok)
    else:
        value = tl.load(v + row * stride_v + (head - heads - kv_heads) * head_dim + d, mask=ok, other=0.0)
        tl.store(v_cache + slot * stride_kv + (head - heads - kv_heads) * head_dim + d, value, mask=ok)


def rope_store(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    at: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """One new token per row: qk [n, heads + kv_heads, D] and v [n, kv_heads · D] (last dimensions contiguous),
    cos and sin [n, D] at each row's position. Ropes the query heads (returned, [n, heads, D]) and the key heads,
    and writes the roped keys and the values to row `at[i]` of the caches [slots, kv_heads, D]."""
    n, total, dim = qk.shape
    kv_heads = total - heads
    q = torch.empty(n, heads, dim, dtype=qk.dtype, device=qk.device)
    if n:
        _rope_store_kernel[(n, heads + 2 * kv_heads)](
            qk, v, cos, sin, k_cache, v_cache, at, q,
            heads, kv_heads, dim, qk.stride(0), v.stride(0), cos.stride(0), k_cache.stride(0), q.stride(0),
            BD=max(16, triton.next_power_of_2(dim)), enable_fp_fusion=False,
        )  # fmt: skip
    return q


@triton.jit(
    do_not_specialize=["head_dim", "stride_x", "stride_xh", "stride_c", "stride_y", "stride_yh"],
    do_not_specialize_on_alignment=["x", "cos", "sin", "y"],
)
def _rope_kernel(
    x, cos, sin, y, head_dim, stride_x, stride_xh, stride_c, stride_y, stride_yh,
    BACKWARD: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    # Forward: y = x·cos + rotate(x)·sin, rotate(x) = [-x2, x1]. Backward: dx = g·cos + rotateᵀ(g·sin), rotateᵀ(u) =
    # [u2, -u1]. Each product rounded to the dtype, then their sum, as the eager ops (and their autograd) round.
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BD)
    ok = d < head_dim
    half = head_dim // 2
    partner = tl.where(d < half, d + half, d - half)
    dtype = y.dtype.element_ty
    base = x + row * stride_x + head * stride_xh
    angles = row * stride_c
    value = tl.load(base + d, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(cos + angles + d, mask=ok, other=0.0).to(tl.float32)
    other = tl.load(base + partner, mask=ok, other=0.0).to(tl.float32)
    if BACKWARD:  # the partner's g·sin, its sign flipped in the second half
        product = (other * tl.load(sin + angles + partner, mask=ok, other=0.0).to(tl.float32)).to(dtype)
        rotated = tl.where(d < half, product.to(tl.float32), -product.to(tl.float32))
    else:
        s = tl.load(sin + angles + d, mask=ok, other=0.0).to(tl.float32)
        rotated = (tl.where(d < half, -other, other) * s).to(dtype).to(tl.float32)
    out = ((value * c).to(dtype).to(tl.float32) + rotated).to(dtype)
    tl.store(y + row * stride_y + head * stride_yh + d, out, mask=ok)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, heads, dim = x.shape
    y = torch.empty((rows, heads, dim), dtype=x.dtype, device=x.device)
    if rows:
        _rope_kernel[(rows, heads)](
            x, cos, sin, y, dim, x.stride(0), x.stride(1), cos.stride(0), y.stride(0), y.stride(1),
            BACKWARD=backward, BD=max(16, triton.next_power_of_2(dim)), enable_fp_fusion=False,
        )  # fmt: skip
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rope(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rope(grad, cos, sin, backward=True), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the heads x [N, heads, D] by each row's cos and sin ([N, 1, D] or [N, D], last dimension contiguous),
    in one pass forward and one backward: the bits `apply_rope`'s eager ops give (products and sum each rounded
    to x's dtype, no fused multiply-add), where those are five passes over x and autograd's four more."""
    cos, sin = (t.reshape(t.shape[0], -1) for t in (cos, sin))
    return _Rope.apply(x, cos, sin)


# Rows and strides are never specialised, nor pointers on their alignment: the trainer's packed stream and
# the decode step's few rows then run one compiled variant, with one reduction order (see invariant.py).
@triton.jit(
    do_not_specialize=["length", "stride_x", "stride_d", "stride_s", "stride_y"],
    do_not_specialize_on_alignment=["x", "delta", "summed", "weight", "y"],
)
def _rms_norm_kernel(
    x, delta, summed, weight, y, length, stride_x, stride_d, stride_s, stride_y, eps,
    ADD: tl.constexpr, GEMMA: tl.constexpr, ONE_ROUNDING: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    dtype = y.dtype.element_ty
    total = tl.zeros((BLOCK,), tl.float32)
    for start in tl.range(0, length, BLOCK):
        ok = start + lanes < length
        v = tl.load(x + row * stride_x + start + lanes, mask=ok, other=0.0)
        if ADD:  # the residual stream's sum, rounded as the addition alone rounds it
            v = (v.to(tl.float32) + tl.load(delta + row * stride_d + start + lanes, mask=ok, other=0.0)).to(dtype)
            tl.store(summed + row * stride_s + start + lanes, v, mask=ok)
        v = v.to(tl.float32)
        total += v * v
    scale = 1.0 / tl.sqrt(tl.sum(total, 0) / length + eps)
    for start in tl.range(0, length, BLOCK):
        ok = start + lanes < length
        v = tl.load(x + row * stride_x + start + lanes, mask=ok, other=0.0)
        if ADD:
            v = (v.to(tl.float32) + tl.load(delta + row * stride_d + start + lanes, mask=ok, other=0.0)).to(dtype)
        v = v.to(tl.float32)
        w = tl.load(weight + start + lanes, mask=ok, other=0.0).to(tl.float32)
        if GEMMA:  # (1 + w) in FP32, one rounding
            out = v * scale * (1.0 + w)
        elif ONE_ROUNDING:  # the fused kind inference engines run
            out = v * scale * w
        else:  # normalised, rounded, then scaled by w and rounded: Llama's order
            out = (v * scale).to(dtype).to(tl.float32) * w
        tl.store(y + row * stride_y + start + lanes, out.to(dtype), mask=ok)


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def norm_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gemma: bool = False,
    delta: torch.Tensor | None = None,
    one_rounding: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `x`'s rows in one pass (FP32 inside), `weight` in x's dtype, no gradient (`rms_norm` has
    one): each row by the same code whatever the number of rows, so the rollout engine and the trainer give a
    row the same bits. `delta`: the norm of x + delta, returned with the sum ((sum, normed)), as a decoder layer
    adds to its residual stream and normalises it. `one_rounding`: scaled by w before the one rounding
    (F.rms_norm's order; otherwise Llama's: normalised, rounded, scaled, rounded)."""
    rows = _rows(x)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(y) if delta is not None else y
    deltas = _rows(delta) if delta is not None else rows
    if rows.numel():
        _rms_norm_kernel[(rows.shape[0],)](
            rows, deltas, summed, weight.contiguous(), y, rows.shape[1],
            rows.stride(0), deltas.stride(0), summed.stride(0), y.stride(0), eps,
            ADD=delta is not None, GEMMA=gemma, ONE_ROUNDING=one_rounding, BLOCK=ROW_BLOCK, num_warps=4,
            enable_fp_fusion=False,
        )  # fmt: skip
    if delta is None:
        return y.view(x.shape)
    return summed.view(x.shape), y.view(x.shape)


@triton.jit(
    do_not_specialize=["width", "stride_g", "stride_u", "stride_o"],
    do_not_specialize_on_alignment=["gate", "up", "out"],
)
def _silu_mul_kernel(gate, up, out, width, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    g = tl.load(gate + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # SiLU rounded, as its own op would leave it
    tl.store(out + row * stride_o + cols, (act * u).to(dtype), mask=ok)


def _silu_mul_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up in gate's dtype, one pass, each rounded as the two eager ops round; `gate` and `up` may
    be the two halves of one projection's output (any row stride)."""
    shape, width = gate.shape, gate.shape[-1]
    g, u = _rows(gate), _rows(up)
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        _silu_mul_kernel[(out.shape[0], triton.cdiv(width, ACTIVATION_BLOCK))](
            g, u, out, width, g.stride(0), u.stride(0), out.stride(0), BLOCK=ACTIVATION_BLOCK, num_warps=4,
            enable_fp_fusion=False,
        )  # fmt: skip
    return out.view(shape)


@triton.jit
def _rms_norm_backward_kernel(
    x, weight, dy, dx, dw_parts, rows, length, stride_x, stride_dy, stride_dx, eps, rows_per_program,
    GEMMA: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Each program takes a run of rows (the whole row in one block) and keeps its share of w's gradient.
    part = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < length
    w = tl.load(weight + cols, mask=ok, other=0.0).to(tl.float32)
    if GEMMA:
        w = 1.0 + w
    dw = tl.zeros((BLOCK,), tl.float32)
    first = part.to(tl.int64) * rows_per_program
    for i in tl.range(0, rows_per_program):
        row = first + i
        here = ok & (cols * 0 + row < rows)  # the last program's run may pass the end: zeros in, nothing out
        v = tl.load(x + row * stride_x + cols, mask=here, other=0.0).to(tl.float32)
        g = tl.load(dy + row * stride_dy + cols, mask=here, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(v * v, 0) / length + eps)
        normed = v * rstd
        if GEMMA:
            dw += g * normed
        else:  # Llama scales the rounded normalised value
            dw += g * normed.to(dx.dtype.element_ty).to(tl.float32)
        gw = g * w
        # d/dx of x·rstd(x): rstd · (gw − x̂ · mean(gw · x̂))
        grad = rstd * (gw - normed * (tl.sum(gw * normed, 0) / length))
        tl.store(dx + row * stride_dx + cols, grad.to(dx.dtype.element_ty), mask=here)
    tl.store(dw_parts + part * length + cols, dw, mask=ok)


class _RMSNorm(torch.autograd.Function):
    """`norm_rows`'s values (Llama's or Gemma's order) with RMSNorm's gradients, from one backward kernel:
    the rounding steps are taken as identities, as autograd takes them."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, gemma: bool):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.gemma = eps, gemma
        return norm_rows(x, weight.to(x.dtype), eps, gemma)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rows, g = _rows(x), _rows(grad)
        n, length = rows.shape
        dx = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        programs = max(1, min(n, BACKWARD_PROGRAMS))
        per = triton.cdiv(n, programs)
        dw_parts = torch.zeros(programs, length, dtype=torch.float32, device=x.device)
        if n:
            block = max(16, triton.next_power_of_2(length))
            _rms_norm_backward_kernel[(programs,)](
                rows, weight.to(x.dtype).contiguous(), g, dx, dw_parts, n, length, rows.stride(0), g.stride(0),
                dx.stride(0), ctx.eps, per, GEMMA=ctx.gemma, BLOCK=block, num_warps=min(16, max(4, block // 256)),
            )  # fmt: skip
        return dx.view(x.shape), dw_parts.sum(0).to(weight.dtype), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm as the trainer computes it (Llama: normalised, rounded, times w, rounded; Gemma: times 1 + w,
    rounded once), `weight` in any dtype (rounded to x's first), in one pass per row, with gradients."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps, gemma)
    return norm_rows(x, weight.to(x.dtype), eps, gemma)


@triton.jit
def _silu_mul_backward_kernel(
    gate, up, dout, dgate, dup, width, stride_g, stride_u, stride_d, stride_dg, stride_du, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    g = tl.load(gate + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(dout + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    dtype = dgate.dtype.element_ty
    tl.store(dup + row * stride_du + cols, (d * g * sig).to(dtype), mask=ok)
    tl.store(dgate + row * stride_dg + cols, (d * u * sig * (1.0 + g * (1.0 - sig))).to(dtype), mask=ok)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _silu_mul_rows(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        width = gate.shape[-1]
        g, u, d = _rows(gate), _rows(up), _rows(grad)
        dgate, dup = (torch.empty(g.shape, dtype=gate.dtype, device=gate.device) for _ in range(2))
        if g.numel():
            _silu_mul_backward_kernel[(g.shape[0], triton.cdiv(width, ACTIVATION_BLOCK))](
                g, u, d, dgate, dup, width, g.stride(0), u.stride(0), d.stride(0), dgate.stride(0), dup.stride(0),
                BLOCK=ACTIVATION_BLOCK, num_warps=4,
            )  # fmt: skip
        return dgate.view(gate.shape), dup.view(up.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up (`_silu_mul_rows`), with gradients."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMul.apply(gate, up)
    return _silu_mul_rows(gate, up)
