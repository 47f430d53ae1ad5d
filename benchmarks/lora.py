"""LoRA against full fine-tuning: peak memory, trainer step time, and weight-sync cost.

For each model, on one rollout batch (every row generates exactly `new_tokens`):

- train step: `Trainer.logprobs` forward + scaled backward + optimizer step, full fine-tuning
  and LoRA timed alternately in one process (A, B, A, B, ...) so machine noise hits both alike;
- sync: `Trainer.export_weights()` + `RolloutWeights.load()`, the weight hand-over of
  every RL step (with LoRA: W + scale·B·A merged in FP32, then cast by the engine), alternated
  likewise;
- peak memory: max RSS of a fresh process that loads the model, builds the trainer and the
  rollout engine, samples the batch and runs three train steps and a sync.

    python benchmarks/lora.py [--rank 8] [--precision bf16] [--repeats 7] [--models builtin,llama-4.4M]

Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from engines import MODELS, alternate, isolated, make_llama_4m  # noqa: E402


class Setup:
    """A trainer (full, or LoRA of `rank`), a rollout engine fed by it, and one rollout batch."""

    def __init__(self, model_dir: str, spec: dict, precision: str, rank: int):
        from parity.engines import kernels
        from parity.engines.lora import LoRAConfig
        from parity.engines.models.io import load_model
        from parity.engines.rollout import RolloutEngine
        from parity.engines.sampling import SamplingParams
        from parity.engines.tokenizer import load_tokenizer
        from parity.engines.trainer import OptimConfig, Trainer
        from parity.rl.problems import ArithmeticTask

        tok = load_tokenizer(model_dir)
        prompts = [tok.encode(p.prompt) for p in ArithmeticTask().problems(spec["prompts"], seed=0, split="eval")]
        model = load_model(model_dir, kernels.numerics())
        lora = LoRAConfig(rank, 2.0 * rank) if rank else None
        self.trainer = Trainer(model, precision, OptimConfig(lr=1e-6), lora)
        self.engine = RolloutEngine(model.config, precision, (-1,), tok.pad_id, kernels.numerics())  # no EOS
        self.sync()
        sampling = SamplingParams(max_new_tokens=spec["new_tokens"])
        self.batch = self.engine.generate(prompts, spec["group"], sampling, seed=0)

    def step(self) -> int:
        b = self.batch
        logp = self.trainer.logprobs(b.prompt_ids, b.response_ids, b.response_mask)
        self.trainer.backward(-(logp.sum() / b.num_tokens) * 1e-3)
        self.trainer.step()
        return b.num_tokens

    def sync(self) -> int:
        self.engine.weights.load(*self.trainer.export_weights())
        return 1

    def trainable(self) -> int:
        return sum(p.numel() for p in self.trainer.params)


def timing_job(model_dir: str, spec: dict, precision: str, rank: int, repeats: int) -> dict:
    from parity.runtime import reuse_freed_memory

    reuse_freed_memory()  # as every Parity command runs
    setups = {"full": Setup(model_dir, spec, precision, 0), f"lora r{rank}": Setup(model_dir, spec, precision, rank)}
    steps = alternate({k: s.step for k, s in setups.items()}, repeats)
    syncs = alternate({k: s.sync for k, s in setups.items()}, repeats)
    total = sum(p.numel() for p in setups["full"].trainer.model.parameters())
    return {
        k: {"params": total, "trainable": s.trainable(), "step_s": steps[k]["seconds"], "sync_s": syncs[k]["seconds"]}
        for k, s in setups.items()
    }


def memory_job(model_dir: str, spec: dict, precision: str, rank: int) -> float:
    from parity.runtime import reuse_freed_memory

    reuse_freed_memory()
    setup = Setup(model_dir, spec, precision, rank)
    for _ in range(3):
        setup.step()
    setup.sync()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()

    from parity.engines.models.io import resolve_model_dir

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            spec = MODELS[name]
            model_dir = str(resolve_model_dir(spec["path"]) if spec["path"] else make_llama_4m(Path(tmp) / name))
            timing = isolated(timing_job, model_dir, spec, args.precision, args.rank, args.repeats)
            for mode, r in timing.items():
                rank = 0 if mode == "full" else args.rank
                rss = isolated(memory_job, model_dir, spec, args.precision, rank)
                rows.append((name, mode, r, rss))
    print(f"\n{args.precision}; train step and sync: medians of {args.repeats} alternated runs\n")
    print("| model | batch | mode | trainable / all params | peak RSS (MB) | train step (s) | weight sync (s) |")
    print("|---|---|---|---|---|---|---|")
    for name, mode, r, rss in rows:
        spec = MODELS[name]
        batch = f"{spec['prompts']}x{spec['group']}, {spec['new_tokens']} new tokens"
        share = f"{r['trainable']:,} / {r['params']:,} ({100 * r['trainable'] / r['params']:.1f}%)"
        print(f"| {name} | {batch} | {mode} | {share} | {rss:.0f} | {r['step_s']:.3f} | {r['sync_s']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
