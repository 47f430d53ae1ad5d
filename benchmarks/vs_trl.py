"""Parity vs Hugging Face TRL's GRPOTrainer on the same work (results: docs/benchmarks.md).

Same model directory, tokenizer, prompts, group size, max new tokens, learning
rate, precision and loss (PPO-clip GRPO, one update per rollout, group-normalised
advantages, per-token sums divided by the max completion length: TRL's `dr_grpo`
and Parity's `grpo` + `seq_mean_token_sum_norm`). Every run is a fresh process
(so max RSS is its own); the sides alternate, TRL then Parity, `--rounds` times.

Step time (default): median step time over the steps after the warm-up, pooled
over the rounds, for each configuration and precision. Beside it, the matmul
floor: one Parity step's linear-layer matmuls (projections, MLP, LM head; the
trainer's with their backward) replayed alone at their own shapes, and the
ceiling, TRL's step time over that floor: the speed-up Parity would reach if
nothing but those matmuls cost time.

Time to solve (`--solve`): the built-in model trained on its perfectible set at
`parity sanity` settings until the 5-step mean training accuracy reaches 95% or
the wall-time budget runs out; Parity in FP16, TRL in its fastest setting on this
CPU (BF16; TRL has no FP16 on CPU). Writes accuracy-against-wall-time curves.

    pip install -e '.[bench]'
    python benchmarks/vs_trl.py [--steps 12] [--warmup 2] [--rounds 2] [--json out.json]
        [--models builtin,llama-4.4M] [--precisions fp32,bf16] [--trl-checkpointing]
    python benchmarks/vs_trl.py --model DIR [--lora 8 [--lora-unmerged]] [...]   # a real model: chat prompts

With `--model DIR` (any Hugging Face directory Parity runs, e.g. SmolLM2-135M-Instruct as
docs/real-models.md converts it) the prompts are chat messages, which both sides put through the
model's chat template, and the reward is `task.name=number`'s: the number the model answers.
    python benchmarks/vs_trl.py --solve [--budget-s 300] [--json out.json] [--plot solve.png]
    python benchmarks/vs_trl.py --custom-task --models smollm2-shape --precisions fp32 [--threads N] [--shape 4,4,32]

`--custom-task` runs your-own-task's shape on both sides: the rows a `datasets.Dataset` holds (integer
answers), two batched reward functions (a correctness check and a torch judge model, weights 1 and
0.1), Parity through `parity.train` as a user calls it. `smollm2-shape` is SmolLM2-135M's shape (30
layers, hidden 576, vocabulary 49,152) with random weights. `--threads N` gives both sides N torch
threads; by default each side takes its own (TRL: torch's, one per core; Parity: the free cores).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from engines import isolated, make_llama_4m, matmul_job, save_random_model  # noqa: E402
from parity.commands.report import SMOOTHING, TARGET_ACCURACY, moving_average  # noqa: E402

CONFIGS = {
    # name: (model: "builtin" or "llama-4.4M", prompts per step, group size, max new tokens)
    "builtin (sanity settings)": ("builtin", 16, 8, 96),
    "llama-4.4M": ("llama-4.4M", 8, 8, 16),
    # SmolLM2-135M's shape (random weights, the built-in tokenizer): a trial's model without its download
    "smollm2-shape": ("smollm2-shape", 4, 4, 64),
}
MODEL_DIR_SHAPE = (4, 4, 64)  # --model DIR: prompts per step, group size, max new tokens
LR = 2e-4


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _eval_problems(n: int, chat: bool = False) -> list[dict]:
    """Arithmetic problems; `chat`: the word problems of `task.name=number`, as one user message each."""
    from parity.rl.problems import ArithmeticTask, NumberTask

    if chat:
        problems = NumberTask().problems(n, seed=0, split="eval")
        return [{"prompt": [{"role": "user", "content": p.prompt}], "answer": p.answer} for p in problems]
    return [{"prompt": p.prompt, "answer": p.answer} for p in ArithmeticTask().problems(n, seed=0, split="eval")]


def _perfectible_problems() -> list[dict]:
    from parity.commands.perfectible import PerfectibleConfig, build_or_load

    path, _, _ = build_or_load(PerfectibleConfig(seed=0))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _solved_at(accuracy: list[float]) -> int | None:
    """Index of the first step at the sanity test's bar (its moving-average accuracy)."""
    return next((i for i, a in enumerate(moving_average(accuracy)) if a >= TARGET_ACCURACY), None)


# ----------------------------------------------------------------------------- the two sides


@dataclass(frozen=True)
class Work:
    """What both sides run: the same model, data, batch shape, precision and budget."""

    model_dir: str
    problems: list[dict]
    prompts: int
    group: int
    new_tokens: int
    precision: str
    steps: int
    seed: int = 0
    trl_checkpointing: bool = False  # TRL only: recompute activations in the backward (its default)
    chat: bool = False  # prompts are chat messages, rewarded as task.name=number
    lora_rank: int = 0  # > 0: both sides train LoRA adapters of this rank on every projection (alpha 2 x rank)
    lora_merge: bool = True  # Parity: the rollout engine gets merged weights (true) or applies adapters unmerged
    custom: bool = False  # your own task: the rewards of `custom_rewards`, through `parity.train` and TRL alike
    threads: int = 0  # torch threads on both sides; 0: each side's own choice (Parity: the free cores)


def grpo_config(work, lr: float, **extra):
    """TRL's `GRPOConfig` for a benchmark's work (`prompts`, `group`, `new_tokens`, `steps`, `precision`,
    `seed`) at the settings Parity is compared at: PPO-clip GRPO with `dr_grpo`'s sums, group-scaled
    rewards, no KL, plain sampling, a constant learning rate, on the CPU."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        per_device_train_batch_size=work.prompts * work.group,
        num_generations=work.group,
        max_completion_length=work.new_tokens,
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_steps=work.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        loss_type="dr_grpo",
        scale_rewards="group",
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        disable_tqdm=True,
        bf16=work.precision == "bf16",
        seed=work.seed,
        **extra,
    )


def _threads(work: Work) -> None:
    import os

    import torch

    if work.threads:
        torch.set_num_threads(work.threads)
        os.environ["PARITY_THREADS"] = str(work.threads)  # Parity would take the free cores otherwise


def parity_run(work: Work, tmp: Path):
    from parity import config
    from parity.rl.loop import Run
    from parity.rl.train_config import TrainConfig

    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in work.problems))
    cfg = config.load(
        TrainConfig,
        None,
        [
            f"model={work.model_dir}",
            f"precision={work.precision}",
            "algorithm.name=grpo",
            "algorithm.advantage=grpo",
            "algorithm.aggregation=seq_mean_token_sum_norm",
            "algorithm.truncated=keep",  # TRL keeps a truncated completion's reward (mask_truncated_completions=False)
            f"task.name={'number' if work.chat else 'builtin'}",
            f"trainer.lr={LR}",
            f"prompts_per_step={work.prompts}",
            f"rollout.group_size={work.group}",
            f"rollout.max_new_tokens={work.new_tokens}",
            f"steps={work.steps}",
            f"task.data={data}",
            f"run_dir={tmp / 'run'}",
            "checkpoint_every=-1",
            "tensorboard=false",
            "log.completions=0",
            f"trainer.micro_batch_tokens={work.prompts * work.group * (work.new_tokens + 64)}",  # one micro-batch
            f"seed={work.seed}",
            *([f"lora.rank={work.lora_rank}", f"lora.merge={str(work.lora_merge).lower()}"] if work.lora_rank else []),
        ],
    )
    return Run.create(cfg, progress=False)


# ----------------------------------------------------------------------------- your own task
# A correctness reward on the data's integer answers and a judge model's score, both batched as TRL
# writes them, weighted 1 and 0.1: the same functions go to `parity.train` and to TRL's GRPOTrainer.
_JUDGE = None


def custom_correct(prompts, completions, answer, **columns):
    return [1.0 if str(a) in str(c) else 0.0 for c, a in zip(completions, answer)]


def custom_judged(prompts, completions, **columns):
    """A small transformer encoder over each completion's bytes, built once per process (seeded)."""
    import torch

    global _JUDGE
    if _JUDGE is None:
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(128, 4, 512, batch_first=True)
        _JUDGE = (torch.nn.Embedding(256, 128), torch.nn.TransformerEncoder(layer, 2), torch.nn.Linear(128, 1))
    embed, encoder, head = _JUDGE
    ids = torch.zeros(len(completions), 96, dtype=torch.long)
    for i, c in enumerate(completions):
        raw = list(str(c).encode()[:96])
        ids[i, : len(raw)] = torch.tensor(raw, dtype=torch.long)
    with torch.no_grad():
        return head(encoder(embed(ids)).mean(1)).squeeze(-1).tolist()


CUSTOM_REWARDS = [(custom_correct, 1.0), (custom_judged, 0.1)]


def parity_custom(work: Work, tmp: Path, **extra):
    """The custom task through `parity.train`, on the keys `parity_run` sets for the built-in one (and `extra`)."""
    import parity

    rows = [{"prompt": p["prompt"], "answer": int(p["answer"])} for p in work.problems]
    rewards = [parity.Reward(fn, weight=w) for fn, w in CUSTOM_REWARDS]
    keys = dict(
        precision=work.precision,
        algorithm__name="grpo",
        algorithm__advantage="grpo",
        algorithm__aggregation="seq_mean_token_sum_norm",
        algorithm__truncated="keep",
        trainer__lr=LR,
        prompts_per_step=work.prompts,
        rollout__group_size=work.group,
        rollout__max_new_tokens=work.new_tokens,
        steps=work.steps,
        checkpoint_every=-1,
        tensorboard=False,
        eval__every=-1,
        log__completions=0,
        trainer__micro_batch_tokens=work.prompts * work.group * (work.new_tokens + 64),
        seed=work.seed,
    )
    return parity.train(work.model_dir, rows, rewards, run_dir=tmp / "run", progress=False, **keys, **extra)


def trl_trainer(work: Work, callbacks: list, on_accuracy=None):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from parity.rl.builtin_rewards import number_reward
    from parity.rl.problems import ArithmeticTask, Problem

    task = ArithmeticTask()

    def reward(prompts, completions, answer, **_):
        if work.chat:  # conversational: a completion is a list with the assistant's message
            texts = [c[-1]["content"] for c in completions]
            scores = [number_reward(Problem(str(p), a), t, 0) for p, t, a in zip(prompts, texts, answer)]
        else:
            scores = [task.reward(Problem(p, a), c) for p, c, a in zip(prompts, completions, answer)]
        if on_accuracy is not None:
            on_accuracy(sum(s >= 1.0 for s in scores) / len(scores))
        return scores

    args = grpo_config(work, LR, gradient_checkpointing=work.trl_checkpointing)
    peft_config = None
    if work.lora_rank:
        from peft import LoraConfig

        from parity.engines.lora import TARGETS

        peft_config = LoraConfig(
            r=work.lora_rank, lora_alpha=2 * work.lora_rank, target_modules=list(TARGETS), task_type="CAUSAL_LM"
        )
    if work.custom:
        args.reward_weights = [weight for _, weight in CUSTOM_REWARDS]
    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(work.model_dir, dtype=torch.float32),
        peft_config=peft_config,
        reward_funcs=[fn for fn, _ in CUSTOM_REWARDS] if work.custom else reward,
        args=args,
        train_dataset=Dataset.from_list(work.problems),
        processing_class=AutoTokenizer.from_pretrained(work.model_dir),
        callbacks=callbacks,
    )


# ----------------------------------------------------------------------------- step time


def parity_steps(work: Work, warmup: int) -> dict:
    _threads(work)
    with tempfile.TemporaryDirectory() as tmp:
        if work.custom:  # as a user of the Python API runs it
            timed = parity_custom(work, Path(tmp)).history[warmup:]
        else:
            timed = parity_run(work, Path(tmp)).train()[warmup:]
    return {
        "step_s": [m["time/step"] for m in timed],
        "tokens_per_s": [m["perf/tokens_per_s"] for m in timed],
        "train_gflops": [m["perf/train_gflops"] for m in timed],
        "peak_mb": _max_rss_mb(),
    }


def parity_matmul_floor(work: Work, warmup: int, repeats: int = 7) -> dict:
    """Seconds that one Parity step's linear-layer matmuls take on their own.

    Every linear layer of a real step (`kernels.ops.linear`, after `warmup` steps) is recorded with its shapes,
    then each is run alone on random inputs of those shapes through `ops.linear` as the step called it (a weight
    reordered for oneDNN where the call had one), so by the kernels the step used: its forward, plus for the
    trainer's the backward matmuls it needs (the input gradient, and the weight gradient
    unless the weight is frozen, as a LoRA base is). The sum is what
    the projections, MLP and LM head cost on this CPU at the shapes the step uses, with
    nothing else running (hot caches: an optimistic floor). Attention, norms, sampling
    and the optimizer are not in it.
    """
    import torch

    from parity.engines.kernels import ops

    calls: list[tuple] = []
    linear = ops.linear

    def recorded(x, weight, *args, fast=None, **kwargs):  # every linear layer of both engines comes here
        trainer = torch.is_grad_enabled()  # the trainer's run with grad enabled; the rollout's without
        calls.append(
            (
                tuple(x.shape),
                tuple(weight.shape),
                x.dtype,
                trainer,
                trainer and x.requires_grad,
                trainer and weight.requires_grad,
                fast is not None,  # on a weight reordered for oneDNN (`Numerics.fast_matrix`)
            )
        )
        return linear(x, weight, *args, fast=fast, **kwargs)

    def seconds(fn, *args) -> float:
        fn(*args)  # first call: BF16 kernels are built per shape
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def replay(x, w, fast, grad_out, wrt):  # the forward, and the backward's products for `wrt` (LoRA: no weight)
        with torch.set_grad_enabled(bool(wrt)):
            out = linear(x, w, fast=fast)
            if wrt:
                torch.autograd.grad(out, wrt, grad_out)

    with tempfile.TemporaryDirectory() as tmp:
        run = parity_run(work, Path(tmp))
        for _ in range(warmup):
            run.step()
        ops.linear = recorded
        try:
            run.step()
        finally:
            ops.linear = linear
    cost: dict[tuple, float] = {}
    floor = {"rollout_s": 0.0, "trainer_s": 0.0}
    for call in calls:
        x_shape, w_shape, dtype, trainer, input_grad, weight_grad, fast = call
        if call not in cost:
            x = torch.randn(x_shape, dtype=dtype).reshape(-1, x_shape[-1]).requires_grad_(input_grad)
            w = torch.randn(w_shape, dtype=dtype).requires_grad_(weight_grad)
            g = torch.randn(x.shape[0], w_shape[0], dtype=dtype)
            wrt = [t for t in (x, w) if t.requires_grad]
            cost[call] = seconds(replay, x, w, ops.numerics().fast_matrix(w) if fast else None, g, wrt)
        floor["trainer_s" if trainer else "rollout_s"] += cost[call]
    return floor


def trl_steps(work: Work, warmup: int) -> dict:
    from transformers import TrainerCallback

    _threads(work)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    timer = StepTimer()
    trainer = trl_trainer(work, [timer])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h][warmup:]
    timed = timer.times[warmup:]
    return {
        "step_s": timed,
        "tokens_per_s": [h["completions/mean_length"] * work.prompts * work.group / s for h, s in zip(logs, timed)],
        "peak_mb": _max_rss_mb(),
    }


def step_table(args) -> dict:
    peak = isolated(matmul_job, 30)
    print(f"matmul GFLOP/s at [1408x256] @ [256x1024]: fp32 {peak['fp32']:.0f}, bf16 {peak['bf16_native']:.0f}")
    print(
        "| config | precision | Parity step s | TRL step s | speed-up | Parity tokens/s | TRL tokens/s | "
        "Parity trainer GFLOP/s | matmul floor s | ceiling | Parity peak MB | TRL peak MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    out = {"matmul_gflops": {"fp32": peak["fp32"], "bf16": peak["bf16_native"]}, "configs": []}
    configs = CONFIGS
    if args.model is not None:
        configs = {f"{args.model.name} (--model)": (str(args.model), *MODEL_DIR_SHAPE)}
    if args.shape is not None:  # every configuration at this batch
        configs = {f"{name.split(' (')[0]}, {'x'.join(map(str, args.shape))}": (model, *args.shape)
                   for name, (model, *_) in configs.items()}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name, (model, prompts, group, new_tokens) in configs.items():
            if args.model is None and model not in args.models.split(","):
                continue
            model_dir = str(_model_dir(model, Path(tmp)))
            for precision in args.precisions.split(","):
                steps = args.steps + args.warmup
                work = Work(
                    model_dir,
                    _eval_problems(256, chat=args.model is not None),
                    prompts,
                    group,
                    new_tokens,
                    precision,
                    steps,
                    trl_checkpointing=args.trl_checkpointing,
                    chat=args.model is not None,
                    lora_rank=args.lora,
                    lora_merge=not args.lora_unmerged,
                    custom=args.custom_task,
                    threads=args.threads,
                )
                rounds = [
                    (isolated(trl_steps, work, args.warmup), isolated(parity_steps, work, args.warmup))
                    for _ in range(args.rounds)
                ]
                floor = isolated(parity_matmul_floor, work, args.warmup) if not args.no_floor else None
                trl = {k: [x for r, _ in rounds for x in r[k]] for k in ("step_s", "tokens_per_s")}
                ours = {k: [x for _, r in rounds for x in r[k]] for k in ("step_s", "tokens_per_s", "train_gflops")}
                row = {
                    "name": name,
                    "precision": precision,
                    "parity_step_s": statistics.median(ours["step_s"]),
                    "trl_step_s": statistics.median(trl["step_s"]),
                    "parity_peak_mb": max(r["peak_mb"] for _, r in rounds),
                    "trl_peak_mb": max(r["peak_mb"] for r, _ in rounds),
                    "parity_tokens_per_s": statistics.median(ours["tokens_per_s"]),
                    "trl_tokens_per_s": statistics.median(trl["tokens_per_s"]),
                    "parity_train_gflops": statistics.median(ours["train_gflops"]),
                    "parity_step_s_all": ours["step_s"],
                    "trl_step_s_all": trl["step_s"],
                    "threads": args.threads,
                    "custom_task": args.custom_task,
                    "matmul_floor_s": floor["rollout_s"] + floor["trainer_s"] if floor else float("nan"),
                    "matmul_floor_rollout_s": floor["rollout_s"] if floor else float("nan"),
                    "matmul_floor_trainer_s": floor["trainer_s"] if floor else float("nan"),
                }
                row["speedup"] = row["trl_step_s"] / row["parity_step_s"]
                row["ceiling_speedup"] = row["trl_step_s"] / row["matmul_floor_s"]
                out["configs"].append(row)
                print(
                    f"| {name} | {precision} | {row['parity_step_s']:.3f} | {row['trl_step_s']:.3f} | "
                    f"{row['speedup']:.2f}x | {row['parity_tokens_per_s']:.0f} | {row['trl_tokens_per_s']:.0f} | "
                    f"{row['parity_train_gflops']:.0f} | {row['matmul_floor_s']:.3f} | {row['ceiling_speedup']:.2f}x | "
                    f"{row['parity_peak_mb']:.0f} | {row['trl_peak_mb']:.0f} |",
                    flush=True,
                )
    return out


def _model_dir(model: str, tmp: Path) -> Path:
    from parity.engines.models.io import resolve_model_dir

    if model == "llama-4.4M":
        return make_llama_4m(tmp / model)
    if model == "smollm2-shape":
        return save_random_model(
            "Llama",
            tmp / model,
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
    return resolve_model_dir(model)


# ----------------------------------------------------------------------------- time to solve


def solve_work(precision: str, max_steps: int, seed: int) -> Work:
    """The built-in model on its perfectible set, at `parity sanity` settings."""
    from parity.engines.models.io import resolve_model_dir

    _, prompts, group, new_tokens = CONFIGS["builtin (sanity settings)"]
    problems = _perfectible_problems()
    return Work(str(resolve_model_dir("builtin")), problems, prompts, group, new_tokens, precision, max_steps, seed)


def parity_solve(work: Work, budget_s: float) -> dict:
    curve, accuracy = [], []
    with tempfile.TemporaryDirectory() as tmp:
        run = parity_run(work, Path(tmp))
        start = time.perf_counter()
        while run.step_count < work.steps:
            accuracy.append(run.step()["reward/accuracy"])
            curve.append((time.perf_counter() - start, accuracy[-1]))
            if _solved_at(accuracy) is not None or curve[-1][0] > budget_s:
                break
    return {"curve": curve}


def trl_solve(work: Work, budget_s: float) -> dict:
    from transformers import TrainerCallback

    curve, accuracy = [], []
    clock = {"start": None}

    def on_accuracy(acc: float) -> None:
        accuracy.append(acc)

    class StopWhenSolved(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if clock["start"] is None:
                clock["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            curve.append((time.perf_counter() - clock["start"], accuracy[-1]))
            if _solved_at(accuracy) is not None or curve[-1][0] > budget_s:
                control.should_training_stop = True

    trl_trainer(work, [StopWhenSolved()], on_accuracy).train()
    return {"curve": curve}


def solve_table(args) -> dict:
    sides = {"Parity fp16": (parity_solve, "fp16"), "TRL bf16": (trl_solve, "bf16")}
    out = {"budget_s": args.budget_s, "seed": args.seed, "runs": []}
    print("| run | steps | 95% reached at step | seconds to 95% | accuracy at the end | seconds run |")
    print("|---|---|---|---|---|---|")
    for name, (fn, precision) in sides.items():
        curve = isolated(fn, solve_work(precision, args.max_steps, args.seed), args.budget_s)["curve"]
        accuracy = [a for _, a in curve]
        hit = _solved_at(accuracy)
        row = {
            "name": name,
            "precision": precision,
            "steps": len(curve),
            "steps_to_95": None if hit is None else hit + 1,
            "seconds_to_95": None if hit is None else curve[hit][0],
            "final_accuracy": moving_average(accuracy)[-1],
            "seconds": curve[-1][0],
            "curve": curve,
        }
        out["runs"].append(row)
        to95 = "not reached" if hit is None else str(hit + 1)
        sec = "—" if hit is None else f"{curve[hit][0]:.0f}"
        print(
            f"| {name} | {len(curve)} | {to95} | {sec} | {row['final_accuracy']:.3f} | {row['seconds']:.0f} |",
            flush=True,
        )
    if args.plot:
        plot_solve(out["runs"], args.plot)
    return out


def plot_solve(runs: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt  # parity.commands.report has chosen the Agg backend

    fig, ax = plt.subplots(figsize=(7, 4.3), layout="constrained")
    for r in runs:
        seconds = [s for s, _ in r["curve"]]
        ax.plot(seconds, moving_average([a for _, a in r["curve"]]), label=r["name"])
    ax.axhline(TARGET_ACCURACY, color="grey", lw=0.7, ls=":")
    ax.set(
        xlabel="wall seconds",
        ylabel=f"training accuracy ({SMOOTHING}-step mean)",
        title="Built-in perfectible set: accuracy against wall time",
    )
    ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per run (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="TRL/Parity run pairs per configuration")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--models", default="builtin,llama-4.4M", help="which configurations (by model)")
    parser.add_argument(
        "--trl-checkpointing",
        action="store_true",
        help="TRL with gradient checkpointing, its GRPOConfig default (more work than Parity does)",
    )
    parser.add_argument("--solve", action="store_true", help="time to 95%% training accuracy instead")
    parser.add_argument("--budget-s", type=float, default=300.0, help="--solve: wall-time budget per side")
    parser.add_argument("--max-steps", type=int, default=200, help="--solve: step budget per side")
    parser.add_argument("--seed", type=int, default=0, help="--solve: seed of both sides")
    parser.add_argument("--plot", type=Path, help="--solve: write the accuracy-vs-time plot here")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--model", type=Path, help="a model directory to compare on instead of --models (chat prompts)")
    parser.add_argument("--lora", type=int, default=0, help="LoRA of this rank on both sides (TRL through PEFT)")
    parser.add_argument("--lora-unmerged", action="store_true", help="--lora: Parity with lora.merge=false")
    parser.add_argument(
        "--custom-task",
        action="store_true",
        help="your own task on both sides: a dataset with integer answers and two batched rewards (a correctness "
        "check and a torch judge model, weights 1 and 0.1) through parity.train and TRL's GRPOTrainer",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads on both sides (0: each side's default)")
    parser.add_argument(
        "--shape",
        type=lambda text: tuple(int(x) for x in text.split(",")),
        help="PROMPTS,GROUP,MAX_NEW_TOKENS: every configuration at this batch (e.g. 4,4,32)",
    )
    parser.add_argument("--no-floor", action="store_true", help="skip the matmul floor (a third run per config)")
    args = parser.parse_args()
    if args.model is not None and args.solve:
        parser.error("--model: time to solve runs on the built-in model only")
    known = {model for model, *_ in CONFIGS.values()}
    if unknown := set(args.models.split(",")) - known:
        parser.error(f"--models: unknown {', '.join(sorted(unknown))}; expected some of {', '.join(sorted(known))}")
    out = solve_table(args) if args.solve else step_table(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
