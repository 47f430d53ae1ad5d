"""The training engine: FP32 master weights, log-prob forward, scaled backward, step.

The trainer keeps its parameters and AdamW state in FP32. Each forward casts the
weights to the trainer precision on the fly (autograd flows back through the cast
into the FP32 master), so the same code path serves FP32, BF16 and FP16 training
and, with `precision=` overridden, a shadow forward in another precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity import precision as prec
from parity.models import CausalLM, export_state


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm after unscaling; 0 = off
    loss_scale_init: float = 2.0**16
    loss_scale_growth_interval: int = 200


@dataclass(frozen=True)
class StepStats:
    grad_norm: float  # before clipping, after unscaling; inf/nan when the step was skipped
    skipped: bool
    loss_scale: float  # the scale this step's backward used
    skipped_total: int
    weight_version: int


def pack_sequences(
    prompt_ids: list[list[int]], response_ids: torch.Tensor, response_mask: torch.Tensor, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate prompt + response per row, right-padded to the longest row.

    Returns (input_ids [B, L], positions [B, L], score_index [B, T]) where
    `score_index[b, j]` is the input position whose output predicts response token j.
    """
    b, t = response_ids.shape
    dev = response_ids.device
    resp_len = response_mask.sum(-1).tolist()
    prompt_len = torch.tensor([len(p) for p in prompt_ids], device=dev)
    total = max(len(p) + n for p, n in zip(prompt_ids, resp_len))
    input_ids = torch.full((b, total), pad_id, dtype=torch.long, device=dev)
    for i, (p, n) in enumerate(zip(prompt_ids, resp_len)):
        input_ids[i, : len(p)] = torch.tensor(p, device=dev)
        input_ids[i, len(p) : len(p) + n] = response_ids[i, :n]
    positions = torch.arange(total, device=dev).expand(b, total)
    score_index = (prompt_len[:, None] - 1 + torch.arange(t, device=dev)).clamp(max=total - 1)
    return input_ids, positions, score_index


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, support: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature) restricted to `support`.

    `logits` [B, T, V] FP32; `support` [B, T, K] token ids (-1 = padding) or None for
    the full vocabulary.
    """
    logits = logits / temperature
    picked = logits.gather(-1, tokens[..., None]).squeeze(-1)
    if support is None:
        return picked - torch.logsumexp(logits, dim=-1)
    kept = logits.gather(-1, support.clamp(min=0)).masked_fill(support < 0, float("-inf"))
    return picked - torch.logsumexp(kept, dim=-1)


class Trainer:
    def __init__(self, model: CausalLM, precision: str, optim: OptimConfig, pad_id: int):
        self.model = model.float()
        self.precision = precision
        self.dtype = prec.to_dtype(precision)
        self.pad_id = pad_id
        self.optim_config = optim
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
        )
        self.scaler = prec.DynamicLossScaler(
            enabled=precision == "fp16",
            init_scale=optim.loss_scale_init,
            growth_interval=optim.loss_scale_growth_interval,
        )
        self.weight_version = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def logprobs(
        self,
        prompt_ids: list[list[int]],
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        support: torch.Tensor | None = None,
        temperature: float = 1.0,
        precision: str | None = None,
    ) -> torch.Tensor:
        """π of each response token [B, T] FP32 (0 on padding); differentiable when grad is on.

        `precision` overrides the trainer precision for this forward (shadow forward).
        """
        dtype = self.dtype if precision is None else prec.to_dtype(precision)
        input_ids, positions, score_index = pack_sequences(prompt_ids, response_ids, response_mask, self.pad_id)
        hidden = self.model.hidden_states(input_ids, positions, dtype)
        hidden = hidden.gather(1, score_index[..., None].expand(-1, -1, hidden.shape[-1]))
        logp = token_logprobs(self.model.logits(hidden), response_ids, support, temperature)
        return logp.masked_fill(~response_mask, 0.0)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` times the current loss scale (1 unless FP16)."""
        (loss * self.scaler.scale).backward()

    def step(self) -> StepStats:
        """Unscale, check, clip, and apply the optimizer step (skipped on inf/NaN)."""
        scale = self.scaler.scale
        finite = self.scaler.unscale_and_check(self.params)
        if finite:
            max_norm = self.optim_config.grad_clip if self.optim_config.grad_clip > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
            self.optimizer.step()
            self.weight_version += 1
        else:
            grad_norm = float("nan")
        self.scaler.update(finite)
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(
            grad_norm=grad_norm,
            skipped=not finite,
            loss_scale=scale,
            skipped_total=self.scaler.skipped_steps,
            weight_version=self.weight_version,
        )

    def export_weights(self) -> tuple[dict[str, torch.Tensor], int]:
        """FP32 weights and their version, for `RolloutEngine.load_weights` (which casts)."""
        return export_state(self.model), self.weight_version
