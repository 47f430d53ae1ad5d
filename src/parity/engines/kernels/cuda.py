"""CUDA settings that make the GPU compute what docs/design.md, "Precision semantics", says.

By default PyTorch lets cuBLAS accumulate FP16/BF16 matmuls with reduced-precision reductions
and run FP32 matmuls on TF32; both break "products accumulated in FP32" (and TF32 makes FP32
no longer FP32). `configure` turns them off once per process. Exact mode also asks for
deterministic algorithms and a fixed cuBLAS workspace, so that a kernel's sum order cannot
change from call to call; its batch invariance comes from `invariant.py`. Checked on an H200
(tests/unit/test_kernels.py's CUDA tests; docs/benchmarks.md, "On a GPU").
"""

from __future__ import annotations

import os

import torch


def configure(exact: bool) -> None:
    """Set the process's CUDA matmul flags (idempotent)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    if exact:
        # cuBLAS picks its workspace-dependent split per stream unless told a fixed size.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def describe(device: torch.device) -> dict[str, str]:
    props = torch.cuda.get_device_properties(device)
    return {
        "gpu": props.name,
        "gpu_capability": f"{props.major}.{props.minor}",
        "cuda": str(torch.version.cuda),
        "tf32": "off",
        "reduced_precision_reduction": "off",
    }
