"""Precision policy: dtypes, the CPU FP16 fast path, and the dynamic loss scaler.

Every matmul-class op in the model goes through `linear` and `attention` here, so
the numerics of each precision are defined in one place:

* inputs and weights are rounded to the compute dtype,
* products are accumulated in FP32 (as GPU tensor cores do),
* outputs are rounded back to the compute dtype.

On CUDA, and for BF16/FP32 on CPU, native kernels already do exactly that. This
machine's CPU has no FP16 matmul hardware (native FP16 matmul is 4-150x slower),
so for FP16 on CPU we run the FP32 kernel on the FP16-rounded inputs and round the
result to FP16: numerically what a GPU does, at FP32 speed. BF16 matmuls run
natively. Attention in FP16/BF16 on CPU follows flash-attention's numerics with FP32
kernels: scores and softmax in FP32, probabilities rounded to the compute dtype,
products accumulated in FP32, output rounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
PRECISIONS = tuple(DTYPES)

# FP16 range, used by the doctor and by the loss scaler's docs.
FP16_MAX = 65504.0
FP16_MIN_NORMAL = 6.103515625e-05


def to_dtype(precision: str) -> torch.dtype:
    """Map a precision name (`fp32`, `bf16`, `fp16`) to its torch dtype."""
    try:
        return DTYPES[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}") from None


def per_shape_kernels(dtype: torch.dtype, device: torch.device) -> bool:
    """True where this dtype's matmuls run kernels generated for each input shape: BF16
    on the CPU goes to oneDNN, which builds (and caches) a kernel per shape, at the cost
    of a few hundred microseconds each. Callers then keep their shapes to a few sizes."""
    return dtype == torch.bfloat16 and device.type == "cpu"


def _emulate(t: torch.Tensor) -> bool:
    """True when `t` is FP16 on a device without fast FP16 matmul (the CPU)."""
    return t.dtype == torch.float16 and t.device.type == "cpu"


# Matmuls get at least this many rows, columns and terms per dot product. The CPU's FP32
# GEMM picks other kernels for small shapes (on this machine: 1-3, 5-7 and 9-11 rows;
# 8 or fewer columns; fewer than 16 terms), so an output element would depend on how many
# rows and columns share its matmul and on how many zero terms follow its own (a causal
# query's masked keys); from there on it does not (BF16: never). Padding with zeros makes
# every output element independent of the rest of the batch, which exact mode needs, for the
# cost of a few zero rows on tiny matmuls (whose time is the weight read anyway).
MIN_ROWS = 16
# Batched matmuls (attention) take another path, whose results vary only below 4 rows: a
# decode step's few query rows per KV head need less padding than MIN_ROWS.
MIN_BATCHED_ROWS = 4


def _pad(x: torch.Tensor, dim: int, size: int = MIN_ROWS) -> torch.Tensor:
    """`x` padded with zeros along `dim` (negative) to `size` entries."""
    short = size - x.shape[dim]
    return F.pad(x, (0, 0) * (-dim - 1) + (0, short)) if short > 0 else x


def matmul(a: torch.Tensor, b: torch.Tensor, pad: bool = True) -> torch.Tensor:
    """Batched `a @ b` whose elements do not depend on the other rows and columns, nor on
    trailing zero terms (see MIN_ROWS); `pad=False`: the kernel as the shapes come."""
    if not pad:
        return torch.matmul(a, b)
    rows, cols = a.shape[-2], b.shape[-1]
    return torch.matmul(_pad(_pad(a, -1), -2, MIN_BATCHED_ROWS), _pad(_pad(b, -2), -1))[..., :rows, :cols]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` in the dtype of `x`, accumulating in FP32; each output element
    is independent of the other rows and columns (see MIN_ROWS)."""
    rows, cols = x.shape[:-1], weight.shape[0]
    x2, weight = _pad(x.reshape(-1, x.shape[-1]), -2), _pad(weight.to(x.dtype), -2)
    bias = None if bias is None else _pad(bias.to(x.dtype)[:, None], -2)[:, 0]
    if _emulate(x):
        out = F.linear(x2.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    else:
        out = F.linear(x2, weight, bias)
    return out[: rows.numel(), :cols].reshape(*rows, cols)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    exact: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads, in the dtype of `q`.

    `q` is [B, H, Tq, D]; `k`, `v` are [B, Hkv, Tk, D]; `mask` is a boolean
    [B, 1, Tq, Tk] (True = attend) or None. `scale` defaults to D ** -0.5; `softcap`
    bounds the scores to (-softcap, softcap) with tanh before the mask (Gemma 2).
    `exact`: the spelled-out form in every precision, with the FP32 kernel for the
    probability-weighted values, so that each query's output is the bits
    `decode_attention(..., exact=True)` gives for it over a KV cache (exact mode).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if exact or softcap is not None or (q.device.type == "cpu" and q.dtype != torch.float32):
        # The CPU has no FP16 attention kernel worth using, and its BF16 one has a ~8x
        # slower backward than FP32's: spell out the flash-attention numerics instead.
        # The query heads sharing a KV head become extra rows of one matmul against it,
        # so K and V are never copied per query head.
        b, h, q_len, d = q.shape
        kv_heads, k_len = k.shape[1], k.shape[2]
        groups = h // kv_heads
        bias = torch.zeros((q_len, k_len), device=q.device)
        if causal:
            bias = bias.masked_fill(torch.ones_like(bias, dtype=torch.bool).triu(1), float("-inf"))
        if mask is not None:
            bias = bias.masked_fill(~mask, float("-inf"))
        bias = bias.repeat(*(1,) * (bias.dim() - 2), groups, 1)  # row g * q_len + t is query t
        q_rows = q.reshape(b, kv_heads, groups * q_len, d).float()
        scores = _capped(matmul(q_rows, k.float().transpose(-1, -2), exact) * scale, softcap) + bias
        return _weighted_values(scores, v, q.dtype, exact).reshape(b, h, q_len, d)
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa, scale=scale)


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def decode_attention(
    q: torch.Tensor,
    k_t: torch.Tensor,
    v: torch.Tensor,
    key_bias: torch.Tensor,
    scale: float | None = None,
    softcap: float | None = None,
    exact: bool = False,
) -> torch.Tensor:
    """Attention of one new token per row over its cache, in the dtype of `q`.

    `q` [B, H, 1, D]; `k_t` [B, Hkv, D, S] (keys transposed); `v` [B, Hkv, S, D];
    `key_bias` [B, 1, 1, S] FP32 (0 = attend, -inf = masked). Grouped query heads
    share their KV head without copying it. `exact`: as in `attention`.
    """
    b, h, _, d = q.shape
    hkv = k_t.shape[1]
    qg = q.float().view(b, hkv, h // hkv, d)
    scale = d**-0.5 if scale is None else scale
    # exact: a decode step's few query rows per KV head are padded (see MIN_BATCHED_ROWS)
    scores = _capped(matmul(qg, k_t.float(), exact) * scale, softcap) + key_bias
    return _weighted_values(scores, v, q.dtype, exact).reshape(b, h, 1, d)


def _weighted_values(scores: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, exact: bool) -> torch.Tensor:
    """softmax(scores) @ v with flash-attention numerics: FP32 scores and softmax, the
    probabilities rounded to `dtype`, FP32 accumulation, the output rounded to `dtype`.
    Softmax and the weighted sum give a query the same bits however many masked keys
    follow its last visible one, which is what lets a cache and a full sequence agree;
    `exact` pads what would otherwise depend on the shapes (see MIN_ROWS)."""
    short = MIN_ROWS - scores.shape[-1]
    if exact and short > 0:  # the CPU softmax takes a scalar path on rows shorter than a vector register
        scores = F.pad(scores, (0, short), value=float("-inf"))
        v = F.pad(v, (0, 0, 0, short))
    probs = torch.softmax(scores, dim=-1).to(dtype)
    if exact or _emulate(probs) or v.dtype == torch.float32:
        # FP32 kernels on rounded inputs: exact products, FP32 sums. (A CPU KV cache
        # holds FP32 values, rounded to the precision when written.)
        return matmul(probs.float(), v.float(), exact).to(dtype)
    return matmul(probs, v, exact)  # the BF16 kernel accumulates in FP32


@dataclass
class LossScaleState:
    scale: float
    clean_steps: int = 0
    skipped_steps: int = 0


class DynamicLossScaler:
    """Dynamic loss scaling for FP16 training (DESIGN.md, precision semantics).

    Start at `init_scale`; after `growth_interval` consecutive clean steps double the
    scale; on any inf/NaN gradient halve it and skip the optimizer step. With
    `enabled=False` (BF16/FP32) the scale stays 1; a non-finite gradient still
    skips the step and is counted.
    """

    def __init__(
        self,
        enabled: bool,
        init_scale: float = 2.0**16,
        growth_interval: int = 200,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
    ) -> None:
        self.enabled = enabled
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.min_scale = min_scale
        self.state = LossScaleState(scale=init_scale if enabled else 1.0)

    @property
    def scale(self) -> float:
        return self.state.scale

    @property
    def skipped_steps(self) -> int:
        return self.state.skipped_steps

    def unscale(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """Divide gradients by the scale in place; return their global L2 norm (a 0-d
        tensor, inf/NaN when any gradient is not finite)."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        if self.enabled and self.state.scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / self.state.scale)
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))

    def update(self, finite: bool) -> None:
        """Advance the scaler after a step; `finite`: the norm `unscale` returned is finite."""
        if not finite:
            self.state.skipped_steps += 1
        if not self.enabled:
            return
        if finite:
            self.state.clean_steps += 1
            if self.state.clean_steps >= self.growth_interval:
                self.state.scale *= self.growth_factor
                self.state.clean_steps = 0
        else:
            self.state.clean_steps = 0
            self.state.scale = max(self.state.scale * self.backoff_factor, self.min_scale)

    def state_dict(self) -> dict[str, float]:
        return {
            "scale": self.state.scale,
            "clean_steps": self.state.clean_steps,
            "skipped_steps": self.state.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.state = LossScaleState(
            scale=float(state["scale"]),
            clean_steps=int(state["clean_steps"]),
            skipped_steps=int(state["skipped_steps"]),
        )
