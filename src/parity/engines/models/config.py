"""A model's configuration: Hugging Face's config.json read into a checked `ModelConfig`, and written back.

Every value is refused with the file and key when it would make the model unloadable or its outputs
NaN. The RoPE frequencies live here, beside the config they are computed from, because the config's
check needs them: a RoPE base or scaling factor can be positive and still give angles beyond FP32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

# model_type -> the transformers class that loads the same checkpoint; `families.register` adds to it
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
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
                f"{source}: unsupported architecture model_type={arch!r}; Parity runs {', '.join(ARCHITECTURES)}"
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
