"""LoRA in the rollout engine, merged against unmerged (results: docs/real-models.md).

One trainer with LoRA adapters on every projection (rank 8, alpha 16) whose B is drawn at
random, N(0, --b-std), so that each projection is changed as a trained adapter changes it.
Two rollout engines on it: one loaded with merged weights W + scale·B·A (`lora.merge=true`),
one with the base and the adapters apart (`lora.merge=false`). For each precision, in turns
(`--rounds`, the same prompts and seeds for both):

- the sync: the seconds to hand the engine its weights (merged: every weight, merged in
  FP32 and cast; unmerged: the adapters alone, the base staying loaded);
- the rollout: the seconds one `generate` takes;
- the mismatch: the trainer's π on the sampled tokens against the engine's μ.

    python benchmarks/lora_sync.py --model DIR [--precisions bf16,fp16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from parity.commands.mismatch import load_prompts
from parity.engines import kernels
from parity.engines.lora import LoRAConfig, adapted
from parity.engines.models.io import load_model, resolve_model_dir
from parity.engines.rollout import RolloutEngine
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import load_tokenizer
from parity.engines.trainer import OptimConfig, Trainer
from parity.rl.diagnostics import mismatch_metrics
from parity.runtime import reuse_freed_memory


def measure(model_dir: Path, precision: str, args: argparse.Namespace) -> dict:
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode_prompt(p) for p in load_prompts("builtin", args.prompts, 0, str(model_dir))]
    trainer = Trainer(
        load_model(model_dir, kernels.numerics()),
        precision,
        OptimConfig(),
        LoRAConfig(args.rank, 2.0 * args.rank),
        seed=0,
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, m in adapted(trainer.model):
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=gen) * args.b_std)
    config = trainer.model.config
    engines = {
        kind: RolloutEngine(config, precision, tokenizer.eos_ids, tokenizer.pad_id, kernels.numerics())
        for kind in ("merged", "unmerged")
    }
    engines["unmerged"].weights.load(*trainer.export_weights(merge=False))  # the base, once

    def sync(kind: str) -> None:
        if kind == "merged":
            engines[kind].weights.load(*trainer.export_weights())
        else:
            engines[kind].weights.load_adapters(*trainer.export_adapters())

    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)
    times: dict[str, dict[str, list[float]]] = {k: {"sync_s": [], "rollout_s": []} for k in engines}
    batches = {}
    for r in range(args.rounds):
        for kind in ("merged", "unmerged") if r % 2 == 0 else ("unmerged", "merged"):
            start = time.perf_counter()
            sync(kind)
            times[kind]["sync_s"].append(time.perf_counter() - start)
            start = time.perf_counter()
            batches[kind] = engines[kind].generate(prompts, args.group, sampling, seed=r)
            times[kind]["rollout_s"].append(time.perf_counter() - start)
    out = {}
    for kind, batch in batches.items():
        with torch.no_grad():
            pi = trainer.logprobs(batch.prompt_ids, batch.response_ids, batch.response_mask)
        metrics = mismatch_metrics(pi, batch.rollout_logprobs, batch.response_mask)
        out[kind] = {
            "sync_s": statistics.median(times[kind]["sync_s"]),
            "rollout_s": statistics.median(times[kind]["rollout_s"]),
            "tokens": int(batch.response_mask.sum()),
            "k3": metrics["k3"],
            "token_abs_log_ratio_mean": metrics["token_abs_log_ratio_mean"],
            "token_abs_log_ratio_max": metrics["token_abs_log_ratio_max"],
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory (or 'builtin')")
    parser.add_argument("--precisions", default="bf16,fp16")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--b-std", type=float, default=0.02, help="spread of the random B")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="syncs and rollouts per engine, in turns")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    reuse_freed_memory()
    model_dir = resolve_model_dir(args.model)
    print(
        "| precision | LoRA in the engine | sync s | rollout s | k3 | mean \\|Δ\\| per token | max \\|Δ\\| | tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for precision in args.precisions.split(","):
        results[precision] = measure(model_dir, precision, args)
        for kind, r in results[precision].items():
            print(
                f"| {precision} | {kind} | {r['sync_s']:.3f} | {r['rollout_s']:.2f} | {r['k3']:.2e} | "
                f"{r['token_abs_log_ratio_mean']:.2e} | {r['token_abs_log_ratio_max']:.2e} | {r['tokens']} |",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
