"""The numerics acceptance run: every precision trained on a device, side by side, with the figures
that say whether each precision takes a fast path there. Runs on CUDA or, at small sizes, on the CPU
(a CI test keeps that working).

For each model, one training run per arm (`fp32`, `bf16`, `fp16`, and `PRECISION-exact` for exact
mode) steps in turn after a warm-up step, `--rounds` × `--steps` times, so that the machine's slow
spells fall on every arm alike. Reported per arm:

- rollout and train seconds per 1,000 sampled tokens (medians), and their ratio to FP32's: the
  cost of a precision on this device (a 16-bit precision without a fast kernel shows up here);
- tokens/s of the rollout and of the train phase, and the weight-sync seconds;
- for exact arms, the largest |μ − π_old| over every step (the run stops if any token differs).

- the train phase's model TFLOP/s and its utilisation of this device's dense matmul rate in the
  arm's precision (measured here on a large square matmul: the `peak_tflops` of the record).

Then per model, on the rollout engine alone (EOS off, a fixed batch): ms per decode step against the
weights-read floor (parameter bytes in the rollout precision ÷ memory bandwidth measured here by a
large copy), and on CUDA the host synchronisations per decode step (`torch.cuda.set_sync_debug_mode`).
With `generate` in `--sections`: rollout tokens/s of Parity's engine against `transformers`'
`generate` on the same model, device, precision and prompts (EOS off, every row the full length).
With `exact`: exact mode at 1 to 256 rows and up to 1,024 new tokens with top-k/top-p, the tokens
whose μ and π_old differ (must be none) counted after the trainer's code path scores them.
`--tests` first runs the test suite's CUDA tests (`pytest -m cuda`).

    python benchmarks/gpu.py [--device cuda] [--models builtin,llama-4.4M,qwen2.5-0.5b-shape,DIR]
        [--arms fp32,bf16,fp16,fp16-exact] [--rounds 2] [--steps 3] [--small] [--tests]
        [--sections train,decode,generate,exact] [--exact-shapes 16x16x64,1x1x1024] [--json out.json]

Nothing else may run on the machine meanwhile. The record names the device and the kernel path of
each precision (`kernels.Numerics.describe`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # `transformers` reads local directories only

from engines import make_llama_4m, save_random_model  # noqa: E402
from parity import config  # noqa: E402
from parity.engines import kernels  # noqa: E402
from parity.engines import precision as prec  # noqa: E402
from parity.engines.models.io import load_model, resolve_model_dir  # noqa: E402
from parity.engines.rollout import RolloutEngine, SamplingParams  # noqa: E402
from parity.engines.tokenizer import load_tokenizer  # noqa: E402
from parity.rl.loop import Run, TrainingError  # noqa: E402
from parity.rl.train_config import TrainConfig  # noqa: E402

# prompts per step, samples per prompt, new tokens; --small for the CPU smoke run
WORKLOADS = {"full": (16, 8, 64), "small": (4, 4, 16)}
DECODE_BATCH = {"full": 128, "small": 16}
# Rollout against `generate`: (prompts, samples per prompt, new tokens), 32-token prompts.
# Exact mode's sweep: (prompts, samples per prompt, new tokens), top-k/top-p sampling, 1 to 256 rows.
EXACT_SHAPES = {"full": [(16, 16, 64), (1, 1, 1024), (2, 8, 512)], "small": [(1, 1, 24), (4, 4, 16)]}
EXACT_SAMPLING = dict(temperature=0.8, top_k=50, top_p=0.9)
GENERATE_SHAPES = {"full": [(8, 8, 256), (16, 8, 256), (16, 16, 256), (16, 8, 1024)], "small": [(2, 4, 16)]}
PROMPT_TOKENS = 32


def make_qwen_shape(out: Path) -> Path:
    """A Qwen2.5-0.5B-shaped model (24 layers, hidden 896, vocabulary 151,936), random weights."""
    return save_random_model(
        "Qwen2",
        out,
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )


def model_dir(name: str, tmp: Path) -> str:
    if name == "builtin":
        return "builtin"
    if name == "llama-4.4M":
        return str(make_llama_4m(tmp / "llama"))
    if name == "qwen2.5-0.5b-shape":
        return str(make_qwen_shape(tmp / "qwen"))
    return str(resolve_model_dir(name))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def create(model: str, arm: str, device: str, workload: tuple[int, int, int], steps: int, run_dir: Path) -> Run:
    precision, _, exact = arm.partition("-")
    prompts, group, new_tokens = workload
    cfg = config.load(
        TrainConfig,
        None,
        [
            f"model={model}",
            f"precision={precision}",
            f"exact={str(exact == 'exact').lower()}",
            f"device={device}",
            f"steps={steps + 1}",
            f"run_dir={run_dir}",
            f"prompts_per_step={prompts}",
            f"rollout.group_size={group}",
            f"rollout.max_new_tokens={new_tokens}",
            "checkpoint_every=-1",
            "tensorboard=false",
        ],
    )
    return Run.create(cfg, progress=False)


def train_arms(model: str, args, workload, tmp: Path) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """Every arm's step metrics, the arms stepping in turn (the order rotating each step), and the arms
    that stopped with the reason (an exact arm stops when a token's μ and π_old differ); the others go on."""
    arms = args.arms.split(",")
    history: dict[str, list[dict]] = {arm: [] for arm in arms}
    failed: dict[str, str] = {}

    def step(arm: str, run: Run) -> dict | None:
        try:
            return run.step()
        except TrainingError as e:
            failed[arm] = str(e)
            print(f"{arm}: {e}", flush=True)
            return None

    for r in range(args.rounds):
        runs = {arm: create(model, arm, args.device, workload, args.steps, tmp / f"{arm}-{r}") for arm in arms}
        try:
            for arm, run in runs.items():
                step(arm, run)  # the first step builds kernels
            for s in range(args.steps):
                k = (r + s) % len(arms)
                for arm in arms[k:] + arms[:k]:
                    if arm not in failed:
                        sync(args.device)
                        if (metrics := step(arm, runs[arm])) is not None:
                            history[arm].append(metrics)
        finally:
            for run in runs.values():
                run.rewards.close()
                run.lock.release()
    return {arm: h for arm, h in history.items() if arm not in failed and h}, failed


def summarise(history: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for arm, steps in history.items():
        tokens = [m["train/samples"] * m["response/length_mean"] for m in steps]
        row = {
            f"{phase}_s_per_1k_tokens": statistics.median(m[f"time/{phase}"] * 1000 / n for m, n in zip(steps, tokens))
            for phase in ("rollout", "train")
        }
        row["rollout_tokens_per_s"] = 1000 / row["rollout_s_per_1k_tokens"]
        row["train_tokens_per_s"] = 1000 / row["train_s_per_1k_tokens"]
        row["sync_s"] = statistics.median(m["time/sync"] for m in steps)
        row["train_tflops"] = statistics.median(m["perf/train_gflops"] for m in steps) / 1000
        row["max_token_abs_log_ratio"] = max(m["mismatch/token_abs_log_ratio_max"] for m in steps)
        if arm.endswith("-exact") and row["max_token_abs_log_ratio"] != 0.0:
            raise SystemExit(f"{arm}: exact mode logged a non-zero mismatch")
        out[arm] = row
    base = out.get("fp32")
    for arm, row in out.items():
        plain = out.get(arm.partition("-")[0]) if arm.endswith("-exact") else None
        for phase in ("rollout", "train"):
            key = f"{phase}_s_per_1k_tokens"
            row[f"{phase}_vs_fp32"] = row[key] / base[key] if base else float("nan")
            if plain is not None:  # exact mode's cost: against the same precision without it
                row[f"{phase}_vs_plain"] = row[key] / plain[key]
    return out


def peak_tflops(device: str) -> dict[str, float]:
    """Dense matmul TFLOP/s per precision on `device` (a square product, random inputs, median of 5):
    the ceiling that the train phase's utilisation is read against."""
    n = 8192 if device == "cuda" else 1024
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        times = []
        for _ in range(6):
            sync(device)
            t = time.perf_counter()
            a @ b
            sync(device)
            times.append(time.perf_counter() - t)
        out[name] = 2 * n**3 / statistics.median(times[1:]) / 1e12
    return out


def bandwidth(device: str) -> float:
    """Bytes/s of a large copy on `device`, counting bytes read and written (median of 5)."""
    src = torch.empty(64 * 2**20 if device == "cpu" else 2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() / statistics.median(times[1:])


def decode_figures(model: str, precision: str, device: str, batch: int, bytes_per_s: float) -> dict:
    """ms per decode step at `batch` rows (two generation lengths differenced, so the prefill
    cancels) against parameter bytes ÷ bandwidth, and host syncs per decode step on CUDA."""
    net = load_model(model, kernels.numerics()).to(device)
    tok = load_tokenizer(resolve_model_dir(model))
    engine = RolloutEngine(net.config, precision, (-1,), tok.pad_id, kernels.numerics(device))
    engine.weights.load(net.state_dict(), version=0)
    prompts = [[3 + (i + j) % (net.config.vocab_size - 3) for j in range(4)] for i in range(batch)]
    short, long = 8, 40

    def timed(new_tokens: int, repeats: int = 3) -> float:
        """The fastest of `repeats` calls: a busy host only ever adds time, and the step is a difference of two
        calls' times, which one slowed call would make meaningless (even negative)."""
        engine.generate(prompts, 1, SamplingParams(max_new_tokens=new_tokens), seed=0)  # warm
        best = float("inf")
        for _ in range(repeats):
            sync(device)
            t = time.perf_counter()
            engine.generate(prompts, 1, SamplingParams(max_new_tokens=new_tokens), seed=0)
            sync(device)
            best = min(best, time.perf_counter() - t)
        return best

    step_ms = (timed(long) - timed(short)) / (long - short) * 1000
    weight_bytes = sum(t.numel() * t.element_size() for t in engine.weights.named_weights().values())
    floor_ms = weight_bytes / bytes_per_s * 1000
    syncs = None
    if device == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.generate(prompts, 1, SamplingParams(max_new_tokens=long), seed=0)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught) / long
    return {"batch": batch, "step_ms": step_ms, "floor_ms": floor_ms, "vs_floor": step_ms / floor_ms, "syncs": syncs}


def rollout_vs_generate(model: str, precision: str, device: str, shapes: list[tuple[int, int, int]]) -> list[dict]:
    """Tokens/s of Parity's rollout engine and of `transformers`' `generate` on the same model, device,
    precision and prompts, EOS off in both (every row generates the full length), plain sampling at
    temperature 1. Each is warmed up on the shape with 8 new tokens, then timed once per shape."""
    from transformers import AutoModelForCausalLM

    dtype = prec.to_dtype(precision)
    hf = AutoModelForCausalLM.from_pretrained(resolve_model_dir(model), dtype=dtype).to(device).eval()
    net = load_model(model, kernels.numerics())
    engine = RolloutEngine(net.config, precision, (-1,), 0, kernels.numerics(device))
    engine.weights.load(net.state_dict(), version=0)
    del net
    vocab = engine.config.vocab_size
    out = []
    for prompts, group, new_tokens in shapes:
        ids = torch.randint(3, vocab, (prompts, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
        rows = ids.repeat_interleave(group, dim=0).to(device)

        def ours(n: int, ids=ids, group=group) -> None:
            engine.generate(ids.tolist(), group, SamplingParams(max_new_tokens=n), seed=0)

        def theirs(n: int, rows=rows) -> None:
            with torch.no_grad():
                generated = hf.generate(
                    input_ids=rows,
                    attention_mask=torch.ones_like(rows),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    pad_token_id=0,
                )
            assert generated.shape[1] == PROMPT_TOKENS + n, "generate stopped early"

        row = {"prompts": prompts, "group": group, "batch": prompts * group, "new_tokens": new_tokens}
        for name, fn in (("parity", ours), ("generate", theirs)):
            fn(8)
            sync(device)
            t = time.perf_counter()
            fn(new_tokens)
            sync(device)
            row[f"{name}_tokens_per_s"] = prompts * group * new_tokens / (time.perf_counter() - t)
        row["speedup"] = row["parity_tokens_per_s"] / row["generate_tokens_per_s"]
        out.append(row)
    return out


def exact_sweep(model: str, precision: str, device: str, shapes: list[tuple[int, int, int]]) -> list[dict]:
    """Exact mode at each shape: the rollout engine samples (top-k/top-p), the trainer's code path scores
    the same tokens in micro-batches of 8 rows; the tokens whose μ and π_old differ (must be none)."""
    from parity.engines.trainer import logprobs_of_rows

    net = load_model(model, kernels.numerics()).to(device).requires_grad_(False)
    net.numerics = kernels.numerics(device, exact=True)
    engine = RolloutEngine(net.config, precision, (-1,), 0, net.numerics)
    engine.weights.load(net.state_dict(), version=0)
    vocab, out = net.config.vocab_size, []
    for prompts, group, new_tokens in shapes:
        gen = torch.Generator().manual_seed(prompts * 1000 + new_tokens)
        ids = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in torch.randint(4, 33, (prompts,))]
        sampling = SamplingParams(max_new_tokens=new_tokens, **EXACT_SAMPLING)
        sync(device)
        t = time.perf_counter()
        batch = engine.generate(ids, group, sampling, seed=1)
        sync(device)
        rollout_s = time.perf_counter() - t
        t = time.perf_counter()
        parts = []
        with torch.no_grad():
            for rows in torch.arange(len(batch.prompt_ids)).split(8):
                parts.append(logprobs_of_rows(net, batch, rows, prec.to_dtype(precision))[1])
        sync(device)
        score_s = time.perf_counter() - t
        mask = batch.response_mask
        pi, mu = torch.cat(parts)[mask], batch.rollout_logprobs[mask]
        row = {"rows": prompts * group, "new_tokens": new_tokens, "tokens": int(mask.sum())}
        row.update(
            differing=int((pi != mu).sum()),
            max_abs=float((pi - mu).abs().max()),
            rollout_s=rollout_s,
            score_s=score_s,
        )
        out.append(row)
        print(
            f"{precision} exact, {row['rows']} rows x {new_tokens} tokens (top-k/top-p): {row['differing']} of "
            f"{row['tokens']} tokens differ (max |Δ| {row['max_abs']:.3g}); rollout {rollout_s:.2f} s, "
            f"trainer scoring {score_s:.2f} s",
            flush=True,
        )
    return out


def table(model: str, rows: dict[str, dict]) -> str:
    lines = [
        f"{model}: | arm | rollout s/1k tok | vs fp32 | train s/1k tok | vs fp32 | rollout tok/s | train tok/s "
        "| train TFLOP/s | MFU | sync s | max token |Δ| |",
    ]
    for arm, r in rows.items():
        lines.append(
            f"| {arm} | {r['rollout_s_per_1k_tokens']:.3f} | {r['rollout_vs_fp32']:.2f}× | "
            f"{r['train_s_per_1k_tokens']:.3f} | {r['train_vs_fp32']:.2f}× | {r['rollout_tokens_per_s']:.0f} | "
            f"{r['train_tokens_per_s']:.0f} | {r['train_tflops']:.3g} | {r['mfu']:.2%} | {r['sync_s']:.3f} | "
            f"{r['max_token_abs_log_ratio']:.2g} |"
        )
    return "\n".join(lines)


SECTIONS = ("train", "decode", "generate", "exact")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="builtin,llama-4.4M")
    parser.add_argument("--arms", default="fp32,bf16,fp16,fp16-exact")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a few sequences per step (the CPU smoke run)")
    parser.add_argument("--tests", action="store_true", help="run the CUDA tests first (pytest -m cuda)")
    parser.add_argument("--sections", default="train,decode", help=f"any of {','.join(SECTIONS)}")
    parser.add_argument(
        "--exact-shapes", help="PROMPTSxSAMPLESxTOKENS,... for the exact section (default: the size's list)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    kernels.check_device(args.device, "--device")
    sections = args.sections.split(",")
    if unknown := set(sections) - set(SECTIONS):
        parser.error(f"--sections: unknown {sorted(unknown)}; allowed: {', '.join(SECTIONS)}")
    size = "small" if args.small else "full"
    record = {"numerics": kernels.numerics(args.device).describe(), "argv": sys.argv[1:], "models": {}}
    print(json.dumps(record["numerics"]), flush=True)
    if args.tests:
        tests = Path(__file__).parent.parent / "tests"
        record["cuda_tests_rc"] = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-m",
                "cuda",
                str(tests / "unit" / "test_engines.py"),
                str(tests / "unit" / "test_kernels.py"),
            ]
        ).returncode
    bytes_per_s = bandwidth(args.device)
    record["bandwidth_gb_s"] = bytes_per_s / 1e9
    record["peak_tflops"] = peak_tflops(args.device)
    print(
        f"copy bandwidth {bytes_per_s / 1e9:.0f} GB/s; dense matmul TFLOP/s "
        + ", ".join(f"{k} {v:.1f}" for k, v in record["peak_tflops"].items()),
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in args.models.split(","):
            model = model_dir(name, tmp)
            result = record["models"][name] = {}
            if "train" in sections:
                history, failed = train_arms(model, args, WORKLOADS[size], tmp / "runs" / name.replace("/", "_"))
                rows = summarise(history)
                if failed:
                    result["failed"] = failed
                for arm, row in rows.items():
                    row["mfu"] = row["train_tflops"] / record["peak_tflops"][arm.partition("-")[0]]
                result["arms"] = rows
                print(table(name, rows), flush=True)
                for arm, row in rows.items():
                    if "rollout_vs_plain" in row:
                        print(
                            f"{name} {arm} against {arm.partition('-')[0]}: rollout {row['rollout_vs_plain']:.2f}×, "
                            f"train {row['train_vs_plain']:.2f}×",
                            flush=True,
                        )
            precisions = sorted({arm.partition("-")[0] for arm in args.arms.split(",")})
            if "decode" in sections:
                decode = {p: decode_figures(model, p, args.device, DECODE_BATCH[size], bytes_per_s) for p in precisions}
                result["decode"] = decode
                for p, d in decode.items():
                    syncs = "" if d["syncs"] is None else f", {d['syncs']:.1f} host syncs/step"
                    print(
                        f"{name} {p} decode at batch {d['batch']}: {d['step_ms']:.2f} ms/step, floor "
                        f"{d['floor_ms']:.3f} ms ({d['vs_floor']:.1f}×){syncs}",
                        flush=True,
                    )
            if "generate" in sections:
                result["generate"] = {
                    p: rollout_vs_generate(model, p, args.device, GENERATE_SHAPES[size]) for p in precisions
                }
                for p, shapes in result["generate"].items():
                    for g in shapes:
                        print(
                            f"{name} {p} rollout {g['prompts']}x{g['group']} rows, {g['new_tokens']} tokens: "
                            f"Parity {g['parity_tokens_per_s']:.0f} tok/s, generate {g['generate_tokens_per_s']:.0f} "
                            f"tok/s ({g['speedup']:.2f}×)",
                            flush=True,
                        )
            if "exact" in sections:
                result["exact"] = {}
                for p in precisions:
                    shapes = EXACT_SHAPES[size]
                    if args.exact_shapes:
                        shapes = [tuple(int(n) for n in s.split("x")) for s in args.exact_shapes.split(",")]
                    result["exact"][p] = exact_sweep(model, p, args.device, shapes)
                    if args.json:
                        args.json.write_text(json.dumps(record, indent=2) + "\n")
            if args.json:  # after every model: a later failure keeps what was measured
                args.json.write_text(json.dumps(record, indent=2) + "\n")
    if record.get("cuda_tests_rc"):
        raise SystemExit(f"the CUDA tests failed (pytest exit {record['cuda_tests_rc']})")


if __name__ == "__main__":
    main()
