"""Kernels: every matmul-class op of both engines, chosen per device and processor.

Every matmul in the models goes through `linear` and `Numerics.attention` /
`Numerics.decode_attention` here, so the numerics of each precision are defined in one place:

* inputs and weights are rounded to the compute dtype,
* products are accumulated in FP32 (as GPU tensor cores do),
* outputs are rounded back to the compute dtype.

On CUDA (with reduced-precision reductions and TF32 off, `cuda.configure`) and for a precision the
CPU has dot-product instructions for, PyTorch's native kernels do exactly that. For a precision
the CPU lacks them for (FP16 on most CPUs; BF16 on AVX2-only ones), the FP32 kernel runs on the
rounded inputs and the result is rounded (`cpu.py`): the same numbers at FP32 speed. Attention in
FP16/BF16 on the CPU follows flash-attention's numerics with FP32 kernels: scores and softmax in
FP32, probabilities rounded to the compute dtype, products accumulated in FP32, output rounded.

`Numerics` is the one object an engine holds: its device, and exact mode (docs/exact.md), the
switch under which both engines compute the same bits for a token whatever its batch. On CUDA,
exact mode runs the matmuls, the attention softmax and RMSNorm's mean through the batch-invariant
Triton kernels of `invariant.py` (cuBLAS and PyTorch's reductions choose their order by shape).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from parity.config import ConfigError
from parity.engines.kernels import cpu, cuda
from parity.engines.packing import PackedBatch, gather_rows

# Matmuls get at least this many rows, columns and terms per dot product. The CPU's FP32
# GEMM picks other kernels for small shapes (on this machine: 1-3, 5-7 and 9-11 rows;
# 8 or fewer columns; fewer than 16 terms), so an output element would depend on how many
# rows and columns share its matmul and on how many zero terms follow its own (a causal
# query's masked keys); from there on it does not (BF16: never). Padding with zeros makes
# every output element independent of the rest of the batch, which exact mode needs, for the
# cost of a few zero rows on tiny matmuls (whose time is the weight read anyway).
MIN_ROWS = 16
# PyTorch's attention backends, cuDNN's left out: on an H200 (PyTorch 2.11) it built a plan for every
# new shape, 3-5 ms of host time per call, and the trainer's packed rows change shape every step: the
# built-in model's BF16 train step took 0.59 s with it and 0.077 s without (FP32, which never uses it:
# 0.085 s).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Exact mode on the CPU: every linear layer's matmul call gets exactly this many rows (the last block
# padded with zeros). MKL and oneDNN choose their kernel, and with it the order of each dot product's
# sums, from the whole shape: measured on an Intel Xeon with AMX (PyTorch 2.13), an FP32 row's bits
# changed between 16 and 64-128 rows at 1536 -> 576, and BF16 ones at any count above 32, where padding
# to MIN_ROWS had sufficed on an AMD EPYC; within one shape every row is computed alike. One shape for
# every call makes a token's bits independent of its batch by construction, for some speed.
EXACT_CPU_ROWS = 64
# Batched matmuls (attention) take another path, whose results vary only below 4 rows: a
# decode step's few query rows per KV head need less padding than MIN_ROWS.
MIN_BATCHED_ROWS = 4


def emulated(t: torch.Tensor) -> bool:
    """True when `t`'s matmuls run the FP32 kernel on its rounded values (a CPU without dot
    products for its dtype)."""
    return t.device.type == "cpu" and t.dtype in cpu.emulated_dtypes()


def per_shape_kernels(dtype: torch.dtype, device: torch.device) -> bool:
    """True where this dtype's matmuls run kernels generated for each input shape: native BF16
    on the CPU goes to oneDNN, which builds (and caches) a kernel per shape, at the cost of a
    few hundred microseconds each. Callers then keep their shapes to a few sizes."""
    return dtype == torch.bfloat16 and device.type == "cpu" and dtype not in cpu.emulated_dtypes()


def _pad(x: torch.Tensor, dim: int, size: int = MIN_ROWS) -> torch.Tensor:
    """`x` padded with zeros along `dim` (negative) to `size` entries."""
    short = size - x.shape[dim]
    return F.pad(x, (0, 0) * (-dim - 1) + (0, short)) if short > 0 else x


def hold(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A matmul weight as an inference engine stores it for `linear(..., held=True)`: rounded to
    `dtype`, and kept in FP32 where `dtype`'s matmuls run the FP32 kernel, so that no call upcasts
    it again (that upcast read and wrote every weight twice per decode step)."""
    w = weight.to(dtype)
    return w.float() if emulated(w) else w


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    held: bool = False,
    row_blocks: bool = False,
) -> torch.Tensor:
    """`x @ weight.T + bias` in the dtype of `x`, accumulating in FP32; each output element
    is independent of the other rows and columns (see MIN_ROWS). `held`: `weight` is as `hold`
    stores it (already rounded to the dtype of `x`). `row_blocks` (exact mode on the CPU): every
    matmul call gets exactly EXACT_CPU_ROWS rows, so a row's bits cannot depend on its batch."""
    rows, cols = x.shape[:-1], weight.shape[0]
    x2, weight = x.reshape(-1, x.shape[-1]), weight if held else weight.to(x.dtype)
    bias = None if bias is None else bias.to(x.dtype)
    if row_blocks:
        # Without gradients (the rollout engine, π_old) the blocks are called directly: a decode
        # step's many small calls would each pay for an autograd node.
        grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        matmul = _RowBlocks.apply if grad else _row_blocks
    else:
        x2, weight = _pad(x2, -2), _pad(weight, -2)
        bias = None if bias is None else _pad(bias[:, None], -2)[:, 0]
        matmul = F.linear
    if emulated(x):  # the FP32 kernel on the rounded values
        out = matmul(x2.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    else:
        out = matmul(x2, weight, bias)
    if out.shape != (rows.numel(), cols):
        out = out[: rows.numel(), :cols]
    # A 2-D input gets the matmul's own tensor, not a view of it (FSDP2 warns of a root module returning one).
    return out if x.dim() == 2 else out.reshape(*rows, cols)


def _row_blocks(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` on a 2-D input in calls of exactly EXACT_CPU_ROWS rows (the last padded with zeros),
    each writing its rows of the output in place: a padded copy of the input and a concatenation of the
    blocks cost up to 2x at 1000 rows (docs/benchmarks.md, "Exact mode with a rollout worker...")."""
    n, rows = x.shape[0], EXACT_CPU_ROWS
    whole = n - n % rows
    out, weight_t = x.new_empty(n, weight.shape[0]), weight.t()

    def block(inputs: torch.Tensor, into: torch.Tensor) -> None:
        if bias is None:
            torch.mm(inputs, weight_t, out=into)
        else:
            torch.addmm(bias, inputs, weight_t, out=into)

    for start in range(0, whole, rows):
        block(x[start : start + rows], out[start : start + rows])
    if whole < n:
        tail = x.new_empty(rows, weight.shape[0])
        block(_pad(x[whole:], -2, rows), tail)
        out[whole:] = tail[: n - whole]
    return out


class _RowBlocks(torch.autograd.Function):
    """`_row_blocks` with the usual backward, one matmul per gradient rather than one per block: only
    the values must not depend on the batch."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _row_blocks(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.T @ x if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


@dataclass(frozen=True)
class Numerics:
    """How an engine computes: on `device`, and in exact mode or not. Build with `numerics()`."""

    device: torch.device
    exact: bool = False
    # Exact mode on CUDA: the batch-invariant Triton kernels (`invariant.py`) replace cuBLAS and
    # PyTorch's softmax and row means wherever a token's value could depend on its batch. (Tests
    # set it on the CPU too, where Triton's interpreter runs the same kernels.)
    invariant: bool = False

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, held: bool = False
    ) -> torch.Tensor:
        """`linear` (above), batch-invariant on CUDA in exact mode."""
        if self.invariant:
            from parity.engines.kernels import invariant

            return invariant.linear(
                x, weight if held else weight.to(x.dtype), None if bias is None else bias.to(x.dtype)
            )
        return linear(x, weight, bias, held, row_blocks=self.exact and self.device.type == "cpu")

    def mean_square(self, x: torch.Tensor) -> torch.Tensor:
        """mean(x², last dimension, keepdim) of an FP32 tensor: RMSNorm's statistic."""
        if self.invariant:
            from parity.engines.kernels import invariant

            return invariant.mean_square(x)
        return x.pow(2).mean(-1, keepdim=True)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Batched `a @ b`; in exact mode its elements depend neither on the other rows and
        columns nor on trailing zero terms (see MIN_ROWS)."""
        if not self.exact:
            return torch.matmul(a, b)
        rows, cols = a.shape[-2], b.shape[-1]
        return torch.matmul(_pad(_pad(a, -1), -2, MIN_BATCHED_ROWS), _pad(_pad(b, -2), -1))[..., :rows, :cols]

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Causal scaled dot-product attention with grouped KV heads, in the dtype of `q`.

        `q` is [B, H, T, D]; `k`, `v` are [B, Hkv, T, D]. `window`: each query sees the last `window`
        keys, itself included (sliding-window layers). `scale` defaults to D ** -0.5; `softcap` bounds
        the scores to (-softcap, softcap) with tanh before the mask (Gemma 2).
        Exact mode on CUDA: the kernel of `attention.py`, which gives each query the bits the decode step
        and the trainer give it. Exact mode on the CPU: the spelled-out form in every precision, with the
        FP32 kernel for the probability-weighted values, so that each query's output is the bits
        `decode_attention` gives for it over a KV cache.
        """
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if self.invariant:
            from parity.engines.kernels import attention

            b, h, t, d = q.shape
            starts = torch.arange(b, device=q.device, dtype=torch.int32) * t
            counts = torch.full((b,), t, device=q.device, dtype=torch.int32)
            tile_row, tile_f0 = attention.tiles(counts, h // k.shape[1])
            rows = attention.Rows(starts, counts, torch.zeros_like(counts), starts, tile_row, tile_f0)
            flat = attention.rows_attention(
                q.transpose(1, 2).reshape(b * t, h, d),
                k.transpose(1, 2).reshape(b * t, -1, d),
                v.transpose(1, 2).reshape(b * t, -1, d),
                rows,
                scale,
                window,
                softcap,
            )
            return flat.view(b, t, h, d).transpose(1, 2)
        allowed = None if window is None else sliding_mask(q.shape[2], window, q.device)
        if self.exact or softcap is not None or (q.device.type == "cpu" and q.dtype != torch.float32):
            # The CPU has no FP16 attention kernel worth using, and its BF16 one has a ~8x
            # slower backward than FP32's: spell out the flash-attention numerics instead.
            # The query heads sharing a KV head become extra rows of one matmul against it,
            # so K and V are never copied per query head.
            b, h, q_len, d = q.shape
            kv_heads, k_len = k.shape[1], k.shape[2]
            groups = h // kv_heads
            bias = torch.zeros((q_len, k_len), device=q.device)
            if allowed is None:
                bias = bias.masked_fill(torch.ones_like(bias, dtype=torch.bool).triu(1), float("-inf"))
            else:
                bias = bias.masked_fill(~allowed, float("-inf"))
            bias = bias.repeat(groups, 1)  # row g * q_len + t is query t
            q_rows = q.reshape(b, kv_heads, groups * q_len, d).float()
            scores = _capped(self.matmul(q_rows, k.float().transpose(-1, -2)) * scale, softcap) + bias
            return self._weighted_values(scores, v, q.dtype).reshape(b, h, q_len, d)
        gqa = q.shape[1] != k.shape[1]
        with sdpa_kernel(SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, is_causal=allowed is None, enable_gqa=gqa, scale=scale
            )

    def packed_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        packed: PackedBatch,
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of the trainer's packed stream (`packing.py`): q [N, H, D], k and v [N, Hkv, D],
        each token attending to its own sequence (a shared prompt, then its response) -> [N, H, D].

        Exact mode on CUDA: `attention.py`'s kernel over the stream (the decode step's bits), with the
        gradients of plain attention. Plain mode on CUDA: flash attention over variable-length rows
        (`varlen.py`) where PyTorch has it and the model allows it. Otherwise (the CPU, always): the rows laid
        out padded, in a few length-sorted chunks, through `attention` (the numerics the CPU always had)."""
        if self.invariant:
            from parity.engines.kernels import varlen

            return varlen.exact_packed_attention(q, k, v, packed, window, scale, softcap, numerics(self.device))
        if q.is_cuda:
            from parity.engines.kernels import varlen

            if varlen.supported(q, window, scale, softcap):
                return varlen.packed_attention(q, k, v, packed, window, scale)
        return padded_attention(self, q, k, v, packed, window, scale, softcap)

    def decode_attention(
        self,
        q: torch.Tensor,
        k_t: torch.Tensor,
        v: torch.Tensor,
        key_bias: torch.Tensor,
        scale: float | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of one new token per row over its cache, in the dtype of `q`: the CPU cache's
        (`kvcache.DenseKVCache`; CUDA's runs `attention.py`).

        `q` [B, H, 1, D]; `k_t` [B, Hkv, D, S] (keys transposed); `v` [B, Hkv, S, D];
        `key_bias` [B, 1, 1, S] FP32 (0 = attend, -inf = masked). Grouped query heads
        share their KV head without copying it.
        """
        b, h, _, d = q.shape
        hkv = k_t.shape[1]
        qg = q.view(b, hkv, h // hkv, d)
        scale = d**-0.5 if scale is None else scale
        # exact: a decode step's few query rows per KV head are padded (see MIN_BATCHED_ROWS).
        scores = _capped(self.matmul(qg.float(), k_t.float()) * scale, softcap) + key_bias
        return self._weighted_values(scores, v, q.dtype).reshape(b, h, 1, d)

    def _weighted_values(self, scores: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """softmax(scores) @ v with flash-attention numerics: FP32 scores and softmax, the
        probabilities rounded to `dtype`, FP32 accumulation, the output rounded to `dtype`.
        Softmax and the weighted sum give a query the same bits however many masked keys
        follow its last visible one, which is what lets a cache and a full sequence agree;
        exact mode pads what would otherwise depend on the shapes (see MIN_ROWS)."""
        short = MIN_ROWS - scores.shape[-1]
        if self.exact and short > 0:  # the CPU softmax takes a scalar path on rows shorter than a vector register
            scores = F.pad(scores, (0, short), value=float("-inf"))
            v = F.pad(v, (0, 0, 0, short))
        probs = torch.softmax(scores, dim=-1).to(dtype)
        if self.exact or emulated(probs) or v.dtype == torch.float32:
            # FP32 kernels on rounded inputs: exact products, FP32 sums. (A CPU KV cache
            # holds FP32 values, rounded to the precision when written.)
            return self.matmul(probs.float(), v.float()).to(dtype)
        return self.matmul(probs, v)  # the native 16-bit kernel accumulates in FP32

    def describe(self) -> dict[str, str]:
        """What this process computes with, for config records and benchmark tables: the device,
        exact mode, the processor's features, and each precision's matmul path."""
        out = {"device": str(self.device), "exact": str(self.exact).lower(), "torch": torch.__version__}
        if self.device.type == "cuda":
            out.update(cuda.describe(self.device))
            path = "triton batch-invariant" if self.invariant else cpu.NATIVE
            out.update({f"matmul_{n}": path for n in ("fp32", "bf16", "fp16")})
            return out
        features = cpu.features()
        out.update(features.describe())
        emulated_dtypes = cpu.emulated_dtypes()
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
            out[f"matmul_{name}"] = cpu.EMULATED if dtype in emulated_dtypes else cpu.NATIVE
        return out


def sliding_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """Causal mask [length, length] (True = attend) keeping the last `window` keys, itself included."""
    i = torch.arange(length, device=device)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance < window)


def padded_attention(
    numerics: Numerics,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: PackedBatch,
    window: int | None,
    scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """`Numerics.packed_attention` with the rows laid out right-padded (plain causal attention is exact on
    the real slots), in `packed.attention_rows`'s length-sorted chunks, each token's output picked back from
    one row; the gathers have a deterministic backward (`gather_rows`)."""
    n, heads, d = q.shape
    q, k, v = (t.reshape(n, -1) for t in (q, k, v))
    outputs = []
    for index in packed.attention_rows:
        out = numerics.attention(
            _heads(gather_rows(q, index), heads),
            _heads(gather_rows(k, index), k.shape[1] // d),
            _heads(gather_rows(v, index), k.shape[1] // d),
            window=window,
            scale=scale,
            softcap=softcap,
        )
        outputs.append(out.transpose(1, 2).flatten(0, 1).flatten(1))
    return gather_rows(torch.cat(outputs), packed.from_rows).view(n, heads, d)


def _heads(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, t, heads * D] -> [b, heads, t, D]."""
    b, t, _ = rows.shape
    return rows.view(b, t, heads, -1).transpose(1, 2)


DEVICES = ("cpu", "cuda")


def check_device(device: str, key: str = "device") -> None:
    """Refuse a `device` config value this process cannot run on, naming the key."""
    if device not in DEVICES:
        raise ConfigError(f"{key}: unknown value {device!r}; allowed: {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}=cuda: PyTorch sees no CUDA device (torch.cuda.is_available() is False)")


def numerics(device: str | torch.device = "cpu", exact: bool = False) -> Numerics:
    """The numerics for `device`, decided once per process (one object per device and mode): on
    CUDA this also sets the matmul flags (`cuda.configure`)."""
    return _numerics(str(torch.device(device)), bool(exact))


@cache
def _numerics(device: str, exact: bool) -> Numerics:
    if device.startswith("cuda"):
        cuda.configure(exact)
        if exact:
            try:
                import triton  # noqa: F401
            except ImportError:
                raise ConfigError(
                    "exact=true on CUDA needs Triton for its batch-invariant kernels (pip install triton); "
                    "PyTorch's CUDA builds for Linux bring it"
                ) from None
    return Numerics(torch.device(device), exact, invariant=exact and device.startswith("cuda"))
