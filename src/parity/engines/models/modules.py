"""The trainer's model, `CausalLM`: torch modules holding the weights of the one decoder Parity runs for every
supported family, which its family's layer function computes (`families.py`).

Parity runs its own compact implementation of the Llama family and its relatives
(Llama, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, Gemma 2/3) rather than the
`transformers` modelling code, so that every matmul goes through the kernels of
`engines.kernels` (`linear`, `Numerics.attention`) and the rollout engine runs the same
layer over a KV cache. Parameter names match Hugging Face's, so checkpoints load and
save in the Hugging Face format with no conversion (`models.io`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from parity.engines import kernels
from parity.engines.models.config import FULL, ModelConfig, rope_tables
from parity.engines.models.decoder import Tap, layer_tap, scale_embeddings, stream
from parity.engines.models.families import family
from parity.engines.packing import PackedBatch, gather_rows

# `CausalLM.chunked_head="auto"` chunks the LM head where one pass's [scored tokens, vocabulary] head would
# take more than this. On the CPU the chunked head was no slower at 805 MB (SmolLM2, 4,096 tokens, FP32:
# the whole head's fresh memory costs what the second pass of its matmul does) and the peak 0.6 GB lower.
CHUNKED_HEAD_BYTES = 2**29


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


def rope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., head_dim] for integer positions, computed in FP32 and rounded to `dtype`."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, gemma: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if gemma else torch.ones(dim))
        self.eps, self.gemma = eps, gemma
        self.numerics = kernels.numerics()  # set through CausalLM.numerics

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.numerics.rms_norm(x, self.weight, self.eps, self.gemma)


class Linear(nn.Module):
    """A linear layer whose matmul follows the precision policy of its input."""

    def __init__(self, d_in: int, d_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None
        self.numerics = kernels.numerics()  # set through CausalLM.numerics
        self.casts: dict | None = None  # set through CausalLM.casting_once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.numerics.linear(x, self.weight_in(x.dtype), self.bias)

    def weight_in(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as this layer multiplies it in `dtype`."""
        return cast_once(self.casts, self.weight, dtype)


def cast_once(casts: dict | None, weight: torch.Tensor, dtype: torch.dtype, use: str = "matmul") -> torch.Tensor:
    """`weight` in `dtype`; inside `CausalLM.casting_once` (`casts` its dict) cast once and reused, autograd's
    cast node with it (a backward through it reaches the FP32 master each time; it saves no tensor). A tied
    weight's two uses (`use`) keep a cast each, so that their gradients meet in FP32, as without the scope."""
    if casts is None or weight.dtype == dtype:
        return weight.to(dtype)
    key = (id(weight), dtype, torch.is_grad_enabled(), use)
    if key not in casts:
        casts[key] = weight.to(dtype)
    return casts[key]


class Attention(nn.Module):
    """Attention's weights (Hugging Face's names) and its settings: the layer's window, scale and soft-cap."""

    def __init__(self, cfg: ModelConfig, window: int | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window, self.scale, self.softcap = window, cfg.query_scale, cfg.attn_softcap
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.gemma)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.gemma)
        else:
            self.q_norm = self.k_norm = None


class MLP(nn.Module):
    """A gated MLP's weights."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_proj = Linear(cfg.hidden_size, width, cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, width, cfg.mlp_bias)
        self.down_proj = Linear(width, cfg.hidden_size, cfg.mlp_bias)


class SparseMoE(nn.Module):
    """A mixture of experts MLP's weights (Qwen3-MoE; `decoder.mlp` runs it). `chosen` keeps the last forward's
    routing (what this router picked)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.chosen: torch.Tensor | None = None


class DecoderLayer(nn.Module):
    """One decoder layer's weights under Hugging Face's names (the norms its family names), computed by the
    family's layer function with this module as its `decoder.Layer`: the trainer's norms (two roundings, as
    Hugging Face's), Q, K and V projected apart, attention over the packed batch. `tap` (set by
    `CausalLM.traced`) sees each stage."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.config = cfg
        self.family = family(cfg)
        self.self_attn = Attention(cfg, cfg.window(index))
        self.mlp = SparseMoE(cfg) if index in cfg.moe_layers else MLP(cfg)
        for name in self.family.norms:
            self.add_module(name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma))
        self.numerics = kernels.numerics()  # set through CausalLM.numerics
        self.tap: Tap | None = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed: PackedBatch, replay: torch.Tensor | None
    ) -> torch.Tensor:
        """The layer's output [N, H] on the packed stream `x` [N, H]: the MLP's output is added here, not by the
        next layer's norm, so that a layer's input and output are one tensor (what activation checkpointing
        keeps, what FSDP2 sees)."""
        attention = self.self_attn

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q, k = self.numerics.rope(q, cos, sin), self.numerics.rope(k, cos, sin)
            out = self.numerics.packed_attention(q, k, v, packed, attention.window, attention.scale, attention.softcap)
            return out.reshape(out.shape[0], -1)

        x, pending, routing = self.family.layer(self, x, None, attend, self.config, self.numerics, replay, self.tap)
        if routing is not None:
            self.mlp.chosen = routing[1].detach()
        return stream(x, pending)

    # ------------------------------------------------------------------ decoder.Layer

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return getattr(self.self_attn if name in ("q_norm", "k_norm") else self, name)(x)

    def add_norm(self, name: str, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + delta
        return x, self.norm(name, x)

    def attention_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, rows = self.self_attn, x.shape[:-1]
        q = a.q_proj(x).view(*rows, a.num_heads, a.head_dim)
        k = a.k_proj(x).view(*rows, a.num_kv_heads, a.head_dim)
        return q, k, a.v_proj(x).view(*rows, a.num_kv_heads, a.head_dim)

    def attention_output(self, x: torch.Tensor) -> torch.Tensor:
        return self.self_attn.o_proj(x)

    def mlp_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mlp.gate_proj(x), self.mlp.up_proj(x)

    def mlp_output(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.down_proj(x)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.mlp.gate(x) if isinstance(self.mlp, SparseMoE) else None

    def expert_inputs(self, expert: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mlp = self.mlp.experts[expert]
        return mlp.gate_proj(x), mlp.up_proj(x)

    def expert_output(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.experts[expert].down_proj(x)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)


class CausalLM(nn.Module):
    """A decoder-only causal LM (the Llama family and its relatives), as the trainer runs it.
    The compute dtype is chosen per call: the FP32 master weights are cast on the fly
    (autograd flows through the cast). The rollout engine runs the same decoder layer over
    its own copy of the weights (`engines.weights`)."""

    def __init__(self, cfg: ModelConfig, numerics: kernels.Numerics):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_buffers()
        # Recompute each decoder layer in the backward instead of keeping its activations.
        self.activation_checkpointing = False
        # The LM head and its log-probabilities a chunk of rows at a time, forward and backward
        # (`trainer.ChunkedHeadLogProbs`): True, False, or "auto" (`chunks_head`).
        self.chunked_head: bool | str = "auto"
        self._casts: dict | None = None
        self.numerics = numerics

    @property
    def numerics(self) -> kernels.Numerics:
        """How the model computes (device, exact mode): given when the model is built (`load_model`), with no
        default, so that no model runs on another mode's kernels by omission; a copy placed on another device
        gets that device's. In exact mode attention and log-probs are computed as the rollout engine computes
        them, so that both give the same bits (docs/exact.md)."""
        return self._numerics

    @numerics.setter
    def numerics(self, value: kernels.Numerics) -> None:
        self._numerics = value
        for module in self.modules():
            if isinstance(module, (DecoderLayer, Linear, RMSNorm)):
                module.numerics = value

    @contextlib.contextmanager
    def casting_once(self):
        """Within: each FP32 weight is cast to a compute dtype once, by the first forward that needs it, and the
        cast is reused by every later forward and backward (the same values: the bits do not change). The
        trainer wraps one optimizer update's micro-batches in it; the weights must not change inside. A sharded
        model (an FSDP2 learner's) keeps nothing: each forward gathers its weights anew."""
        if any(hasattr(p, "device_mesh") for p in self.parameters()):
            yield
            return
        casts: dict = {}
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for module in linears:
            module.casts = casts
        self._casts = casts
        try:
            yield
        finally:
            for module in linears:
                module.casts = None
            self._casts = None

    @contextlib.contextmanager
    def traced(self, tap: Tap):
        """Within: every decoder layer gives each stage it computes to `tap` as ("layer{i}.{stage}", value)."""
        for i, layer in enumerate(self.model.layers):
            layer.tap = layer_tap(tap, i)
        try:
            yield
        finally:
            for layer in self.model.layers:
                layer.tap = None

    def init_buffers(self) -> None:
        """Compute the RoPE tables (again after `to_empty`, which leaves a model built on the meta
        device with uninitialised buffers)."""
        for kind, inv_freq in rope_tables(self.config).items():
            self.register_buffer(f"inv_freq_{kind}", inv_freq, persistent=False)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(0.0 if self.config.gemma else 1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def hidden_states(self, packed: PackedBatch, dtype: torch.dtype, replay: bool = False) -> torch.Tensor:
        """Final normalised hidden states [N, H] in `dtype` of the packed token stream.
        `replay`: the MoE layers use the experts in `packed.routing` (the rollout engine's)."""
        cfg = self.config
        embed = cast_once(self._casts, self.model.embed_tokens.weight, dtype, "embedding")
        x = scale_embeddings(gather_rows(embed, packed.token_ids), cfg)
        angles = {}
        for kind in set(cfg.layer_types) or {FULL}:
            cos, sin = rope_angles(packed.positions, getattr(self, f"inv_freq_{kind}"), dtype)
            angles[kind] = cos[:, None], sin[:, None]  # broadcast over heads
        for i, layer in enumerate(self.model.layers):
            experts = None
            if replay and packed.routing is not None and i in cfg.moe_layers:
                experts = packed.routing[:, cfg.moe_layers.index(i)]
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, *angles[cfg.layer_type(i)], packed, experts, use_reentrant=False)
            else:
                x = layer(x, *angles[cfg.layer_type(i)], packed, experts)
        return self.model.norm(x)

    def routing(self) -> torch.Tensor | None:
        """The experts each MoE layer chose in the last forward, [N, MoE layers, k]."""
        moe = [layer.mlp.chosen for layer in self.model.layers if isinstance(layer.mlp, SparseMoE)]
        return torch.stack(moe, dim=1) if moe and all(c is not None for c in moe) else None

    def forward(
        self,
        packed: PackedBatch,
        dtype: torch.dtype,
        replay: bool = False,
        head: Callable[[torch.Tensor, Linear], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The LM head's output [len(packed.score_index), V] at the stream's scored positions, in
        `dtype`, before the final soft-cap (`final_logits` makes logits of it); or what `head(hidden,
        lm_head)` makes of the final hidden states there instead (the log-probabilities, with the head
        computed a chunk at a time: `trainer.sequence_logprobs`). One module call, so that a sharding
        wrapper (FSDP2) gathers the weights around all of it."""
        hidden = gather_rows(self.hidden_states(packed, dtype, replay), packed.score_index)
        return self.lm_head(hidden) if head is None else head(hidden, self.lm_head)

    def chunks_head(self, scored: int, dtype: torch.dtype) -> bool:
        """Whether a pass scoring `scored` tokens computes the LM head a chunk at a time (`chunked_head`): "auto"
        does where the whole head would take more than CHUNKED_HEAD_BYTES."""
        if self.chunked_head != "auto":
            return bool(self.chunked_head)
        return scored * self.config.vocab_size * dtype.itemsize > CHUNKED_HEAD_BYTES

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits in FP32 from hidden states (the matmul in the hidden dtype)."""
        return final_logits(self.lm_head(hidden), self.config.final_softcap)


def final_logits(head: torch.Tensor, cap: float | None) -> torch.Tensor:
    """FP32 logits from the LM head's output: upcast, then the final soft-cap (Gemma 2) if any."""
    return softcap(head.float(), cap)
