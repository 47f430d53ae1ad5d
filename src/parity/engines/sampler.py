"""The sampling side of a step: the rollout engine, and the trainer's code path on the same weights.

Three policies enter a step (docs/design.md, "One step"): μ, the rollout engine's log-probs while it
samples; π_old, the trainer's code path and precision on the weights that sampled;
π_θ, the policy being trained. The sampler owns the weights that sampled, so it is
where π_old can be computed without the learner keeping old weights: after
generating, it scores its own samples with `sequence_logprobs`, the trainer's
function, in the trainer precision (π_old, `ratio_source=shadow`) and, for the
mismatch decomposition, in the rollout precision (the probe):

    β = π_old − probe   the precision gap: same code path, same weights, two precisions
    κ = probe − μ       the engine gap: same precision, two code paths (fused kernels, KV cache)

so that g = π_old − μ = β + κ. In the synchronous loop the weights that sampled are
still the trainer's, so the sampler's π_old equals the one the trainer would
recompute; the asynchronous trainer, whose learners have moved on, needs it.
"""

from __future__ import annotations

import torch

from parity.engines import precision as prec
from parity.engines.batch import RolloutBatch
from parity.engines.kernels import Numerics
from parity.engines.locate import StageDiff, first_divergence, format_table, locate_row, worst_row
from parity.engines.models.config import ModelConfig
from parity.engines.models.decoder import routing_differs
from parity.engines.models.modules import CausalLM
from parity.engines.packing import PackedBatch
from parity.engines.rollout import Between, RolloutEngine
from parity.engines.sampling import SamplingParams
from parity.engines.trainer import full_vocab_logprobs, logprobs_of_batch


class ExactnessError(RuntimeError):
    """Exact mode found the two engines computing different bits; the message says where."""


def check_first_pass(
    numerics: Numerics,
    old: torch.Tensor,
    mask: torch.Tensor,
    rows: torch.Tensor,
    first_pass: torch.Tensor,
    where: str,
) -> None:
    """What `numerics` promise of the trainer's first π_θ pass over `rows` on the weights that sampled: in exact
    mode π_old's bits (its own batch shape and, with sharded learners, its all-gathered weights change none)."""
    differs = numerics.differing(first_pass, old[rows], mask[rows])
    if differs is not None and bool(differs.any()):
        row = int(rows[int(differs.any(-1).nonzero()[0])])
        largest = float(((first_pass - old[rows]) * mask[rows]).abs().max())
        raise ExactnessError(
            f"exact=true, but {where}'s first π_θ pass differs from π_old at {int(differs.sum())} tokens (first "
            f"in row {row}, max |Δ| {largest:.3g}) though it ran on the weights that sampled"
        )


class Sampler:
    """Samples with a `RolloutEngine` and scores what it sampled with the trainer's code path.

    `score_old`: compute π_old (trainer precision) for every batch. `probe`: compute the
    probe (rollout precision) when the two precisions differ; when they match, the
    probe is π_old itself and β = 0 exactly, so no forward runs for it.
    """

    def __init__(
        self,
        config: ModelConfig,
        rollout_precision: str,
        trainer_precision: str,
        eos_ids: tuple[int, ...],
        pad_id: int,
        *,
        score_old: bool,
        probe: bool,
        micro_batch_tokens: int,
        numerics: Numerics,
        routing_replay: bool = False,
    ):
        self.engine = RolloutEngine(config, rollout_precision, eos_ids, pad_id, numerics)
        self.numerics = numerics  # the run's mode: what `verify` holds the engines to
        self.trainer_precision = trainer_precision
        # A MoE model's routing mismatch is measured where π_old is scored, so it is scored every step.
        self.score_old = score_old or config.num_experts > 0
        self.routing_replay = routing_replay
        self.probe = probe and rollout_precision != trainer_precision
        self.micro_batch_tokens = micro_batch_tokens
        # The trainer's model at the sampling weights (FP32 master copy), only when scoring.
        self.scorer = None
        if self.score_old or self.probe:
            self.scorer = CausalLM(config, self.engine.numerics).requires_grad_(False).to(self.engine.device)

    @property
    def precision(self) -> str:
        return self.engine.precision

    @property
    def weight_version(self) -> int:
        return self.engine.weights.version

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.engine.weights.load(state, version)
        if self.scorer is not None:
            with torch.no_grad():
                for name, tensor in self.scorer.state_dict().items():
                    if name in state:  # a tied head shares the embedding
                        tensor.copy_(state[name])

    def load_adapters(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], version: int) -> None:
        """LoRA applied unmerged on the engine's base (`RolloutWeights.load_adapters`)."""
        if self.scorer is not None:
            raise RuntimeError("Sampler.load_adapters: the trainer's code path here holds merged weights only")
        self.engine.weights.load_adapters(adapters, version)

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, precision: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [B, T] of the batch's tokens from the trainer's code path on the sampling
        weights, in `precision`, in the micro-batches the trainer uses (same shapes, same bits);
        for a MoE model, also the fraction of tokens per MoE layer whose experts differ from the
        rollout engine's (the routing mismatch: what the trainer's routers pick, even when the
        experts used are replayed, so a layer's inputs then come from replayed layers below)."""
        if self.scorer is None:
            raise RuntimeError("Sampler.logprobs() needs score_old or probe")
        differing, tokens = 0, 0

        def count_routing(rows: torch.Tensor, packed: PackedBatch) -> None:
            nonlocal differing, tokens
            if packed.routing is not None:
                real = slice(0, packed.num_tokens)
                differing = differing + routing_differs(self.scorer.routing()[real], packed.routing[real]).sum(0)
                tokens += packed.num_tokens

        logprobs = logprobs_of_batch(
            self.scorer, batch, prec.to_dtype(precision), self.micro_batch_tokens, self.routing_replay, count_routing
        )
        mismatch = differing / tokens if tokens else None
        return logprobs, mismatch

    def generate(
        self,
        prompts: list[list[int]],
        group_size: int,
        sampling: SamplingParams,
        seed: int,
        full_vocab: int = 0,
        limits: list[int] | None = None,
        between: Between | None = None,
    ) -> RolloutBatch:
        """Sample: tokens and μ, at the current weight version (and with `full_vocab` > 0 the whole
        distribution at about that many positions); episodes of several turns with `between`
        (`RolloutEngine.generate`)."""
        return self.engine.generate(prompts, group_size, sampling, seed, full_vocab, limits, between=between)

    def fill_full_vocab(self, batch: RolloutBatch, model: CausalLM | None = None) -> None:
        """Fill `batch.full_vocab.trainer_logprobs`: the trainer's code path and precision on the weights
        that sampled, at the positions the engine recorded. `model`: those weights, where this sampler
        keeps no copy of its own (in one process the trainer holds them until it updates)."""
        scorer = self.scorer if model is None else model
        if scorer is None:
            raise RuntimeError("Sampler.fill_full_vocab() needs the sampling weights: score_old, probe or model")
        record = batch.full_vocab
        record.trainer_logprobs = full_vocab_logprobs(scorer, batch, prec.to_dtype(self.trainer_precision))

    def fill_old_logprobs(self, batch: RolloutBatch) -> None:
        """Fill `batch.old_logprobs` (when `score_old`) and `batch.probe_logprobs` (when `probe`)."""
        if batch.weight_version != self.weight_version:
            raise RuntimeError(
                f"fill_old_logprobs: the batch was sampled at weight version {batch.weight_version}, "
                f"the sampler now holds {self.weight_version}"
            )
        if self.score_old:
            batch.old_logprobs, batch.routing_mismatch = self.logprobs(batch, self.trainer_precision)
        if self.probe:
            batch.probe_logprobs = self.logprobs(batch, self.engine.precision)[0]

    def verify(
        self,
        batch: RolloutBatch,
        old: torch.Tensor,
        rows: torch.Tensor | None = None,
        first_pass: torch.Tensor | None = None,
        where: str = "",
    ) -> None:
        """What the numerics in force promise (`Numerics.differing`), checked where the weights that sampled
        still are. Exact mode: every sampled token's μ must equal π_old (`old`); so must every entry of the
        whole distributions the engine recorded, and the trainer's first π_θ pass over `rows` (`first_pass`)
        where it ran on those weights. Raises ExactnessError naming the row and, re-scoring it stage by stage,
        where the engines part; `where` names this sampler (a rollout worker). Plain numerics promise none of
        it, and nothing is checked."""
        numerics = self.numerics
        on = f" on {where}" if where else ""
        mask = batch.sampled_mask
        differs = numerics.differing(old, batch.rollout_logprobs, mask)
        if differs is None:
            return
        if bool(differs.any()):
            row = worst_row(old, batch)
            largest = float(((old - batch.rollout_logprobs) * mask).abs().max())
            diffs = self.locate(batch, row)
            first = first_divergence(diffs)
            part = (
                f"the engines first part at {first.stage} (position {first.first_position}, "
                f"max |Δ| {first.max_abs:.3g})"
                if first is not None
                else "replayed alone, that row gives the same bits in both engines, so the difference depends on "
                "the batch it was computed in"
            )
            raise ExactnessError(
                f"exact=true, but {int(differs.sum())} of {int(mask.sum())} sampled tokens have μ != π_old{on} "
                f"(max |Δ| {largest:.3g}); re-scoring row {row}, {part}. Stage by stage:\n{format_table(diffs)}"
            )
        record = batch.full_vocab
        if record is not None and record.trainer_logprobs is not None:
            valid = record.steps >= 0
            apart = numerics.differing(record.rollout_logprobs, record.trainer_logprobs, valid[..., None])
            differing = apart.any(-1).nonzero()
            if len(differing):
                i, j = differing[0].tolist()
                finite = torch.isfinite(record.rollout_logprobs[i, j])
                gap = (record.rollout_logprobs[i, j] - record.trainer_logprobs[i, j])[finite].abs().max()
                raise ExactnessError(
                    f"exact=true, but at {len(differing)} of {int(valid.sum())} checked positions{on} the whole "
                    f"next-token distribution differs though every sampled token's μ equals π_old (first: row "
                    f"{int(record.rows[i])}, response token {int(record.steps[i, j])}, max |Δ log p| {float(gap):.3g})"
                )
        if rows is not None and first_pass is not None:
            check_first_pass(numerics, old, batch.sampled_mask, rows, first_pass, where or "the trainer")

    def locate(self, batch: RolloutBatch, row: int) -> list[StageDiff]:
        """Where the rollout engine and the trainer's code path (in the rollout precision, on the
        weights that sampled) first differ on one row of `batch`, stage by stage (`engines.locate`).
        The trainer's model is rebuilt from the engine's own weights: in the engine's precision
        they are the trainer's FP32 weights cast as the trainer casts them."""
        model = CausalLM(self.engine.config, self.engine.numerics).requires_grad_(False).to(self.engine.device)
        model.load_state_dict({k: v.float() for k, v in self.engine.weights.named_weights().items()}, strict=False)
        return locate_row(model, self.engine, batch, row, self.engine.dtype)
