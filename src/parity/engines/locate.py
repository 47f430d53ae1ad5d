"""Where the rollout engine and the trainer first compute different bits.

`locate` replays one sampled sequence through both engines on the same weights,
records every stage of the forward pass for every position (each layer's input
norm, attention before and after its output projection, MLP and residual
output; then the final norm, the logits and the log-probability), and compares
them in forward order. The first stage that differs is where the two code paths
part; everything after it inherits the difference. Exact mode's runtime check
names that stage when a token's μ and π_old differ; `parity mismatch --locate`
prints the whole table for any model and precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity.engines.batch import RolloutBatch
from parity.engines.models.decoder import LAYER_STAGES
from parity.engines.models.modules import CausalLM, final_logits
from parity.engines.packing import pack
from parity.engines.rollout import RolloutEngine
from parity.engines.sampling import SamplingParams
from parity.engines.trainer import token_logprobs


@dataclass(frozen=True)
class StageDiff:
    stage: str  # e.g. "layer3.attention" or "logits"
    max_abs: float  # largest |rollout − trainer| over the stage's elements
    differing_positions: int  # positions where any element differs
    first_position: int | None  # the first such position (in the sequence; None if none)


def trainer_trace(
    model: CausalLM,
    prompt: list[int],
    response: list[int],
    dtype: torch.dtype,
    support: torch.Tensor | None,
    temperature: float,
) -> dict[str, torch.Tensor]:
    """The trainer's code path on one sequence, every stage as `RolloutEngine.trace` records it."""
    stages: dict[str, torch.Tensor] = {}

    def keep(name: str, value: torch.Tensor) -> None:
        stages[name] = value.detach().float()

    device = next(model.parameters()).device
    tokens = torch.tensor([response], device=device)
    packed = pack([prompt], tokens, torch.ones_like(tokens, dtype=torch.bool))
    handle = model.model.norm.register_forward_hook(lambda module, inputs, output: keep("norm", output))
    try:
        with torch.no_grad(), model.traced(keep):
            logits = model(packed, dtype)
    finally:
        handle.remove()
    stages["norm"] = stages["norm"][packed.score_index]
    cap = model.config.final_softcap
    stages["logits"] = final_logits(logits, cap)
    stages["logprob"] = token_logprobs(logits, tokens[0], support, temperature, cap, model.numerics)[:, None]
    return {name: value.cpu() for name, value in stages.items()}


def compare(rollout: dict[str, torch.Tensor], trainer: dict[str, torch.Tensor], prompt_len: int) -> list[StageDiff]:
    """Per stage in forward order: how far apart the two traces are. Positions count from the
    sequence start for layer stages and from the first response token's prediction (the last
    prompt token, position prompt_len − 1) for norm, logits and log-prob."""
    layers = sorted({int(name.split(".")[0].removeprefix("layer")) for name in trainer if name.startswith("layer")})
    order = [f"layer{i}.{part}" for i in layers for part in LAYER_STAGES] + ["norm", "logits", "logprob"]
    out = []
    for name in order:
        a, b = rollout[name], trainer[name]
        differs = (a != b).any(-1) & ~(a.isnan() & b.isnan()).all(-1)
        offset = 0 if name.startswith("layer") else prompt_len - 1
        first = int(differs.nonzero()[0]) + offset if bool(differs.any()) else None
        out.append(StageDiff(name, float((a - b).abs().nan_to_num(nan=float("inf")).max()), int(differs.sum()), first))
    return out


def locate(
    model: CausalLM,
    engine: RolloutEngine,
    prompt: list[int],
    response: list[int],
    sampling: SamplingParams,
    dtype: torch.dtype,
    support: torch.Tensor | None = None,
) -> list[StageDiff]:
    """Replay one sequence through both engines (the engine in its precision, the trainer's
    model in `dtype`, on the same weights) and compare every stage; `support` [T, K] is the
    row's sampling support when top-k/top-p filtered it."""
    rollout = engine.trace(prompt, response, sampling)
    trainer = trainer_trace(model, prompt, response, dtype, support, sampling.temperature)
    return compare(rollout, trainer, len(prompt))


def locate_row(
    model: CausalLM, engine: RolloutEngine, batch: RolloutBatch, row: int, dtype: torch.dtype
) -> list[StageDiff]:
    """`locate` on row `row` of a sampled batch: its prompt, response and sampling support."""
    n = int(batch.response_mask[row].sum())
    support = None if batch.support is None else batch.support[row, :n]
    response = batch.response_ids[row, :n].tolist()
    return locate(model, engine, batch.prompt_ids[row], response, batch.sampling, dtype, support)


def worst_row(logprobs: torch.Tensor, batch: RolloutBatch) -> int:
    """The row holding the token whose `logprobs` lie furthest from the batch's μ."""
    gap = ((logprobs - batch.rollout_logprobs).abs() * batch.sampled_mask).flatten()
    return int(gap.argmax()) // batch.sampled_mask.shape[1]


def first_divergence(diffs: list[StageDiff]) -> StageDiff | None:
    return next((d for d in diffs if d.differing_positions), None)


def format_table(diffs: list[StageDiff]) -> str:
    lines = [f"{'stage':<24} {'max |Δ|':>10} {'positions differing':>20} {'first at':>9}"]
    for d in diffs:
        first = "" if d.first_position is None else str(d.first_position)
        lines.append(f"{d.stage:<24} {d.max_abs:>10.3g} {d.differing_positions:>20} {first:>9}")
    return "\n".join(lines)
