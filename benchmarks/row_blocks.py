"""What exact mode's one matmul shape costs a linear layer on the CPU, and what other forms would.

Exact mode gives every linear layer's matmul exactly `kernels.EXACT_CPU_ROWS` rows (docs/exact.md,
"one matmul shape"). This times one layer's forward without gradients, plain (`kernels.linear`) and
in exact mode (`row_blocks=True`), at a decode step's row count and at a training pass's, on the
layer shapes of the built-in model, the 4.4M Llama and SmolLM2-135M (its MLP up and down), with one thread: the figure
behind exact mode's cost in docs/benchmarks.md.

    python benchmarks/row_blocks.py [--dtypes bf16,fp16,fp32] [--rows 16,128,1000,4000]
    python benchmarks/row_blocks.py --dtypes bf16 --rows 16,1000 --block-rows 64,128,256
    python benchmarks/row_blocks.py --forms blocks,batched,prepacked,tokens-as-columns
    python benchmarks/row_blocks.py --forms blocks,concatenated --rows 16,128,1000

`--block-rows`: the exact path with other fixed block sizes too (set for the benchmark only).
`--forms`: other ways to compute the same blocks, each timed and checked for what exact mode needs
(a row's bits the same whichever rows share its call; tested at 1, 16, 17, 64, 65 and 300 rows
against the full count):
  blocks             exact mode's path: one call per block of rows, each writing its rows of the output
  concatenated       the same calls on a padded copy of the input, the blocks' outputs concatenated
                     (exact mode's path before commit 7b90616)
  batched            one batched matmul over all the blocks, the weight broadcast to each
  prepacked          one call per block, the weight reordered for oneDNN once beforehand (not timed)
  tokens-as-columns  one call with the operands swapped (W @ Xᵀ), the tokens as the matmul's columns

Nothing else may run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from parity.engines import kernels
from parity.engines.kernels import ops
from parity.engines.precision import DTYPES

SHAPES = {
    "built-in 128->384": (128, 384),
    "4.4M Llama 256->768": (256, 768),
    "SmolLM2 576->1536": (576, 1536),
    "SmolLM2 1536->576": (1536, 576),
}
INVARIANCE_ROWS = (1, 16, 17, 64, 65, 300)


def per_call_us(fn, *args, reps: int = 100, rounds: int = 3, **kwargs) -> float:
    """The fastest of `rounds` means over `reps` calls of fn(*args, **kwargs), in microseconds."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn(*args, **kwargs)
        best = min(best, (time.perf_counter() - start) / reps * 1e6)
    return best


def _padded_blocks(x: torch.Tensor) -> torch.Tensor:
    """`x`'s rows padded with zeros to whole blocks, as [blocks, EXACT_CPU_ROWS, K]."""
    rows = kernels.EXACT_CPU_ROWS
    count = max(-(-x.shape[0] // rows), 1)
    return ops._pad(x, -2, count * rows).view(count, rows, -1)


def concatenated(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    inputs, weight = (x.float(), weight.float()) if kernels.emulated(x) else (x, weight)  # as `kernels.linear`
    return torch.cat([F.linear(block, weight) for block in _padded_blocks(inputs)])[: x.shape[0]].to(x.dtype)


def batched(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    blocks = _padded_blocks(x)
    out = torch.bmm(blocks, weight.t().unsqueeze(0).expand(blocks.shape[0], -1, -1))
    return out.reshape(-1, weight.shape[0])[: x.shape[0]]


def prepacked(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    blocks = [torch.ops.mkldnn._linear_pointwise(b, packed, None, "none", [], "") for b in _padded_blocks(x)]
    return torch.cat(blocks)[: x.shape[0]]


def tokens_as_columns(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, x.t()).t().contiguous()


def forms(weight: torch.Tensor, names: list[str]) -> dict:
    """The forms in `names`, each as fn(x) for this weight (oneDNN reorders a 16-bit weight only on a
    processor with AVX-512, so `prepacked` is built only when asked for)."""
    made = {
        "blocks": lambda x: kernels.linear(x, weight, row_blocks=True),
        "concatenated": lambda x: concatenated(x, weight),
        "batched": lambda x: batched(x, weight),
        "tokens-as-columns": lambda x: tokens_as_columns(x, weight),
    }
    if "prepacked" in names:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, kernels.EXACT_CPU_ROWS)
        made["prepacked"] = lambda x: prepacked(x, packed)
    return {name: made[name] for name in names}


def row_invariant(fn, x: torch.Tensor) -> bool:
    """Whether every row of fn(x) has the bits it has when computed among fewer rows."""
    whole = fn(x)
    return all(torch.equal(fn(x[:rows]), whole[:rows]) for rows in INVARIANCE_ROWS if rows < x.shape[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", type=lambda v: v.split(","), default=["bf16", "fp16", "fp32"])
    parser.add_argument("--rows", type=lambda v: [int(x) for x in v.split(",")], default=[16, 128, 1000, 4000])
    parser.add_argument("--block-rows", type=lambda v: [int(x) for x in v.split(",")], default=[kernels.EXACT_CPU_ROWS])
    parser.add_argument("--forms", type=lambda v: v.split(","), default=["blocks"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    default_rows = kernels.EXACT_CPU_ROWS
    print(json.dumps(kernels.numerics("cpu").describe()))
    print("microseconds per call, plain -> each form (ratio); ! = a row's bits depend on the rows beside it")
    with torch.no_grad():
        for name in args.dtypes:
            dtype = DTYPES[name]
            for shape, (k, n) in SHAPES.items():
                weight = torch.randn(n, k).to(dtype)
                invariant = {}
                cells = []
                for rows in args.rows:
                    x = torch.randn(rows, k).to(dtype)
                    plain = per_call_us(kernels.linear, x, weight)
                    timed = []
                    for block in args.block_rows:
                        kernels.EXACT_CPU_ROWS = block  # `linear` and the forms read it at each call
                        for form, fn in forms(weight, args.forms).items():
                            label = form if len(args.block_rows) == 1 else f"{form} R={block}"
                            if form not in ("blocks", "concatenated"):  # one shape per call: invariant by construction
                                invariant[label] = invariant.get(label, True) and row_invariant(fn, x)
                            us = per_call_us(fn, x)
                            timed.append(f"{label} {us:.0f} ({us / plain:.1f}x)")
                    cells.append(f"{rows} rows {plain:.0f} -> {', '.join(timed)}")
                    kernels.EXACT_CPU_ROWS = default_rows
                varying = [label for label, ok in invariant.items() if not ok]
                flagged = f"  ! {', '.join(varying)}" if varying else ""
                print(f"{name} {shape}: " + "; ".join(cells) + flagged, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
