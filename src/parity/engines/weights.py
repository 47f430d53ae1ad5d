"""The rollout engine's weights: stored in the rollout precision, with the Q/K/V and gate/up projections
fused into one matrix each (as inference engines hold them), loaded and synced under Hugging Face names.

Kept apart from the decode loop (`rollout.py`): a weight sync writes into the buffers the first load built,
so the decode step's CUDA graphs, which read those buffers, stay valid; anything that allocates anew
(the first load, new LoRA adapters, a load that drops them) bumps `layout`, which tells the engine to
capture again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parity.engines import kernels
from parity.engines.models.config import ModelConfig
from parity.engines.models.families import family
from parity.engines.models.modules import CausalLM


@dataclass
class LayerWeights:
    """One decoder layer as the rollout engine holds it, and its `decoder.Layer`: the engine's norms (one
    rounding, the residual added in the same pass), the fused projections with their unmerged adapters."""

    config: ModelConfig
    numerics: kernels.Numerics
    # By `layer_names`' parts: qkv, gate_up (fused) and their biases, o, down, the norms (Hugging Face's
    # names), a MoE layer's router and its experts' fused projections stacked (experts_gate_up [E·2I, H],
    # experts_down [E·H, I]). A part the model lacks is absent.
    tensors: dict[str, torch.Tensor]
    # Unmerged LoRA (`load_adapters`): per projection ("qkv", "o", "gate_up", "down") the pair (A, B)
    # whose x·Aᵀ·Bᵀ is added to the base projection; a fused projection's A stacks its members' and
    # its B is block-diagonal, so one pair serves Q, K and V (or gate and up) together. With the pair,
    # each adapted member's (output columns, rank columns) in it, for exact mode (`Numerics.add_adapter`).
    lora: dict[str, tuple[torch.Tensor, torch.Tensor, list[tuple[slice, slice]]]] = field(default_factory=dict)
    # Per projection, the copy the numerics multiplies by faster (`Numerics.fast_matrix`), remade every load.
    fast: dict[str, torch.Tensor] = field(default_factory=dict)

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.numerics.engine_norm(x, self.tensors[name], self.config.rms_norm_eps, self.config.gemma)

    def add_norm(self, name: str, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.numerics.engine_add_norm(x, delta, self.tensors[name], self.config.rms_norm_eps)

    def project(self, part: str, x: torch.Tensor) -> torch.Tensor:
        """The projection `part` (qkv, o, gate_up, down), with its unmerged adapter."""
        weight, bias = self.tensors[part], self.tensors.get(part + "_bias")
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
        router = self.tensors.get("router")
        return None if router is None else self.numerics.linear(x, router, prerounded=True)

    def expert_inputs(self, expert: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.tensors["experts_gate_up"].unflatten(0, (self.config.num_experts, -1))[expert]
        return self.numerics.linear(x, weight, prerounded=True).chunk(2, dim=-1)

    def expert_output(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        weight = self.tensors["experts_down"].unflatten(0, (self.config.num_experts, -1))[expert]
        return self.numerics.linear(x, weight, prerounded=True)


PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the dense layer's matmuls, as the engine fuses them
MATRICES = (*PROJECTIONS, "router", "experts_gate_up", "experts_down", "embed", "lm_head")  # `store_for_engine`'s
Members = tuple[tuple[str, int], ...]  # the Hugging Face tensors stacked into one part, with their rows


def layer_names(cfg: ModelConfig, i: int) -> dict[str, Members]:
    """Layer i's Hugging Face map, the one the engine loads, syncs and checks by: each part of
    `LayerWeights.tensors` and the tensors stacked into it, in order, with their rows. Q, K and V are fused,
    gate and up, and a MoE layer's experts stacked (gate, up, then the next expert's)."""
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    q, kv, hidden = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    inner = cfg.intermediate_size
    fused = {
        "qkv": ((a + "q_proj", q), (a + "k_proj", kv), (a + "v_proj", kv)),
        "gate_up": ((m + "gate_proj", inner), (m + "up_proj", inner)),
        "o": ((a + "o_proj", hidden),),
        "down": ((m + "down_proj", hidden),),
    }
    out = {part: tuple((name + ".weight", rows) for name, rows in members) for part, members in fused.items()}
    out |= {part + "_bias": tuple((name + ".bias", rows) for name, rows in members) for part, members in fused.items()}
    out |= {norm: ((p + norm + ".weight", hidden),) for norm in family(cfg).norms}
    out |= {"q_norm": ((a + "q_norm.weight", cfg.head_dim),), "k_norm": ((a + "k_norm.weight", cfg.head_dim),)}
    if i in cfg.moe_layers:
        e, experts, width = m + "experts.", range(cfg.num_experts), cfg.moe_intermediate_size
        out["router"] = ((m + "gate.weight", cfg.num_experts),)
        pairs = [(f"{e}{j}.gate_proj.weight", f"{e}{j}.up_proj.weight") for j in experts]
        out["experts_gate_up"] = tuple((name, width) for pair in pairs for name in pair)
        out["experts_down"] = tuple((f"{e}{j}.down_proj.weight", hidden) for j in experts)
    return out


def root_names(cfg: ModelConfig) -> dict[str, Members]:
    """The weights outside the layers, as `layer_names` gives a layer's (a tied LM head is the embedding)."""
    out = {"embed": (("model.embed_tokens.weight", cfg.vocab_size),), "norm": (("model.norm.weight", cfg.hidden_size),)}
    return out if cfg.tie_word_embeddings else out | {"lm_head": (("lm_head.weight", cfg.vocab_size),)}


class RolloutWeights:
    """The weights one rollout engine samples with, in `dtype`, on `numerics.device`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, numerics: kernels.Numerics):
        self.config = config
        self.dtype = dtype
        self.device = numerics.device
        with torch.device("meta"):
            names = CausalLM(config, numerics).state_dict().keys()
        self._expected = {n for n in names if not (config.tie_word_embeddings and n == "lm_head.weight")}
        self.root: dict[str, torch.Tensor] = {}  # by `root_names`' parts
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

    @property
    def lm_head(self) -> torch.Tensor:
        return self.root.get("lm_head", self.root["embed"])

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy weights in (Hugging Face names), rounded to the rollout precision, fused, and record their
        version. The first load allocates the buffers; later ones write into them (the same bits as a fresh
        load), so the decode step's graphs stay valid, unless adapters were loaded: a load drops them."""
        missing = sorted(self._expected - state.keys())
        if missing:
            raise ValueError(f"weight sync: missing {missing[:4]}")
        if not self.layers or any(layer.lora for layer in self.layers):
            self._allocate(state)
        for name, stored in self.stored_views().items():
            new = state[name].detach()
            if new.shape != stored.shape:
                raise ValueError(f"weight sync: {name} has shape {tuple(new.shape)}, expected {tuple(stored.shape)}")
            # copy_ rounds to a 16-bit buffer's dtype itself; an FP32-held weight takes the rounded values.
            stored.copy_(new.to(device=stored.device, dtype=self.dtype) if stored.dtype != self.dtype else new)
        self._reorder()
        self.weight_version = version

    def _allocate(self, state: dict[str, torch.Tensor]) -> None:
        """Empty buffers for every part whose tensors `state` holds (a matmul weight held as
        `kernels.store_for_engine` keeps it)."""

        held = kernels.store_for_engine(torch.empty(0, dtype=self.dtype, device=self.device), self.dtype).dtype

        def buffers(parts: dict[str, Members]) -> dict[str, torch.Tensor]:
            out = {}
            for part, members in parts.items():
                if members[0][0] in state:
                    shape = state[members[0][0]].shape
                    rows = sum(r for _, r in members) if len(members) > 1 else shape[0]
                    dtype = held if part in MATRICES else self.dtype
                    out[part] = torch.empty((rows, *shape[1:]), dtype=dtype, device=self.device)
            return out

        self.root = buffers(root_names(self.config))
        cfg = self.config
        self.layers = [LayerWeights(cfg, self.numerics, buffers(layer_names(cfg, i))) for i in range(cfg.num_layers)]
        self.layout += 1

    def _reorder(self) -> None:
        """The numerics' faster copies of the stored matmul weights (`Numerics.fast_matrix`), after a load."""
        fast = self.numerics.fast_matrix
        self.lm_head_fast = fast(self.lm_head)
        for layer in self.layers:
            copies = {part: fast(layer.tensors[part]) for part in PROJECTIONS if part in layer.tensors}
            layer.fast = {part: copy for part, copy in copies.items() if copy is not None}

    def load_adapters(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], version: int) -> None:
        """Apply LoRA unmerged on the loaded base: `adapters` maps a projection's Hugging Face module
        name (`model.layers.0.self_attn.q_proj`) to (A [r, in], scale·B [out, r]); projections not
        named keep no adapter. Replaces the previous adapters and records the version."""
        unknown = set(adapters)
        for i, layer in enumerate(self.layers):
            layer.lora = {}
            names = layer_names(self.config, i)
            for part in PROJECTIONS:
                members = [(name.rpartition(".")[0], rows) for name, rows in names[part]]  # module names
                pairs = [adapters.get(name) for name, _ in members]
                unknown -= {name for name, _ in members}
                if all(p is None for p in pairs):
                    continue
                ranks = [0 if p is None else p[0].shape[0] for p in pairs]
                a = torch.cat([p[0] for p in pairs if p is not None])
                widths = [rows for _, rows in members]
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
        held = [(root_names(self.config), self.root)]
        held += [(layer_names(self.config, i), layer.tensors) for i, layer in enumerate(self.layers)]
        out = {}
        for names, tensors in held:
            for part, tensor in tensors.items():
                members = names[part]
                pieces = tensor.split([rows for _, rows in members]) if len(members) > 1 else (tensor,)
                out.update({name: piece for (name, _), piece in zip(members, pieces)})
        return out
