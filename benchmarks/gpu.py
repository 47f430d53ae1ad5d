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

Then per model, on the rollout engine alone (EOS off, a fixed batch): ms per decode step against the
weights-read floor (parameter bytes in the rollout precision ÷ memory bandwidth measured here by a
large copy), and on CUDA the host synchronisations per decode step (`torch.cuda.set_sync_debug_mode`).
`--tests` first runs the test suite's CUDA tests (`pytest -m cuda`).

    python benchmarks/gpu.py [--device cuda] [--models builtin,llama-4.4M,qwen2.5-0.5b-shape,DIR]
        [--arms fp32,bf16,fp16,fp16-exact] [--rounds 2] [--steps 3] [--small] [--tests] [--json out.json]

Nothing else may run on the machine meanwhile. The record names the device and the kernel path of
each precision (`kernels.Numerics.describe`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from engines import make_llama_4m, save_random_model  # noqa: E402
from parity import config  # noqa: E402
from parity.engines import kernels  # noqa: E402
from parity.engines.models import load_model, resolve_model_dir  # noqa: E402
from parity.engines.rollout import RolloutEngine, SamplingParams  # noqa: E402
from parity.engines.tokenizer import load_tokenizer  # noqa: E402
from parity.rl.loop import Run  # noqa: E402
from parity.rl.train_config import TrainConfig  # noqa: E402

# prompts per step, samples per prompt, new tokens; --small for the CPU smoke run
WORKLOADS = {"full": (16, 8, 64), "small": (4, 4, 16)}
DECODE_BATCH = {"full": 128, "small": 16}


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


def train_arms(model: str, args, workload, tmp: Path) -> dict[str, list[dict]]:
    """Every arm's step metrics, the arms stepping in turn (the order rotating each step)."""
    arms = args.arms.split(",")
    history: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r in range(args.rounds):
        runs = {arm: create(model, arm, args.device, workload, args.steps, tmp / f"{arm}-{r}") for arm in arms}
        try:
            for run in runs.values():
                run.step()  # the first step builds kernels
            for s in range(args.steps):
                k = (r + s) % len(arms)
                for arm in arms[k:] + arms[:k]:
                    sync(args.device)
                    history[arm].append(runs[arm].step())
        finally:
            for run in runs.values():
                run.rewards.close()
                run.lock.release()
    return history


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
        row["max_token_abs_log_ratio"] = max(m["mismatch/token_abs_log_ratio_max"] for m in steps)
        if arm.endswith("-exact") and row["max_token_abs_log_ratio"] != 0.0:
            raise SystemExit(f"{arm}: exact mode logged a non-zero mismatch")
        out[arm] = row
    base = out.get("fp32")
    for row in out.values():
        for phase in ("rollout", "train"):
            key = f"{phase}_s_per_1k_tokens"
            row[f"{phase}_vs_fp32"] = row[key] / base[key] if base else float("nan")
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
    net = load_model(model).to(device)
    tok = load_tokenizer(resolve_model_dir(model))
    engine = RolloutEngine(net.config, precision, (-1,), tok.pad_id, kernels.numerics(device))
    engine.load_weights(net.state_dict(), version=0)
    prompts = [[3 + (i + j) % (net.config.vocab_size - 3) for j in range(4)] for i in range(batch)]
    short, long = 8, 40

    def timed(new_tokens: int) -> float:
        engine.generate(prompts, 1, SamplingParams(max_new_tokens=new_tokens), seed=0)  # warm
        sync(device)
        t = time.perf_counter()
        engine.generate(prompts, 1, SamplingParams(max_new_tokens=new_tokens), seed=0)
        sync(device)
        return time.perf_counter() - t

    step_ms = (timed(long) - timed(short)) / (long - short) * 1000
    weight_bytes = sum(t.numel() * t.element_size() for t in engine.named_weights().values())
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


def table(model: str, rows: dict[str, dict]) -> str:
    lines = [
        f"{model}: | arm | rollout s/1k tok | vs fp32 | train s/1k tok | vs fp32 | rollout tok/s | train tok/s "
        "| sync s | max token |Δ| |",
    ]
    for arm, r in rows.items():
        lines.append(
            f"| {arm} | {r['rollout_s_per_1k_tokens']:.3f} | {r['rollout_vs_fp32']:.2f}× | "
            f"{r['train_s_per_1k_tokens']:.3f} | {r['train_vs_fp32']:.2f}× | {r['rollout_tokens_per_s']:.0f} | "
            f"{r['train_tokens_per_s']:.0f} | {r['sync_s']:.3f} | {r['max_token_abs_log_ratio']:.2g} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="builtin,llama-4.4M")
    parser.add_argument("--arms", default="fp32,bf16,fp16,fp16-exact")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a few sequences per step (the CPU smoke run)")
    parser.add_argument("--tests", action="store_true", help="run the CUDA tests first (pytest -m cuda)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    kernels.check_device(args.device, "--device")
    size = "small" if args.small else "full"
    record = {"numerics": kernels.numerics(args.device).describe(), "argv": sys.argv[1:], "models": {}}
    print(json.dumps(record["numerics"]), flush=True)
    if args.tests:
        tests = Path(__file__).parent.parent / "tests"
        record["cuda_tests_rc"] = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "cuda", str(tests)]
        ).returncode
    bytes_per_s = bandwidth(args.device)
    record["bandwidth_gb_s"] = bytes_per_s / 1e9
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in args.models.split(","):
            model = model_dir(name, tmp)
            rows = summarise(train_arms(model, args, WORKLOADS[size], tmp / "runs" / name.replace("/", "_")))
            precisions = sorted({arm.partition("-")[0] for arm in rows})
            decode = {p: decode_figures(model, p, args.device, DECODE_BATCH[size], bytes_per_s) for p in precisions}
            record["models"][name] = {"arms": rows, "decode": decode}
            print(table(name, rows), flush=True)
            for p, d in decode.items():
                syncs = "" if d["syncs"] is None else f", {d['syncs']:.1f} host syncs/step"
                print(
                    f"{name} {p} decode at batch {d['batch']}: {d['step_ms']:.2f} ms/step, floor "
                    f"{d['floor_ms']:.3f} ms ({d['vs_floor']:.1f}×){syncs}",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    if record.get("cuda_tests_rc"):
        raise SystemExit(f"the CUDA tests failed (pytest exit {record['cuda_tests_rc']})")


if __name__ == "__main__":
    main()
