"""What exact mode's one matmul shape costs a linear layer on the CPU.

Exact mode gives every linear layer's matmul exactly `kernels.EXACT_CPU_ROWS` rows (docs/exact.md,
"one matmul shape"). This times one layer's forward without gradients, plain (`kernels.linear`) and
in exact mode (`row_blocks=True`), at a decode step's row count and at a training pass's, on the
layer shapes of the built-in model, the 4.4M Llama and SmolLM2-135M, with one thread: the figure
behind exact mode's cost in docs/benchmarks.md.

    python benchmarks/row_blocks.py [--dtypes bf16,fp16,fp32] [--rows 16,128,1000,4000]
    python benchmarks/row_blocks.py --dtypes bf16 --rows 16,1000 --block-rows 64,128,256

`--block-rows`: the exact path with other fixed block sizes too (set for the benchmark only).

Nothing else may run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from parity.engines import kernels
from parity.engines.precision import DTYPES

SHAPES = {"built-in 128->384": (128, 384), "4.4M Llama 256->768": (256, 768), "SmolLM2 576->1536": (576, 1536)}


def per_call_us(fn, *args, reps: int = 100, rounds: int = 3, **kwargs) -> float:
    """The fastest of `rounds` means over `reps` calls of fn(*args, **kwargs), in microseconds."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn(*args, **kwargs)
        best = min(best, (time.perf_counter() - start) / reps * 1e6)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", type=lambda v: v.split(","), default=["bf16", "fp16", "fp32"])
    parser.add_argument("--rows", type=lambda v: [int(x) for x in v.split(",")], default=[16, 128, 1000, 4000])
    parser.add_argument("--block-rows", type=lambda v: [int(x) for x in v.split(",")], default=[kernels.EXACT_CPU_ROWS])
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    default_rows = kernels.EXACT_CPU_ROWS
    print(json.dumps(kernels.numerics("cpu").describe()))
    print("microseconds per call, plain -> exact with R rows per call (ratio)")
    with torch.no_grad():
        for name in args.dtypes:
            dtype = DTYPES[name]
            for shape, (k, n) in SHAPES.items():
                weight = torch.randn(n, k).to(dtype)
                cells = []
                for rows in args.rows:
                    x = torch.randn(rows, k).to(dtype)
                    plain = per_call_us(kernels.linear, x, weight)
                    exact = []
                    for block in args.block_rows:
                        kernels.EXACT_CPU_ROWS = block  # `linear` reads it at each call
                        us = per_call_us(kernels.linear, x, weight, row_blocks=True)
                        exact.append(f"R={block} {us:.0f} ({us / plain:.1f}x)")
                    cells.append(f"{rows} rows {plain:.0f} -> {', '.join(exact)}")
                print(f"{name} {shape}: " + "; ".join(cells), flush=True)
    kernels.EXACT_CPU_ROWS = default_rows
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
