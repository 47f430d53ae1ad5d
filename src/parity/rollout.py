"""The rollout (inference) engine: batched sampling with a static KV cache.

One call samples `group_size` responses for each prompt. Each prompt is prefilled
once and its cache copied to its group; finished sequences are dropped from the
batch as they stop. For every sampled token the engine records μ, its
log-probability under the distribution actually sampled from (after temperature,
top-k and top-p), and, when filtering is on, the ids of that distribution's
support so the trainer can score π on the same support.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity import precision as prec
from parity.models import CausalLM, KVCache, ModelConfig


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"sampling.temperature must be > 0 (use top_k=1 for greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


@dataclass
class RolloutBatch:
    """B = num_prompts × group_size sampled sequences, rows grouped by prompt."""

    prompt_ids: list[list[int]]
    response_ids: torch.Tensor  # [B, T] int64, pad after the end
    response_mask: torch.Tensor  # [B, T] bool, True on generated tokens (EOS included)
    rollout_logprobs: torch.Tensor  # [B, T] float32 μ, 0 on padding
    support: torch.Tensor | None  # [B, T, K] int64 token ids (-1 = none), None = full vocabulary
    truncated: torch.Tensor  # [B] bool, True if the response hit max_new_tokens without EOS
    group_index: torch.Tensor  # [B] int64, the prompt each row answers
    weight_version: int
    sampling: SamplingParams

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)

    @property
    def num_tokens(self) -> int:
        return int(self.response_mask.sum())


def filter_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to FP32 logits [N, V]; dropped tokens get -inf."""
    logits = logits / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop_sorted = (probs.cumsum(-1) - probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def support_ids(kept: torch.Tensor) -> torch.Tensor:
    """Token ids where `kept` [N, V] is True, as [N, K] padded with -1 (K = max count)."""
    counts = kept.sum(-1)
    k = int(counts.max())
    ids = torch.sort(kept.to(torch.int8), dim=-1, descending=True, stable=True).indices[:, :k]
    return ids.masked_fill(torch.arange(k, device=kept.device) >= counts[:, None], -1)


class RolloutEngine:
    """Samples from a copy of the policy whose weights are stored in the rollout precision."""

    def __init__(self, config: ModelConfig, precision: str, eos_id: int, pad_id: int, device: str = "cpu"):
        self.precision = precision
        self.dtype = prec.to_dtype(precision)
        self.device = torch.device(device)
        self.eos_id, self.pad_id = eos_id, pad_id
        self.model = CausalLM(config).to(device=self.device, dtype=self.dtype).requires_grad_(False)
        self.model.inv_freq = self.model.inv_freq.float()  # RoPE frequencies stay FP32
        self.weight_version = -1

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy weights in (cast to the rollout precision) and record their version."""
        missing, unexpected = self.model.load_state_dict(
            {k: v.to(self.dtype) for k, v in state.items()}, strict=False
        )
        missing = [k for k in missing if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"weight sync: missing {missing[:4]}, unexpected {unexpected[:4]}")
        self.weight_version = version

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], group_size: int, sampling: SamplingParams, seed: int
    ) -> RolloutBatch:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate() needs at least one prompt, each with at least one token")
        dev, model = self.device, self.model
        gen = torch.Generator(device=dev).manual_seed(seed)
        n_prompts, max_new = len(prompts), sampling.max_new_tokens
        prompt_len = max(len(p) for p in prompts)
        max_len = prompt_len + max_new
        if max_len > model.config.max_position_embeddings:
            raise ValueError(
                f"prompt ({prompt_len}) + max_new_tokens ({max_new}) exceeds the model's "
                f"max_position_embeddings ({model.config.max_position_embeddings})"
            )

        # Prefill each prompt once, left-padded to a common length.
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        pad = prompt_len - lengths
        ids = torch.full((n_prompts, prompt_len), self.pad_id, dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            ids[i, prompt_len - len(p) :] = torch.tensor(p, device=dev)
        slots = torch.arange(max_len, device=dev)
        key_valid = slots[None, :] >= pad[:, None]  # [P, max_len]: pads are never attended
        positions = (slots[None, :prompt_len] - pad[:, None]).clamp(min=0)
        causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=dev).tril()
        # A pad query attends to itself only, so its (unused) softmax row is not empty.
        mask = (causal & key_valid[:, None, None, :prompt_len]) | torch.eye(prompt_len, dtype=torch.bool, device=dev)
        cache = KVCache(model.config, n_prompts, max_len, self.dtype, dev)
        hidden = model.hidden_states(ids, positions, self.dtype, cache, 0, mask)
        logits = model.logits(hidden[:, -1]).repeat_interleave(group_size, dim=0)

        # Expand to the groups; from here on `rows` maps active rows to output rows.
        batch = n_prompts * group_size
        cache = cache.repeat_interleave(group_size, prompt_len)
        key_valid = key_valid.repeat_interleave(group_size, dim=0)
        next_pos = lengths.repeat_interleave(group_size)
        rows = torch.arange(batch, device=dev)
        done = torch.zeros(batch, dtype=torch.bool, device=dev)

        tokens = torch.full((batch, max_new), self.pad_id, dtype=torch.long, device=dev)
        logprobs = torch.zeros(batch, max_new, dtype=torch.float32, device=dev)
        mask_out = torch.zeros(batch, max_new, dtype=torch.bool, device=dev)
        supports: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, ids) per step

        for t in range(max_new):
            processed = filter_logits(logits, sampling)
            logp = torch.log_softmax(processed, dim=-1)
            token = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            live = ~done
            out_rows = rows[live]
            tokens[out_rows, t] = token[live]
            logprobs[out_rows, t] = logp.gather(-1, token[:, None]).squeeze(-1)[live]
            mask_out[out_rows, t] = True
            if sampling.filtered:
                supports.append((out_rows, support_ids(torch.isfinite(processed[live]))))
            done = done | (token == self.eos_id)
            if bool(done.all()) or t == max_new - 1:
                break
            # Drop finished rows once they are a quarter of the batch (cache copy amortised).
            if int(done.sum()) * 4 >= done.numel():
                keep = (~done).nonzero().squeeze(-1)
                cache.select(keep)
                rows, token, done = rows[keep], token[keep], done[keep]
                key_valid, next_pos = key_valid[keep], next_pos[keep]
            start = prompt_len + t
            step_mask = key_valid[:, None, None, : start + 1]
            hidden = model.hidden_states(token[:, None], next_pos[:, None], self.dtype, cache, start, step_mask)
            logits = model.logits(hidden[:, -1])
            next_pos = next_pos + 1

        used = int(mask_out.sum(0).nonzero().max()) + 1
        tokens, logprobs, mask_out = tokens[:, :used], logprobs[:, :used], mask_out[:, :used]
        support = None
        if sampling.filtered:
            width = max(ids.shape[1] for _, ids in supports)
            support = torch.full((batch, used, width), -1, dtype=torch.long, device=dev)
            for t, (out_rows, ids) in enumerate(supports):
                support[out_rows, t, : ids.shape[1]] = ids
        lengths_out = mask_out.sum(-1)
        ended = tokens.gather(1, (lengths_out - 1).clamp(min=0)[:, None]).squeeze(-1) == self.eos_id
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompts for _ in range(group_size)],
            response_ids=tokens,
            response_mask=mask_out,
            rollout_logprobs=logprobs,
            support=support,
            truncated=~ended,
            group_index=torch.arange(n_prompts, device=dev).repeat_interleave(group_size),
            weight_version=self.weight_version,
            sampling=sampling,
        )
