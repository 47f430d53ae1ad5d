"""The sampling side of a step: the rollout engine, and the trainer's code path on the same weights.

Three policies enter a step (DESIGN.md): μ, the rollout engine's log-probs while it
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
from parity.engines.models import CausalLM, ModelConfig
from parity.engines.rollout import RolloutBatch, RolloutEngine, SamplingParams
from parity.engines.trainer import sequence_logprobs


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
        micro_batch_size: int,
    ):
        self.engine = RolloutEngine(config, rollout_precision, eos_ids, pad_id)
        self.trainer_precision = trainer_precision
        self.score_old = score_old
        self.probe = probe and rollout_precision != trainer_precision
        self.micro_batch_size = micro_batch_size
        # The trainer's model at the sampling weights (FP32 master copy), only when scoring.
        self.scorer = CausalLM(config).requires_grad_(False) if (self.score_old or self.probe) else None

    @property
    def precision(self) -> str:
        return self.engine.precision

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.engine.load_weights(state, version)
        if self.scorer is not None:
            with torch.no_grad():
                for name, tensor in self.scorer.state_dict().items():
                    if name in state:  # a tied head shares the embedding
                        tensor.copy_(state[name])

    @torch.no_grad()
    def score(self, batch: RolloutBatch, precision: str) -> torch.Tensor:
        """Log-probs [B, T] of the batch's tokens from the trainer's code path on the sampling
        weights, in `precision`, in the micro-batches the trainer uses (same shapes, same bits)."""
        if self.scorer is None:
            raise RuntimeError("Sampler.score() needs score_old or probe")
        dtype = prec.to_dtype(precision)
        rows = torch.arange(batch.response_ids.shape[0]).split(self.micro_batch_size)
        return torch.cat(
            [
                sequence_logprobs(
                    self.scorer,
                    [batch.prompt_ids[i] for i in r.tolist()],
                    batch.response_ids[r],
                    batch.response_mask[r],
                    None if batch.support is None else batch.support[r],
                    batch.sampling.temperature,
                    dtype,
                )[1]
                for r in rows
            ]
        )

    def generate(self, prompts: list[list[int]], group_size: int, sampling: SamplingParams, seed: int) -> RolloutBatch:
        """Sample: tokens and μ, at the current weight version."""
        return self.engine.generate(prompts, group_size, sampling, seed)

    def score_samples(self, batch: RolloutBatch) -> None:
        """Fill `batch.old_logprobs` (when `score_old`) and `batch.probe_logprobs` (when `probe`)."""
        if batch.weight_version != self.weight_version:
            raise RuntimeError(
                f"score_samples: the batch was sampled at weight version {batch.weight_version}, "
                f"the sampler now holds {self.weight_version}"
            )
        if self.score_old:
            batch.old_logprobs = self.score(batch, self.trainer_precision)
        if self.probe:
            batch.probe_logprobs = self.score(batch, self.engine.precision)
