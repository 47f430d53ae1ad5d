"""The rollout engine's weights: stored in the rollout precision, with the Q/K/V and gate/up projections
fused into one matrix each (as inference engines hold them), loaded and synced under Hugging Face names.

Kept apart from the decode loop (`rollout.py`): a weight sync writes into the buffers the first load built,
so the decode step's CUDA graphs, which read those buffers, stay valid; anything that allocates anew
(the first load, new LoRA adapters) bumps `layout`, which tells the engine to capture again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parity.engines import kernels
from parity.engines.models.config import ModelConfig
from parity.engines.models.modules import CausalLM


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None  # dense MLP
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | None
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    pre_mlp_norm: torch.Tensor | None = None  # Gemma's norms around the MLP
    post_mlp_norm: torch.Tensor | None = None
    router: torch.Tensor | None = None  # MoE: [E, H], and each expert's fused projections
    experts_gate_up: torch.Tensor | None = None  # [E, 2I, H]
    experts_down: torch.Tensor | None = None  # [E, H, I]
    # Unmerged LoRA (`load_adapters`): per projection ("qkv", "o", "gate_up", "down") the pair (A, B)
    # whose x·Aᵀ·Bᵀ is added to the base projection; a fused projection's A stacks its members' and
    # its B is block-diagonal, so one pair serves Q, K and V (or gate and up) together. With the pair,
    # each adapted member's (output columns, rank columns) in it, for exact mode (`RolloutEngine._project`).
    lora: dict[str, tuple[torch.Tensor, torch.Tensor, list[tuple[slice, slice]]]] = field(default_factory=dict)
    # Per projection, the copy the numerics multiplies by faster (`Numerics.fast_matrix`), remade every load.
    fast: dict[str, torch.Tensor] = field(default_factory=dict)


def projections(cfg: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """A dense layer's projections as the engine holds them (`_Layer` fields), each with its Hugging
    Face members (module names under the layer) and their output widths, in the order they are
    stacked: Q, K and V fused, gate and up fused."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "qkv": (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)),
        "o": (("self_attn.o_proj", cfg.hidden_size),),
        "gate_up": (("mlp.gate_proj", cfg.intermediate_size), ("mlp.up_proj", cfg.intermediate_size)),
        "down": (("mlp.down_proj", cfg.hidden_size),),
    }


class RolloutWeights:
    """The weights one rollout engine samples with, in `dtype`, on `numerics.device`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, numerics: kernels.Numerics):
        self.config = config
        self.dtype = dtype
        self.numerics = numerics
        self.device = numerics.device
        with torch.device("meta"):
            names = CausalLM(config, numerics).state_dict().keys()
        self._expected = {n for n in names if not (config.tie_word_embeddings and n == "lm_head.weight")}
        self.layers: list[LayerWeights] = []
        self.weight_version = -1
        self.layout = 0  # bumped whenever a buffer is allocated anew (see the module docstring)

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy weights in (Hugging Face names), cast to the rollout precision, fuse, and
        record their version."""
        missing = sorted(self._expected - state.keys())
        if missing:
            raise ValueError(f"weight sync: missing {missing[:4]}")
        if self.layers and not any(layer.lora for layer in self.layers):
            self._copy_into_stored(state)
            self._reorder()
            self.weight_version = version
            return

        def w(name: str, matrix: bool = False) -> torch.Tensor | None:
            """The tensor in the rollout precision; a matmul weight as `kernels.store_for_engine` keeps it."""
            if name not in state:
                return None
            source = state[name].detach()
            t = source.to(self.device)
            t = kernels.store_for_engine(t, self.dtype) if matrix else t.to(self.dtype)
            # The engine owns its buffers (later syncs copy into them), never the sender's tensor.
            return t.clone() if t.data_ptr() == source.data_ptr() else t

        def cat(*names: str, matrix: bool = True) -> torch.Tensor | None:
            return torch.cat([w(n, matrix) for n in names]) if names[0] in state else None

        cfg = self.config
        self.embed = w("model.embed_tokens.weight", matrix=True)
        self.norm = w("model.norm.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings else w("lm_head.weight", matrix=True)
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            experts = range(cfg.num_experts if i in cfg.moe_layers else 0)
            self.layers.append(
                LayerWeights(
                    input_norm=w(p + "input_layernorm.weight"),
                    qkv=cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                    qkv_bias=cat(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias", matrix=False),
                    o=w(a + "o_proj.weight", matrix=True),
                    o_bias=w(a + "o_proj.bias"),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=cat(m + "gate_proj.weight", m + "up_proj.weight"),
                    gate_up_bias=cat(m + "gate_proj.bias", m + "up_proj.bias", matrix=False),
                    down=w(m + "down_proj.weight", matrix=True),
                    down_bias=w(m + "down_proj.bias"),
                    q_norm=w(a + "q_norm.weight"),
                    k_norm=w(a + "k_norm.weight"),
                    pre_mlp_norm=w(p + "pre_feedforward_layernorm.weight"),
                    post_mlp_norm=w(p + "post_feedforward_layernorm.weight"),
                    router=w(m + "gate.weight", matrix=True),
                    experts_gate_up=torch.stack(
                        [cat(f"{m}experts.{e}.gate_proj.weight", f"{m}experts.{e}.up_proj.weight") for e in experts]
                    )
                    if experts
                    else None,
                    experts_down=torch.stack([w(f"{m}experts.{e}.down_proj.weight", matrix=True) for e in experts])
                    if experts
                    else None,
                )
            )
        self._reorder()
        self.weight_version = version
        self.layout += 1

    def _reorder(self) -> None:
        """The numerics' faster copies of the stored matmul weights (`Numerics.fast_matrix`), after a load."""
        fast = self.numerics.fast_matrix
        self.lm_head_fast = fast(self.lm_head)
        for layer in self.layers:
            layer.fast = {}
            for part in projections(self.config):
                stored = getattr(layer, part)
                copy = None if stored is None else fast(stored)
                if copy is not None:
                    layer.fast[part] = copy

    @torch.no_grad()
    def _copy_into_stored(self, state: dict[str, torch.Tensor]) -> None:
        """A later sync: each weight rounded to the rollout precision into the buffers the first load
        built, on their device (the same bits as a fresh load, without allocating the model again)."""
        for name, stored in self.stored_views().items():
            new = state[name].detach()
            if new.shape != stored.shape:
                raise ValueError(f"weight sync: {name} has shape {tuple(new.shape)}, expected {tuple(stored.shape)}")
            # copy_ rounds to a 16-bit buffer's dtype itself; an FP32-held weight takes the rounded values.
            stored.copy_(new.to(device=stored.device, dtype=self.dtype) if stored.dtype != self.dtype else new)

    def load_adapters(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], version: int) -> None:
        """Apply LoRA unmerged on the loaded base: `adapters` maps a projection's Hugging Face module
        name (`model.layers.0.self_attn.q_proj`) to (A [r, in], scale·B [out, r]); projections not
        named keep no adapter. Replaces the previous adapters and records the version."""
        unknown = set(adapters)
        for i, layer in enumerate(self.layers):
            layer.lora = {}
            for part, members in projections(self.config).items():
                pairs = [adapters.get(f"model.layers.{i}.{name}") for name, _ in members]
                unknown -= {f"model.layers.{i}.{name}" for name, _ in members}
                if all(p is None for p in pairs):
                    continue
                ranks = [0 if p is None else p[0].shape[0] for p in pairs]
                a = torch.cat([p[0] for p in pairs if p is not None])
                b = torch.zeros(sum(w for _, w in members), sum(ranks), dtype=a.dtype, device=a.device)
                row = col = 0
                blocks = []
                for p, (_, width), rank in zip(pairs, members, ranks):
                    if p is not None:
                        b[row : row + width, col : col + rank] = p[1]
                        blocks.append((slice(row, row + width), slice(col, col + rank)))
                    row, col = row + width, col + rank
                # Rounded to the rollout precision, held as `Numerics.add_adapter` reads them.
                held = self.numerics.adapter_dtype(self.dtype)
                a, b = (t.to(device=self.device, dtype=self.dtype).to(held) for t in (a, b))
                layer.lora[part] = (a, b, blocks)
        if unknown:
            raise ValueError(f"adapter sync: no projection named {sorted(unknown)[:3]}")
        self.weight_version = version
        self.layout += 1

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The weights as loaded, in the rollout precision, under their Hugging Face names (views
        into the fused projections), for checking a weight sync against the sender's checksums."""
        # Weights held in FP32 (`kernels.store_for_engine`) are given in the rollout precision (copies), as sent.
        return {name: t if t.dtype == self.dtype else t.to(self.dtype) for name, t in self.stored_views().items()}

    def stored_views(self) -> dict[str, torch.Tensor]:
        """Every stored weight as held (a matmul weight possibly in FP32), under its Hugging Face name:
        views into the fused projections."""
        cfg = self.config
        out = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            for part, members in projections(cfg).items():
                for suffix, tensor in (("weight", getattr(layer, part)), ("bias", getattr(layer, part + "_bias"))):
                    if tensor is not None:
                        for (name, _), piece in zip(members, tensor.split([w for _, w in members])):
                            out[f"{p}{name}.{suffix}"] = piece
            if layer.router is not None:
                for e in range(cfg.num_experts):
                    gate, up = layer.experts_gate_up[e].chunk(2)
                    out[f"{m}experts.{e}.gate_proj.weight"], out[f"{m}experts.{e}.up_proj.weight"] = gate, up
                    out[f"{m}experts.{e}.down_proj.weight"] = layer.experts_down[e]
            single = {
                p + "input_layernorm.weight": layer.input_norm,
                p + "post_attention_layernorm.weight": layer.post_norm,
                p + "pre_feedforward_layernorm.weight": layer.pre_mlp_norm,
                p + "post_feedforward_layernorm.weight": layer.post_mlp_norm,
                a + "q_norm.weight": layer.q_norm,
                a + "k_norm.weight": layer.k_norm,
                m + "gate.weight": layer.router,
            }
            out.update({name: t for name, t in single.items() if t is not None})
        return out
