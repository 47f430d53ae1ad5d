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
    """One decoder layer as the rollout engine holds it, and its `decoder.Layer`: the engine's norms (one
    rounding, the residual added in the same pass), the fused projections with their unmerged adapters."""

    config: ModelConfig
    numerics: kernels.Numerics
    input_layernorm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_attention_layernorm: torch.Tensor
    gate_up: torch.Tensor | None  # dense MLP
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | None
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    pre_feedforward_layernorm: torch.Tensor | None = None  # Gemma's norms around the MLP
    post_feedforward_layernorm: torch.Tensor | None = None
    router: torch.Tensor | None = None  # MoE: [E, H], and each expert's fused projections
    experts_gate_up: torch.Tensor | None = None  # [E, 2I, H]
    experts_down: torch.Tensor | None = None  # [E, H, I]
    # Unmerged LoRA (`load_adapters`): per projection ("qkv", "o", "gate_up", "down") the pair (A, B)
    # whose x·Aᵀ·Bᵀ is added to the base projection; a fused projection's A stacks its members' and
    # its B is block-diagonal, so one pair serves Q, K and V (or gate and up) together. With the pair,
    # each adapted member's (output columns, rank columns) in it, for exact mode (`Numerics.add_adapter`).
    lora: dict[str, tuple[torch.Tensor, torch.Tensor, list[tuple[slice, slice]]]] = field(default_factory=dict)
    # Per projection, the copy the numerics multiplies by faster (`Numerics.fast_matrix`), remade every load.
    fast: dict[str, torch.Tensor] = field(default_factory=dict)

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.numerics.engine_norm(x, getattr(self, name), self.config.rms_norm_eps, self.config.gemma)

    def add_norm(self, name: str, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.numerics.engine_add_norm(x, delta, getattr(self, name), self.config.rms_norm_eps)

    def project(self, part: str, x: torch.Tensor) -> torch.Tensor:
        """The projection `part` (qkv, o, gate_up, down), with its unmerged adapter."""
        weight, bias = getattr(self, part), getattr(self, part + "_bias")
        out = self.numerics.linear(x, weight, bias, prerounded=True, fast=self.fast.get(part))
        if part in self.lora:
            out = self.numerics.add_adapter(out, x, *self.lora[part])
        return out

    def attention_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views into the fused projection's output (Q's heads, then K's, then V's)."""
        cfg, rows = self.config, x.shape[:-1]
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, k, v = self.project("qkv", x).split([h * d, hkv * d, hkv * d], dim=-1)
        return q.view(*rows, h, d), k.view(*rows, hkv, d), v.view(*rows, hkv, d)

    def attention_output(self, x: torch.Tensor) -> torch.Tensor:
        return self.project("o", x)

    def mlp_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.project("gate_up", x).chunk(2, dim=-1)

    def mlp_output(self, x: torch.Tensor) -> torch.Tensor:
        return self.project("down", x)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor | None:
        return None if self.router is None else self.numerics.linear(x, self.router, prerounded=True)

    def expert_inputs(self, expert: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.numerics.linear(x, self.experts_gate_up[expert], prerounded=True).chunk(2, dim=-1)

    def expert_output(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self.numerics.linear(x, self.experts_down[expert], prerounded=True)


PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the dense layer's matmuls, as the engine fuses them
MATRICES = (*PROJECTIONS, "router")  # held as `kernels.store_for_engine` keeps a matmul weight


def layer_names(cfg: ModelConfig, i: int) -> dict[str, tuple[tuple[str, int | None], ...]]:
    """Layer i's Hugging Face map, the one the engine loads, syncs and checks by: each `LayerWeights` field
    (MoE experts aside) and the parameters stacked into it in order, with each one's rows in a fused field
    (None: the field is that one tensor). Q, K and V are fused, and gate and up."""
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    q, kv, inner = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    qkv = ((a + "q_proj", q), (a + "k_proj", kv), (a + "v_proj", kv))
    gate_up = ((m + "gate_proj", inner), (m + "up_proj", inner))
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    one = {
        **{norm: p + norm + ".weight" for norm in norms},
        "o": a + "o_proj.weight",
        "o_bias": a + "o_proj.bias",
        "down": m + "down_proj.weight",
        "down_bias": m + "down_proj.bias",
        "q_norm": a + "q_norm.weight",
        "k_norm": a + "k_norm.weight",
        "router": m + "gate.weight",
    }
    out = {part: ((name, None),) for part, name in one.items()}
    for part, members in (("qkv", qkv), ("gate_up", gate_up)):
        out[part] = tuple((name + ".weight", rows) for name, rows in members)
        out[part + "_bias"] = tuple((name + ".bias", rows) for name, rows in members)
    return out


def _modules(members: tuple[tuple[str, int | None], ...]) -> list[tuple[str, int | None]]:
    """A projection's members as module names (`model.layers.0.self_attn.q_proj`) with their rows."""
    return [(name.rpartition(".")[0], rows) for name, rows in members]


class RolloutWeights:
    """The weights one rollout engine samples with, in `dtype`, on `numerics.device`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, numerics: kernels.Numerics):
        self.config = config
        self.dtype = dtype
        self.device = numerics.device
        with torch.device("meta"):
            names = CausalLM(config, numerics).state_dict().keys()
        self._expected = {n for n in names if not (config.tie_word_embeddings and n == "lm_head.weight")}
        self.layers: list[LayerWeights] = []
        self.numerics = numerics
        self.lm_head_fast: torch.Tensor | None = None  # the LM head as `Numerics.fast_matrix` reorders it
        self.weight_version = -1
        self.layout = 0  # bumped whenever a buffer is allocated anew (see the module docstring)

    @property
    def numerics(self) -> kernels.Numerics:
        """How the weights compute; every layer's (`LayerWeights.numerics`) follows it."""
        return self._numerics

    @numerics.setter
    def numerics(self, value: kernels.Numerics) -> None:
        self._numerics = value
        for layer in self.layers:
            layer.numerics = value

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

        def stacked(members: tuple[tuple[str, int | None], ...], matrix: bool) -> torch.Tensor | None:
            """The members stacked (one: as is), or None where the model has none of them."""
            if members[0][0] not in state:
                return None
            return torch.cat([w(name, matrix) for name, _ in members]) if len(members) > 1 else w(members[0][0], matrix)

        cfg = self.config
        self.embed = w("model.embed_tokens.weight", matrix=True)
        self.norm = w("model.norm.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings else w("lm_head.weight", matrix=True)
        self.layers = []
        for i in range(cfg.num_layers):
            fields = {part: stacked(members, part in MATRICES) for part, members in layer_names(cfg, i).items()}
            experts, m = range(cfg.num_experts if i in cfg.moe_layers else 0), f"model.layers.{i}.mlp.experts."
            if experts:  # each expert's gate and up fused, the experts stacked
                pairs = [(f"{m}{e}.gate_proj.weight", f"{m}{e}.up_proj.weight") for e in experts]
                fields["experts_gate_up"] = torch.stack([torch.cat([w(n, True) for n in pair]) for pair in pairs])
                fields["experts_down"] = torch.stack([w(f"{m}{e}.down_proj.weight", matrix=True) for e in experts])
            self.layers.append(LayerWeights(cfg, self.numerics, **fields))
        self._reorder()
        self.weight_version = version
        self.layout += 1

    def _reorder(self) -> None:
        """The numerics' faster copies of the stored matmul weights (`Numerics.fast_matrix`), after a load."""
        fast = self.numerics.fast_matrix
        self.lm_head_fast = fast(self.lm_head)
        for layer in self.layers:
            layer.fast = {}
            for part in PROJECTIONS:
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
            names = layer_names(self.config, i)
            for part in PROJECTIONS:
                members = _modules(names[part])
                pairs = [adapters.get(name) for name, _ in members]
                unknown -= {name for name, _ in members}
                if all(p is None for p in pairs):
                    continue
                ranks = [0 if p is None else p[0].shape[0] for p in pairs]
                a = torch.cat([p[0] for p in pairs if p is not None])
                widths = [rows or getattr(layer, part).shape[0] for _, rows in members]
                b = torch.zeros(sum(widths), sum(ranks), dtype=a.dtype, device=a.device)
                row = col = 0
                blocks = []
                for p, width, rank in zip(pairs, widths, ranks):
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
            for part, members in layer_names(cfg, i).items():
                tensor = getattr(layer, part)
                if tensor is None:
                    continue
                pieces = tensor.split([rows for _, rows in members]) if len(members) > 1 else (tensor,)
                out.update({name: piece for (name, _), piece in zip(members, pieces)})
            if layer.router is not None:
                m = f"model.layers.{i}.mlp.experts."
                for e in range(cfg.num_experts):
                    gate, up = layer.experts_gate_up[e].chunk(2)
                    out[f"{m}{e}.gate_proj.weight"], out[f"{m}{e}.up_proj.weight"] = gate, up
                    out[f"{m}{e}.down_proj.weight"] = layer.experts_down[e]
        return out
