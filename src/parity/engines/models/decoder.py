"""The decoder layer's parts, written once for both engines.

The trainer's modules (`modules.DecoderLayer`) and the rollout engine's stored weights (`engines.weights`)
hold a layer's weights differently: FP32 masters cast per pass with Q, K and V apart, against the rollout
precision with Q/K/V and gate/up fused, LoRA unmerged and the norms that round once. Each is a `Layer`: it
says how it normalises and multiplies. From these parts (attention with its q/k norms, the MLP or mixture
of experts, the input norm) each family's layer function (`families.py`) puts a layer together in its
order. How attention reaches the other tokens (a packed batch, a KV cache) is the caller's `attend`.

The residual stream is carried as (x, pending): the MLP's output is added by the next layer's input norm
(`Layer.add_norm`), so that an engine may add and normalise in one pass; the trainer adds, then
normalises, the same two roundings as `x + mlp` before the norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from parity.engines.models.config import ModelConfig
from parity.engines.packing import gather_rows

# What a decoder layer computes, in order, by the names `parity mismatch --locate` compares both engines at:
# the input norm, attention before and after its output projection, the MLP, the layer's output.
LAYER_STAGES = ("input_norm", "attention_core", "attention", "mlp", "output")

Tap = Callable[[str, torch.Tensor], None]
# Attention over the other tokens (RoPE, the cache): (q, k, v) heads -> [..., heads · head_dim].
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Layer(Protocol):
    """One decoder layer's weights, as a holder applies them. Norms are named as in Hugging Face's
    checkpoints (`input_layernorm`, `post_attention_layernorm`, Gemma's `pre_feedforward_layernorm` and
    `post_feedforward_layernorm`, the per-head `q_norm` and `k_norm`)."""

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor: ...

    def add_norm(self, name: str, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm `name`)."""

    def attention_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query, key and value heads [..., heads, head_dim] of `x` [..., hidden]."""

    def attention_output(self, x: torch.Tensor) -> torch.Tensor: ...

    def mlp_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A dense MLP's gate and up projections."""

    def mlp_output(self, x: torch.Tensor) -> torch.Tensor: ...

    def router_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """A mixture of experts' router logits [N, experts]; None for a dense MLP."""

    def expert_inputs(self, expert: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def expert_output(self, expert: int, x: torch.Tensor) -> torch.Tensor: ...


def route(
    router_logits: torch.Tensor, top_k: int, normalise: bool, replay: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing: (experts used [N, k], their weights [N, k] FP32, experts chosen [N, k]).
    Softmax in FP32 over all experts; `replay` (another engine's choice) replaces the chosen
    experts, and their weights are still this router's probabilities, so the router trains."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    used = chosen if replay is None else replay
    weights = probs.gather(-1, used)
    if normalise:
        weights = weights / weights.sum(-1, keepdim=True)
    return used, weights, chosen


def routing_differs(chosen: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """[N, layers] True where two routings [N, layers, k] picked different expert sets."""
    return (chosen.sort(-1).values != other.sort(-1).values).any(-1)


def mlp(
    layer: Layer, x: torch.Tensor, cfg: ModelConfig, numerics, replay: torch.Tensor | None = None
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The MLP's output, and for a mixture of experts (used, chosen) [N, k] each: each token's output is the
    weighted sum of its top-k experts' (`replay`: another engine's experts, `route`)."""
    flat = x.reshape(-1, x.shape[-1])
    logits = layer.router_logits(flat)
    if logits is None:
        return layer.mlp_output(numerics.gated_activation(cfg.activation, *layer.mlp_inputs(x))), None
    used, weights, chosen = route(logits, cfg.experts_per_token, cfg.norm_topk_prob, replay)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(flat)
    for e in used.unique().tolist():  # in expert order, each expert on its tokens
        token, slot = (used == e).nonzero(as_tuple=True)
        hidden = numerics.gated_activation(cfg.activation, *layer.expert_inputs(e, gather_rows(flat, token)))
        out = out.index_add(0, token, layer.expert_output(e, hidden) * weights[token, slot, None])
    return out.view_as(x), (used, chosen)


def attention(
    layer: Layer, normed: torch.Tensor, attend: Attend, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the normalised stream, with the q/k norms: (core, out), `attend`'s output [..., heads ·
    head_dim] and that through the output projection."""
    q, k, v = layer.attention_inputs(normed)
    if cfg.qk_norm:
        q, k = layer.norm("q_norm", q), layer.norm("k_norm", k)
    core = attend(q, k, v)
    return core, layer.attention_output(core)


def input_norm(layer: Layer, x: torch.Tensor, pending: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(The stream with the last MLP's output added, its input norm)."""
    if pending is None:
        return x, layer.norm("input_layernorm", x)
    return layer.add_norm("input_layernorm", x, pending)


def show_stages(tap: Tap | None, *values: torch.Tensor) -> None:
    """Give `tap` each stage of LAYER_STAGES, in order (the layer's output as its stream's value)."""
    if tap is not None:
        for stage, value in zip(LAYER_STAGES, values):
            tap(stage, value)


def layer_tap(tap: Tap | None, layer: int) -> Tap | None:
    """`tap` with each stage named for its layer ("layer3.mlp")."""
    return None if tap is None else lambda stage, value: tap(f"layer{layer}.{stage}", value)


def stream(x: torch.Tensor, pending: torch.Tensor | None) -> torch.Tensor:
    """The residual stream's value: x with the last MLP's output added."""
    return x if pending is None else x + pending


def heads_together(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The query and key heads as one tensor [..., heads + KV heads, D]: a view where K's heads follow Q's in
    memory (one fused projection's output), else a copy. A dimension of size 1 has no stride to agree on
    (a decode step's one token: `view` gives Q and K different strides there)."""
    heads, d = q.shape[-2], q.shape[-1]
    outer = q.shape[:-2]
    adjacent = (
        outer == k.shape[:-2]
        and all(size == 1 or a == b for size, a, b in zip(outer, q.stride()[:-2], k.stride()[:-2]))
        and q.stride(-2) == k.stride(-2)
        and q.stride(-1) == k.stride(-1) == 1
        and q.stride(-2) == d
        and k.data_ptr() == q.data_ptr() + heads * d * q.element_size()
    )
    if adjacent:
        return q.as_strided((*q.shape[:-2], heads + k.shape[-2], d), q.stride())
    return torch.cat([q, k], dim=-2)


def scale_embeddings(x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Gemma multiplies the embeddings by √hidden in the compute dtype."""
    return x * torch.tensor(cfg.hidden_size**0.5, dtype=x.dtype) if cfg.gemma else x
