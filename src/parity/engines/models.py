"""Causal language models: config, one decoder transformer for the families Parity runs, loading and saving.

Parity runs its own compact implementation of the Llama family and its relatives
(Llama, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, Gemma 2/3) rather than the
`transformers` modelling code, so that every matmul goes through the kernels of
`engines.kernels` (`linear`, `Numerics.attention`) and the rollout engine can keep a
KV cache. Parameter names match Hugging Face's, so checkpoints load and
save in the Hugging Face format with no conversion.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from parity.engines import kernels
from parity.engines.packing import PackedBatch, gather_rows, pack
from parity.files import atomic_dir

BUILTIN_DIR = Path(__file__).parent.parent / "builtin" / "model"
# model_type -> the transformers class that loads the same checkpoint
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
FULL, SLIDING = "full_attention", "sliding_attention"


class ModelError(ValueError):
    """A model directory that cannot be loaded; the message says why and what to do."""


# The longest context a config may declare: the rollout engine holds RoPE cos/sin tables for every position.
MAX_POSITIONS = 2**21
_REQUIRED = object()


def _int(hf: dict[str, Any], key: str, source: str, default: Any = _REQUIRED, lo: int = 1, hi: int | None = None):
    """config.json's integer `key`, in [lo, hi]; `default` when absent or null (required without one)."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ModelError(f"{source}: {key} is missing; expected an integer")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise ModelError(f"{source}: {key}: expected an integer, got {value!r}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise ModelError(f"{source}: {key}: expected an integer {bound}, got {value}")
    return value


def _positive(hf: dict[str, Any], key: str, source: str, default: float | None) -> float | None:
    """config.json's number `key`, > 0 and finite; `default` when absent or null."""
    value = hf.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ModelError(f"{source}: {key}: expected a positive number, got {value!r}")
    return float(value)


def _bool(hf: dict[str, Any], key: str, source: str, default: bool) -> bool:
    """config.json's true/false `key`; `default` when absent or null. A string "false" is refused, not read
    as true (a tie_word_embeddings of "false" would drop the model's own lm_head)."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelError(f"{source}: {key}: expected true or false, got {value!r}")
    return value


def config_token_ids(hf: dict[str, Any], key: str, source: str, vocab: int, many: bool = False) -> Any:
    """A token id (or, with `many`, an id or a list of ids) of the vocabulary, or None: `key` of a config
    file's `hf`, named `source` in the error."""
    value = hf.get(key)
    if value is None:
        return None
    items = value if many and isinstance(value, list) else [value]
    for item in items:
        _int({key: item}, key, source, lo=0, hi=vocab - 1)
    return [int(i) for i in items] if isinstance(value, list) else int(value)


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # RoPE scaling of the full-attention layers, as (key, value) pairs: rope_type, factor, ...
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    local_rope_theta: float | None = None  # RoPE base of sliding-window layers (Gemma 3)
    sliding_window: int | None = None  # keys a sliding-window layer sees, itself included
    layer_types: tuple[str, ...] = ()  # FULL or SLIDING per layer; empty = all full
    qk_norm: bool = False  # RMSNorm on each query and key head before RoPE (Qwen3, Gemma 3)
    gemma: bool = False  # (1 + w) norms in FP32, norms around attention and MLP, embeddings × √hidden
    activation: str = "silu"  # or "gelu_tanh"
    query_scale: float | None = None  # attention score scale; None = head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap · tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the output logits (Gemma 2)
    num_experts: int = 0  # > 0: a sparse mixture-of-experts MLP on `moe_layers`
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    # The config.json this came from, written back on save so that nothing Parity does not read is lost.
    hf_config: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else FULL

    def window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_type(i) == SLIDING else None

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        arch = hf.get("model_type")
        if arch not in ARCHITECTURES:
            raise ModelError(
                f"{source}: unsupported architecture model_type={arch!r}; "
                f"Parity runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        gemma = arch.startswith("gemma")
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise ModelError(f"{source}: unsupported activation {act!r}; expected one of {', '.join(ACTIVATIONS)}")
        if _bool(hf, "use_bidirectional_attention", source, False):
            raise ModelError(f"{source}: bidirectional attention is not a causal LM; Parity runs causal models")
        full_rope, local_theta = _rope_parameters(hf, source)
        heads = _int(hf, "num_attention_heads", source)
        hidden = _int(hf, "hidden_size", source)
        num_layers = _int(hf, "num_hidden_layers", source)
        vocab = _int(hf, "vocab_size", source)
        kv_heads = _int(hf, "num_key_value_heads", source, default=heads, hi=heads)
        if heads % kv_heads:
            raise ModelError(f"{source}: num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads})")
        head_dim = _int(hf, "head_dim", source, default=hidden // heads)
        if head_dim < 1:
            raise ModelError(f"{source}: hidden_size {hidden} / num_attention_heads {heads} leaves no head_dim")
        window, layer_types = _attention_layout(hf, arch, num_layers, source)
        experts = 0
        if arch == "qwen3_moe":
            experts = _int(hf, "num_experts", source, default=None, lo=0)
            experts = experts if experts is not None else _int(hf, "num_local_experts", source, default=0, lo=0)
        moe_layers: tuple[int, ...] = ()
        if experts:
            step = _int(hf, "decoder_sparse_step", source, default=1)
            dense = hf.get("mlp_only_layers") or []
            if not isinstance(dense, list):
                raise ModelError(f"{source}: mlp_only_layers: expected a list of layer numbers, got {dense!r}")
            moe_layers = tuple(i for i in range(num_layers) if i not in set(dense) and (i + 1) % step == 0)
        bias = _bool(hf, "attention_bias", source, False)
        scalar = _positive(hf, "query_pre_attn_scalar", source, None)
        config = cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_int(hf, "intermediate_size", source),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive(hf, "rms_norm_eps", source, 1e-6),
            rope_theta=float(full_rope.pop("rope_theta")),
            max_position_embeddings=_int(hf, "max_position_embeddings", source, default=2048, hi=MAX_POSITIONS),
            tie_word_embeddings=_bool(hf, "tie_word_embeddings", source, gemma),
            qkv_bias=arch == "qwen2" or bias,
            o_bias=bias and arch != "qwen2",
            mlp_bias=_bool(hf, "mlp_bias", source, False),
            bos_token_id=config_token_ids(hf, "bos_token_id", source, vocab),
            eos_token_id=config_token_ids(hf, "eos_token_id", source, vocab, many=True),
            pad_token_id=config_token_ids(hf, "pad_token_id", source, vocab),
            rope_scaling=tuple(sorted(full_rope.items())) if full_rope["rope_type"] != "default" else (),
            local_rope_theta=local_theta,
            sliding_window=window,
            layer_types=layer_types,
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3_text"),
            gemma=gemma,
            activation=ACTIVATIONS[act],
            query_scale=scalar**-0.5 if gemma and scalar else None,
            attn_softcap=_positive(hf, "attn_logit_softcapping", source, None) if arch == "gemma2" else None,
            final_softcap=_positive(hf, "final_logit_softcapping", source, None) if gemma else None,
            num_experts=experts,
            experts_per_token=_int(hf, "num_experts_per_tok", source, lo=1, hi=experts) if experts else 0,
            moe_intermediate_size=_int(hf, "moe_intermediate_size", source) if experts else 0,
            norm_topk_prob=_bool(hf, "norm_topk_prob", source, False),
            moe_layers=moe_layers,
            hf_config=dict(hf),
        )
        _check_rope_angles(config, source)
        return config

    def to_hf(self) -> dict[str, Any]:
        """The config.json `transformers` needs to load these weights."""
        if self.hf_config is not None:
            return {**self.hf_config, "torch_dtype": "float32"}
        if self.architecture not in ("llama", "qwen2"):
            raise ModelError(f"a {self.architecture} config needs the config.json it was read from")
        hf: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.architecture == "llama":
            hf["attention_bias"] = self.qkv_bias
            hf["mlp_bias"] = self.mlp_bias
        else:
            hf["use_sliding_window"] = False
        return hf


def _rope_parameters(hf: dict[str, Any], source: str) -> tuple[dict[str, Any], float | None]:
    """The full-attention layers' RoPE parameters (rope_type, rope_theta, scaling keys) and the
    sliding layers' RoPE base, from either config.json layout (transformers 5 `rope_parameters`,
    per layer type or not, or the older `rope_theta` + `rope_scaling`)."""
    params = hf.get("rope_parameters")
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise ModelError(f'{source}: {key}: expected an object such as {{"rope_type": "linear", "factor": 2.0}}')
    local = None
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        full = dict(params.get(FULL) or {})
        if params.get(SLIDING):
            local = params[SLIDING]
    else:
        full = dict(params or hf.get("rope_scaling") or {})
        if hf.get("rope_local_base_freq") is not None:
            local = {"rope_type": "default", "rope_theta": hf["rope_local_base_freq"]}
    full.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    full["rope_type"] = full.pop("type", None) or full.get("rope_type", "default")
    for layers, p in (("", full), ("sliding-window layers' ", local or {})):
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ModelError(
                f"{source}: unsupported {layers}RoPE scaling rope_type={kind!r}; Parity implements "
                f"{', '.join(ROPE_TYPES)}"
            )
    if local is not None and local.get("rope_type", "default") != "default":
        raise ModelError(f"{source}: sliding-window layers with scaled RoPE are not supported")
    for key in ("partial_rotary_factor", "attention_factor"):
        if full.pop(key, 1.0) != 1.0:
            raise ModelError(f"{source}: RoPE {key} != 1 is not supported")
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
    for key in ("rope_theta", *needed.get(full["rope_type"], ())):
        if _positive(full, key, f"{source}: RoPE", None) is None:
            raise ModelError(f"{source}: RoPE {key} is missing; {full['rope_type']} scaling needs it")
    if full["rope_type"] == "llama3":
        _int(full, "original_max_position_embeddings", f"{source}: RoPE")
    if local is not None and _positive(local, "rope_theta", f"{source}: sliding-window layers' RoPE", None) is None:
        raise ModelError(f"{source}: sliding-window layers' RoPE rope_theta is missing")
    return full, None if local is None else float(local["rope_theta"])


def _check_rope_angles(cfg: ModelConfig, source: str) -> None:
    """Refuse RoPE values under which some position's angle is not a finite FP32 number (a rope_theta of
    1e-300 or a factor of 1e-320 is positive, yet every output would be NaN)."""
    for kind, inv_freq in rope_tables(cfg).items():
        if not torch.isfinite(inv_freq * (cfg.max_position_embeddings - 1)).all():
            layers = "sliding-window layers' " if kind == SLIDING else ""
            raise ModelError(
                f"{source}: the {layers}RoPE values (rope_theta {cfg.local_rope_theta if layers else cfg.rope_theta}"
                f", scaling {dict(cfg.rope_scaling) or 'none'}) give rotation angles beyond FP32's range"
            )


def _attention_layout(
    hf: dict[str, Any], arch: str, num_layers: int, source: str
) -> tuple[int | None, tuple[str, ...]]:
    """The sliding window and each layer's attention type, as transformers derives them."""
    window = hf.get("sliding_window")
    if arch in ("qwen2", "qwen3", "qwen3_moe") and not _bool(hf, "use_sliding_window", source, False):
        window = None
    if window is None:
        return None, ()
    types = hf.get("layer_types")
    if types is None:
        if arch.startswith("qwen"):
            first = int(hf.get("max_window_layers", num_layers))
            types = [SLIDING if i >= first else FULL for i in range(num_layers)]
        elif arch == "gemma2":
            types = [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
        elif arch == "gemma3_text":
            pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
            types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
        else:
            types = [SLIDING] * num_layers
    if not isinstance(types, list) or len(types) != num_layers or any(t not in (FULL, SLIDING) for t in types):
        raise ModelError(f"{source}: layer_types must list {FULL!r} or {SLIDING!r} for each of {num_layers} layers")
    return _int(hf, "sliding_window", source), tuple(types)


# ----------------------------------------------------------------------------- modules


# Elementwise kernels with an exp or tanh run vector code on most elements and scalar code on
# the tail of each contiguous run (the last `width % 32` elements of a row, on AVX-512), and
# the two can round differently: a token's activations would depend on the tensor's shape.
# Rows padded to a multiple of this many elements keep every element on the vector path.
ACTIVATION_ROW_MULTIPLE = 64


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    width = x.shape[-1]
    if width % ACTIVATION_ROW_MULTIPLE:
        return activation(name, F.pad(x, (0, -width % ACTIVATION_ROW_MULTIPLE)))[..., :width]
    return F.silu(x) if name == "silu" else F.gelu(x, approximate="tanh")


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


def rope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., head_dim] for integer positions, computed in FP32 and rounded to `dtype`."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_inv_freq(cfg: ModelConfig, layer_type: str = FULL) -> torch.Tensor:
    """RoPE inverse frequencies of a layer type, with the config's scaling (linear, Llama 3)."""
    dim = cfg.head_dim
    theta = cfg.local_rope_theta if layer_type == SLIDING and cfg.local_rope_theta else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(cfg.rope_scaling)
    if not scaling or (layer_type == SLIDING and cfg.local_rope_theta):  # local layers are never scaled
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # Llama 3: long wavelengths divided by `factor`, short ones kept, a smooth blend between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, blended, scaled)


def rope_tables(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse frequencies per attention type the model uses."""
    return {kind: rope_inv_freq(cfg, kind) for kind in sorted(set(cfg.layer_types) or {FULL})}


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
        return self.numerics.linear(x, cast_once(self.casts, self.weight, x.dtype), self.bias)


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
    def __init__(self, cfg: ModelConfig, window: int | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window, self.scale, self.softcap = window, cfg.query_scale, cfg.attn_softcap
        self.numerics = kernels.numerics()  # set through CausalLM.numerics
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.gemma)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.gemma)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
        """`x` [N, H] is the packed token stream; attention runs on its rows."""
        n, d = x.shape[0], self.head_dim
        q, k = self.q_proj(x).view(n, self.num_heads, d), self.k_proj(x).view(n, self.num_kv_heads, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v_proj(x).view(n, self.num_kv_heads, d)
        out = self.numerics.packed_attention(q, k, v, packed, self.window, self.scale, self.softcap)
        return self.o_proj(out.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.activation = cfg.activation
        self.gate_proj = Linear(cfg.hidden_size, width, cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, width, cfg.mlp_bias)
        self.down_proj = Linear(width, cfg.hidden_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(activation(self.activation, self.gate_proj(x)) * self.up_proj(x))


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


class SparseMoE(nn.Module):
    """A mixture of experts MLP (Qwen3-MoE): each token's output is the weighted sum of its
    top-k experts'. `chosen` keeps the last forward's routing (what this router picked)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.normalise = cfg.experts_per_token, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.chosen: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> torch.Tensor:
        used, weights, chosen = route(self.gate(x), self.top_k, self.normalise, replay)
        self.chosen = chosen.detach()
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = (used == e).nonzero(as_tuple=True)
            if token.numel():
                y = expert(gather_rows(x, token)) * weights[token, slot, None]
                out = out.index_add(0, token, y)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.self_attn = Attention(cfg, cfg.window(index))
        self.mlp = SparseMoE(cfg) if index in cfg.moe_layers else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)
        if cfg.gemma:  # Gemma: norms after attention and around the MLP
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma=True)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma=True)
        self.gemma = cfg.gemma

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed: PackedBatch, replay: torch.Tensor | None
    ) -> torch.Tensor:
        mlp = partial(self.mlp, replay=replay) if isinstance(self.mlp, SparseMoE) else self.mlp
        if self.gemma:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, packed))
            return x + self.post_feedforward_layernorm(mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, packed)
        return x + mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)


class CausalLM(nn.Module):
    """A decoder-only causal LM (the Llama family and its relatives), as the trainer runs it.
    The compute dtype is chosen per call: the FP32 master weights are cast on the fly
    (autograd flows through the cast). The rollout engine has its own inference path
    over the same weights."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_buffers()
        # Recompute each decoder layer in the backward instead of keeping its activations.
        self.activation_checkpointing = False
        self._casts: dict | None = None
        self.numerics = kernels.numerics()

    @property
    def numerics(self) -> kernels.Numerics:
        """How the model computes (device, exact mode); set it when the model is placed. In exact
        mode attention and log-probs are computed as the rollout engine computes them, so that
        both give the same bits (docs/exact.md)."""
        return self._numerics

    @numerics.setter
    def numerics(self, value: kernels.Numerics) -> None:
        self._numerics = value
        for module in self.modules():
            if isinstance(module, (Attention, Linear, RMSNorm)):
                module.numerics = value

    @contextlib.contextmanager
    def casting_once(self):
        """Within: each FP32 weight is cast to a compute dtype once, by the first forward that needs it, and the
        cast is reused by every later forward and backward (the same values: the bits do not change). The
        trainer wraps one optimizer update's micro-batches in it; the weights must not change inside."""
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
        x = gather_rows(cast_once(self._casts, self.model.embed_tokens.weight, dtype, "embedding"), packed.token_ids)
        if cfg.gemma:
            x = x * torch.tensor(cfg.hidden_size**0.5, dtype=dtype)
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

    def forward(self, packed: PackedBatch, dtype: torch.dtype, replay: bool = False) -> torch.Tensor:
        """The LM head's output [len(packed.score_index), V] at the stream's scored positions, in
        `dtype`, before the final soft-cap (`final_logits` makes logits of it). One module call, so
        that a sharding wrapper (FSDP2) gathers the weights around all of it."""
        return self.lm_head(gather_rows(self.hidden_states(packed, dtype, replay), packed.score_index))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits in FP32 from hidden states (the matmul in the hidden dtype)."""
        return final_logits(self.lm_head(hidden), self.config.final_softcap)


def final_logits(head: torch.Tensor, cap: float | None) -> torch.Tensor:
    """FP32 logits from the LM head's output: upcast, then the final soft-cap (Gemma 2) if any."""
    return softcap(head.float(), cap)


# ----------------------------------------------------------------------------- load / save


def model_file(model_dir: Path, name: str) -> Path:
    """`model_dir / name`, refused when it resolves outside the model directory (a symlink to a file
    elsewhere: a template linked to /etc/passwd would be read into every prompt, and a tokenizer file
    copied into every checkpoint). A snapshot in the Hugging Face cache links its files to the cached
    repository's blobs, which stay allowed (`_cache_blobs`)."""
    path = model_dir / name
    if not path.is_symlink() and not any(p.is_symlink() for p in path.parents if p != model_dir):
        return path
    real, root = path.resolve(), model_dir.resolve()
    blobs = _cache_blobs(root)
    if not real.is_relative_to(root) and not (blobs is not None and real.is_relative_to(blobs)):
        raise ModelError(
            f"{path}: links to {real}, outside the model directory; Parity reads only files inside it "
            "(copy the file in instead of linking it)"
        )
    return path


def _cache_blobs(snapshot: Path) -> Path | None:
    """The blobs folder a Hugging Face cache snapshot links into, when `snapshot` (resolved) is one:
    HUB/models--ORG--NAME/snapshots/REVISION beside HUB/models--ORG--NAME/blobs. Any other folder named
    snapshots/X is an ordinary directory, whose links must stay inside it."""
    snapshots, repo = snapshot.parent, snapshot.parent.parent
    if snapshots.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
        return repo / "blobs"
    return None


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ModelError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a model directory's file; anything else is a one-line ModelError."""
    try:
        value = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except RecursionError:
        raise ModelError(f"{path}: JSON nested too deeply to read") from None
    if not isinstance(value, dict):
        raise ModelError(f"{path}: expected a JSON object {{...}} at the top level, got a {type(value).__name__}")
    return value


def hf_cache_dir() -> Path:
    """Where the Hugging Face libraries keep downloaded repositories: $HF_HUB_CACHE, $HF_HOME/hub, or
    ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of a Hugging Face model id (`org/name`) that `main` points at in the cache, or
    None: Parity reads the cache and never the network."""
    repo = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    try:
        revision = (repo / "refs" / "main").read_text().strip()
    except OSError:
        snapshots = sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
        return snapshots[-1] if len(snapshots) == 1 else None
    snapshot = repo / "snapshots" / revision
    return snapshot if snapshot.is_dir() else None


def resolve_model_dir(model: str | Path) -> Path:
    """`builtin` names the shipped model; `org/name` that is not a directory, a Hugging Face id in the
    local cache; anything else is a local directory."""
    if str(model) == "builtin":
        if not (BUILTIN_DIR / "model.safetensors").is_file():
            raise ModelError(f"the built-in model is missing from {BUILTIN_DIR}; rebuild it with `parity build-model`")
        return BUILTIN_DIR
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    text = str(model)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        snapshot = cached_snapshot(text)
        if snapshot is not None:
            return snapshot
        raise ModelError(
            f"model {text!r}: no such directory, and not in the local Hugging Face cache ({hf_cache_dir()}); "
            f"Parity never downloads: fetch it first (huggingface-cli download {text})"
        )
    raise ModelError(
        f"model {text!r}: no such directory (give a model directory, a Hugging Face id in the local cache, or builtin)"
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    model_dir = resolve_model_dir(model_dir)
    path = model_file(model_dir, "config.json")
    if not path.is_file():
        raise ModelError(f"{model_dir}: no config.json; this is not a Hugging Face model directory")
    return ModelConfig.from_hf(read_json(path), source=str(path))


def _weight_files(model_dir: Path) -> list[Path]:
    single = model_file(model_dir, "model.safetensors")
    if single.is_file():
        return [single]
    index = model_file(model_dir, "model.safetensors.index.json")
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelError(f'{index}: expected {{"weight_map": {{"TENSOR NAME": "SHARD FILE", ...}}}}')
        return [model_file(model_dir, s) for s in sorted(set(weight_map.values()))]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")) or any(model_dir.glob("*.pth")):
        raise ModelError(
            f"{model_dir}: weights are pickle files (.bin/.pt), which Parity never unpickles; "
            "convert them with model.save_pretrained(DIR, safe_serialization=True)"
        )
    raise ModelError(f"{model_dir}: no model.safetensors (or sharded index) found")


def load_model(model_dir: str | Path, shard: Callable[[CausalLM], object] | None = None) -> CausalLM:
    """Load FP32 weights from a Hugging Face directory, one tensor at a time. `trust_remote_code`
    is never used. `shard` (FSDP2's `fully_shard` of each learner) is applied to the model before
    any weight is read: the model is built on the meta device, sharded, given memory for its shards
    only, and each process then reads only the rows of each tensor that its shards hold."""
    model_dir = resolve_model_dir(model_dir)
    cfg = load_config(model_dir)
    with _WeightFiles(_weight_files(model_dir)) as files:
        _check_sizes(cfg, files.file_shapes, model_dir)
        if shard is None:
            model = CausalLM(cfg)
        else:
            with torch.device("meta"):
                model = CausalLM(cfg)
            shard(model)
            model.to_empty(device="cpu")
            model.init_buffers()
        params = {
            k: v
            for k, v in model.state_dict(keep_vars=True).items()
            if not (cfg.tie_word_embeddings and k == "lm_head.weight")
        }
        missing = sorted(params.keys() - files.shapes.keys())
        unexpected = sorted(
            k
            for k in files.shapes.keys() - params.keys()
            if not (k.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and k == "lm_head.weight"))
        )
        if missing or unexpected:
            raise ModelError(
                f"{model_dir}: weights do not match a {cfg.architecture} model "
                f"(missing {missing[:4]}, unexpected {unexpected[:4]})"
            )
        wrong_shape = [
            f"{k} {files.shapes[k]}, expected {tuple(v.shape)}"
            for k, v in params.items()
            if files.shapes[k] != tuple(v.shape)
        ]
        if wrong_shape:
            raise ModelError(f"{model_dir}: weights do not match config.json ({'; '.join(wrong_shape[:3])})")
        with torch.no_grad():
            for name, param in params.items():
                local, first = _local_rows(param)
                local.copy_(files.read(name, first, first + local.shape[0]))
    return model


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The part of `param` this process holds, and the row of the whole tensor where it begins: all of
    it from row 0, or for an FSDP2 parameter (a DTensor sharded on dim 0 over a 1-D mesh, as
    `torch.chunk` splits it) this rank's rows."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return param, 0
    if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise ValueError(f"load_model: cannot read shards placed as {param.placements} on a {param.device_mesh}")
    rows, world = param.shape[0], param.device_mesh.size()
    chunk = -(-rows // world)
    first = min(param.device_mesh.get_local_rank() * chunk, rows)
    local = param.to_local()
    if local.shape[0] != min(chunk, rows - first):
        raise ValueError(f"load_model: a shard of {rows} rows over {world} ranks holds {local.shape[0]} (not chunked)")
    return local, first


class _WeightFiles:
    """A model's safetensors files, open for reading tensor by tensor and row range by row range under
    the model's parameter names: nothing is read before it is asked for. Experts stacked in two tensors
    per layer (transformers 5: gate_up_proj [E, 2I, H], down_proj [E, H, I]) are read as the per-expert
    names of checkpoints on the Hub."""

    def __init__(self, files: list[Path]):
        self.files = files
        self._open = contextlib.ExitStack()
        self._slices: dict[str, tuple[Any, Path]] = {}  # tensor name in the files -> (its lazy slice, its file)
        self.file_shapes: dict[str, tuple[int, ...]] = {}
        # per-expert name -> (stacked tensor's name, expert, first row in it)
        self._stacked: dict[str, tuple[str, int, int]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}  # under the model's names

    def __enter__(self) -> _WeightFiles:
        try:
            self._index()
        except BaseException:
            self._open.close()
            raise
        return self

    def _index(self) -> None:
        from safetensors import safe_open

        for f in self.files:
            if not f.is_file():
                raise ModelError(f"{f}: missing (a shard the index names)")
            try:
                opened = self._open.enter_context(safe_open(str(f), "pt"))
                for k in opened.keys():
                    self._slices[k] = (opened.get_slice(k), f)
                    self.file_shapes[k] = tuple(self._slices[k][0].get_shape())
            except Exception as e:  # safetensors raises its own error types for cut or garbled files
                raise ModelError(f"{f}: not a readable safetensors file ({e})") from None
        self.shapes = dict(self.file_shapes)
        for name in [n for n in self.file_shapes if n.endswith(".mlp.experts.gate_up_proj")]:
            prefix, where = name.removesuffix("gate_up_proj"), self._slices[name][1]
            down = prefix + "down_proj"
            gate_up_shape, down_shape = self.shapes.pop(name), self.shapes.pop(down, None)
            if len(gate_up_shape) != 3 or down_shape is None or len(down_shape) != 3:
                raise ModelError(
                    f"{where}: stacked experts must be {name} [experts, 2 x intermediate, hidden] and {down} "
                    f"[experts, hidden, intermediate]; found {gate_up_shape} and {down_shape}"
                )
            experts, width, hidden = gate_up_shape[0], gate_up_shape[1] // 2, gate_up_shape[2]
            for e in range(experts):
                for proj, source, first, shape in (
                    ("gate_proj", name, 0, (width, hidden)),
                    ("up_proj", name, width, (width, hidden)),
                    ("down_proj", down, 0, down_shape[1:]),
                ):
                    self._stacked[f"{prefix}{e}.{proj}.weight"] = (source, e, first)
                    self.shapes[f"{prefix}{e}.{proj}.weight"] = shape

    def __exit__(self, *exc) -> None:
        self._open.close()

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the tensor the model names `name`, as stored (FP32 copies are the caller's)."""
        stacked = self._stacked.get(name)
        lazy, f = self._slices[stacked[0] if stacked else name]
        try:
            if stacked:
                _, expert, first = stacked
                return lazy[expert, first + start : first + stop]
            return lazy[start:stop]
        except Exception as e:
            raise ModelError(f"{f}: {name} could not be read ({e})") from None


def _check_sizes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], model_dir: Path) -> None:
    """Refuse a config.json whose sizes the weight files do not hold, from the files' headers, before
    anything is allocated (a vocab_size of 10**12 would otherwise reach the allocator)."""
    differ = f"{model_dir}: weights do not match config.json:"
    embed = shapes.get("model.embed_tokens.weight")
    if embed != (cfg.vocab_size, cfg.hidden_size):
        raise ModelError(
            f"{differ} vocab_size {cfg.vocab_size} x hidden_size {cfg.hidden_size}, "
            f"but model.embed_tokens.weight is {embed}"
        )
    layers = {int(k.split(".")[2]) for k in shapes if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    if layers != set(range(cfg.num_layers)):
        raise ModelError(f"{differ} num_hidden_layers {cfg.num_layers}, but the weights hold {len(layers)} layers")
    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    expected = {
        "self_attn.q_proj.weight": ((q_width, cfg.hidden_size), "num_attention_heads x head_dim"),
        "self_attn.k_proj.weight": ((kv_width, cfg.hidden_size), "num_key_value_heads x head_dim"),
        "mlp.gate_proj.weight": ((cfg.intermediate_size, cfg.hidden_size), "intermediate_size"),
    }
    for name, (shape, keys) in expected.items():
        found = shapes.get(f"model.layers.0.{name}")
        if found is not None and found != shape:
            raise ModelError(f"{differ} {keys} make model.layers.0.{name} {shape}, but the weights hold {found}")
    if cfg.num_experts and cfg.moe_layers:
        first = f"model.layers.{cfg.moe_layers[0]}.mlp.experts."
        stacked = shapes.get(first + "gate_up_proj")
        held = stacked[0] if stacked else len({k[len(first) :].split(".")[0] for k in shapes if k.startswith(first)})
        if held != cfg.num_experts:
            raise ModelError(f"{differ} num_experts {cfg.num_experts}, but the weights hold {held}")


# Tokens of the first forward that `require_finite_logits` runs: enough to pass every layer, cheap on any model.
PROBE_TOKENS = 32


def require_finite_logits(model: CausalLM, prompt: list[int], dtypes: dict[str, torch.dtype], source: Path) -> None:
    """Refuse a model whose first forward gives inf/NaN logits in any of `dtypes` (precision name -> dtype),
    before anything is computed or written. Positive config values can still make every output NaN (a RoPE
    base too small for FP16's range, norms that divide by 0), and a run would then train on NaN while
    exiting 0."""
    packed = pack([prompt[:PROBE_TOKENS]], device=next(model.parameters()).device)
    with torch.no_grad():
        for name, dtype in dtypes.items():
            if not torch.isfinite(model.logits(model.hidden_states(packed, dtype))).all():
                raise ModelError(
                    f"{source}: the first forward in {name} gives inf/NaN logits; nothing can be trained or "
                    "measured from them (`parity doctor` names the first layer that overflows)"
                )


def export_state(
    model: CausalLM, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """Parameters under their Hugging Face names, cast to `dtype` (tied head omitted), on `device`
    (default: where the model is, so that a weight sync on one GPU never passes through the host)."""
    return {
        k: v.detach().to(device=device or v.device, dtype=dtype).contiguous()
        for k, v in model.state_dict().items()
        if not (model.config.tie_word_embeddings and k == "lm_head.weight")
    }


def save_model(model: CausalLM, out_dir: str | Path, add_files: Callable[[Path], object] | None = None) -> Path:
    """Write config.json + model.safetensors atomically; `add_files(folder)` puts more files
    (the tokenizer's: `tokenizer.copy_tokenizer_files`) in before the folder appears."""
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2) + "\n")
        save_file(export_state(model, device="cpu"), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if add_files is not None:
            add_files(tmp)
    return out_dir
