"""The training engine: FP32 master weights, log-prob forward, scaled backward, step.

The trainer keeps its parameters and AdamW state in FP32. Each forward casts the
weights to the trainer precision on the fly (autograd flows back through the cast
into the FP32 master), so one code path, `sequence_logprobs`, serves FP32, BF16 and
FP16 training, and the sampler runs the same function on the weights that sampled
(π_old, and the precision probe in the rollout precision).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from parity.engines import kernels
from parity.engines import precision as prec
from parity.engines.batch import RolloutBatch
from parity.engines.lora import LoRAConfig, adapter_pairs, apply_lora, base_state, merged_state
from parity.engines.models.config import ModelConfig
from parity.engines.models.io import export_state
from parity.engines.models.modules import CausalLM, final_logits
from parity.engines.packing import PackedBatch, Routing, pack


@dataclass
class OptimConfig:
    """The trainer's optimizer and loss scaler (a run's `trainer.*` keys extend it: `rl/train_config.py`)."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm after unscaling; 0 = off
    loss_scale_init: float = 2.0**16
    loss_scale_growth_interval: int = 200


def scheduled_lr(base: float, schedule: str, warmup_steps: int, step: int, total_steps: int) -> float:
    """The learning rate of RL step `step` (0-based) of `total_steps`, as transformers' schedulers give it
    after `step` scheduler steps (`get_constant_schedule_with_warmup`, `get_linear_schedule_with_warmup`,
    `get_cosine_schedule_with_warmup` with `num_training_steps=total_steps`): base·step/warmup_steps over
    the first `warmup_steps` steps (0 at step 0), then `constant`, or falling towards 0 along a `linear` or
    `cosine` schedule that reaches 0 one step past the last (so the last step still learns)."""
    if step < warmup_steps:
        return base * step / warmup_steps
    if schedule == "constant":
        return base
    span = max(total_steps - warmup_steps, 1)
    done = min((step - warmup_steps) / span, 1.0)
    if schedule == "linear":
        return base * (1.0 - done)
    if schedule == "cosine":
        return base * 0.5 * (1.0 + math.cos(math.pi * done))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}")


@dataclass(frozen=True)
class StepStats:
    grad_norm: float  # before clipping, after unscaling; inf/nan when the step was skipped
    skipped: bool
    loss_scale: float  # the scale this step's backward used
    skipped_total: int
    weight_version: int


# Elements of [rows, V] FP32 worked on at once by `HeadLogProbs`, whatever the vocabulary: 32 MiB on the
# CPU (cache-sized); 256 MiB on a GPU, where each chunk costs a few kernel launches (a 151,936-word
# vocabulary gave 55-row chunks at 32 MiB: ~180 chunks for 10k tokens).
LOGPROB_CHUNK_ELEMENTS = {"cpu": 2**23, "cuda": 2**26}
# ... by `ChunkedHeadLogProbs`, whose every chunk also adds a [V, H] product into the weight's gradient: on a
# GPU, 16-bit products of 74 chunks (32k tokens of Qwen2.5-0.5B at 2**26) would move about 120 GB; at 2**28,
# 19 chunks, a quarter of that. Not yet measured on a card (`benchmarks/gpu_probe.py`'s sweep measures both
# heads). The CPU keeps its chunks under glibc's mmap cap (`runtime.py`), and its FP32 sum adds in place.
CHUNKED_HEAD_ELEMENTS = {"cpu": 2**23, "cuda": 2**28}


class HeadLogProbs(torch.autograd.Function):
    """log p(token) from the LM head's output `head` [M, V] (any dtype), with the soft-cap `cap` and
    `temperature` applied in FP32, over the whole vocabulary or over each row's `support` [M, K] (token
    ids, -1 = padding): [M] FP32, with `numerics`' arithmetic (`Numerics.token_logprobs`: exact mode's is
    the rollout engine's, for the same bits; one Triton pass over each row where `Numerics.fused_head`).

    Autograd's log-softmax would hold [M, V] FP32 tensors three times over (the upcast logits,
    the saved output, the gradient; 300 MB each for 1,536 tokens of a 49k vocabulary). This keeps
    only `head` itself (what the matmul wrote, in its dtype) and each row's log-normaliser, and works in
    row chunks of LOGPROB_CHUNK_ELEMENTS, forward and backward (the fused head in one: `_head_chunks`): the
    same function and gradient."""

    @staticmethod
    def forward(
        ctx, head, tokens, support, temperature: float, cap: float | None, numerics: kernels.Numerics, reuse: bool
    ):
        picked = torch.empty(head.shape[0], device=head.device)
        lse = torch.empty_like(picked)
        for chunk in _head_chunks(head, support, numerics):
            picked[chunk], lse[chunk] = _chunk_logprobs(
                head[chunk], tokens[chunk], _rows(support, chunk), temperature, cap, numerics
            )
        ctx.save_for_backward(head, tokens, lse, *(() if support is None else (support,)))
        ctx.temperature, ctx.cap, ctx.numerics, ctx.reuse = temperature, cap, numerics, reuse
        return picked

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        head, tokens, lse, *support = ctx.saved_tensors
        support = support[0] if support else None
        # `reuse`: nothing reads `head` after this, and each chunk's gradient overwrites it once read. A fresh
        # [M, V] tensor is first-touched memory: 1.1 s of page faults a step at 4,096 scored tokens (SmolLM2).
        out = head if ctx.reuse else torch.empty_like(head)
        for chunk in _head_chunks(head, support, ctx.numerics):
            _head_gradient(
                head[chunk], tokens[chunk], lse[chunk], grad[chunk], _rows(support, chunk), ctx.temperature, ctx.cap,
                ctx.numerics, out[chunk],
            )  # fmt: skip
        return out, None, None, None, None, None, None


class ChunkedHeadLogProbs(torch.autograd.Function):
    """`HeadLogProbs` from the LM head's input: the final hidden states `hidden` [M, H] and the head's weight
    [V, H] as the model multiplies them in the compute dtype (`Linear.weight_in`).
    Each chunk of rows goes through the head, gives its log-probabilities, and is gone; the backward computes
    each chunk's head again, its gradient, and that chunk's share of the hidden states' and the weight's. No
    [M, V] tensor exists at any time (what `HeadLogProbs` keeps from the forward to the backward is the whole
    head: 10 GB at 32k tokens of a 152k vocabulary in BF16), for one more pass of the head's matmul. The
    values are the ones `numerics.linear` gives each chunk's rows (exact mode's: the unchunked head's bits)."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, support, temperature: float, cap: float | None, numerics):
        picked = torch.empty(hidden.shape[0], device=hidden.device)
        lse = torch.empty_like(picked)
        for chunk in _row_chunks(hidden.shape[0], weight.shape[0], hidden.device, CHUNKED_HEAD_ELEMENTS):
            head = numerics.linear(hidden[chunk], weight)
            picked[chunk], lse[chunk] = _chunk_logprobs(
                head, tokens[chunk], _rows(support, chunk), temperature, cap, numerics
            )
        ctx.save_for_backward(hidden, weight, tokens, lse, *(() if support is None else (support,)))
        ctx.temperature, ctx.cap, ctx.numerics = temperature, cap, numerics
        return picked

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, tokens, lse, *support = ctx.saved_tensors
        support = support[0] if support else None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # Summed over the chunks in FP32 (in place: a fresh [V, H] per chunk cost 3.6 s a step in page faults,
        # SmolLM2 at 4,096 tokens), rounded to the weight's dtype once; a 16-bit product goes through one buffer.
        grad_weight = weight.new_zeros(weight.shape, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        product = None if grad_weight is None or weight.dtype == torch.float32 else torch.empty_like(weight)
        for chunk in _row_chunks(hidden.shape[0], weight.shape[0], hidden.device, CHUNKED_HEAD_ELEMENTS):
            head = ctx.numerics.linear(hidden[chunk], weight)
            # Into the head's own storage, in its dtype: the matmuls' backward runs in the compute dtype, as a
            # `Linear`'s does.
            dz = _head_gradient(
                head, tokens[chunk], lse[chunk], grad[chunk], _rows(support, chunk), ctx.temperature, ctx.cap,
                ctx.numerics, head,
            )  # fmt: skip
            if grad_hidden is not None:
                grad_hidden[chunk] = dz @ weight
            if product is not None:
                grad_weight += torch.mm(dz.T, hidden[chunk], out=product)
            elif grad_weight is not None:
                grad_weight.addmm_(dz.T, hidden[chunk])
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _chunk_logprobs(
    head, tokens, support, temperature: float, cap: float | None, numerics: kernels.Numerics
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(token), the log-normaliser) [rows] FP32 of a chunk of the head's rows."""
    if numerics.fused_head(head, support):
        from parity.engines.kernels import head as fused_head

        return fused_head.logprobs(head, tokens, temperature, cap)
    return numerics.token_logprobs(_scaled(head, temperature, cap), tokens, support)


def _head_gradient(
    head, tokens, lse, grad, support, temperature: float, cap: float | None, numerics: kernels.Numerics, out
) -> torch.Tensor:
    """d log p(token) / d head for a chunk of rows, times the incoming gradient `grad` [rows], written into `out`
    [rows, V] (`head` itself allowed) in its dtype and returned. d log p(t) / dz = onehot(t) - softmax(z) over the
    support; then the temperature's and the soft-cap's factors (FP32)."""
    if numerics.fused_head(head, support):
        from parity.engines.kernels import head as fused_head

        return fused_head.gradient(head, tokens, lse, grad, temperature, cap, out)
    g = grad[:, None]
    z = _scaled(head, temperature, cap)
    if support is not None:
        z = kernels.restrict(z, support)
    dz = torch.exp(z - lse[:, None]).mul_(-g)
    dz.scatter_add_(-1, tokens[:, None], g)
    if temperature != 1.0:
        dz /= temperature
    if cap is not None:  # d cap·tanh(x / cap) / dx = 1 - tanh²
        dz *= 1 - torch.tanh(head.float() / cap).square()
    return out.copy_(dz)


def _row_chunks(rows: int, vocab: int, device: torch.device, elements: dict | None = None) -> list[slice]:
    """Slices of `rows` rows, each [chunk, vocab] holding about `elements` (default LOGPROB_CHUNK_ELEMENTS)."""
    elements = elements or LOGPROB_CHUNK_ELEMENTS
    size = max(1, elements.get(device.type, elements["cpu"]) // vocab)
    return [slice(start, start + size) for start in range(0, rows, size)]


def _head_chunks(head: torch.Tensor, support: torch.Tensor | None, numerics: kernels.Numerics) -> list[slice]:
    """`HeadLogProbs`' chunks of rows: all of them at once where the fused head makes no FP32 copy of them (a
    program per row, as many programs as rows), else `_row_chunks`."""
    return [slice(None)] if numerics.fused_head(head, support) else _row_chunks(*head.shape, head.device)


def _rows(support: torch.Tensor | None, chunk: slice) -> torch.Tensor | None:
    return None if support is None else support[chunk]


def _scaled(head: torch.Tensor, temperature: float, cap: float | None) -> torch.Tensor:
    z = final_logits(head, cap)
    return z / temperature if temperature != 1.0 else z


def token_logprobs(
    head: torch.Tensor,
    tokens: torch.Tensor,
    support: torch.Tensor | None,
    temperature: float,
    cap: float | None = None,
    numerics: kernels.Numerics | None = None,
    reuse_head: bool = False,
) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature) restricted to `support`, [M] FP32 (`HeadLogProbs`).

    `head` [M, V] is the LM head's output (`CausalLM.forward`; its final soft-cap `cap` not yet
    applied), `tokens` [M]; `support` [M, K] token ids (-1 = padding) or None for the full
    vocabulary. `numerics`: the model's (default: the plain arithmetic of `head`'s device). `reuse_head`:
    the caller reads `head` no more, and the backward writes the gradient into it.
    """
    numerics = numerics or kernels.numerics(head.device)
    return HeadLogProbs.apply(head, tokens, support, temperature, cap, numerics, reuse_head)


def matmul_flops(cfg: ModelConfig, packed: PackedBatch, scored: int) -> float:
    """Model FLOPs (2 per multiply-add) of one forward over `packed` scoring `scored`
    tokens: projections and MLP per stream token, causal attention over its lower
    triangle, the LM head per scored token. Padding and recomputation are not counted."""
    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_token = cfg.hidden_size * (2 * q_width + 2 * kv_width + 3 * cfg.intermediate_size)
    lengths = packed.seq_lengths.double()
    attention = 2 * q_width * float((lengths * (lengths + 1)).sum())  # QKᵀ and PV per layer
    layers = cfg.num_layers * (2 * per_token * packed.num_tokens + attention)
    return layers + 2 * cfg.hidden_size * cfg.vocab_size * scored


def sequence_logprobs(
    model: CausalLM,
    prompt_ids: list[list[int]],
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    support: torch.Tensor | None,
    temperature: float,
    dtype: torch.dtype,
    routing: Routing | None = None,
    replay: bool = False,
    on_head: Callable[[Callable[[torch.Tensor], torch.Tensor]], None] | None = None,
) -> tuple[PackedBatch, torch.Tensor]:
    """The trainer's code path: log p of each response token [B, T] FP32 (0 on padding)
    with the model computed in `dtype`, and the packed batch it ran on. `routing` (the
    rollout engine's experts, MoE models) travels in the packed batch; `replay` uses it.
    `on_head` is given a function from positions among the response tokens (row-major) to the LM head's
    output there (`record_full_vocab`). The head is computed a chunk at a time where `model.chunks_head`.
    The log-probs are on the model's device, wherever the batch is."""
    device = next(model.parameters()).device
    response_ids, response_mask = response_ids.to(device), response_mask.to(device)
    support = None if support is None else support.to(device)
    routing = None if routing is None else routing.to(device)
    bucket = kernels.per_shape_kernels(dtype, device)
    packed = pack(prompt_ids, response_ids, response_mask, bucket=bucket, routing=routing)
    num_scored = int(response_mask.sum())
    tokens, kept = response_ids[response_mask], None if support is None else support[response_mask]
    cap, numerics = model.config.final_softcap, model.numerics

    def chunked(hidden: torch.Tensor, lm_head) -> torch.Tensor:
        hidden = hidden[:num_scored]  # a bucketed batch's padding goes
        if on_head is not None:
            with torch.no_grad():
                on_head(lambda at: lm_head(hidden[at]))
        return ChunkedHeadLogProbs.apply(
            hidden, lm_head.weight_in(hidden.dtype), tokens, kept, temperature, cap, numerics
        )

    if model.chunks_head(num_scored, dtype):
        scored = model(packed, dtype, replay, head=chunked)
    else:
        head = model(packed, dtype, replay)
        if head.shape[0] != num_scored:  # a bucketed batch's padding (a slice that keeps every row costs a copy back)
            head = head[:num_scored]
        if on_head is not None:
            on_head(lambda at: head.detach()[at])
        scored = token_logprobs(head, tokens, kept, temperature, cap, numerics, reuse_head=True)
    out = torch.zeros(response_ids.shape, dtype=scored.dtype, device=scored.device)
    return packed, out.masked_scatter(response_mask, scored)


def logprobs_of_rows(
    model: CausalLM,
    batch: RolloutBatch,
    rows: torch.Tensor,
    dtype: torch.dtype,
    replay: bool = False,
    on_head: Callable[[Callable[[torch.Tensor], torch.Tensor]], None] | None = None,
) -> tuple[PackedBatch, torch.Tensor]:
    """`sequence_logprobs` on `rows` of a rollout batch: their prompts and responses, at the temperature
    they were sampled at, restricted to each token's recorded support, with the rollout engine's experts
    (replayed when `replay`). The one way a batch's rows reach the trainer's code path."""
    return sequence_logprobs(
        model,
        [batch.prompt_ids[i] for i in rows.tolist()],
        batch.response_ids[rows],
        batch.response_mask[rows],
        None if batch.support is None else batch.support[rows],
        batch.sampling.temperature,
        dtype,
        None if batch.routing is None else batch.routing.rows(rows),
        replay,
        on_head,
    )


@torch.no_grad()
def logprobs_of_batch(
    model: CausalLM,
    batch: RolloutBatch,
    dtype: torch.dtype,
    micro_batch_tokens: int,
    replay: bool = False,
    each: Callable[[torch.Tensor, PackedBatch], None] | None = None,
) -> torch.Tensor:
    """Log-probs [B, T] of every row of the batch from the trainer's code path, in the micro-batches the
    trainer trains in (`RolloutBatch.micro_batches`), so that a score and a training pass run the same
    shapes (in exact mode, the same bits). `each(rows, packed)` sees every pass while the model still holds
    what the pass recorded (a MoE model's routing)."""
    parts = []
    with model.casting_once():
        for rows in batch.micro_batches(torch.arange(batch.response_ids.shape[0]), micro_batch_tokens):
            packed, scored = logprobs_of_rows(model, batch, rows, dtype, replay)
            if each is not None:
                each(rows, packed)
            parts.append(scored)
    return torch.cat(parts)


@torch.no_grad()
def full_vocab_logprobs(model: CausalLM, batch: RolloutBatch, dtype: torch.dtype) -> torch.Tensor:
    """The trainer's code path at the positions `batch.full_vocab` recorded: log-probs over the whole
    vocabulary [R, k, V] FP32, restricted to the sampled support and at the sampling temperature as the
    rollout engine's were (its arithmetic, so that exact mode gives the same bits); NaN where a row had
    fewer positions than k. The recorded rows only are run again."""
    record = batch.full_vocab
    device = next(model.parameters()).device
    rows = record.rows.to(device)
    mask = batch.response_mask.to(device)[rows]
    packed = pack([batch.prompt_ids[r] for r in rows.tolist()], batch.response_ids.to(device)[rows], mask, routing=None)
    # Only the recorded positions go through the LM head (a vocabulary-wide matmul each).
    steps = record.steps.to(device)
    head = model.lm_head(model.hidden_states(packed, dtype)[packed.score_index[_recorded_positions(mask, steps)]])
    return _full_vocab_rows(head, batch, rows, steps, model.config.final_softcap)


@torch.no_grad()
def record_full_vocab(
    batch: RolloutBatch,
    rows: torch.Tensor,
    head_at: Callable[[torch.Tensor], torch.Tensor],
    cap: float | None,
    device: torch.device,
) -> None:
    """`full_vocab_logprobs` from a pass the trainer makes anyway, on `device`: fill
    `batch.full_vocab.trainer_logprobs` for the recorded rows among `rows` from `head_at(positions)`, the LM
    head's output at positions among those rows' response tokens (`sequence_logprobs`'s `on_head`), on the
    weights that sampled."""
    record = batch.full_vocab
    if record.trainer_logprobs is None:
        record.trainer_logprobs = torch.full(record.rollout_logprobs.shape, float("nan"), device=device)
    match = rows.to(device)[None, :] == record.rows.to(device)[:, None]  # [R, len(rows)]
    found = match.any(-1)
    if not bool(found.any()):
        return
    steps = record.steps.to(device)[found]
    at = match[found].int().argmax(-1)  # each found row's place among `rows`
    mask = batch.response_mask.to(device)[rows.to(device)]
    head = head_at(_recorded_positions(mask, steps, at))
    record.trainer_logprobs[found] = _full_vocab_rows(head, batch, record.rows.to(device)[found], steps, cap)


def _recorded_positions(mask: torch.Tensor, steps: torch.Tensor, at: torch.Tensor | None = None) -> torch.Tensor:
    """Where recorded positions `steps` [R, k] (-1: none) sit among the response tokens of the rows of
    `mask` [B, T] laid row-major (`at`: each recorded row's row in `mask`; default: the same order), flat."""
    lengths = mask.sum(-1)
    starts = torch.cumsum(lengths, 0) - lengths
    return ((starts if at is None else starts[at])[:, None] + steps.clamp(min=0)).flatten()


def _full_vocab_rows(
    head: torch.Tensor, batch: RolloutBatch, rows: torch.Tensor, steps: torch.Tensor, cap: float | None
) -> torch.Tensor:
    """Log-probs [R, k, V] from the LM head's output [R·k, V] at recorded rows `rows`' positions `steps` [R, k],
    as the rollout engine computed μ (temperature, support); NaN at a position the row did not have."""
    support = None
    if batch.support is not None:
        support = batch.support.to(head.device)[rows[:, None], steps.clamp(min=0)].flatten(0, 1)
    logits = kernels.restrict(_scaled(head, batch.sampling.temperature, cap), support)
    logprobs = torch.log_softmax(logits, dim=-1).view(*steps.shape, -1)
    return logprobs.masked_fill(~(steps >= 0)[..., None], float("nan"))


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor; on a sharded (DTensor) one, a collective every shard holder must join."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


class Trainer:
    """`lora`: train low-rank adapters (FP32 master) on a base frozen in the trainer precision;
    the optimizer, loss scaler and clip then see only the adapters. `seed` draws their start."""

    def __init__(
        self, model: CausalLM, precision: str, optim: OptimConfig, lora: LoRAConfig | None = None, seed: int = 0
    ):
        self.model = model.float()
        self.precision = precision
        self.dtype = prec.to_dtype(precision)
        self.optim_config = optim
        self.lora = lora
        if lora is not None:
            apply_lora(self.model, lora, self.dtype, seed)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            fused=True,  # one kernel for all parameters: 3.5x faster than the default on CPU
        )
        self.scaler = prec.DynamicLossScaler(
            enabled=prec.Precision.named(precision).loss_scaled,
            init_scale=optim.loss_scale_init,
            growth_interval=optim.loss_scale_growth_interval,
        )
        self.weight_version = 0
        # A sharded learner group averages gradients over its `world` learners; each learner's
        # loss carries the whole mini-batch's denominators, so the sum is wanted: world, not 1.
        self.grad_sum_factor = 1.0
        self.matmul_flops = 0.0  # model FLOPs of every pass so far (backward counted as 2x forward, 1x with LoRA)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def sharded(self) -> bool:
        """Whether this process holds a shard of each parameter (a learner of a group, under FSDP2)."""
        return hasattr(next(self.model.parameters()), "device_mesh")

    def logprobs(
        self,
        prompt_ids: list[list[int]],
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        support: torch.Tensor | None = None,
        temperature: float = 1.0,
        routing: Routing | None = None,
    ) -> torch.Tensor:
        """π of each response token [B, T] FP32 (0 on padding) in the trainer precision;
        differentiable when grad is on. `routing`: MoE experts to replay."""
        packed, scored = sequence_logprobs(
            self.model, prompt_ids, response_ids, response_mask, support, temperature, self.dtype, routing, True
        )
        self._count_pass(packed, int(response_mask.sum()))
        return scored

    def batch_logprobs(
        self, batch: RolloutBatch, rows: torch.Tensor, replay: bool = False, full_vocab: bool = False
    ) -> torch.Tensor:
        """π of `rows` of a rollout batch (`logprobs_of_rows`); differentiable when grad is on. `replay`: a MoE
        model uses the experts the rollout engine chose. `full_vocab`: the pass also fills the batch's
        full-vocabulary record for its recorded rows among `rows` (`record_full_vocab`)."""
        on_head = None
        if full_vocab and batch.full_vocab is not None:
            on_head = partial(record_full_vocab, batch, rows, cap=self.model.config.final_softcap, device=self.device)
        packed, scored = logprobs_of_rows(self.model, batch, rows, self.dtype, replay, on_head)
        self._count_pass(packed, int(batch.response_mask[rows].sum()))
        return scored

    def frozen_logprobs(self, batch: RolloutBatch, micro_batch_tokens: int, replay: bool = False) -> torch.Tensor:
        """π of every row of a rollout batch, without grad, in the trainer's micro-batches (`logprobs_of_batch`)."""
        return logprobs_of_batch(
            self.model,
            batch,
            self.dtype,
            micro_batch_tokens,
            replay,
            lambda rows, packed: self._count_pass(packed, int(batch.response_mask[rows].sum())),
        )

    def _count_pass(self, packed: PackedBatch, scored: int) -> None:
        # Backward costs 2x forward (input and weight gradients); a frozen base needs input gradients only.
        passes = (2 if self.lora is not None else 3) if torch.is_grad_enabled() else 1
        self.matmul_flops += passes * matmul_flops(self.model.config, packed, scored)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` times the current loss scale (1 unless FP16)."""
        (loss * (self.scaler.scale * self.grad_sum_factor)).backward()

    def set_lr(self, lr: float) -> None:
        """The learning rate of the updates from now on (a schedule's value for the step)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> StepStats:
        """Unscale, check, clip, and apply the optimizer step (skipped on inf/NaN)."""
        scale = self.scaler.scale
        # One norm serves the inf/NaN check, the clip and the log.
        norm = self.scaler.unscale(self.params)
        # Sharded (DTensor) gradients give a sharded norm: the global value for the check and the log.
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        finite = math.isfinite(grad_norm)
        if finite:
            if self.optim_config.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(self.params, self.optim_config.grad_clip, norm)
            self.optimizer.step()
            self.weight_version += 1
        self.scaler.update(finite)
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(
            grad_norm=grad_norm,
            skipped=not finite,
            loss_scale=scale,
            skipped_total=self.scaler.skipped_steps,
            weight_version=self.weight_version,
        )

    def full_weights(self) -> dict[str, torch.Tensor]:
        """FP32 parameters, unsharded, under their names (a tied head once)."""
        return {n: _full(p) for n, p in self.model.named_parameters()}

    def export_weights(self, merge: bool = True) -> tuple[dict[str, torch.Tensor], int]:
        """The weights and their version, for `RolloutWeights.load` (which casts): FP32, with
        LoRA adapters merged in, or with `merge=False` the frozen base alone, as held (the adapters
        then travel by `export_adapters`)."""
        if self.lora is None:
            return export_state(self.model), self.weight_version
        return (merged_state if merge else base_state)(self.model), self.weight_version

    @torch.no_grad()
    def share_frozen(self, tensors: dict[str, torch.Tensor]) -> int:
        """Point each frozen parameter at the tensor of its name in `tensors` where dtype, shape and
        device agree (the values must be equal): with unmerged LoRA the rollout engine's weights,
        views into its fused projections, so that the frozen base is held once. Returns how many."""
        shared = 0
        for name, p in self.model.named_parameters():
            t = tensors.get(name)
            if not p.requires_grad and t is not None and (t.dtype, t.shape, t.device) == (p.dtype, p.shape, p.device):
                p.data = t
                shared += 1
        return shared

    def export_adapters(self) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], int]:
        """LoRA's (A, scale·B) per projection and the version, for `RolloutWeights.load_adapters`."""
        return adapter_pairs(self.model), self.weight_version
