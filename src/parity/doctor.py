"""`parity doctor --model DIR`: is this model FP16-safe, and which precision to use.

FP16 keeps 8x more mantissa than BF16 (so a far smaller training-inference
mismatch) but covers only ±65504, with normal numbers down to 6.1e-5. The
doctor measures, per layer, the largest weight and activation against that
range, the share of weights too small for FP16, and the mismatch of each
precision pair on a few prompts, then recommends a precision with its reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from parity.files import atomic_write_json, atomic_write_text
from parity.mismatch import MismatchConfig, SamplingConfig, run_mismatch
from parity.models import load_model, load_tokenizer, resolve_model_dir
from parity.packing import pack
from parity.precision import FP16_MAX, FP16_MIN_NORMAL
from parity.tasks import ArithmeticTask

GENERIC_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "12 + 35 =",
    "Water boils at",
    "The quick brown fox",
    "In 1969, the first",
    "Translate to French: good morning",
)
# Activations this close to 65504 leave no room for the growth training brings.
MIN_HEADROOM = 16.0


@dataclass
class LayerReport:
    name: str
    weight_max: float
    activation_max: float
    tiny_weight_frac: float  # nonzero weights below FP16's smallest normal (precision lost)

    @property
    def headroom(self) -> float:
        peak = max(self.weight_max, self.activation_max)
        return FP16_MAX / peak if peak > 0 else math.inf


def layer_reports(model, input_ids: torch.Tensor) -> list[LayerReport]:
    """Weight and activation magnitudes per decoder layer (and the embedding/head), in FP32."""
    groups = {"embed_tokens": model.model.embed_tokens, "lm_head": model.lm_head, "final_norm": model.model.norm}
    for i, layer in enumerate(model.model.layers):
        groups[f"layer {i}"] = layer
    act_max: dict[str, float] = dict.fromkeys(groups, 0.0)
    hooks = []
    for name, module in groups.items():
        for sub in module.modules():

            def record(_module, _inputs, output, name=name):
                act_max[name] = max(act_max[name], float(output.detach().abs().max()))

            hooks.append(sub.register_forward_hook(record))
    with torch.no_grad():
        model.logits(model.hidden_states(pack(input_ids.tolist()), torch.float32))
    for h in hooks:
        h.remove()
    # The embedding is a table lookup, not a module call: measure the rows used.
    act_max["embed_tokens"] = float(model.model.embed_tokens.weight.detach()[input_ids].abs().max())
    reports = []
    for name, module in groups.items():
        weights = torch.cat([p.detach().abs().flatten() for p in module.parameters()])
        nonzero = weights[weights > 0]
        reports.append(
            LayerReport(
                name=name,
                weight_max=float(weights.max()),
                activation_max=act_max[name],
                tiny_weight_frac=float((nonzero < FP16_MIN_NORMAL).float().mean()) if nonzero.numel() else 0.0,
            )
        )
    return reports


def recommend(reports: list[LayerReport], mismatch: dict[str, dict]) -> tuple[str, str]:
    worst = min(reports, key=lambda r: r.headroom)
    fp16 = mismatch.get("fp16", {})
    if any(not math.isfinite(v) for v in fp16.values()):
        return "bf16", "an FP16 forward produced inf/NaN: activations overflow FP16's range (±65504)"
    if worst.headroom < MIN_HEADROOM:
        peak = max(worst.weight_max, worst.activation_max)
        return "bf16", (
            f"{worst.name} reaches {peak:.3g}, within {worst.headroom:.3g}x of FP16's maximum 65504 "
            f"(Parity asks for {MIN_HEADROOM:g}x headroom); BF16 has FP32's range"
        )
    ratio = ""
    if "bf16" in mismatch and fp16.get("k3", 0) > 0:
        ratio = f"; its mismatch k3 is {mismatch['bf16']['k3'] / fp16['k3']:.3g}x smaller than BF16's"
    return "fp16", (
        f"every weight and activation stays at least {worst.headroom:.3g}x below FP16's maximum "
        f"(tightest: {worst.name}){ratio}; train with dynamic loss scaling (on by default)"
    )


def run_doctor(model: str, out: Path | None, num_prompts: int = 8, seed: int = 0) -> dict:
    model_dir = resolve_model_dir(model)
    tok = load_tokenizer(model_dir)
    net = load_model(model_dir)
    if str(model) == "builtin":
        texts = [p.prompt for p in ArithmeticTask().problems(num_prompts, seed=seed, split="eval")]
    else:
        texts = list(GENERIC_PROMPTS[:num_prompts])
    encoded = [tok.encode(t) for t in texts]
    width = min(len(e) for e in encoded)
    reports = layer_reports(net, torch.tensor([e[:width] for e in encoded]))

    pairs = run_mismatch(
        MismatchConfig(
            model=str(model),
            group_size=2,
            pairs=["fp32/fp32", "bf16/bf16", "fp16/fp16"],
            sampling=SamplingConfig(max_new_tokens=48),
            seed=seed,
        ),
        progress=False,
        texts=texts,
    )
    mismatch = {p.trainer_precision: p.metrics for p in pairs}
    precision, reason = recommend(reports, mismatch)
    result = {
        "model": str(model),
        "recommendation": precision,
        "reason": reason,
        "layers": [
            {
                "name": r.name,
                "weight_max": r.weight_max,
                "activation_max": r.activation_max,
                "headroom": r.headroom,
                "tiny_weight_frac": r.tiny_weight_frac,
            }
            for r in reports
        ],
        "mismatch": mismatch,
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "doctor.json", result)
        atomic_write_text(out / "doctor.md", render(result))
    return result


def render(result: dict) -> str:
    lines = [
        f"# parity doctor: {result['model']}",
        "",
        f"**Recommendation: {result['recommendation'].upper()}** — {result['reason']}.",
        "",
        "| layer | max \\|weight\\| | max \\|activation\\| | FP16 headroom | weights below 6.1e-5 |",
        "|---|---|---|---|---|",
    ]
    for r in result["layers"]:
        flag = " ⚠" if r["headroom"] < MIN_HEADROOM else ""
        lines.append(
            f"| {r['name']} | {r['weight_max']:.3g} | {r['activation_max']:.3g} | {r['headroom']:.3g}x{flag} | "
            f"{r['tiny_weight_frac']:.2%} |"
        )
    lines += [
        "",
        "| precision (both engines) | k3 | mean \\|Δ\\| per token | mean \\|Σ Δ\\| per sequence |",
        "|---|---|---|---|",
    ]
    for p, m in result["mismatch"].items():
        lines.append(f"| {p} | {m['k3']:.3g} | {m['token_abs_log_ratio_mean']:.3g} | {m['seq_abs_log_ratio']:.3g} |")
    return "\n".join(lines) + "\n"
