"""The trainer's attention over its packed stream on CUDA, without padding.

The stream holds each prompt prefix once and each response after it (`packing.py`). Every stream token
is a query exactly once, in its row (`PackedBatch.rows`); a row's keys are its prompt then its response,
gathered per row (a prompt's keys and values once for each row that reads it: KV heads only).

* Plain mode: PyTorch's flash attention over variable-length rows (`torch.nn.attention.varlen`,
  causal, the last query of a row aligned with its last key), with its own backward.
* Exact mode: the kernel of `attention.py` over the same rows (the bits the decode step gives each
  token), and in the backward the gradients of plain attention, recomputed: gradients do not enter
  μ = π_old, only the forward values must match.
"""

from __future__ import annotations

import inspect
from functools import cache

import torch
import torch.nn.functional as F

from parity.engines.packing import PackedBatch

# Off: the trainer lays its rows out padded instead (benchmarks compare the two).
ENABLED = True


@cache
def _varlen() -> tuple[object, frozenset[str]] | None:
    """PyTorch's `varlen_attn` and its keyword names (they changed between releases), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def supported(q: torch.Tensor, window: int | None, scale: float | None, softcap: float | None) -> bool:
    """Whether `packed_attention` can run these: a PyTorch with varlen attention, 16-bit inputs (flash
    attention's), no soft-cap, and the window or scale only where this PyTorch's call takes them."""
    found = _varlen()
    if not ENABLED or found is None or q.dtype not in (torch.float16, torch.bfloat16) or softcap is not None:
        return False
    params = found[1]
    if window is not None and "window_size" not in params:
        return False
    default_scale = scale is None or scale == q.shape[-1] ** -0.5
    return default_scale or "scale" in params


def _gathered(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows `order` of t [N, heads, D] through `F.embedding`, whose backward sums a repeated row (a prompt
    read by its whole group) in a fixed order."""
    n, heads, d = t.shape
    return F.embedding(order.long(), t.reshape(n, heads * d)).view(-1, heads, d)


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedBatch, window: int | None, scale: float | None
) -> torch.Tensor:
    """Plain causal attention of the stream, q [N, H, D], k and v [N, Hkv, D] -> [N, H, D] (see `supported`)."""
    varlen_attn, params = _varlen()
    rows = packed.rows
    heads, kv_heads = q.shape[1], k.shape[1]
    queries = q.index_select(0, rows.q_order)  # a permutation: its backward writes each row once
    keys, values = _gathered(k, rows.kv_order), _gathered(v, rows.kv_order)
    kwargs = {}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = kv_heads != heads
    elif kv_heads != heads:
        keys, values = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (keys, values))
    if "window_size" in params:  # (left, right): causal, with a sliding window if any
        kwargs["window_size"] = (-1 if window is None else window - 1, 0)
    else:
        kwargs["is_causal"] = True
    if scale is not None and "scale" in params:
        kwargs["scale"] = scale
    zero = torch.zeros(1, dtype=torch.int32, device=q.device)
    cu_q = torch.cat([zero, torch.cumsum(rows.q_count, 0, dtype=torch.int32)])
    cu_k = torch.cat([rows.kv_start, zero + len(rows.kv_order)])
    out = varlen_attn(queries, keys, values, cu_q, cu_k, rows.max_q, rows.max_k, **kwargs)
    return torch.zeros_like(q).index_copy(0, rows.q_order, out)


class _ExactPackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, packed, window, scale, softcap, plain):
        from parity.engines.kernels import attention

        rows = packed.rows
        heads, dim = q.shape[1], q.shape[2]
        tile_row, tile_f0 = attention.tiles(rows.q_count, heads // k.shape[1])
        spec = attention.Rows(rows.q_first, rows.q_count, rows.q_pos0, rows.kv_start, tile_row, tile_f0, rows.kv_order)
        scale_value = dim**-0.5 if scale is None else scale
        out = attention.rows_attention(q.index_select(0, rows.q_order), k, v, spec, scale_value, window, softcap)
        ctx.save_for_backward(q, k, v)
        ctx.args = (packed, window, scale, softcap, plain)
        return torch.zeros_like(q).index_copy_(0, rows.q_order, out)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        packed, window, scale, softcap, plain = ctx.args
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            out = plain.packed_attention(*inputs, packed, window, scale, softcap)
            grads = torch.autograd.grad(out, inputs, grad)
        return (*grads, None, None, None, None, None)


def exact_packed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: PackedBatch,
    window: int | None,
    scale: float | None,
    softcap: float | None,
    plain,
) -> torch.Tensor:
    """Exact mode's attention of the stream (see the module docstring); `plain`: the numerics whose
    attention gives the gradients."""
    return _ExactPackedAttention.apply(q, k.contiguous(), v.contiguous(), packed, window, scale, softcap, plain)
