"""Causal language models: config, a Llama/Qwen2 transformer, loading and saving.

Parity runs its own compact implementation of the Llama family (Llama, Qwen2)
rather than the `transformers` modelling code, so that every matmul goes through
`precision.linear` / `precision.attention` and the rollout engine can keep a
KV cache. Parameter names match Hugging Face's, so checkpoints load and
save in the Hugging Face format with no conversion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from parity.engines import precision
from parity.engines.packing import PackedBatch, gather_rows
from parity.files import atomic_dir

BUILTIN_DIR = Path(__file__).parent.parent / "builtin" / "model"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


class ModelError(ValueError):
    """A model directory that cannot be loaded; the message says why and what to do."""


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
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        arch = hf.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelError(
                f"{source}: unsupported architecture model_type={arch!r}; "
                f"Parity runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"{source}: unsupported hidden_act={act!r}; expected 'silu'")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelError(
                f"{source}: unsupported RoPE scaling rope_type={rope_type!r}; only the default RoPE is implemented"
            )
        if hf.get("use_sliding_window"):
            raise ModelError(f"{source}: sliding-window attention is not supported")
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            o_bias=arch == "llama" and bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=hf.get("pad_token_id"),
        )

    def to_hf(self) -> dict[str, Any]:
        """The config.json `transformers` needs to load these weights."""
        hf: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM" if self.architecture == "llama" else "Qwen2ForCausalLM"],
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


# ----------------------------------------------------------------------------- modules


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in FP32, round to the compute dtype, then scale (as HF Llama does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * xf.to(x.dtype)


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


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """A linear layer whose matmul follows the precision policy of its input."""

    def __init__(self, d_in: int, d_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return precision.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
        """`x` [N, H] is the packed token stream; attention runs on its rows."""
        n, d = x.shape[0], self.head_dim
        q = apply_rope(self.q_proj(x).view(n, self.num_heads, d), cos, sin).reshape(n, -1)
        k = apply_rope(self.k_proj(x).view(n, self.num_kv_heads, d), cos, sin).reshape(n, -1)
        v = self.v_proj(x)
        outputs = []
        for index in packed.attention_rows:
            # Rows are right-padded, so plain causal attention is exact on the real slots.
            out = precision.attention(
                _heads(gather_rows(q, index), self.num_heads),
                _heads(gather_rows(k, index), self.num_kv_heads),
                _heads(gather_rows(v, index), self.num_kv_heads),
                causal=True,
            )
            outputs.append(out.transpose(1, 2).flatten(0, 1).flatten(1))
        return self.o_proj(gather_rows(torch.cat(outputs), packed.from_rows))


def _heads(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, t, heads * D] -> [b, heads, t, D]."""
    b, t, _ = rows.shape
    return rows.view(b, t, heads, -1).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, packed)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """A Llama-family causal LM, as the trainer runs it. The compute dtype is chosen
    per call: the FP32 master weights are cast on the fly (autograd flows through the
    cast). The rollout engine has its own inference path over the same weights."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("layernorm.weight") or name == "model.norm.weight":
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def hidden_states(self, packed: PackedBatch, dtype: torch.dtype) -> torch.Tensor:
        """Final normalised hidden states [N, H] in `dtype` of the packed token stream."""
        x = gather_rows(self.model.embed_tokens.weight.to(dtype), packed.token_ids)
        cos, sin = rope_angles(packed.positions, self.inv_freq, dtype)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        for layer in self.model.layers:
            x = layer(x, cos, sin, packed)
        return self.model.norm(x)

    def forward(self, packed: PackedBatch, dtype: torch.dtype) -> torch.Tensor:
        """FP32 logits [len(packed.score_index), V] at the stream's scored positions. One module
        call, so that a sharding wrapper (FSDP2) gathers the weights around all of it."""
        return self.logits(gather_rows(self.hidden_states(packed, dtype), packed.score_index))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits in FP32 from hidden states (the matmul in the hidden dtype)."""
        return self.lm_head(hidden).float()


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None


# ----------------------------------------------------------------------------- load / save


def resolve_model_dir(model: str | Path) -> Path:
    """`builtin` names the shipped model; anything else is a local directory."""
    if str(model) == "builtin":
        if not (BUILTIN_DIR / "model.safetensors").is_file():
            raise ModelError(f"the built-in model is missing from {BUILTIN_DIR}; rebuild it with `parity build-model`")
        return BUILTIN_DIR
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelError(f"model directory {str(path)!r} does not exist (pass --model DIR or --model builtin)")
    return path


def load_config(model_dir: str | Path) -> ModelConfig:
    model_dir = resolve_model_dir(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelError(f"{model_dir}: no config.json; this is not a Hugging Face model directory")
    return ModelConfig.from_hf(read_json(path), source=str(path))


def _weight_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index)["weight_map"].values()))
        return [model_dir / s for s in shards]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")) or any(model_dir.glob("*.pth")):
        raise ModelError(
            f"{model_dir}: weights are pickle files (.bin/.pt), which Parity never unpickles; "
            "convert them with model.save_pretrained(DIR, safe_serialization=True)"
        )
    raise ModelError(f"{model_dir}: no model.safetensors (or sharded index) found")


def load_model(model_dir: str | Path) -> CausalLM:
    """Load FP32 weights from a Hugging Face directory. `trust_remote_code` is never used."""
    model_dir = resolve_model_dir(model_dir)
    cfg = load_config(model_dir)
    state: dict[str, torch.Tensor] = {}
    for f in _weight_files(model_dir):
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types for cut or garbled files
            raise ModelError(f"{f}: not a readable safetensors file ({e})") from None
    model = CausalLM(cfg)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(expected - state.keys())
    unexpected = sorted(k for k in state.keys() - expected if not k.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise ModelError(
            f"{model_dir}: weights do not match a {cfg.architecture} model "
            f"(missing {missing[:4]}, unexpected {unexpected[:4]})"
        )
    wrong_shape = [
        f"{k} {tuple(state[k].shape)}, expected {tuple(v.shape)}"
        for k, v in model.state_dict().items()
        if k in state and state[k].shape != v.shape
    ]
    if wrong_shape:
        raise ModelError(f"{model_dir}: weights do not match config.json ({'; '.join(wrong_shape[:3])})")
    model.load_state_dict({k: v.float() for k, v in state.items() if k in expected}, strict=False)
    return model


def export_state(model: CausalLM, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Parameters under their Hugging Face names, cast to `dtype` (tied head omitted)."""
    return {
        k: v.detach().to(dtype).contiguous()
        for k, v in model.state_dict().items()
        if not (model.config.tie_word_embeddings and k == "lm_head.weight")
    }


def save_model(model: CausalLM, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
    """Write config.json + model.safetensors (+ tokenizer files) atomically."""
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2) + "\n")
        save_file(export_state(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer_dir is not None:
            src = resolve_model_dir(tokenizer_dir)
            for name in (
                "tokenizer.json",
                "tokenizer_config.json",
                "generation_config.json",
                "special_tokens_map.json",
            ):
                if (src / name).is_file():
                    (tmp / name).write_bytes((src / name).read_bytes())
    return out_dir
