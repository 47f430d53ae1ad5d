"""Fused elementwise work of the decode step on CUDA (Triton): RoPE on the new token's query and key
heads and the cache write of its key and value, one kernel per layer instead of nine.

Each element is computed as PyTorch's eager ops compute it, operation by operation: x·cos and
rotate(x)·sin each rounded to the compute dtype, then their sum rounded (no fused multiply-add), so
the roped query and key are the bits `models.modules.apply_rope` gives, which exact mode needs (the trainer
ropes eagerly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
