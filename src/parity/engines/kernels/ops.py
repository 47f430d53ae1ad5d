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

`Numerics` is the one object an engine holds: its device, and in exact mode (docs/exact.md) the
implementation under which both engines compute the same bits for a token whatever its batch:
`CpuExact` on the CPU, `TritonExact` on CUDA, which runs the matmuls, attention and RMSNorm's mean
through the batch-invariant Triton kernels of `invariant.py` and `attention.py` (cuBLAS and PyTorch's
reductions choose their order by shape).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from parity.config import ConfigError
from parity.engines.kernels import cpu, cuda
from parity.engines.packing import PackedBatch, gather_rows
from parity.engines.precision import Precision

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
# Elementwise kernels with an exp or tanh run vector code on most elements and scalar code on
# the tail of each contiguous run (the last `width % 32` elements of a row, on AVX-512), and
# the two can round differently: a token's activations would depend on the tensor's shape.
# Rows padded to a multiple of this many elements keep every element on the vector path.
ACTIVATION_ROW_MULTIPLE = 64
# Batched matmuls (attention) take another path, whose results vary only below 4 rows: a
# decode step's few query rows per KV head need less padding than MIN_ROWS.
MIN_BATCHED_ROWS = 4
# Exact mode on the CPU sums attention's probability-weighted values over blocks of this many keys, one
# block after another. MKL's FP32 GEMM splits a dot product of more than 192 terms into pieces whose
# bounds follow the term count (measured on an AMD EPYC, MKL 2024.2: a query's p·v over 167 real keys
# changed bits between 193 and 400 keys, the keys past its own being zeros), so a query's sum would
# depend on how many keys its call held: the decode step's furthest row, the trainer's longest row in
# its chunk. Within one block's fixed shape the trailing zeros change nothing; the blocks past a
# query's last key add exact zeros. (The GPU kernel walks keys in blocks of 64 too, `attention.py`.)
EXACT_KEY_BLOCK = 64
# Outside exact mode FP32 matmuls on the CPU go to oneDNN rather than to MKL, where PyTorch sends an FP32
# `F.linear`: at a decode step's 16 rows MKL reached 45-80 GFLOP/s on SmolLM2's shapes and 130-180 at a
# training pass's 700, oneDNN 120-150 and 170-205 (AMD EPYC, 2 threads; docs/benchmarks.md, issue 56); on an
# AMD EPYC with full-width AVX-512 oneDNN ran at about twice MKL's rate in the forward and in both products
# of the backward (2.2 against 5.1 ms at 640 rows of 576 -> 1536). The rollout engine multiplies by weights
# reordered into oneDNN's blocked layout for calls of this many rows (`Numerics.fast_matrix`), once per
# weight sync; the trainer, whose weights change every update, by the weights as stored (within 5% of the
# reordered ones at its row counts, with no reorder: 37 ms for SmolLM2's LM head).
PACKED_ROWS = 16
# ... for weights of at least this many elements. oneDNN's call costs about 25 µs more than MKL's and a reorder
# at least 200 µs, which a small weight's matmuls never win back: 128x384 (the built-in model's) took 34 µs at
# 16 rows against MKL's 22, 576x576 75 against 103 (AMD EPYC, 2 threads).
FAST_MIN_ELEMENTS = 2**18
# The backward's weight gradient of a weight with more rows than this (a vocabulary's: the LM head) stays with
# MKL: through oneDNN SmolLM2's 49,152 x 576 took 199 ms against MKL's 163 on the AVX2 class (143 against 166
# with AVX-512), at 512 rows.
ONEDNN_GRAD_WEIGHT_MAX_ROWS = 2**14


def on_onednn(weight: torch.Tensor) -> bool:
    """Whether a matmul by `weight` runs on oneDNN (see PACKED_ROWS): a large FP32 weight on the CPU."""
    usable = weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
    return usable and min(weight.shape) >= MIN_ROWS and weight.numel() >= FAST_MIN_ELEMENTS


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


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The MLP's activation ("silu" or "gelu_tanh") in x's dtype (see ACTIVATION_ROW_MULTIPLE)."""
    width = x.shape[-1]
    if width % ACTIVATION_ROW_MULTIPLE:
        return activation(name, F.pad(x, (0, -width % ACTIVATION_ROW_MULTIPLE)))[..., :width]
    return F.silu(x) if name == "silu" else F.gelu(x, approximate="tanh")


def store_for_engine(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A matmul weight as an inference engine stores it for `linear(..., prerounded=True)`: rounded to
    `dtype`, and kept in FP32 where `dtype`'s matmuls run the FP32 kernel, so that no call upcasts
    it again (that upcast read and wrote every weight twice per decode step)."""
    w = weight.to(dtype)
    return w.float() if emulated(w) else w


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    prerounded: bool = False,
    row_blocks: bool = False,
    fast: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ weight.T + bias` in the dtype of `x`, accumulating in FP32; each output element
    is independent of the other rows and columns (see MIN_ROWS). `prerounded`: `weight` is as `store_for_engine`
    stores it (already rounded to the dtype of `x`). `row_blocks` (exact mode on the CPU): every
    matmul call gets exactly EXACT_CPU_ROWS rows, so a row's bits cannot depend on its batch. `fast`: `weight`
    as `Numerics.fast_matrix` reorders it, which the forward multiplies by instead (the backward reads `weight`);
    without it, a weight `on_onednn` goes to oneDNN as it is stored."""
    rows, cols = x.shape[:-1], weight.shape[0]
    x2, weight = x.reshape(-1, x.shape[-1]), weight if prerounded else weight.to(x.dtype)
    bias = None if bias is None else bias.to(x.dtype)
    # Without gradients (the rollout engine, π_old) the kernels are called directly: a decode
    # step's many small calls would each pay for an autograd node.
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if fast is None and not row_blocks and x.dtype == torch.float32 and on_onednn(weight):
        fast = weight
    if fast is not None:
        x2 = _pad(x2, -2)

        def matmul(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return _OneDnn.apply(inputs, weight, bias, fast) if grad else _fast_linear(inputs, fast, bias)

    elif row_blocks:
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


def _fast_linear(x: torch.Tensor, fast: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` by oneDNN's kernel: `fast` a weight `Numerics.fast_matrix` reordered, or any strided FP32 one."""
    return torch.ops.mkldnn._linear_pointwise(x, fast, bias, "none", [], "")


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
    """`_row_blocks` (exact mode): the values must not depend on the batch; the backward is the usual one,
    one matmul per gradient."""

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


class _OneDnn(torch.autograd.Function):
    """`_fast_linear` by `fast` (`weight` itself, or its reordered copy), and the backward on oneDNN too: the
    input's gradient by `weight`ᵀ, the weight's as (gradient)ᵀ · x, each a strided view."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fast: torch.Tensor):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _fast_linear(x, fast, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = _fast_linear(grad, weight.t(), None) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            on_mkl = weight.shape[0] > ONEDNN_GRAD_WEIGHT_MAX_ROWS
            grad_weight = grad.T @ x if on_mkl else _fast_linear(grad.t(), x.t(), None)
        grad_bias = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE: x·cos + rotate(x)·sin, rotate(x) = [-x2, x1] over the last dimension's halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def restrict(logits: torch.Tensor, support: torch.Tensor | None) -> torch.Tensor:
    """`logits` [M, V] with every token outside `support` [M, K] (ids, -1 = padding) at -inf: the
    distribution the rollout engine sampled from after top-k/top-p, as its log-softmax sees it."""
    if support is None:
        return logits
    vocab = logits.shape[-1]
    columns = support.masked_fill(support < 0, vocab)  # padding goes to a column dropped below
    kept = torch.zeros((logits.shape[0], vocab + 1), dtype=torch.bool, device=logits.device)
    return logits.masked_fill(~kept.scatter_(-1, columns, True)[:, :vocab], float("-inf"))


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """A LoRA projection's W + scale · B·A in FP32, as PEFT merges (and as `lora.merge` syncs it)."""
    return weight.float() + (b.float() @ a.float()) * scale


class Numerics:
    """How an engine computes on `device`: each precision's matmul path for the device and processor (see
    the module docstring), PyTorch's attention, the rollout engine's fused RMSNorm. One object per device and
    mode (`numerics()`), handed to every engine and layer that computes; exact mode is a subclass
    (`CpuExact`, `TritonExact`), never a flag the engines test."""

    exact = False

    def __init__(self, device: torch.device):
        self.device = device

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    @property
    def cache_layout(self) -> str:
        """The rollout engine's KV cache (`kvcache.kv_cache`): "dense" on the CPU, "slots" on CUDA."""
        return "slots" if self.device.type == "cuda" else "dense"

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        prerounded: bool = False,
        fast: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`linear` (above)."""
        return linear(x, weight, bias, prerounded, fast=fast)

    @torch.no_grad()
    def fast_matrix(self, weight: torch.Tensor) -> torch.Tensor | None:
        """A copy of a matmul weight in the layout `linear(..., fast=)` multiplies by fastest here, or None where
        the weight's own layout is that: on the CPU a large FP32 weight reordered for oneDNN (PACKED_ROWS). Valid
        until the weight changes: the rollout engine makes it at each load."""
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS) if on_onednn(weight) else None

    def differing(self, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """Where this mode promises that `a` and `b` (the rollout engine's log-probabilities and the trainer's)
        hold the same bits and they do not, [...] bool, False outside `mask`. Plain numerics promise no bits:
        None, and nothing is checked."""
        return None

    def fused_rows(self, x: torch.Tensor) -> bool:
        """Whether RMSNorm and SiLU · up run as one Triton pass per row (`fused.py`), in both engines: on
        CUDA (a few kernels fewer per layer, forward and backward, and a row's bits whatever its batch); the
        eager ops on the CPU, whose bits the engines are tested against."""
        return x.is_cuda

    def fused_head(self, head: torch.Tensor, support: torch.Tensor | None) -> bool:
        """Whether the trainer computes the LM head's log-probabilities and their gradient in one Triton pass
        over each row of the head's output (`head.py`): on CUDA, over the whole vocabulary, its rows contiguous (a
        top-k/top-p support takes PyTorch's ops, as the CPU always does)."""
        return support is None and head.is_cuda and head.stride(-1) == 1

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The trainer's RoPE on heads x [N, heads, D] by each token's cos and sin [N, 1, D]: on CUDA one Triton
        pass forward and one backward (`fused.rope`), in every mode (the eager ops' bits, which exact mode needs);
        the eager ops elsewhere."""
        if x.is_cuda and x.dim() == 3:
            from parity.engines.kernels import fused

            return fused.rope(x, cos, sin)
        return apply_rope(x, cos, sin)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
        """RMSNorm as the trainer (and Hugging Face) computes it: normalise in FP32, then scale: Llama rounds
        to the compute dtype and multiplies by w; Gemma multiplies by (1 + w) in FP32 and rounds once. Either
        way w is the weight as the compute dtype holds it."""
        if self.fused_rows(x):
            from parity.engines.kernels import fused

            return fused.rms_norm(x, weight, eps, gemma)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if gemma:
            return (xf * (1.0 + weight.to(x.dtype).float())).to(x.dtype)
        return weight.to(x.dtype) * xf.to(x.dtype)

    def engine_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
        """The rollout engine's RMSNorm: the fused kind (FP32 inside, one rounding), as inference engines run
        it; Gemma's (1 + w) scale has no fused form, so Gemma's is the trainer's."""
        if gemma:
            return self.rms_norm(x, weight, eps, gemma)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def engine_add_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rollout engine's residual addition and the (Llama) norm after it: (x + delta, its `engine_norm`),
        in one pass on CUDA."""
        if x.is_cuda:
            from parity.engines.kernels import fused

            return fused.norm_rows(x, weight, eps, delta=delta, one_rounding=True)
        return self._add_then_norm(x, delta, weight, eps)

    def _add_then_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + delta
        return x, self.engine_norm(x, weight, eps)

    def gated_activation(self, name: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated MLP's activation(gate) · up, in both engines: SiLU's in one pass where `fused_rows`, two
        eager ops otherwise."""
        if name == "silu" and self.fused_rows(gate):
            from parity.engines.kernels import fused

            return fused.silu_mul(gate, up)
        return activation(name, gate) * up

    def add_adapter(
        self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, blocks: list
    ) -> torch.Tensor:
        """`out` plus an unmerged LoRA adapter's x·Aᵀ·Bᵀ (`weights.LayerWeights.lora`)."""
        if a.dtype == x.dtype:
            return out + linear(linear(x, a), b)
        # BF16 on the CPU would build a oneDNN kernel for each of these rank-wide matmuls at every
        # decode batch size (1.5x the rollout's time, measured); FP32 on the BF16 values, each
        # product rounded to BF16, computes what the BF16 kernel does, to the order of its sums.
        low = linear(x.float(), a).to(x.dtype)
        return out + linear(low.float(), b).to(x.dtype)

    def lora_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        a: torch.Tensor,
        b: torch.Tensor,
        scale: float,
        merged: bool,
        cast: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """A LoRA projection in the trainer: x·Wᵀ (+ bias) + (x·Aᵀ)·(scale·B)ᵀ, each matmul in x's dtype; `weight`
        is the frozen FP32 W and `cast(W)` its copy in x's dtype; `merged`: the rollout engine multiplies by
        `merged_weight` (`lora.merge`). Scaling B (rank columns) rather than the output (one more pass over
        every token's activations) is bit-identical to PEFT's order when scale is a power of two, as at the
        default alpha = 2 × rank."""
        return self.linear(x, cast(weight), bias) + self.linear(self.linear(x, a), b * scale)

    def adapter_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the rollout engine holds an adapter's A and B in (rounded to `dtype` first): FP32 where
        `dtype`'s kernels are built per shape (`add_adapter`)."""
        return torch.float32 if per_shape_kernels(dtype, self.device) else dtype

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Batched `a @ b` (attention's)."""
        return torch.matmul(a, b)

    def token_logprobs(
        self, z: torch.Tensor, tokens: torch.Tensor, support: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log p(token) [M] and the log-normaliser [M] of FP32 logits `z` [M, V] restricted to each row's
        `support` [M, K] (token ids, -1 = padding; None: the whole vocabulary): a log-sum-exp of the kept
        logits alone, which reads K of them rather than V."""
        kept = z if support is None else z.gather(-1, support.clamp(min=0)).masked_fill(support < 0, float("-inf"))
        lse = torch.logsumexp(kept, dim=-1)
        return z.gather(-1, tokens[:, None]).squeeze(-1) - lse, lse

    def draw_unfiltered(
        self, logits: torch.Tensor, uniforms: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A token per row of logits [N, V] (16-bit or FP32, read as FP32) from softmax(logits / temperature)
        with `uniforms` [N], and its log-probability, in one fused pass where this device has one (the Gumbel
        kernel on CUDA); None: the caller draws from the log-softmax (`sampling.draw`)."""
        if not logits.is_cuda:
            return None
        from parity.engines.kernels import gumbel

        return gumbel.sample(logits, uniforms, normalised=False, temperature=temperature)

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
        """
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if softcap is not None or (q.device.type == "cpu" and q.dtype != torch.float32):
            # The CPU has no FP16 attention kernel worth using, and its BF16 one has a ~8x
            # slower backward than FP32's: spell out the flash-attention numerics instead.
            return self._spelled_out(q, k, v, window, scale, softcap)
        allowed = None if window is None else sliding_mask(q.shape[2], window, q.device)
        gqa = q.shape[1] != k.shape[1]
        with sdpa_kernel(SDPA_BACKENDS) if q.is_cuda else contextlib.nullcontext():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, is_causal=allowed is None, enable_gqa=gqa, scale=scale
            )

    def _spelled_out(self, q, k, v, window: int | None, scale: float, softcap: float | None) -> torch.Tensor:
        """Attention with flash-attention's numerics written out. The query heads sharing a KV head become
        extra rows of one matmul against it, so K and V are never copied per query head."""
        b, h, q_len, d = q.shape
        kv_heads, k_len = k.shape[1], k.shape[2]
        groups = h // kv_heads
        bias = torch.zeros((q_len, k_len), device=q.device)
        if window is None:
            bias = bias.masked_fill(torch.ones_like(bias, dtype=torch.bool).triu(1), float("-inf"))
        else:
            bias = bias.masked_fill(~sliding_mask(q_len, window, q.device), float("-inf"))
        bias = bias.repeat(groups, 1)  # row g * q_len + t is query t
        q_rows = q.reshape(b, kv_heads, groups * q_len, d).float()
        scores = _capped(self.matmul(q_rows, k.float().transpose(-1, -2)) * scale, softcap) + bias
        return self._weighted_values(scores, v, q.dtype).reshape(b, h, q_len, d)

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
        each token attending to its own sequence (its prompt, prefixes shared, then its response) -> [N, H, D]. On CUDA:
        flash attention over variable-length rows (`varlen.py`) where PyTorch has it and the model allows it.
        Otherwise (the CPU, always): the rows laid out padded, in a few length-sorted chunks, through
        `attention`."""
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
        """Attention of each row's new tokens over its cache, in the dtype of `q`: the CPU cache's
        (`kvcache.DenseKVCache`; CUDA's runs `attention.py`). One token per row in a decode step, several
        when an episode's ids are fed between turns.

        `q` [B, H, T, D]; `k_t` [B, Hkv, D, S] (keys transposed); `v` [B, Hkv, S, D];
        `key_bias` [B, 1, T, S] FP32 (0 = attend, -inf = masked). Grouped query heads
        share their KV head without copying it.
        """
        b, h, t, d = q.shape
        hkv = k_t.shape[1]
        groups = h // hkv
        qg = q.reshape(b, hkv, groups * t, d)  # row g * t + i: head g of the KV head's group, token i
        scale = d**-0.5 if scale is None else scale
        bias = key_bias if t == 1 else key_bias.repeat(1, 1, groups, 1)
        scores = _capped(self.matmul(qg.float(), k_t.float()) * scale, softcap) + bias
        return self._weighted_values(scores, v, q.dtype).reshape(b, h, t, d)

    def _weighted_values(self, scores: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """softmax(scores) @ v with flash-attention numerics: FP32 scores and softmax, the
        probabilities rounded to `dtype`, FP32 accumulation, the output rounded to `dtype`.
        Softmax and the weighted sum give a query the same bits however many masked keys
        follow its last visible one, which is what lets a cache and a full sequence agree."""
        probs = torch.softmax(scores, dim=-1).to(dtype)
        if emulated(probs) or v.dtype == torch.float32:
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
            out.update({f"matmul_{p}": self._cuda_matmul_path for p in Precision})
            return out
        features = cpu.features()
        out.update(features.describe())
        emulated_dtypes = cpu.emulated_dtypes()
        for p in Precision:
            out[f"matmul_{p}"] = cpu.EMULATED if p.dtype in emulated_dtypes else cpu.NATIVE
        return out

    _cuda_matmul_path = cpu.NATIVE


class _Exact(Numerics):
    """What both forms of exact mode share: the rollout engine computes as the trainer does (its RMSNorm,
    each adapter member added on its own), so that μ is π's bits (docs/exact.md)."""

    exact = True

    def differing(self, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        return (a != b) & mask

    def fast_matrix(self, weight: torch.Tensor) -> torch.Tensor | None:
        return None  # one kernel, whose bits both engines are held to

    def fused_head(self, head: torch.Tensor, support: torch.Tensor | None) -> bool:
        return False  # the log-normaliser in `token_logprobs`' order: the rollout engine's log-softmax bits

    def engine_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
        return self.rms_norm(x, weight, eps, gemma)

    engine_add_norm = Numerics._add_then_norm  # the trainer's two steps: its addition, then its norm

    def add_adapter(
        self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, blocks: list
    ) -> torch.Tensor:
        # The trainer adds each member's adapter to its own output: the block-diagonal B would
        # sum over the other members' (zero) rank columns too, in another order.
        low = self.linear(x, a)
        for columns, ranks in blocks:
            out[..., columns] += self.linear(low[..., ranks], b[columns, ranks])
        return out

    def adapter_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def lora_linear(self, x, weight, bias, a, b, scale, merged, cast):
        if merged:  # the rollout engine multiplies by the merged weight, rounded: so does this (A, B get gradients)
            return self.linear(x, merged_weight(weight, a, b, scale), bias)
        return super().lora_linear(x, weight, bias, a, b, scale, merged, cast)

    def token_logprobs(
        self, z: torch.Tensor, tokens: torch.Tensor, support: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The rollout engine's arithmetic: a log-softmax of the whole row, the tokens outside the support at -inf.
        logp = torch.log_softmax(restrict(z, support), dim=-1)
        picked = logp.gather(-1, tokens[:, None]).squeeze(-1)
        return picked, z.gather(-1, tokens[:, None]).squeeze(-1) - picked

    def draw_unfiltered(self, logits, uniforms, temperature):
        return None  # μ is read off the log-softmax of the whole row, as the trainer computes it


class CpuExact(_Exact):
    """Exact mode on the CPU: every linear layer's matmul in calls of exactly EXACT_CPU_ROWS rows; attention
    spelled out in every precision, padded where the CPU's kernels would pick another path for a short row."""

    def linear(self, x, weight, bias=None, prerounded=False, fast=None) -> torch.Tensor:
        return linear(x, weight, bias, prerounded, row_blocks=True)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Elements that depend neither on the other rows and columns nor on trailing zero terms (MIN_ROWS)."""
        rows, cols = a.shape[-2], b.shape[-1]
        return torch.matmul(_pad(_pad(a, -1), -2, MIN_BATCHED_ROWS), _pad(_pad(b, -2), -1))[..., :rows, :cols]

    def attention(self, q, k, v, window=None, scale=None, softcap=None) -> torch.Tensor:
        """The spelled-out form in every precision, with the FP32 kernel for the probability-weighted values,
        so that each query's output is the bits `decode_attention` gives for it over a KV cache."""
        return self._spelled_out(q, k, v, window, q.shape[-1] ** -0.5 if scale is None else scale, softcap)

    def _weighted_values(self, scores: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        short = MIN_ROWS - scores.shape[-1]
        if short > 0:  # the CPU softmax takes a scalar path on rows shorter than a vector register
            scores = F.pad(scores, (0, short), value=float("-inf"))
            v = F.pad(v, (0, 0, 0, short))
        probs = torch.softmax(scores, dim=-1).to(dtype)
        return self._blocked_matmul(probs.float(), v.float()).to(dtype)

    def _blocked_matmul(self, probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """probs [..., M, S] @ v [..., S, D] as a sum over blocks of EXACT_KEY_BLOCK keys (the last zero padded),
        added in key order: each block one matmul of one shape, so a query's sum does not depend on S. One
        call per block reads the cache's values in place (a [.., blocks, ..] batch would copy them all)."""
        out = None
        for start in range(0, probs.shape[-1], EXACT_KEY_BLOCK):
            keys = slice(start, start + EXACT_KEY_BLOCK)
            part = self.matmul(_pad(probs[..., keys], -1, EXACT_KEY_BLOCK), _pad(v[..., keys, :], -2, EXACT_KEY_BLOCK))
            out = part if out is None else out + part
        return out


class TritonExact(_Exact):
    """Exact mode on CUDA: the batch-invariant Triton kernels replace cuBLAS and PyTorch's attention and row
    means wherever a token's value could depend on its batch (`invariant.py`, `attention.py`). Tests build it
    on the CPU too, where Triton's interpreter runs the same kernels."""

    cache_layout = "slots"
    _cuda_matmul_path = "triton batch-invariant"

    def linear(self, x, weight, bias=None, prerounded=False, fast=None) -> torch.Tensor:
        from parity.engines.kernels import invariant

        return invariant.linear(
            x, weight if prerounded else weight.to(x.dtype), None if bias is None else bias.to(x.dtype)
        )

    def fused_rows(self, x: torch.Tensor) -> bool:
        return True  # on the CPU too, in Triton's interpreter, as the tests run exact mode's kernels

    def attention(self, q, k, v, window=None, scale=None, softcap=None) -> torch.Tensor:
        """The kernel of `attention.py`, which gives each query the bits the decode step and the trainer
        give it."""
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
            d**-0.5 if scale is None else scale,
            window,
            softcap,
        )
        return flat.view(b, t, h, d).transpose(1, 2)

    def packed_attention(self, q, k, v, packed, window=None, scale=None, softcap=None) -> torch.Tensor:
        """`attention.py`'s kernel over the stream (the decode step's bits), with the gradients of plain
        attention."""
        from parity.engines.kernels import varlen

        return varlen.exact_packed_attention(q, k, v, packed, window, scale, softcap, numerics(self.device))


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
    """The numerics for `device` (`Numerics`, or exact mode's `CpuExact` / `TritonExact`), decided once per
    process (one object per device and mode): on CUDA this also sets the matmul flags (`cuda.configure`)."""
    return _numerics(str(torch.device(device)), bool(exact))


@cache
def _numerics(device: str, exact: bool) -> Numerics:
    where = torch.device(device)
    if where.type != "cuda":
        return CpuExact(where) if exact else Numerics(where)
    cuda.configure(exact)
    if not exact:
        return Numerics(where)
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ConfigError(
            "exact=true on CUDA needs Triton for its batch-invariant kernels (pip install triton); "
            "PyTorch's CUDA builds for Linux bring it"
        ) from None
    return TritonExact(where)
