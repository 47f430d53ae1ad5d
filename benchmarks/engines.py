"""Engine benchmarks, side by side in one run (results: docs/benchmarks.md).

1. Rollout tokens/s: Parity's RolloutEngine vs Hugging Face `generate` on the same
   model, prompts, group size, sampling settings and token budget, timed
   alternately in one process (A, B, A, B, ...) so machine noise hits both alike:
   - `fixed`: EOS disabled in both, every row generates exactly `new_tokens`;
   - `eos`: the natural case, each row stops at EOS; tokens/s counts generated
     tokens up to and including EOS.
2. FP16 / BF16 cost ratio on this CPU for a rollout and for a trainer step
   (forward + backward + optimizer step on one rollout batch), alternated likewise.
3. Peak memory: max RSS of each workload run alone in a fresh process.
4. Matmul throughput on this CPU at a trainer-step shape, per precision path
   (FP32, native BF16, native FP16, and Parity's FP16 fast path), which explains
   the FP16/BF16 ratios above.

    python benchmarks/engines.py [--repeats 7] [--models builtin,llama-4.4M] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

MODELS = {
    "builtin": dict(path="builtin", prompts=16, group=4, new_tokens=64),
    # The 4.4M-parameter Llama of docs/design.md, "Precision semantics" (6 layers, hidden 256), random weights.
    "llama-4.4M": dict(path=None, prompts=16, group=4, new_tokens=16),
}


def save_random_model(model_class: str, out: Path, **config) -> Path:
    """A transformers model of `model_class` (e.g. "Llama") with random weights (seed 0), saved to
    `out` with the built-in model's tokenizer (its ids are a subset of any vocabulary here)."""
    import transformers

    from parity.engines.models.io import BUILTIN_DIR

    torch.manual_seed(0)
    hf_config = getattr(transformers, f"{model_class}Config")(
        bos_token_id=None, eos_token_id=1, pad_token_id=0, **config
    )
    getattr(transformers, f"{model_class}ForCausalLM")(hf_config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((BUILTIN_DIR / name).read_bytes())
    return out


def make_llama_4m(out: Path) -> Path:
    """The 4.4M-parameter Llama of docs/design.md, "Precision semantics" (6 layers, hidden 256), random weights."""
    return save_random_model(
        "Llama",
        out,
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )


class Workloads:
    """Everything a measurement needs, built once per process."""

    def __init__(self, model_dir: str, spec: dict):
        from parity.engines.tokenizer import load_tokenizer
        from parity.rl.problems import ArithmeticTask

        self.model_dir, self.spec = model_dir, spec
        self.tok = load_tokenizer(model_dir)
        problems = ArithmeticTask().problems(spec["prompts"], seed=0, split="eval")
        self.prompts = [self.tok.encode(p.prompt) for p in problems]
        self.seed = 0

    def parity_rollout(self, precision: str, eos: bool):
        from parity.engines import kernels
        from parity.engines.models.io import load_model
        from parity.engines.rollout import RolloutEngine
        from parity.engines.sampling import SamplingParams

        model = load_model(self.model_dir, kernels.numerics())
        engine = RolloutEngine(
            model.config, precision, self.tok.eos_ids if eos else (-1,), self.tok.pad_id, kernels.numerics()
        )
        engine.weights.load(model.state_dict(), 0)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=self.spec["new_tokens"])

        def run() -> int:
            self.seed += 1
            return engine.generate(self.prompts, self.spec["group"], sampling, seed=self.seed).num_tokens

        return run

    def hf_generate(self, precision: str, eos: bool):
        from transformers import AutoModelForCausalLM

        from parity.engines import precision as prec

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=prec.to_dtype(precision)).eval()
        group, new = self.spec["group"], self.spec["new_tokens"]
        width = max(len(p) for p in self.prompts)
        rows = [p for p in self.prompts for _ in range(group)]
        ids = torch.tensor([[self.tok.pad_id] * (width - len(p)) + p for p in rows])
        attn = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in rows])[:, None]).long()
        eos_id = self.tok.eos_id

        def run() -> int:
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=attn,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=new,
                    min_new_tokens=None if eos else new,
                    eos_token_id=eos_id if eos else None,
                    pad_token_id=self.tok.pad_id,
                )
            gen = out[:, width:]
            if not eos:
                return gen.numel()
            is_eos = gen == eos_id
            first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, torch.full_like(gen[:, 0], gen.shape[1]))
            return int(first.sum())

        return run

    def train_step(self, precision: str):
        from parity.engines import kernels
        from parity.engines.models.io import load_model
        from parity.engines.rollout import RolloutEngine
        from parity.engines.sampling import SamplingParams
        from parity.engines.trainer import OptimConfig, Trainer

        model = load_model(self.model_dir, kernels.numerics())
        engine = RolloutEngine(model.config, precision, -1, self.tok.pad_id, kernels.numerics())
        trainer = Trainer(model, precision, OptimConfig(lr=1e-6))
        engine.weights.load(*trainer.export_weights())
        sampling = SamplingParams(max_new_tokens=self.spec["new_tokens"])
        batch = engine.generate(self.prompts, self.spec["group"], sampling, seed=0)

        def run() -> int:
            logp = trainer.logprobs(batch.prompt_ids, batch.response_ids, batch.response_mask)
            trainer.backward(-(logp.sum() / batch.num_tokens) * 1e-3)
            trainer.step()
            return batch.num_tokens

        return run


def alternate(runs: dict, repeats: int) -> dict:
    """Median seconds and tokens/s of each callable, called in turn `repeats` times after a warm-up."""
    for fn in runs.values():
        fn()
    times: dict = {k: [] for k in runs}
    tokens: dict = {k: [] for k in runs}
    for _ in range(repeats):
        for k, fn in runs.items():
            t = time.perf_counter()
            tokens[k].append(fn())
            times[k].append(time.perf_counter() - t)
    return {
        k: {
            "seconds": statistics.median(times[k]),
            "tokens_per_s": statistics.median(n / s for n, s in zip(tokens[k], times[k])),
        }
        for k in runs
    }


def timing_job(model_dir: str, spec: dict, repeats: int) -> dict:
    from parity.runtime import reuse_freed_memory

    reuse_freed_memory()  # as every Parity command runs; Hugging Face's side shares the process
    w = Workloads(model_dir, spec)
    out = {}
    for eos in (False, True):
        for precision in ("fp32", "bf16"):
            r = alternate({"parity": w.parity_rollout(precision, eos), "hf": w.hf_generate(precision, eos)}, repeats)
            out[f"rollout_{'eos' if eos else 'fixed'}_{precision}"] = r
    out["rollout_fp16_vs_bf16"] = alternate({p: w.parity_rollout(p, False) for p in ("bf16", "fp16")}, repeats)
    out["train_step"] = alternate({p: w.train_step(p) for p in ("fp32", "bf16", "fp16")}, repeats)
    return out


def memory_job(model_dir: str, spec: dict, kind: str, precision: str) -> float:
    from parity.runtime import reuse_freed_memory

    if kind != "hf_generate":
        reuse_freed_memory()
    w = Workloads(model_dir, spec)
    fn = {
        "parity_rollout": lambda: w.parity_rollout(precision, False),
        "hf_generate": lambda: w.hf_generate(precision, False),
        "train_step": lambda: w.train_step(precision),
    }[kind]()
    for _ in range(3):
        fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def matmul_job(repeats: int) -> dict:
    """GFLOP/s of x[1408, 256] @ w[256, 1024] (64 sequences x 22 tokens, a 4.4M-Llama MLP)."""
    import torch.nn.functional as F

    from parity.engines import kernels

    x, w = torch.randn(1408, 256), torch.randn(1024, 256)
    flops = 2 * x.shape[0] * x.shape[1] * w.shape[0]
    paths = {
        "fp32": lambda: F.linear(x, w),
        "bf16_native": (lambda xb, wb: lambda: F.linear(xb, wb))(x.bfloat16(), w.bfloat16()),
        "fp16_native": (lambda xh, wh: lambda: F.linear(xh, wh))(x.half(), w.half()),
        "fp16_fast_path": (lambda xh, wh: lambda: kernels.linear(xh, wh))(x.half(), w.half()),
    }
    out = {}
    for name, fn in paths.items():
        fn()
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        out[name] = flops * repeats / (time.perf_counter() - t) / 1e9
    return out


def isolated(fn, *args):
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from parity.engines.models.io import resolve_model_dir

    results: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "models": {}}
    results["matmul_gflops"] = isolated(matmul_job, 20)
    print(
        "matmul GFLOP/s at [1408x256] @ [256x1024]: "
        + ", ".join(f"{k} {v:.0f}" for k, v in results["matmul_gflops"].items())
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            spec = MODELS[name]
            model_dir = str(resolve_model_dir(spec["path"]) if spec["path"] else make_llama_4m(Path(tmp) / name))
            r = isolated(timing_job, model_dir, spec, args.repeats)
            r["peak_rss_mb"] = {
                f"{kind}_{p}": isolated(memory_job, model_dir, spec, kind, p)
                for kind in ("parity_rollout", "hf_generate", "train_step")
                for p in ("fp32", "bf16")
            }
            r["peak_rss_mb"]["train_step_fp16"] = isolated(memory_job, model_dir, spec, "train_step", "fp16")
            results["models"][name] = r
            print(
                f"\n## {name}: {spec['prompts']} prompts x {spec['group']} samples, up to {spec['new_tokens']} "
                f"new tokens, median of {args.repeats}, {torch.get_num_threads()} threads"
            )
            print("| rollout | precision | Parity tokens/s | HF generate tokens/s | speed-up |")
            print("|---|---|---|---|---|")
            for key in (k for k in r if k.startswith("rollout_") and k.count("_") == 2):
                _, mode, precision = key.split("_")
                ours, hf = r[key]["parity"]["tokens_per_s"], r[key]["hf"]["tokens_per_s"]
                print(f"| {mode} | {precision} | {ours:.0f} | {hf:.0f} | {ours / hf:.2f}x |")
            roll = r["rollout_fp16_vs_bf16"]
            train = r["train_step"]
            print(
                f"\nrollout fp16/bf16 time: {roll['fp16']['seconds'] / roll['bf16']['seconds']:.2f}x "
                f"({roll['fp16']['seconds']:.3f}s / {roll['bf16']['seconds']:.3f}s)"
            )
            print(
                f"train step fp16/bf16 time: {train['fp16']['seconds'] / train['bf16']['seconds']:.2f}x "
                f"(fp32 {train['fp32']['seconds']:.3f}s, bf16 {train['bf16']['seconds']:.3f}s, "
                f"fp16 {train['fp16']['seconds']:.3f}s)"
            )
            print("peak RSS MB: " + ", ".join(f"{k} {v:.0f}" for k, v in r["peak_rss_mb"].items()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
