"""Kernels: every matmul-class op of both engines, chosen per device and processor.

`ops.py` holds them and the `Numerics` an engine computes with (`numerics(device, exact)`), the numerics
of each precision in one place; this package exposes them as `kernels.<name>`. The other modules are the
kernels they choose from: `cpu.py` (per processor), `cuda.py` (the matmul flags), and on CUDA the Triton
kernels of `invariant.py`, `attention.py`, `varlen.py`, `fused.py`, `gumbel.py` and `head.py`.
"""

from parity.engines.kernels.ops import (
    ACTIVATION_ROW_MULTIPLE,
    DEVICES,
    EXACT_CPU_ROWS,
    EXACT_KEY_BLOCK,
    MIN_BATCHED_ROWS,
    MIN_ROWS,
    SDPA_BACKENDS,
    CpuExact,
    Numerics,
    TritonExact,
    activation,
    apply_rope,
    check_device,
    emulated,
    linear,
    merged_weight,
    numerics,
    padded_attention,
    per_shape_kernels,
    restrict,
    sliding_mask,
    store_for_engine,
)

__all__ = [
    "ACTIVATION_ROW_MULTIPLE",
    "DEVICES",
    "EXACT_CPU_ROWS",
    "EXACT_KEY_BLOCK",
    "MIN_BATCHED_ROWS",
    "MIN_ROWS",
    "SDPA_BACKENDS",
    "CpuExact",
    "Numerics",
    "TritonExact",
    "activation",
    "apply_rope",
    "check_device",
    "emulated",
    "linear",
    "merged_weight",
    "numerics",
    "padded_attention",
    "per_shape_kernels",
    "restrict",
    "sliding_mask",
    "store_for_engine",
]
