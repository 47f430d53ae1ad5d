"""The static-shape rollout engine against the engine before it, on this CPU, side by side in one process.

The previous decode loop (a KV cache grown a block at a time and copied when rows leave, the filtered
distribution built over the whole vocabulary with a [B, V] mask per step) is kept as a test oracle in
tests/reference_rollout.py and runs here on the same engine's weights, so that the comparison isolates
what changed: the loop, the cache and the sampling. Each configuration times the two in turn
(A, B, A, B, ...) after a warm-up of each, and checks that they sampled the same tokens and μ.

    python benchmarks/static_engine.py [--repeats 5] [--json out.json]

Record `torch.backends.cpu.get_cpu_capability()` with the figures; for the AVX2 class run it under
`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import reference_rollout  # noqa: E402
from engines import make_llama_4m  # noqa: E402
from parity.engines import kernels  # noqa: E402
from parity.engines.kernels import cpu  # noqa: E402
from parity.engines.models.io import export_state, load_model, resolve_model_dir  # noqa: E402
from parity.engines.rollout import RolloutEngine  # noqa: E402
from parity.engines.sampling import SamplingParams  # noqa: E402
from parity.engines.tokenizer import load_tokenizer  # noqa: E402

# (model, prompts, samples per prompt, new tokens): the built-in task's rollout, and a larger model's.
WORKLOADS = [("builtin", 8, 8, 96), ("llama-4.4M", 16, 4, 64)]
SAMPLINGS = {"plain": {}, "top-k-top-p": dict(temperature=0.8, top_k=20, top_p=0.9)}


def compare(engine, ids: list[list[int]], group: int, sampling: SamplingParams, repeats: int) -> dict:
    """Median seconds of the static engine and of the previous loop on the same call, in turn after a warm-up
    of each, and whether they sampled the same tokens and μ."""
    arms = {
        "static": lambda seed: engine.generate(ids, group, sampling, seed),
        "previous": lambda seed: reference_rollout.generate(engine, ids, group, sampling, seed),
    }
    first = {arm: fn(0) for arm, fn in arms.items()}
    same = all(
        torch.equal(getattr(first["static"], name), getattr(first["previous"], name))
        for name in ("response_ids", "rollout_logprobs")
    )
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for r in range(repeats):
        for arm in list(arms)[r % 2 :] + list(arms)[: r % 2]:
            start = time.perf_counter()
            arms[arm](r + 1)
            times[arm].append(time.perf_counter() - start)
    row = {"tokens": first["static"].num_tokens, "same_bits": same}
    row.update({f"{arm}_s": statistics.median(t) for arm, t in times.items()})
    row["ratio"] = row["static_s"] / row["previous_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precisions", default="fp32,bf16,fp16")
    parser.add_argument("--models", default=",".join(name for name, *_ in WORKLOADS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as `parity sanity` runs each run
    record = {"capability": torch.backends.cpu.get_cpu_capability(), **cpu.features().describe(), "rows": []}
    print(json.dumps({k: v for k, v in record.items() if k != "rows"}), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, prompts, group, new_tokens in [w for w in WORKLOADS if w[0] in args.models.split(",")]:
            path = "builtin" if name == "builtin" else str(make_llama_4m(Path(tmp) / "llama"))
            model = load_model(path, kernels.numerics())
            tok = load_tokenizer(resolve_model_dir(path))
            gen = torch.Generator().manual_seed(0)
            ids = [torch.randint(3, model.config.vocab_size, (12,), generator=gen).tolist() for _ in range(prompts)]
            for precision in args.precisions.split(","):
                engine = RolloutEngine(model.config, precision, tok.eos_ids, tok.pad_id, kernels.numerics())
                engine.weights.load(export_state(model), version=0)
                for label, extra in SAMPLINGS.items():
                    sampling = SamplingParams(max_new_tokens=new_tokens, **extra)
                    row = compare(engine, ids, group, sampling, args.repeats)
                    row.update(model=name, precision=precision, sampling=label, rows=prompts * group)
                    record["rows"].append(row)
                    print(
                        f"{name} {precision} {label}: static {row['static_s']:.3f} s, previous "
                        f"{row['previous_s']:.3f} s ({row['ratio']:.2f}x), same bits: {row['same_bits']}",
                        flush=True,
                    )
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
