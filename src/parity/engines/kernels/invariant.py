"""Batch-invariant kernels for exact mode on CUDA (Triton): the matmul of every linear layer. (Attention's is
`attention.py`; RMSNorm's and SiLU · up's, which both engines run on CUDA in every mode, `fused.py`.)

cuBLAS picks its GEMM algorithm from the whole shape (tile sizes, split-K, stream-K), and PyTorch's
row reductions pick their thread layout from the row count and row length, so on a GPU a token's
values depend on how many other tokens share its matmul: measured on an H200, the rollout engine's
prefill and the trainer's packed stream gave different FP32 Q/K/V projections for the same token
(exact mode stopped at `layer0.attention_core`, position 0). The kernels here compute every output
element by the same code whatever the shape around it:

* `linear`: each output element's dot product accumulated in FP32 over K in order (FP32 inputs as
  FP32 FMAs, never TF32; 16-bit inputs on the tensor cores, K in their own fixed chunks), whatever
  tile computes it. A row's result depends neither on the other rows nor on the columns beside it: a
  fused projection's columns give its members' bits. The tile shape follows the row count (`tiles_for`:
  small tiles for a decode step's few rows, large ones for the trainer's thousands); measured on an
  H200, every tile shape gave every element the same bits at each of the model's projection shapes
  (docs/benchmarks.md, "On a GPU"; tests/unit/test_invariant.py and tests/e2e/test_invariant_engines.py
  check it on the card).

Forward values are what exact mode needs; the backward passes are plain PyTorch (autograd.Function),
because gradients do not enter μ = π_old. Imported only where exact mode runs the CUDA kernels
(`Numerics`). With `TRITON_INTERPRET=1` the same kernels run on CPU tensors, which is how the CPU tests
check them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Tiles:
    """A matmul's tile configuration: fixed for every shape (a tile chosen by shape would reorder the sums)."""

    m: int
    n: int
    k: int
    warps: int
    stages: int
    group: int = 8  # row tiles per group of the grouped order


# 16-bit inputs on the tensor cores: small tiles for a few rows (more programs share the weight read), large
# ones for many; FP32 as FMAs in order, narrower in K for the registers. For a few rows the weight's shape
# picks: a narrow output over a long sum (the MLP's down projection, 896 <- 4864) needs thin tiles to give
# the GPU enough programs, a narrow output over a short sum (attention's qkv and o) narrower columns. Measured
# on an H100 at 128 rows (docs/benchmarks.md, "The engines on a GPU"): down 32 -> 53 TFLOP/s, o 20 -> 24,
# qkv 25 -> 26, every element the same bits as the 64 x 64 tiles.
TILES = {
    "few_rows": Tiles(64, 64, 64, warps=4, stages=3),
    "few_rows_narrow": Tiles(64, 32, 64, warps=4, stages=4),
    "few_rows_long": Tiles(16, 32, 64, warps=2, stages=5),
    "many_rows": Tiles(128, 128, 64, warps=8, stages=3),
    "fma": Tiles(64, 64, 32, warps=4, stages=2),
}
NARROW = 2048  # output columns up to which a few rows' matmul takes narrower tiles
MANY_ROWS = 512  # rows from which a 16-bit matmul takes the large tiles
# Triton's CPU interpreter multiplies 16-bit tiles as integers: there the FP32 path runs for every dtype.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# Triton compiles a variant of a kernel per argument property: integers equal to 1 or divisible by 16,
# pointers aligned to 16 bytes. A variant may lay a block out over the threads differently, and a
# reduction's order follows the layout: on an H200, exact mode parted at key counts of 16, 32 and 64
# (a softmax over the keys). Row counts, whose variants a batch would pick, are never specialised; the
# strides and pointers of the matmul are (16-byte loads), which does not touch its sums (measured: every
# tile shape, every layout, the same bits).
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    a, b, c, bias, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    # Grouped order: GROUP row tiles sweep the columns together (their rows of A and columns of B stay in L2).
    tile, col_tiles = tl.program_id(0), tl.cdiv(N, BN)
    per_group = GROUP * col_tiles
    first_row = tile // per_group * GROUP
    group_rows = tl.minimum(tl.cdiv(M, BM) - first_row, GROUP)
    pid_m = first_row + (tile % per_group) % group_rows
    pid_n = (tile % per_group) // group_rows
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)  # M x N can pass 2^31 (an LM head's output)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    a_ptrs = a + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, K, BK):
        a_tile = tl.load(a_ptrs, mask=(rows[:, None] < M) & (ks[None, :] + k0 < K), other=0.0)
        b_tile = tl.load(b_ptrs, mask=(ks[:, None] + k0 < K) & (cols[None, :] < N), other=0.0)
        if IEEE:  # FP32 FMA in order (no TF32); 16-bit products are exact in FP32
            acc = tl.dot(a_tile.to(tl.float32), b_tile.to(tl.float32), acc, input_precision="ieee")
        else:  # FP16/BF16 tensor cores, FP32 accumulation
            acc = tl.dot(a_tile, b_tile, acc)
        a_ptrs += BK * stride_ak
        b_ptrs += BK * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=cols < N, other=0.0).to(tl.float32)
    out = c + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(out, acc.to(c.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def tiles_for(rows: int, dtype: torch.dtype, n: int = 0, k: int = 0) -> Tiles:
    """The tile configuration of a matmul of `rows` rows in `dtype` by a [k, n] weight (see TILES and the
    module docstring: the tile changes which program computes an element, never the order of its sums)."""
    if dtype == torch.float32 or INTERPRETED:
        return TILES["fma"]
    if rows >= MANY_ROWS:
        return TILES["many_rows"]
    if n <= NARROW:
        return TILES["few_rows_long" if k >= 2 * n else "few_rows_narrow"]
    return TILES["few_rows"]


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, tiles: Tiles | None = None):
    """a [M, K] @ b [K, N] (+ bias [N]) -> [M, N] in a's dtype, any strides. `tiles`: another configuration
    (benchmarks compare them; exact mode runs `tiles_for(M, dtype)`)."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if c.numel() == 0:
        return c
    t = tiles or tiles_for(m, a.dtype, n, k)
    grid = (triton.cdiv(m, t.m) * triton.cdiv(n, t.n),)
    _matmul_kernel[grid](
        a, b, c, c if bias is None else bias, m, n, k, *a.stride(), *b.stride(), *c.stride(),
        HAS_BIAS=bias is not None, IEEE=a.dtype == torch.float32 or INTERPRETED,
        BM=t.m, BN=t.n, BK=t.k, GROUP=t.group, num_warps=t.warps, num_stages=t.stages,
    )  # fmt: skip
    return c


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return matmul(x, weight.t(), bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x, grad.sum(0) if ctx.has_bias else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias`, all in one dtype, FP32 accumulation; batch-invariant."""
    rows = x.shape[:-1]
    out = _Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.reshape(*rows, weight.shape[0])
