"""Engine benchmarks, side by side in one run (results: docs/benchmarks.md).

1. Rollout tokens/s: Parity's RolloutEngine vs Hugging Face `generate` on the same
   model, batch, sampling settings and number of new tokens (EOS disabled in both
   so every row generates exactly `--new-tokens` tokens).
2. FP16 / BF16 cost ratio on this machine for a rollout and for a trainer step
   (forward + backward + optimizer step on the rolled-out batch).
3. Peak memory (max RSS) of each measurement, each run in a fresh subprocess.

    python benchmarks/engines.py [--repeats 5] [--json out.json]
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
    # name: (model dir or None for a random Llama of this shape, prompts, group size, new tokens)
    "builtin": dict(path="builtin", prompts=16, group=4, new_tokens=64),
    # The 4.4M-parameter Llama of DESIGN.md (6 layers, hidden 256), random weights.
    "llama-4.4M": dict(path=None, prompts=16, group=4, new_tokens=16),
}


def _llama_4m(tmp: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from parity.models import BUILTIN_DIR

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                      bos_token_id=None, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp / name).write_bytes((BUILTIN_DIR / name).read_bytes())
    return tmp


def _prompts(spec: dict, tokenizer) -> list[list[int]]:
    from parity.tasks import ArithmeticTask

    return [tokenizer.encode(p.prompt) for p in ArithmeticTask().problems(spec["prompts"], seed=0, split="eval")]


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(kind: str, model_dir: str, spec: dict, precision: str, repeats: int) -> dict:
    """One measurement; runs in its own process so max RSS is its own peak."""
    from parity import precision as prec
    from parity.models import load_model, load_tokenizer
    from parity.rollout import RolloutEngine, SamplingParams
    from parity.trainer import OptimConfig, Trainer

    torch.manual_seed(0)
    tok = load_tokenizer(model_dir)
    prompts = _prompts(spec, tok)
    n_rows, new = len(prompts) * spec["group"], spec["new_tokens"]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new)
    if kind == "hf_generate":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=prec.to_dtype(precision)).eval()
        width = max(len(p) for p in prompts)
        rows = [p for p in prompts for _ in range(spec["group"])]
        ids = torch.tensor([[tok.pad_id] * (width - len(p)) + p for p in rows])
        attn = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in rows])[:, None]).long()

        def run():
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0,
                                     top_p=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=tok.pad_id)
            assert out.shape[1] == width + new

        seconds = _median_time(run, repeats)
        return {"seconds": seconds, "tokens_per_s": n_rows * new / seconds, "max_rss_mb": _max_rss_mb()}

    model = load_model(model_dir)
    engine = RolloutEngine(model.config, precision, eos_id=-1, pad_id=tok.pad_id)  # EOS off: fixed length
    trainer = Trainer(model, precision, OptimConfig(lr=1e-6), tok.pad_id)
    engine.load_weights(*trainer.export_weights())
    seed = iter(range(10**6))
    if kind == "rollout":
        seconds = _median_time(lambda: engine.generate(prompts, spec["group"], sampling, seed=next(seed)), repeats)
        return {"seconds": seconds, "tokens_per_s": n_rows * new / seconds, "max_rss_mb": _max_rss_mb()}
    batch = engine.generate(prompts, spec["group"], sampling, seed=0)

    def train_step():
        logp = trainer.logprobs(batch.prompt_ids, batch.response_ids, batch.response_mask)
        trainer.backward(-(logp.sum() / batch.num_tokens) * 1e-3)
        trainer.step()

    seconds = _median_time(train_step, repeats)
    return {"seconds": seconds, "tokens_per_s": batch.num_tokens / seconds, "max_rss_mb": _max_rss_mb()}


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _run_isolated(*args) -> dict:
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(measure, args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            spec = MODELS[name]
            model_dir = spec["path"] or str(_llama_4m(Path(tmp) / name))
            r: dict = {}
            for precision in ("fp32", "bf16", "fp16"):
                r[f"rollout_{precision}"] = _run_isolated("rollout", model_dir, spec, precision, args.repeats)
                r[f"train_{precision}"] = _run_isolated("train", model_dir, spec, precision, args.repeats)
            for precision in ("fp32", "bf16"):
                r[f"hf_generate_{precision}"] = _run_isolated("hf_generate", model_dir, spec, precision, args.repeats)
            results["models"][name] = r
            rows = spec["prompts"] * spec["group"]
            print(f"\n## {name}: {rows} sequences ({spec['prompts']} prompts x {spec['group']}), "
                  f"{spec['new_tokens']} new tokens, median of {args.repeats}")
            print("| measurement | precision | seconds | tokens/s | max RSS MB |")
            print("|---|---|---|---|---|")
            for key, v in r.items():
                kind, precision = key.rsplit("_", 1)
                print(f"| {kind} | {precision} | {v['seconds']:.3f} | {v['tokens_per_s']:.0f} | {v['max_rss_mb']:.0f} |")
            for precision in ("fp32", "bf16"):
                ratio = r[f"rollout_{precision}"]["tokens_per_s"] / r[f"hf_generate_{precision}"]["tokens_per_s"]
                print(f"rollout speed vs HF generate ({precision}): {ratio:.2f}x")
            for kind in ("rollout", "train"):
                ratio = r[f"{kind}_fp16"]["seconds"] / r[f"{kind}_bf16"]["seconds"]
                print(f"{kind} cost fp16 / bf16: {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
