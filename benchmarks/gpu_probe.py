"""The engines on a GPU, every figure in one call (issue 46): decode, rollout, exact mode and the trainer,
today's code re-measured beside the previous code on the same card.

    python benchmarks/gpu_probe.py --out DIR [--baseline-src OLD/src] [--tests] [--small] [--device cuda]

Sections, each in a process of its own with a deadline (a section that fails or runs out of time is
recorded as such and the others still run):

- `tests`: the CUDA tests (`pytest -m cuda`) and the whole of tests/unit/test_invariant.py on the card;
- `device`: the card, a device-to-device copy's bandwidth (bytes read + written) and the dense matmul rate
  per precision: the measured ceilings, which the summary reads every figure against second, after the
  card's published specification (`CARDS`);
- `engine`: on a Qwen2.5-0.5B-shaped model (random weights): ms per decode step at batch 128, read off the
  engine's own state reads (every CHECK_EVERY steps) once the step is captured, against the floor
  (weights + the KV cache rows read at that step) ÷ bandwidth; with CUDA graphs (BF16, BF16 exact, FP16)
  and without (BF16); rollout tokens/s at 16 prompts × 8 samples × 256 tokens (EOS off); exact mode's μ
  against the trainer's π_old on the same tokens with top-k/top-p (every token must agree);
- `train`: the trainer's step (forward, backward, optimizer) on a packed batch of 8k and 32k tokens: tokens/s
  and model FLOP utilisation in BF16, BF16 exact and FP16;
- `matmul`: exact mode's matmul (`invariant.TILES` and other tile shapes) against cuBLAS at the model's
  projection shapes, 128 and 16,384 rows, and whether other tiles give the same bits; cuBLASLt beside cuBLAS;
- `learners`: the learner's FSDP2 path (`distributed.actors.Learner`, world size 1: NCCL on a card, gloo on
  the CPU; decoder layers gathered in the trainer precision by `MixedPrecisionPolicy`) against one process's
  trainer, LEARNER_STEPS GRPO steps on the same batches, in FP32, BF16, FP16 and BF16 exact: exact mode must
  keep every weight bit for bit, and its learner stops before stepping if its first pass is not π_old's bits;
- with `--baseline-src`, the `engine` and `train` figures again from that source tree (the code before this
  change), in the same call.

Writes DIR/probe.json after every section and DIR/summary.md at the end (also printed); the model and
the sections' own files go to a temporary folder. `--small` runs
everything at toy sizes on any device (CI runs it on the CPU).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# batch rows, prompt tokens, new tokens for the decode figure; rollout (prompts, samples, tokens); the trainer's
# step sizes (prompts, samples, prompt tokens, response tokens) of ~8k and ~32k tokens.
SIZES = {
    "full": dict(
        decode=(128, 32, 512),
        rollout=(16, 8, 256),
        exact=[(16, 16, 64), (2, 8, 512)],
        train={"8k": (16, 8, 32, 60), "32k": (16, 8, 32, 252)},
        matmul_rows=(128, 16384),
        learners=(16, 8, 32, 128),
    ),
    "small": dict(
        decode=(16, 8, 24),
        rollout=(2, 4, 16),
        exact=[(2, 4, 16)],
        train={"8k": (2, 4, 8, 12)},
        matmul_rows=(16,),
        learners=(2, 4, 8, 12),
    ),
}
# The cards' published specifications (NVIDIA's data sheets): memory bandwidth (GB/s) and dense rates (TFLOP/s,
# no sparsity) per precision: BF16 and FP16 on the tensor cores, FP32 without them (Parity turns TF32 off).
# Every decode floor and MFU is read against these first, as the field quotes them, and against what the
# `device` section measured on the card second. Matched by the device name's words, the longer names first.
CARDS = {
    "H200 NVL": dict(bandwidth_gb_s=4800, tflops={"bf16": 835, "fp16": 835, "fp32": 60}),
    "H200": dict(bandwidth_gb_s=4800, tflops={"bf16": 989, "fp16": 989, "fp32": 67}),
    "H100 NVL": dict(bandwidth_gb_s=3900, tflops={"bf16": 835, "fp16": 835, "fp32": 60}),
    "H100 PCIe": dict(bandwidth_gb_s=2000, tflops={"bf16": 756, "fp16": 756, "fp32": 51}),
    "H100": dict(bandwidth_gb_s=3350, tflops={"bf16": 989, "fp16": 989, "fp32": 67}),  # SXM5 ("H100 80GB HBM3")
    "A100 80GB PCIe": dict(bandwidth_gb_s=1935, tflops={"bf16": 312, "fp16": 312, "fp32": 19.5}),
    "A100-SXM4-80GB": dict(bandwidth_gb_s=2039, tflops={"bf16": 312, "fp16": 312, "fp32": 19.5}),
    "A100": dict(bandwidth_gb_s=1555, tflops={"bf16": 312, "fp16": 312, "fp32": 19.5}),  # 40 GB
}


def card_spec(name: str | None) -> tuple[str, dict] | None:
    """The specification of a device named `name` (`torch.cuda.get_device_properties(0).name`), or None."""
    words = (name or "").replace("NVIDIA ", "")
    for card, spec in CARDS.items():
        if all(part in words for part in card.split()):
            return card, spec
    return None


DEADLINES = {"tests": 150, "device": 60, "engine": 150, "train": 150, "matmul": 90, "learners": 120, "baseline": 150}
LEARNER_STEPS = 4
EXACT_SAMPLING = dict(temperature=0.8, top_k=50, top_p=0.9)
ROUNDS = 7  # train steps per arm, the arms in turn (5 left the 8k ratios 10% apart run to run on an H100)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=gen).tolist()


# ----------------------------------------------------------------------------- sections


def section_device(args) -> dict:
    from gpu import bandwidth, peak_tflops

    out = {"bandwidth_gb_s": bandwidth(args.device) / 1e9, "peak_tflops": peak_tflops(args.device)}
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        out.update(card=props.name, sms=props.multi_processor_count, memory_gb=props.total_memory / 1e9)
    out["torch"] = torch.__version__
    return out


def load_model(model_dir: str):
    """The model's weights on the CPU (the caller places it and gives it its numerics)."""
    from parity.engines import kernels

    try:
        from parity.engines.models.io import load_model
    except ImportError:  # a baseline from before the models package (issue 45)
        from parity.engines.models import load_model
    if "numerics" not in inspect.signature(load_model).parameters:  # a baseline from before the model's numerics
        return load_model(model_dir)
    return load_model(model_dir, kernels.numerics())


def engine_for(model_dir: str, precision: str, device: str, exact: bool, graphs: bool = True):
    from parity.engines import kernels
    from parity.engines.rollout import RolloutEngine

    model = load_model(model_dir).to(device)
    numerics = kernels.numerics(device, exact=exact)
    model.numerics = numerics
    engine = RolloutEngine(model.config, precision, (-1,), 0, numerics)  # EOS off: every row decodes to the end
    if hasattr(engine, "use_graphs"):
        engine.use_graphs = graphs
    # the previous engine (the baseline) loads through `load_weights`
    (getattr(engine, "load_weights", None) or engine.weights.load)(model.state_dict(), version=0)
    return model, engine


def decode_step_ms(engine, device: str, rows: int, prompt: int, new_tokens: int) -> dict:
    """Per-step time from the engine's own state reads (a host sync every CHECK_EVERY steps): the median over the
    second half of the call, after warm-up, capture and the first reads."""
    from parity.engines.sampling import SamplingParams

    vocab = engine.config.vocab_size
    prompts = random_prompts(rows, prompt, vocab, seed=1)
    sampling = SamplingParams(max_new_tokens=new_tokens)
    # Compiles the kernels; the timed call captures its step at its start, before the steps measured.
    engine.generate(prompts, 1, SamplingParams(max_new_tokens=32), seed=0)
    stamps: list[float] = []

    def stamp(done: torch.Tensor) -> bool:
        stamps.append(time.perf_counter())
        return False

    sync(device)
    engine.generate(prompts, 1, sampling, seed=0, stop=stamp)
    every = getattr(engine, "check_every", 16)
    gaps = [(b - a) / every for a, b in zip(stamps, stamps[1:])]
    measured = gaps[len(gaps) // 2 :]
    # The reads measured span these positions: the mean one's KV rows are what a step reads on average.
    first = prompt + every * (len(gaps) - len(measured) + 1)
    mean_position = first + every * len(measured) / 2
    cfg = engine.config
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * rows * mean_position
    named = getattr(engine, "named_weights", None) or engine.weights.named_weights  # the baseline's, or ours
    weight_bytes = sum(t.numel() * t.element_size() for t in named().values())
    return {
        "rows": rows,
        "step_ms": statistics.median(measured) * 1000,
        "mean_position": mean_position,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "graphs": bool(getattr(engine, "use_graphs", False)) and getattr(engine, "graphs_off_reason", None) is None,
        "graphs_off_reason": getattr(engine, "graphs_off_reason", None),
    }


def kernel_profile(engine, rows: int, prompt: int, steps: int = 32) -> list[dict]:
    """Where a decode step's GPU time goes, run eagerly (the graph replays the same kernels): the kernels
    with the most device time over `steps` steps (and the prefill), per step."""
    from torch.profiler import ProfilerActivity, profile

    from parity.engines.sampling import SamplingParams

    prompts = random_prompts(rows, prompt, engine.config.vocab_size, seed=1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, 1, SamplingParams(max_new_tokens=steps), seed=0)
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:25]
    return [
        {"kernel": e.key[:120], "us_per_step": e.device_time_total / steps, "calls_per_step": e.count / steps}
        for e in events
    ]


def rollout_tokens_per_s(engine, device: str, prompts: int, group: int, new_tokens: int) -> dict:
    from parity.engines.sampling import SamplingParams

    ids = random_prompts(prompts, 32, engine.config.vocab_size, seed=2)
    sampling = SamplingParams(max_new_tokens=new_tokens)
    engine.generate(ids, group, sampling, seed=0)  # warm: kernels, workspace, graphs
    sync(device)
    start = time.perf_counter()
    batch = engine.generate(ids, group, sampling, seed=1)
    sync(device)
    seconds = time.perf_counter() - start
    return {"tokens": int(batch.response_mask.sum()), "seconds": seconds, "tokens_per_s": batch.num_tokens / seconds}


def exact_agreement(model, engine, precision: str, shapes, device: str) -> list[dict]:
    """μ against the trainer's π_old on the tokens the engine sampled (top-k/top-p): every token must agree."""
    from parity.engines import precision as prec
    from parity.engines.sampling import SamplingParams
    from parity.engines.trainer import logprobs_of_rows

    rows = []
    for prompts, group, new_tokens in shapes:
        ids = random_prompts(prompts, 24, engine.config.vocab_size, seed=prompts + new_tokens)
        sampling = SamplingParams(max_new_tokens=new_tokens, **EXACT_SAMPLING)
        batch = engine.generate(ids, group, sampling, seed=3)
        parts = []
        with torch.no_grad():
            for chunk in torch.arange(len(batch.prompt_ids)).split(32):
                parts.append(logprobs_of_rows(model, batch, chunk, prec.to_dtype(precision))[1])
        mask = batch.response_mask
        pi, mu = torch.cat(parts)[mask], batch.rollout_logprobs[mask]
        rows.append(
            {"rows": prompts * group, "new_tokens": new_tokens, "tokens": int(mask.sum()),
             "differing": int((pi != mu).sum()), "max_abs": float((pi - mu).abs().max())}
        )  # fmt: skip
    return rows


def section_engine(args) -> dict:
    size = SIZES[args.size]
    rows, prompt, new_tokens = size["decode"]
    out: dict = {"decode": {}, "rollout": {}}
    arms = [("bf16", False, True), ("bf16-exact", True, True), ("fp16", False, True), ("bf16-eager", False, False)]
    if args.baseline:  # the previous engine has neither graphs nor a switch for them
        arms = [("bf16", False, True), ("bf16-exact", True, True)]
    for name, exact, graphs in arms:
        precision = name.split("-")[0]
        model, engine = engine_for(args.model_dir, precision, args.device, exact, graphs)
        out["decode"][name] = decode_step_ms(engine, args.device, rows, prompt, new_tokens)
        print(f"decode {name}: {out['decode'][name]['step_ms']:.3f} ms/step", flush=True)
        if name in ("bf16", "bf16-exact"):
            out["rollout"][name] = rollout_tokens_per_s(engine, args.device, *size["rollout"])
            print(f"rollout {name}: {out['rollout'][name]['tokens_per_s']:.0f} tokens/s", flush=True)
        if name == "bf16-eager" and args.device == "cuda":
            out["decode_profile"] = kernel_profile(engine, rows, prompt)
        if name == "bf16-exact" and not args.baseline:
            out["exact_agreement"] = exact_agreement(model, engine, precision, size["exact"], args.device)
            print(f"exact agreement: {out['exact_agreement']}", flush=True)
        if name == "bf16-exact" and args.device == "cuda" and not args.baseline:
            engine.use_graphs = False  # the same engine's step eagerly, for the profiler
            engine._workspace = None
            out["decode_profile_exact"] = kernel_profile(engine, rows, prompt)
        del model, engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return out


def synthetic_batch(prompts: int, group: int, prompt_len: int, response_len: int, vocab: int, device: str):
    from parity.engines.batch import RolloutBatch
    from parity.engines.sampling import SamplingParams

    ids = random_prompts(prompts, prompt_len, vocab, seed=4)
    rows = prompts * group
    gen = torch.Generator().manual_seed(5)
    return RolloutBatch(
        prompt_ids=[ids[i // group] for i in range(rows)],
        response_ids=torch.randint(3, vocab, (rows, response_len), generator=gen).to(device),
        response_mask=torch.ones(rows, response_len, dtype=torch.bool, device=device),
        rollout_logprobs=torch.zeros(rows, response_len, device=device),
        support=None,
        truncated=torch.zeros(rows, dtype=torch.bool, device=device),
        group_index=torch.arange(prompts, device=device).repeat_interleave(group),
        weight_version=0,
        sampling=SamplingParams(),
    )


def train_step(trainer, batch, budget: int | None) -> None:
    """One update: every micro-batch forward and backward (a plain log-likelihood loss), then the optimizer."""
    import contextlib

    rows = torch.arange(len(batch.prompt_ids))
    if budget is None:  # the previous trainer: 64-row micro-batches, each weight cast per forward
        parts, scope = rows.split(64), contextlib.nullcontext()
    else:
        parts, scope = batch.micro_batches(rows, budget), trainer.model.casting_once()
    total = batch.num_tokens
    with scope:
        for part in parts:
            if hasattr(trainer, "batch_logprobs"):
                logp = trainer.batch_logprobs(batch, part)
            else:  # the trainer before issue 45's logprobs_of_rows
                logp = trainer.logprobs([batch.prompt_ids[i] for i in part.tolist()], batch.response_ids[part],
                                        batch.response_mask[part])  # fmt: skip
            trainer.backward(-(logp * batch.response_mask[part]).sum() / total)
    trainer.step()


def _varlen_on() -> bool:
    from parity.engines.kernels import varlen

    return varlen.ENABLED and varlen._varlen() is not None


def section_train(args) -> dict:
    from parity.engines import kernels
    from parity.engines.trainer import OptimConfig, Trainer

    budget = None
    if not args.baseline:
        from parity.rl.train_config import MICRO_BATCH_TOKENS

        budget = MICRO_BATCH_TOKENS[args.device]
    peak = json.loads(Path(args.json).read_text())["sections"]["device"]["result"]["peak_tflops"]
    out = {}
    sizes = SIZES[args.size]["train"]
    if args.baseline:  # the previous trainer at the size the issue measured it at
        sizes = dict(list(sizes.items())[:1])
    arms = ("bf16", "bf16-exact", "fp16")
    for size_name, shape in sizes.items():
        trainers, batches = {}, {}
        for arm in arms:
            model = load_model(args.model_dir).to(args.device)
            model.numerics = kernels.numerics(args.device, exact=arm.endswith("exact"))
            trainers[arm] = Trainer(model, arm.split("-")[0], OptimConfig(lr=1e-6))
            batches[arm] = synthetic_batch(*shape, model.config.vocab_size, args.device)
            try:
                train_step(trainers[arm], batches[arm], budget)  # warm
            except Exception as e:  # noqa: BLE001 - recorded, then measured without varlen attention
                if args.baseline:
                    raise
                from parity.engines.kernels import varlen

                out.setdefault("errors", []).append(f"{arm}@{size_name}: {type(e).__name__}: {e}"[:2000])
                varlen.ENABLED = False
                trainers[arm].optimizer.zero_grad(set_to_none=True)
                train_step(trainers[arm], batches[arm], budget)
        # The arms step in turn, the order rotating each round, so that the card's slow spells fall on all alike.
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        flops: dict[str, list[float]] = {arm: [] for arm in arms}
        for r in range(ROUNDS):
            for arm in arms[r % 3 :] + arms[: r % 3]:
                before = trainers[arm].matmul_flops
                sync(args.device)
                start = time.perf_counter()
                train_step(trainers[arm], batches[arm], budget)
                sync(args.device)
                times[arm].append(time.perf_counter() - start)
                flops[arm].append(trainers[arm].matmul_flops - before)
        for arm in arms:
            precision = arm.split("-")[0]
            seconds = statistics.median(times[arm])
            tflops = statistics.median(flops[arm]) / seconds / 1e12
            batch = batches[arm]
            tokens = sum(len(p) for p in batch.prompt_ids[:: shape[1]]) + batch.num_tokens
            out[f"{arm}@{size_name}"] = {
                "varlen_attention": not args.baseline and _varlen_on(),
                "tokens": tokens, "seconds": seconds, "all_seconds": times[arm], "tokens_per_s": tokens / seconds,
                "tflops": tflops, "mfu": tflops / peak[precision], "micro_batch_tokens": budget,
            }  # fmt: skip
            print(f"train {arm} at {size_name}: {seconds:.3f} s/step, MFU {tflops / peak[precision]:.1%}", flush=True)
        if not args.baseline and size_name == list(sizes)[-1]:
            # One trainer on the card, as in a run: the others' weights and optimizer states go first.
            trainer, batch = trainers.pop("bf16"), batches["bf16"]
            trainers.clear()
            if args.device == "cuda":
                torch.cuda.empty_cache()
                out[f"train_profile@{size_name}"] = train_profile(trainer, batch, budget)
            sweep = budget_sweep(trainer, batch, budget, 2 * budget, peak=peak["bf16"], device=args.device)
            out[f"bf16@{size_name}/micro_batch_tokens"] = sweep
            del trainer
        del trainers, batches
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return out


def budget_sweep(trainer, batch, *budgets: int, peak: float, device: str) -> dict:
    """The same step at other micro-batch token budgets (median of 3 after a warm-up), one trainer on the card,
    with the LM head whole and a chunk at a time (`trainer.chunked_head`): is the default the fastest, and what
    does the chunked head save? (At 8k tokens per micro-batch, the 32k step took 0.84 s against 0.60 s at 16k:
    H100, call 1.) At the first budget also the whole head without each of the trainer's fused kernels
    (ABLATIONS): what each saves."""
    out = {}
    numerics = trainer.model.numerics
    for tokens in budgets:
        arms = [("whole head", False, {}), ("chunked head", True, {})]
        if tokens == budgets[0]:
            arms += [(f"whole head, {name}", False, eager) for name, eager in ABLATIONS.items()]
        for head, chunked, eager in arms:
            trainer.model.chunked_head = chunked
            numerics.__dict__.update(eager)  # on this numerics object, for this arm (one trainer is on the card)
            times, flops = [], []
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            for i in range(4):
                before = trainer.matmul_flops
                sync(device)
                start = time.perf_counter()
                train_step(trainer, batch, tokens)
                sync(device)
                if i:
                    times.append(time.perf_counter() - start)
                    flops.append(trainer.matmul_flops - before)
            seconds = statistics.median(times)
            mfu = statistics.median(flops) / seconds / 1e12 / peak
            arm = out[f"{tokens}/{head}"] = {"seconds": seconds, "mfu": mfu}
            if device == "cuda":  # the whole process: the model, its gradients, AdamW's state, the step's activations
                arm["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
            print(f"train bf16 at {tokens} tokens per micro-batch, {head}: {seconds:.3f} s/step {arm}", flush=True)
            for name in eager:
                del numerics.__dict__[name]
    trainer.model.chunked_head = "auto"
    return out


def _eager_rope(x, cos, sin):
    from parity.engines.kernels import apply_rope

    return apply_rope(x, cos, sin)


# The trainer's fused kernels, each replaced by PyTorch's ops in an arm of `budget_sweep` (a `Numerics` method
# set on the instance for that arm).
ABLATIONS = {
    "PyTorch's log-probabilities": {"fused_head": lambda head, support: False},
    "eager RoPE": {"rope": _eager_rope},
}


def train_profile(trainer, batch, budget: int) -> list[dict]:
    """Where a train step's GPU time goes: the kernels with the most device time in one step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        train_step(trainer, batch, budget)
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:30]
    return [{"kernel": e.key[:120], "us": e.device_time_total, "calls": e.count} for e in events]


def tflops_of(fn, flops: int, device: str) -> float:
    """TFLOP/s of `fn` (median of CUDA-event timings; one timed call on the CPU)."""
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return flops / (time.perf_counter() - start) / 1e12
    import triton.testing

    return flops / (triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median") / 1e3) / 1e12


def blas_tflops(library: str, a: torch.Tensor, w: torch.Tensor, flops: int, device: str) -> float | None:
    """`a @ w.T` through PyTorch's other BLAS backend on CUDA (cuBLASLt's kernels for a few rows may read
    the weight faster than cuBLAS's); None on the CPU."""
    if device != "cuda":
        return None
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        return tflops_of(lambda: a @ w.t(), flops, device)
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def section_matmul(args) -> dict:
    """cuBLAS and exact mode's matmul at the model's projection shapes; other tile shapes' speed and bits."""
    from parity.engines.kernels import invariant
    from parity.engines.models.io import load_config

    cfg = load_config(args.model_dir)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "qkv": (q + 2 * kv, cfg.hidden_size),
        "o": (cfg.hidden_size, q),
        "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
        "down": (cfg.hidden_size, cfg.intermediate_size),
        "lm_head": (cfg.vocab_size, cfg.hidden_size),
    }
    if args.small:  # the CPU smoke, in Triton's interpreter: a short sum and a long one
        shapes = {k: shapes[k] for k in ("qkv", "down")}
    # For a decode step's few rows: narrower tiles, more programs over the same weight read (the o and down
    # projections ran 28 programs on 132 multiprocessors at 64 x 64); K's chunk stays 64.
    few = [
        invariant.Tiles(64, 32, 64, 4, 4),
        invariant.Tiles(64, 16, 64, 4, 4),
        invariant.Tiles(32, 64, 64, 4, 4),
        invariant.Tiles(32, 32, 64, 2, 4),
        invariant.Tiles(16, 64, 64, 4, 4),
        invariant.Tiles(16, 32, 64, 2, 5),
    ]
    out = {}
    for m in SIZES[args.size]["matmul_rows"]:
        others = (few[:2] if args.small else few) if m < invariant.MANY_ROWS else []
        for name, (n, k) in shapes.items():
            a = torch.randn(m, k, device=args.device).bfloat16()
            w = torch.randn(n, k, device=args.device).bfloat16()
            flops = 2 * m * n * k
            reference = invariant.matmul(a, w.t())
            row = {
                "cublas_tflops": tflops_of(lambda a=a, w=w: a @ w.t(), flops, args.device),
                "cublaslt_tflops": blas_tflops("cublaslt", a, w, flops, args.device),
                "tiles_tflops": tflops_of(lambda a=a, w=w: invariant.matmul(a, w.t()), flops, args.device),
            }
            for t in others:
                label = f"{t.m}x{t.n}x{t.k}/w{t.warps}/s{t.stages}"
                row[f"{label}_tflops"] = tflops_of(
                    lambda a=a, w=w, t=t: invariant.matmul(a, w.t(), tiles=t), flops, args.device
                )
                row[f"{label}_same_bits"] = bool(torch.equal(invariant.matmul(a, w.t(), tiles=t), reference))
            # a fused projection's columns against the member alone (the trainer multiplies by q_proj alone)
            row["fused_columns_same_bits"] = bool(
                torch.equal(invariant.matmul(a, w[: n // 2].t()), reference[:, : n // 2])
            )
            out[f"{name}@{m}"] = row
            print(f"matmul {name} ({m} x {k} -> {n}): {row}", flush=True)
    return out


def learner_batch(step: int, shape: tuple[int, int, int, int], vocab: int, device: str):
    """A step's synthetic batch: random responses of random lengths (so that micro-batches pack unevenly),
    random rewards; π_old and μ are filled in by the caller."""
    from parity.engines.batch import RolloutBatch
    from parity.engines.sampling import SamplingParams

    prompts, group, prompt_len, response_len = shape
    rows = prompts * group
    gen = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(response_len // 4, response_len + 1, (rows,), generator=gen)
    mask = torch.arange(response_len)[None] < lengths[:, None]
    ids = torch.randint(3, vocab, (prompts, prompt_len), generator=gen).tolist()
    batch = RolloutBatch(
        prompt_ids=[ids[i // group] for i in range(rows)],
        response_ids=(torch.randint(3, vocab, (rows, response_len), generator=gen) * mask).to(device),
        response_mask=mask.to(device),
        rollout_logprobs=torch.zeros(rows, response_len, device=device),
        support=None,
        truncated=(lengths == response_len).to(device),
        group_index=torch.arange(prompts).repeat_interleave(group).to(device),
        weight_version=step,
        sampling=SamplingParams(max_new_tokens=response_len),
    )
    return batch, torch.rand(rows, generator=gen).to(device)


def learners_match(model_dir: str, device: str, arm: str, shape, steps: int) -> dict:
    """One FSDP2 learner (`distributed.actors.Learner`, world size 1: NCCL on a card, gloo on the CPU) against
    one process's trainer, step for step on the same batches: GRPO's loss over two mini-batches a step, π_old
    scored by the one process. Exact mode: the learner's first π_θ pass must be π_old's bits (checked before
    it steps, as in a run: it stops otherwise), and both must end with the same weights, bit for bit."""
    from parity import config
    from parity.distributed.actors import Learner
    from parity.engines import kernels
    from parity.engines.trainer import Trainer
    from parity.rl.algorithms import group_advantages
    from parity.rl.step import Prepared, UpdatePlan, train_on_batch
    from parity.rl.train_config import TrainConfig

    precision, exact = arm.split("-")[0], arm.endswith("exact")
    prompts, group, _, response_len = shape
    cfg = config.load(TrainConfig, None, [
        f"model={model_dir}", f"precision={precision}", f"exact={str(exact).lower()}", f"device={device}",
        "algorithm.name=grpo", "algorithm.num_minibatches=2", f"prompts_per_step={prompts}",
        f"rollout.group_size={group}", f"rollout.max_new_tokens={response_len}", "trainer.lr=1e-5",
    ])  # fmt: skip
    plan = UpdatePlan(cfg.algorithm.build(), cfg.trainer.micro_batch_tokens, prompts, group, response_len)
    one = Trainer(load_model(model_dir).to(device), cfg.trainer_precision, cfg.trainer)
    one.model.numerics = kernels.numerics(device, exact=exact)
    learner = Learner(0, 1, model_dir, cfg, threads=None)
    learner.setup("127.0.0.1", free_port())
    rows = []
    for step in range(steps):
        batch, rewards = learner_batch(step, shape, one.model.config.vocab_size, device)
        batch.old_logprobs = one.frozen_logprobs(batch, plan.micro_batch_tokens)
        batch.rollout_logprobs = batch.old_logprobs.clone()
        advantages = group_advantages(rewards, batch.group_index, cfg.algorithm.advantage)
        prepared = Prepared(rewards, advantages, batch.sampled_mask.clone(), None, batch.old_logprobs, "sampler")
        a = train_on_batch(one, batch, prepared, plan, order_seed=step)
        b = learner.update(batch, prepared, plan, order_seed=step, sampled_here=True)
        rows.append({"loss": [a.losses, b.losses], "grad_norm": [a.grad_norms, b.grad_norms]})
    mine, theirs = one.full_weights(), learner.trainer.full_weights()
    differ = [n for n in mine if not torch.equal(mine[n], theirs[n])]
    worst = max(float((mine[n] - theirs[n]).abs().max()) for n in mine)
    losses = [x for r in rows for x in zip(*r["loss"])] + [x for r in rows for x in zip(*r["grad_norm"])]
    rel = max(abs(x - y) / max(abs(x), 1e-12) for x, y in losses)
    out = {"steps": rows, "weights_differing": len(differ), "weights": len(mine), "max_abs_weight_diff": worst,
           "max_rel_loss_or_norm_diff": rel, "tokens_per_step": int(batch.response_mask.sum())}  # fmt: skip
    del one, learner
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def section_learners(args) -> dict:
    """The learner's FSDP2 path on this device against one process, in each precision and in exact mode."""
    shape = SIZES[args.size]["learners"]
    out = {}
    for arm in ("fp32", "bf16", "fp16", "bf16-exact"):
        try:
            out[arm] = learners_match(args.model_dir, args.device, arm, shape, LEARNER_STEPS)
        except Exception as e:  # noqa: BLE001 - an arm that fails is recorded, and the others still run
            out[arm] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(f"learners {arm}: {json.dumps({k: v for k, v in out[arm].items() if k != 'steps'})}", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return out


SECTIONS = {
    "device": section_device,
    "engine": section_engine,
    "train": section_train,
    "matmul": section_matmul,
    "learners": section_learners,
}


# ----------------------------------------------------------------------------- driver


def run_section(name: str, args, record: dict, env: dict | None = None, key: str | None = None) -> None:
    """Run one section in a child process under its deadline; record its result or what stopped it."""
    key = key or name
    part = Path(args.scratch) / f"{key}.json"
    command = [sys.executable, __file__, "--child", name, "--json", str(Path(args.out) / "probe.json"),
               "--part", str(part), "--device", args.device, "--model-dir", args.model_dir]  # fmt: skip
    if args.small:
        command.append("--small")
    if key == "baseline-engine" or key == "baseline-train":
        command.append("--baseline")
    start = time.perf_counter()
    deadline = DEADLINES["baseline" if key.startswith("baseline") else name]
    entry: dict = {}
    try:
        done = subprocess.run(command, env=env, timeout=deadline, capture_output=True, text=True)
        sys.stdout.write(done.stdout[-6000:])
        entry["rc"] = done.returncode
        if done.returncode:
            entry["error"] = done.stderr[-4000:]
            sys.stdout.write(done.stderr[-2000:])
    except subprocess.TimeoutExpired as e:
        entry["error"] = f"deadline of {deadline} s passed"
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        sys.stdout.write(out[-3000:])
    if part.exists():
        entry["result"] = json.loads(part.read_text())
    entry["seconds"] = time.perf_counter() - start
    record["sections"][key] = entry
    Path(args.out, "probe.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"== {key}: {'ok' if 'result' in entry and not entry.get('error') else entry.get('error', '')[:300]} "
          f"({entry['seconds']:.0f} s)", flush=True)  # fmt: skip


def run_tests(args, record: dict) -> None:
    tests = HERE.parent / "tests"
    files = [tests / "unit" / f for f in ("test_engines.py", "test_kernels.py", "test_static_engine.py")]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    start = time.perf_counter()
    entry: dict = {}
    try:
        cuda = subprocess.run([*command, "-m", "cuda", *map(str, files)], timeout=DEADLINES["tests"] * 0.6,
                              capture_output=True, text=True)  # fmt: skip
        invariant_files = [
            str(tests / "unit" / "test_invariant.py"),
            str(tests / "e2e" / "test_invariant_engines.py"),
            # the fused head's kernels, compiled (the rest of that file runs on the CPU)
            str(tests / "unit" / "test_chunked_head.py") + "::test_the_fused_head_gives_pytorchs_logprobs_and_gradient",
        ]
        invariant = subprocess.run([*command, *invariant_files],
                                   timeout=DEADLINES["tests"] * 0.4,
                                   capture_output=True, text=True)  # fmt: skip
        entry = {"cuda_rc": cuda.returncode, "invariant_rc": invariant.returncode,
                 "cuda_tail": cuda.stdout[-3000:], "invariant_tail": invariant.stdout[-3000:]}  # fmt: skip
    except subprocess.TimeoutExpired as e:
        entry["error"] = f"tests passed their deadline: {e.cmd[-1]}"
    entry["seconds"] = time.perf_counter() - start
    record["sections"]["tests"] = entry
    print(f"== tests: {entry.get('cuda_tail', '')[-500:]}\n{entry.get('invariant_tail', '')[-500:]}", flush=True)


def summary(record: dict) -> str:
    """The issue's figures as a table, each beside what it is read against."""
    s = record["sections"]
    device = s.get("device", {}).get("result", {})
    bandwidth = device.get("bandwidth_gb_s", float("nan")) * 1e9
    measured_peak = device.get("peak_tflops") or {}
    lines = [f"# GPU probe: {device.get('card', record['device'])}, torch {device.get('torch', '?')}", ""]
    known = card_spec(device.get("card"))
    if known is None:  # the measured ceilings stand in for the specification, and the summary says so
        spec_bandwidth, spec_peak = bandwidth, {}
        lines.append("no specification for this device (`CARDS`): the 'spec' figures are read against the measured")
    else:
        spec_name, spec = known
        spec_bandwidth, spec_peak = spec["bandwidth_gb_s"] * 1e9, spec["tflops"]
        lines.append(f"specification ({spec_name}): {spec['bandwidth_gb_s']} GB/s; dense TFLOP/s {spec['tflops']}")
    lines.append(f"measured on the card: copy bandwidth {bandwidth / 1e9:.0f} GB/s; dense TFLOP/s {measured_peak}")
    lines += [
        "",
        "Each figure against the specification first, then against what was measured on the card.",
        "",
        "| figure | previous code | this code |",
        "|---|---|---|",
    ]

    def against(value: float, floor_spec: float, floor_measured: float, unit: str) -> str:
        """`value` as a multiple of the floor at the specification's ceiling and at the measured one."""
        return f"{value:.3f} {unit} = {value / floor_spec:.1f}× spec floor, {value / floor_measured:.1f}× measured"

    new, old = s.get("engine", {}).get("result", {}), s.get("baseline-engine", {}).get("result", {})

    def decode(result, arm):
        d = result.get("decode", {}).get(arm)
        if not d:
            return "—"
        read = d["weight_bytes"] + d["kv_bytes"]
        return against(d["step_ms"], read / spec_bandwidth * 1000, read / bandwidth * 1000, "ms")

    for arm in ("bf16", "bf16-exact", "fp16", "bf16-eager"):
        lines.append(f"| decode step, batch {new.get('decode', {}).get(arm, {}).get('rows', '?')}, {arm} | "
                     f"{decode(old, arm)} | {decode(new, arm)} |")  # fmt: skip
    for arm in ("bf16", "bf16-exact"):
        cells = [r.get("rollout", {}).get(arm, {}).get("tokens_per_s") for r in (old, new)]
        lines.append(
            f"| rollout tokens/s, {arm} | " + " | ".join("—" if c is None else f"{c:.0f}" for c in cells) + " |"
        )
    for result, label in ((old, "previous"), (new, "this")):
        d = result.get("decode", {})
        if "bf16" in d and "bf16-exact" in d:
            lines.append(
                f"| exact decode / plain ({label} code) | {d['bf16-exact']['step_ms'] / d['bf16']['step_ms']:.2f}× | |"
            )
    if "exact_agreement" in new:
        lines.append(f"| exact mode: tokens whose μ ≠ π_old | | {sum(r['differing'] for r in new['exact_agreement'])} "
                     f"of {sum(r['tokens'] for r in new['exact_agreement'])} |")  # fmt: skip
    t_new, t_old = s.get("train", {}).get("result", {}), s.get("baseline-train", {}).get("result", {})
    for key in [k for k in t_new or t_old if "/" not in k and "@" in k and not k.startswith("train_profile")]:
        precision = key.split("@")[0].split("-")[0]
        peak, measured = spec_peak.get(precision) or measured_peak.get(precision), measured_peak.get(precision)
        cells = [
            f"MFU {r[key]['tflops'] / peak:.1%} of spec, {r[key]['tflops'] / measured:.1%} of measured; "
            f"{r[key]['tokens_per_s']:.0f} tok/s"
            if key in r
            else "—"
            for r in (t_old, t_new)
        ]
        lines.append(f"| train {key} | {cells[0]} | {cells[1]} |")
    for result, label in ((t_old, "previous"), (t_new, "this")):
        for size in ("8k", "32k"):
            plain, exact, fp16 = (result.get(f"{a}@{size}") for a in ("bf16", "bf16-exact", "fp16"))
            if plain and exact:
                lines.append(
                    f"| exact train / plain at {size} ({label} code) | {exact['seconds'] / plain['seconds']:.2f}× | |"
                )
            if plain and fp16:
                lines.append(
                    f"| FP16 train / BF16 at {size} ({label} code) | {fp16['seconds'] / plain['seconds']:.2f}× | |"
                )
    for arm, r in s.get("learners", {}).get("result", {}).items():
        figure = f"FSDP2 learner (world size 1) against one process, {arm}, {LEARNER_STEPS} steps"
        if "error" in r:
            lines.append(f"| {figure} | | failed: {r['error'][:200]} |")
            continue
        lines.append(f"| {figure} | | {r['weights'] - r['weights_differing']} of {r['weights']} weights bit for bit, "
                     f"max |Δw| {r['max_abs_weight_diff']:.1e}; losses and grad norms within "
                     f"{r['max_rel_loss_or_norm_diff']:.1e} (relative) |")  # fmt: skip
    tests = s.get("tests", {})
    if tests:
        lines.append(f"\ntests: CUDA rc {tests.get('cuda_rc')}, test_invariant rc {tests.get('invariant_rc')} "
                     f"{tests.get('error', '')}")  # fmt: skip
    for key, entry in s.items():
        if entry.get("error"):
            lines.append(f"\n{key} did not finish: {entry['error'][-600:]}")
    return "\n".join(lines) + "\n"


def child(args) -> None:
    """One section, in this process: its result to --part."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        result = SECTIONS[args.child](args)
    except Exception:
        traceback.print_exc()
        raise SystemExit(1) from None
    Path(args.part).write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu-probe")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--baseline-src", help="a source tree of the previous code (its src/), measured beside")
    parser.add_argument("--baseline-sections", default="engine,train", help="the sections measured on it too")
    parser.add_argument(
        "--tests", action="store_true", help="run the CUDA tests and tests/unit/test_invariant.py first"
    )
    parser.add_argument("--small", action="store_true", help="toy sizes (the CPU smoke run)")
    parser.add_argument("--sections", default="device,engine,train,matmul,learners")
    parser.add_argument("--model-dir")
    parser.add_argument("--child", choices=sorted(SECTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.size = "small" if args.small else "full"
    if args.child:
        child(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.scratch = tempfile.mkdtemp(prefix="gpu-probe-")  # the model and each section's part: not results
    if args.device == "cpu":  # Triton's kernels run in its interpreter without a GPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
    record: dict = {"device": args.device, "argv": sys.argv[1:], "sections": {}}
    if args.tests:
        run_tests(args, record)
    if not args.model_dir:
        from engines import make_llama_4m
        from gpu import make_qwen_shape

        make = make_llama_4m if args.small else make_qwen_shape
        args.model_dir = str(make(Path(args.scratch) / "model"))
    for name in args.sections.split(","):
        run_section(name, args, record)
    if args.baseline_src:
        env = {**os.environ, "PYTHONPATH": str(Path(args.baseline_src).resolve())}
        for name in args.baseline_sections.split(","):
            if name in args.sections.split(","):
                run_section(name, args, record, env=env, key=f"baseline-{name}")
    text = summary(record)
    (out / "summary.md").write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
