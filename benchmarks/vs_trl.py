"""Parity vs Hugging Face TRL's GRPOTrainer: step time on the same work (results: docs/benchmarks.md).

Same model directory, tokenizer, prompts, group size, max new tokens, learning
rate, precision and loss (PPO-clip GRPO, one update per rollout, group-normalised
advantages, per-token sums divided by the max completion length: TRL's `dr_grpo`
and Parity's `grpo` + `seq_mean_token_sum_norm`). Each side runs in its own fresh
process (so max RSS is its own), back to back; the median step time is taken
over the steps after the warm-up.

    pip install -e '.[bench]'
    python benchmarks/vs_trl.py [--steps 7] [--warmup 2] [--json out.json]
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

CONFIGS = {
    # name: (model: "builtin" or "llama-4.4M", prompts per step, group size, max new tokens)
    "builtin (sanity settings)": ("builtin", 16, 8, 96),
    "llama-4.4M": ("llama-4.4M", 8, 8, 16),
}
LR = 2e-4


def _problems(n: int):
    from parity.tasks import ArithmeticTask

    return ArithmeticTask().problems(n, seed=0, split="eval")


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_parity(model_dir: str, prompts: int, group: int, new_tokens: int, precision: str, steps: int, warmup: int):
    from parity import config
    from parity.loop import Run, TrainConfig

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.jsonl"
        data.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in _problems(256)))
        cfg = config.load(
            TrainConfig,
            None,
            [
                f"model={model_dir}",
                f"precision={precision}",
                "algorithm.name=grpo",
                "algorithm.advantage=grpo",
                "algorithm.aggregation=seq_mean_token_sum_norm",
                f"trainer.lr={LR}",
                f"prompts_per_step={prompts}",
                f"rollout.group_size={group}",
                f"rollout.max_new_tokens={new_tokens}",
                f"steps={steps + warmup}",
                f"task.data={data}",
                f"run_dir={Path(tmp) / 'run'}",
                "checkpoint_every=-1",
                "tensorboard=false",
                f"trainer.micro_batch_size={prompts * group}",
            ],
        )
        history = Run.create(cfg, progress=False).train()
    timed = history[warmup:]
    return {
        "step_s": statistics.median(m["time/step"] for m in timed),
        "tokens_per_s": statistics.median(m["perf/tokens_per_s"] for m in timed),
        "peak_mb": _max_rss_mb(),
    }


def run_trl(model_dir: str, prompts: int, group: int, new_tokens: int, precision: str, steps: int, warmup: int):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from parity.tasks import ArithmeticTask, Problem

    task = ArithmeticTask()

    def reward(prompts, completions, answer, **_):
        return [task.reward(Problem(p, a), c) for p, c, a in zip(prompts, completions, answer)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    timer = StepTimer()
    dataset = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in _problems(256)])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        per_device_train_batch_size=prompts * group,
        num_generations=group,
        max_completion_length=new_tokens,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_steps=steps + warmup,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        gradient_checkpointing=False,
        loss_type="dr_grpo",
        scale_rewards="group",
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        disable_tqdm=True,
        bf16=precision == "bf16",
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[timer],
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h][warmup:]
    timed = timer.times[warmup:]
    tokens = [h["completions/mean_length"] * prompts * group for h in logs]
    return {
        "step_s": statistics.median(timed),
        "tokens_per_s": statistics.median(n / s for n, s in zip(tokens, timed)),
        "peak_mb": _max_rss_mb(),
    }


def isolated(fn, *args):
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=7, help="timed steps per side (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from engines import make_llama_4m
    from parity.models import resolve_model_dir

    out = {"configs": []}
    print(
        "| config | precision | Parity step s | TRL step s | speed-up | Parity tokens/s | TRL tokens/s | "
        "Parity peak MB | TRL peak MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (model, prompts, group, new_tokens) in CONFIGS.items():
            model_dir = str(resolve_model_dir("builtin") if model == "builtin" else make_llama_4m(Path(tmp) / model))
            for precision in args.precisions.split(","):
                work = (model_dir, prompts, group, new_tokens, precision, args.steps, args.warmup)
                trl = isolated(run_trl, *work)
                ours = isolated(run_parity, *work)
                row = {
                    "name": name,
                    "precision": precision,
                    "parity_step_s": ours["step_s"],
                    "trl_step_s": trl["step_s"],
                    "speedup": trl["step_s"] / ours["step_s"],
                    "parity_peak_mb": ours["peak_mb"],
                    "trl_peak_mb": trl["peak_mb"],
                    "parity_tokens_per_s": ours["tokens_per_s"],
                    "trl_tokens_per_s": trl["tokens_per_s"],
                }
                out["configs"].append(row)
                print(
                    f"| {name} | {precision} | {ours['step_s']:.3f} | {trl['step_s']:.3f} | {row['speedup']:.2f}x | "
                    f"{ours['tokens_per_s']:.0f} | {trl['tokens_per_s']:.0f} | {ours['peak_mb']:.0f} | "
                    f"{trl['peak_mb']:.0f} |",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
