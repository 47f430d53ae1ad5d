"""Attention over rows of keys (Triton): the decode step's attention over the KV cache, and exact
mode's attention in the prefill and the trainer, on CUDA.

A *row* is one sequence: its keys at positions 0, 1, ... (each key found at `kv_start[row] + p`
in the key storage, or through a table, `kv_order[kv_start[row] + p]`, for the trainer's packed
stream where a prompt prefix is stored once for every row that starts with it), and its queries at consecutive
positions from `q_pos0[row]`, each attending to the keys at positions <= its own (and inside the
sliding window, if any). The decode step is a row per sequence with one query; the prefill a row
per prompt; the trainer a row per packed sequence.

One program takes a tile of BLOCK_M (query, head) pairs of one row that share a KV head and walks
the row's keys in blocks of BLOCK_N from position 0, in order, with the flash-attention
recurrence: FP32 scores and running max and sum, the probabilities rounded to the compute dtype
before they weight the values, FP32 accumulation, one division at the end. Every (query, head) is
computed by the same code whatever else its tile holds: the blocks are fixed by absolute position,
a block with no key visible to a query leaves that query's state exactly as it was, and every
shape and layout is fixed (one compiled variant, no specialisation on the integers). So a token's
output has the same bits in the decode step, the prefill and the trainer, which exact mode needs;
plain mode uses the same kernel for its speed (keys and values read once, in their 16-bit storage).
FP32 runs its dot products as FP32 FMAs (never TF32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from parity.engines.kernels.invariant import INTERPRETED

BLOCK_M, BLOCK_N = 16, 64
NUM_WARPS = 4

# No variant per value of the integers that steer the loops (a batch's row count never picks a variant);
# strides and pointers are specialised (16-byte loads), which leaves every sum in its order.
_INTS = ["use_table", "window", "groups", "head_dim"]


@triton.jit(do_not_specialize=_INTS)
def _rows_attention_kernel(
    q, k, v, out,
    q_first, q_count, q_pos0, kv_start, kv_order, tile_row, tile_f0,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
    use_table, scale, window, softcap, groups, head_dim,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(tile_row + tile)
    f = tl.load(tile_f0 + tile) + tl.arange(0, BM)
    j, g = f // groups, f % groups
    valid = j < tl.load(q_count + row)
    query = (tl.load(q_first + row) + j).to(tl.int64)
    head = kv_head * groups + g
    pos = tl.load(q_pos0 + row) + j
    d = tl.arange(0, BD)
    d_ok = d < head_dim
    q_tile = tl.load(
        q + query[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
        mask=valid[:, None] & d_ok[None, :],
        other=0.0,
    )
    if IEEE:
        q_tile = q_tile.to(tl.float32)
    hi = tl.max(tl.where(valid, pos, 0), 0) + 1
    # With a sliding window, the blocks wholly before every query's window change nothing: skipped.
    lo = tl.where(window > 0, tl.maximum(tl.min(tl.where(valid, pos, hi), 0) - window + 1, 0) // BN * BN, 0)
    base = tl.load(kv_start + row).to(tl.int64)
    m = tl.full((BM,), float("-inf"), tl.float32)
    total = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, BD), tl.float32)
    for start in tl.range(lo, hi, BN):
        p = start + tl.arange(0, BN)
        in_row = p < hi
        if use_table:
            slot = tl.load(kv_order + base + p, mask=in_row, other=0).to(tl.int64)
        else:
            slot = base + p
        k_tile = tl.load(
            k + slot[None, :] * stride_kn + kv_head * stride_kh + d[:, None],
            mask=in_row[None, :] & d_ok[:, None],
            other=0.0,
        )
        v_tile = tl.load(
            v + slot[:, None] * stride_vn + kv_head * stride_vh + d[None, :],
            mask=in_row[:, None] & d_ok[None, :],
            other=0.0,
        )
        if IEEE:
            s = tl.dot(q_tile, k_tile.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q_tile, k_tile)
        s = s * scale
        if softcap > 0:  # Gemma 2: softcap · tanh(s / softcap)
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        visible = p[None, :] <= pos[:, None]
        if window > 0:
            visible = visible & (p[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A block with no visible key leaves m, the sum and the accumulator exactly as they were.
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
        probs = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
        total = total * alpha + tl.sum(probs, 1)
        rounded = probs.to(out.dtype.element_ty)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(rounded.to(tl.float32), v_tile.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(rounded, v_tile)
        m = m_new
    result = acc / tl.where(valid, total, 1.0)[:, None]
    tl.store(
        out + query[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
        result.to(out.dtype.element_ty),
        mask=valid[:, None] & d_ok[None, :],
    )


@dataclass(frozen=True)
class Rows:
    """Where each row's queries and keys are (see the module docstring), as int32 tensors on the device,
    and the tiles of BLOCK_M (query, head) pairs the kernel runs: `tile_row`, `tile_f0` (the tile's
    first pair, numbered query-major within the row)."""

    q_first: torch.Tensor
    q_count: torch.Tensor
    q_pos0: torch.Tensor
    kv_start: torch.Tensor
    tile_row: torch.Tensor
    tile_f0: torch.Tensor
    kv_order: torch.Tensor | None = None


def tiles(q_count: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_row, tile_f0), int32, covering `q_count[r]` queries x `groups` heads of each row r."""
    per_row = (q_count.long() * groups + BLOCK_M - 1) // BLOCK_M
    total = int(per_row.sum())
    device = q_count.device
    row = torch.repeat_interleave(torch.arange(len(q_count), device=device), per_row, output_size=total)
    first = torch.cumsum(per_row, 0) - per_row
    f0 = (torch.arange(total, device=device) - first[row]) * BLOCK_M
    return row.to(torch.int32), f0.to(torch.int32)


def one_query_per_row(positions: torch.Tensor, kv_start: torch.Tensor, groups: int) -> Rows:
    """The decode step: row i has one query (q[i]) at `positions[i]`, its keys from `kv_start[i]`. Built from
    device tensors with device ops only (CUDA-graph safe)."""
    n = positions.shape[0]
    per_row = -(-groups // BLOCK_M)
    index = torch.arange(n * per_row, device=positions.device, dtype=torch.int32)
    return Rows(
        q_first=torch.arange(n, device=positions.device, dtype=torch.int32),
        q_count=torch.ones(n, device=positions.device, dtype=torch.int32),
        q_pos0=positions.to(torch.int32),
        kv_start=kv_start.to(torch.int32),
        tile_row=index // per_row,
        tile_f0=index % per_row * BLOCK_M,
    )


def rows_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: Rows,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [Nq, H, D], k and v [Nk, Hkv, D] (last dimension contiguous; one dtype): each query's attention
    over its row's keys up to its position, [Nq, H, D] in q's dtype (queries no tile covers are left
    as `out` holds them, zeros by default)."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    if out is None:
        out = torch.zeros_like(q)
    if rows.tile_row.numel() == 0:
        return out
    # Without a table the kernel reads none; an int32 tensor in its place keeps one compiled variant.
    table = rows.kv_order if rows.kv_order is not None else rows.q_count
    grid = (rows.tile_row.numel(), kv_heads)
    _rows_attention_kernel[grid](
        q, k, v, out,
        rows.q_first, rows.q_count, rows.q_pos0, rows.kv_start, table, rows.tile_row, rows.tile_f0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        int(rows.kv_order is not None), float(scale), int(window or 0), float(softcap or 0.0), heads // kv_heads, dim,
        BM=BLOCK_M, BN=BLOCK_N, BD=max(16, triton.next_power_of_2(dim)), IEEE=q.dtype == torch.float32 or INTERPRETED,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
