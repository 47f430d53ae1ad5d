"""Inputs of the kernel tests (tests/unit/test_invariant.py, tests/e2e/test_invariant_engines.py): the device
they run on, the precisions, and seeded random tensors."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=DEVICE, dtype=dtype)
