"""`parity doctor --model DIR`: is this model FP16-safe, and which precision to use.

FP16 keeps 8x more mantissa than BF16 (so a far smaller training-inference
mismatch) but covers only ±65504, with normal numbers down to 6.1e-5. The doctor
measures what decides between them instead of guessing from magnitudes:

* the weights' finiteness;
* one FP16 training pass on a few prompts, through the trainer's own code path:
  the forward (log-probs with the weights cast to FP16) and the backward of a
  policy-gradient-shaped loss under the dynamic loss scaler, backing off the scale
  as training would, without an optimizer step (the weights do not change);
* the mismatch of each precision pair (fp32, bf16, fp16 for both engines);
* per layer, the largest weight and activation against FP16's range, and the share
  of weights too small for FP16 (information, and a caution; they decide nothing).

Verdict, first rule that applies:

1. NaN/inf weights, or an FP32 forward that gives inf/NaN from finite weights (config.json's
   RoPE or norm values) -> "none": no precision trains them; restore or fix the checkpoint.
2. The FP16 forward gives inf/NaN (trainer or rollout engine) -> BF16: activations
   overflow FP16's range; the first layer that overflows is named.
3. The FP16 backward gives inf/NaN even at the scaler's smallest loss scale -> BF16:
   the gradients themselves overflow, which loss scaling cannot fix.
4. FP16's mismatch is smaller than BF16's in k3 and in mean |Δ| per token -> FP16,
   with both ratios and the loss-scale backoffs the backward needed; layers within
   16x of 65504 are named as a caution to watch skipped steps.
5. Otherwise BF16: FP16's precision buys no smaller mismatch.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from parity.commands.mismatch import MismatchConfig, SamplingConfig, load_prompts, run_mismatch
from parity.config import ConfigError
from parity.engines import kernels
from parity.engines.models.io import load_config, load_model, resolve_model_dir
from parity.engines.models.modules import CausalLM
from parity.engines.packing import PackedBatch, pack
from parity.engines.precision import FP16_MAX, FP16_MIN_NORMAL
from parity.engines.tokenizer import load_tokenizer
from parity.engines.trainer import OptimConfig, Trainer
from parity.outdir import claim_output_dir, held_output_dir, write_output, write_output_json
from parity.rl.data import prompt_limit

PROBE_NEW_TOKENS = 48  # each probe prompt's responses in the mismatch measurement
MAX_PROMPTS = 1024  # --prompts: a probe, not an evaluation

# Below this headroom the reason cautions that training may grow activations into overflow.
MIN_HEADROOM = 16.0
# The verdict for weights that hold NaN/inf: no precision will train them.
UNTRAINABLE = "none"


@dataclass
class LayerReport:
    name: str
    weight_max: float
    activation_max: float
    tiny_weight_frac: float  # nonzero weights below FP16's smallest normal (precision lost)

    @property
    def headroom(self) -> float:
        """How many times the largest weight or activation fits below 65504 (NaN when either is NaN)."""
        peaks = (self.weight_max, self.activation_max)
        if any(math.isnan(p) for p in peaks):
            return math.nan
        return FP16_MAX / max(peaks) if max(peaks) > 0 else math.inf


@dataclass(frozen=True)
class FP16Pass:
    """One FP16 training pass: forward, then backward under the dynamic loss scaler."""

    forward_finite: bool
    backward_finite: bool  # at some loss scale the scaler can reach
    loss_scale: float | None  # the scale at which the backward was finite
    backoffs: int  # halvings of the scale before that (each one a skipped step in training)
    overflow_layer: str | None  # the first layer whose FP16 activations are inf/NaN, if any


def non_finite_weights(model: nn.Module) -> list[tuple[str, int]]:
    """(parameter name, number of NaN/inf values) of each parameter that holds any."""
    counts = ((name, int((~torch.isfinite(p.detach())).sum())) for name, p in model.named_parameters())
    return [(name, count) for name, count in counts if count]


def layer_groups(model: CausalLM) -> dict[str, nn.Module]:
    """The embedding, each decoder layer, the final norm and the head, in forward order."""
    groups: dict[str, nn.Module] = {"embed_tokens": model.model.embed_tokens}
    for i, layer in enumerate(model.model.layers):
        groups[f"layer {i}"] = layer
    groups["final_norm"] = model.model.norm
    groups["lm_head"] = model.lm_head
    return groups


def activation_peaks(model: CausalLM, packed: PackedBatch, dtype: torch.dtype) -> dict[str, float]:
    """Largest |output| of any module in each layer group over one forward in `dtype`
    (inf or NaN where the group overflowed; NaN propagates)."""
    groups = layer_groups(model)
    peaks = dict.fromkeys(groups, torch.zeros((), device=packed.token_ids.device))
    hooks = []
    for name, module in groups.items():
        for sub in module.modules():

            def record(_module, _inputs, output, name=name):
                peaks[name] = torch.maximum(peaks[name], output.detach().abs().max().float())

            hooks.append(sub.register_forward_hook(record))
    with torch.no_grad():
        model.logits(model.hidden_states(packed, dtype))
    for h in hooks:
        h.remove()
    # The embedding is a table lookup, not a module call: measure the rows used.
    peaks["embed_tokens"] = model.model.embed_tokens.weight.detach().to(dtype)[packed.token_ids].abs().max().float()
    return {name: float(peak) for name, peak in peaks.items()}


def layer_reports(model: CausalLM, prompts: list[list[int]]) -> list[LayerReport]:
    """Weight and activation magnitudes per layer group, in FP32."""
    device = next(model.parameters()).device
    activation_max = activation_peaks(model, pack(prompts, device=device), torch.float32)
    reports = []
    for name, module in layer_groups(model).items():
        weights = torch.cat([p.detach().abs().flatten() for p in module.parameters()])
        nonzero = weights[weights > 0]
        reports.append(
            LayerReport(
                name=name,
                weight_max=float(weights.max()),
                activation_max=activation_max[name],
                tiny_weight_frac=float((nonzero < FP16_MIN_NORMAL).float().mean()) if nonzero.numel() else 0.0,
            )
        )
    return reports


def teacher_forced(prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Each prompt as a response to its own first token: (contexts, response ids [B, T], mask [B, T]); a
    one-token prompt has nothing to score, and prompts that are all one token are a ConfigError."""
    prompts = [p for p in prompts if len(p) > 1]
    if not prompts:
        raise ConfigError(
            "every probe prompt encodes as one token (the chat template?): the FP16 step scores none; "
            "--chat-template none probes the raw text"
        )
    responses = [p[1:] for p in prompts]
    width = max(len(r) for r in responses)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in responses])
    mask = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in responses])
    return [p[:1] for p in prompts], ids, mask


def measure_fp16_pass(model: CausalLM, prompts: list[list[int]]) -> FP16Pass:
    """Forward and backward of an FP16 training step on `prompts`, as the trainer runs them.

    The loss is -mean log p of the prompt tokens, each scored after the one before:
    a policy-gradient loss with advantage 1 on text the model reads anyway. The
    backward starts at the scaler's initial scale; on inf/NaN gradients the scale
    halves and the pass reruns, as training would over skipped steps, down to the
    scaler's minimum. There is no optimizer step, so the weights do not change.
    """
    trainer = Trainer(model, "fp16", OptimConfig())
    scaler = trainer.scaler
    contexts, responses, mask = teacher_forced(prompts)
    backoffs = 0
    while True:
        logprobs = trainer.logprobs(contexts, responses, mask)
        if not torch.isfinite(logprobs).all():
            # Where the forward overflowed; the stream is the one the trainer just ran.
            peaks = activation_peaks(model, pack(contexts, responses, mask), torch.float16)
            first = next((name for name, peak in peaks.items() if not math.isfinite(peak)), None)
            return FP16Pass(
                forward_finite=False, backward_finite=False, loss_scale=None, backoffs=backoffs, overflow_layer=first
            )
        scale = scaler.scale
        trainer.backward(-logprobs.sum() / mask.sum())
        finite = math.isfinite(float(scaler.unscale(trainer.params)))
        trainer.optimizer.zero_grad(set_to_none=True)
        if finite or scale <= scaler.min_scale:
            return FP16Pass(
                forward_finite=True,
                backward_finite=finite,
                loss_scale=scale if finite else None,
                backoffs=backoffs,
                overflow_layer=None,
            )
        scaler.update(finite=False)
        backoffs += 1


def untrainable_reason(bad: list[tuple[str, int]]) -> str:
    named = ", ".join(f"{name} holds {count} NaN/inf value{'s' if count > 1 else ''}" for name, count in bad[:3])
    more = f" (and {len(bad) - 3} more tensors)" if len(bad) > 3 else ""
    return f"{named}{more}; no precision will train these weights: restore or fix the checkpoint"


def fp32_overflow_reason(layer: str) -> str:
    return (
        f"the FP32 forward gives inf/NaN from {layer} on, with finite weights: config.json's values (RoPE, "
        "norms) make the model compute nothing, in any precision; fix config.json"
    )


def recommend(reports: list[LayerReport], fp16_pass: FP16Pass, mismatch: dict[str, dict]) -> tuple[str, str]:
    """The precision and its reason from the measured FP16 pass and mismatch (rules 2-5 of the module doc)."""
    fp16, bf16 = mismatch["fp16"], mismatch["bf16"]
    if not fp16_pass.forward_finite or any(not math.isfinite(v) for v in fp16.values()):
        where = f" (first in {fp16_pass.overflow_layer})" if fp16_pass.overflow_layer else ""
        return "bf16", (
            f"an FP16 forward produced inf/NaN{where}: activations overflow FP16's range (±65504); "
            "BF16 has FP32's range"
        )
    if not fp16_pass.backward_finite:
        return "bf16", (
            f"the FP16 backward produced inf/NaN gradients even at loss scale 1 ({fp16_pass.backoffs} backoffs): "
            "the gradients overflow FP16's range (±65504) and loss scaling cannot fix that; BF16 has FP32's range"
        )
    compared = ("k3", "token_abs_log_ratio_mean")
    if not all(fp16[k] < bf16[k] for k in compared):
        return "bf16", (
            f"FP16's measured mismatch is not smaller than BF16's (k3 {fp16['k3']:.3g} vs {bf16['k3']:.3g}, "
            f"mean |Δ| per token {fp16['token_abs_log_ratio_mean']:.3g} vs {bf16['token_abs_log_ratio_mean']:.3g}), "
            "so its narrower range buys nothing"
        )
    k3_ratio, token_ratio = (bf16[k] / fp16[k] if fp16[k] > 0 else math.inf for k in compared)
    reason = (
        f"an FP16 forward and backward stay finite (the backward at loss scale {fp16_pass.loss_scale:g} after "
        f"{fp16_pass.backoffs} backoffs) and FP16's mismatch is {k3_ratio:.3g}x smaller than BF16's in k3 "
        f"({token_ratio:.3g}x in mean |Δ| per token); train with dynamic loss scaling (on by default)"
    )
    tightest = min(reports, key=lambda r: r.headroom)
    if tightest.headroom < MIN_HEADROOM:
        peak = max(tightest.weight_max, tightest.activation_max)
        reason += (
            f"; caution: {tightest.name} reaches {peak:.3g}, only {tightest.headroom:.3g}x below 65504, "
            "so watch precision/skipped_steps in training"
        )
    return "fp16", reason


def run_doctor(
    model: str,
    out: Path | None,
    num_prompts: int = 8,
    seed: int = 0,
    chat_template: str = "auto",
    device: str = "cpu",
    progress: bool = True,
) -> dict:
    """Probe with `parity mismatch`'s default prompts (arithmetic for the built-in model, chat questions for
    any other), encoded under `chat_template` (one of CHAT_TEMPLATE_MODES), as training would encode them;
    every model runs on `device`. `progress`: each stage is named on stderr as it starts, with the time so far
    (on a large model on a CPU the whole takes minutes)."""
    start = time.perf_counter()

    def stage(what: str) -> None:
        if progress:
            print(f"doctor: {what} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)

    kernels.check_device(device, "--device")
    if not 1 <= num_prompts <= MAX_PROMPTS:
        raise ConfigError(f"--prompts: must be between 1 and {MAX_PROMPTS}, got {num_prompts}")
    # Held from before the work (minutes on a large model on a CPU): a second doctor there is refused at once.
    with held_output_dir(out, "doctor"):
        result = _diagnose(model, num_prompts, seed, chat_template, device, progress, stage)
        if out is not None:
            claim_output_dir(out, "doctor")
            write_output_json(out / "doctor.json", result)
            write_output(out / "doctor.md", render(result))
    return result


def _diagnose(model: str, num_prompts: int, seed: int, chat_template: str, device: str, progress: bool, stage) -> dict:
    """What doctor.json holds: the layers' weights and activations, then (all finite) an FP16 training pass and
    the mismatch in each precision, and the recommendation."""
    model_dir = resolve_model_dir(model)
    tok = load_tokenizer(model_dir)
    texts = load_prompts("builtin", num_prompts, seed, str(model))
    positions = load_config(model_dir).max_position_embeddings
    limit = prompt_limit(tok, positions, PROBE_NEW_TOKENS, "the doctor's new tokens", chat_template)
    prompts = [limit.check(f"probe prompt {i + 1}", t) for i, t in enumerate(texts)]
    net = load_model(model_dir, kernels.numerics(device))

    stage(f"weights and activations of each layer, {len(prompts)} prompts")
    bad = non_finite_weights(net)
    reports = layer_reports(net, prompts)
    overflow = next((r.name for r in reports if not math.isfinite(r.activation_max)), None)
    if bad or overflow:
        # The layer table shows where NaN/inf spread; a training pass or mismatch through them measures nothing.
        precision, reason = UNTRAINABLE, untrainable_reason(bad) if bad else fp32_overflow_reason(overflow)
        fp16_pass, mismatch = None, {}
    else:
        stage("an FP16 training pass")
        fp16_pass = measure_fp16_pass(net, prompts)
        stage("the mismatch in FP32, BF16 and FP16")
        pairs = run_mismatch(
            MismatchConfig(
                model=str(model),
                group_size=2,
                pairs=["fp32/fp32", "bf16/bf16", "fp16/fp16"],
                sampling=SamplingConfig(max_new_tokens=PROBE_NEW_TOKENS),
                seed=seed,
                chat_template=chat_template,
                device=device,
            ),
            progress=progress,
            texts=texts,
        )
        mismatch = {p.trainer_precision: p.metrics for p in pairs}
        precision, reason = recommend(reports, fp16_pass, mismatch)
    stage("done")
    result = {
        "model": str(model),
        "recommendation": precision,
        "reason": reason,
        "non_finite_weights": [{"name": name, "count": count} for name, count in bad],
        "fp16_pass": None if fp16_pass is None else asdict(fp16_pass),
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
    return result


def render_fp16_pass(p: dict) -> str:
    if not p["forward_finite"]:
        where = f", first in {p['overflow_layer']}" if p["overflow_layer"] else ""
        return f"FP16 training pass: the forward overflows (inf/NaN{where}); no backward."
    if not p["backward_finite"]:
        return f"FP16 training pass: forward finite; gradients inf/NaN down to loss scale 1 ({p['backoffs']} backoffs)."
    return (
        f"FP16 training pass: forward finite; backward finite at loss scale {p['loss_scale']:g} "
        f"after {p['backoffs']} backoffs."
    )


def render(result: dict) -> str:
    lines = [f"# parity doctor: {result['model']}", ""]
    lines += [f"**Recommendation: {result['recommendation'].upper()}** — {result['reason']}.", ""]
    if result["fp16_pass"] is not None:
        lines += [render_fp16_pass(result["fp16_pass"]), ""]
    lines += [
        "| layer | max \\|weight\\| | max \\|activation\\| | FP16 headroom | weights below 6.1e-5 |",
        "|---|---|---|---|---|",
    ]
    for r in result["layers"]:
        headroom = "nan" if math.isnan(r["headroom"]) else f"{r['headroom']:.3g}x"
        flag = " ⚠" if r["headroom"] < MIN_HEADROOM else ""
        lines.append(
            f"| {r['name']} | {r['weight_max']:.3g} | {r['activation_max']:.3g} | {headroom}{flag} | "
            f"{r['tiny_weight_frac']:.2%} |"
        )
    if result["mismatch"]:
        lines += [
            "",
            "| precision (both engines) | k3 | mean \\|Δ\\| per token | mean \\|Σ Δ\\| per sequence |",
            "|---|---|---|---|",
        ]
        for p, m in result["mismatch"].items():
            lines.append(
                f"| {p} | {m['k3']:.3g} | {m['token_abs_log_ratio_mean']:.3g} | {m['seq_abs_log_ratio']:.3g} |"
            )
    return "\n".join(lines) + "\n"
