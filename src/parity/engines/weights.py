"""The rollout engine's weights: stored in the rollout precision, with the Q/K/V and gate/up projections
fused into one matrix each (as inference engines hold them), loaded and synced under the trainer's model's names.

A weight sync writes into the buffers the first load built, so the decode step's CUDA graphs, which read them,
stay valid; anything that allocates anew (the first load, new LoRA adapters, a load that drops them) bumps
`layout`, which tells the engine to capture again.
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

    owner: RolloutWeights  # whose config and numerics it computes with
    # By `fusions`' parts: qkv, gate_up (fused) and their biases, o, down, the norms (Hugging Face's
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
        cfg = self.owner.config
        return self.owner.numerics.engine_norm(x, self.tensors[name], cfg.rms_norm_eps, cfg.gemma)

    def add_norm(self, name: str, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner.numerics.engine_add_norm(x, delta, self.tensors[name], self.owner.config.rms_norm_eps)

    def project(self, part: str, x: torch.Tensor) -> torch.Tensor:
        """The projection `part` (qkv, o, gate_up, down), with its unmerged adapter."""
        numerics, weight, bias = self.owner.numerics, self.tensors[part], self.tensors.get(part + "_bias")
        out = numerics.linear(x, weight, bias, prerounded=True, fast=self.fast.get(part))
        return numerics.add_adapter(out, x, *self.lora[part]) if part in self.lora else out

    def attention_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views into the fused projection's output (Q's heads, then K's, then V's)."""
        cfg, rows = self.owner.config, x.shape[:-1]
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
        return None if router is None else self.owner.numerics.linear(x, router, prerounded=True)

    def expert_inputs(self, expert: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._expert("experts_gate_up", expert, x).chunk(2, dim=-1)

    def expert_output(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self._expert("experts_down", expert, x)

    def _expert(self, part: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        weight = self.tensors[part].unflatten(0, (self.owner.config.num_experts, -1))[expert]  # its rows of the stack
        return self.owner.numerics.linear(x, weight, prerounded=True)


PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the dense layer's matmuls, as the engine fuses them
MATRICES = (*PROJECTIONS, "router", "experts_gate_up", "experts_down", "embed", "lm_head")  # `store_for_engine`'s
Members = tuple[tuple[str, int], ...]  # the Hugging Face tensors stacked into one part, with their rows
ROOT = {"embed": ("model.embed_tokens",), "norm": ("model.norm",), "lm_head": ("lm_head",)}


def fusions(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The modules of a layer whose weights the engine stacks into one part, in order: Q, K and V, gate and up,
    a MoE layer's experts (gate, up, then the next expert's)."""
    experts = range(cfg.num_experts)
    return {
        "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "o": ("self_attn.o_proj",),
        "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
        "down": ("mlp.down_proj",),
        "router": ("mlp.gate",),
        "experts_gate_up": tuple(f"mlp.experts.{j}.{m}" for j in experts for m in ("gate_proj", "up_proj")),
        "experts_down": tuple(f"mlp.experts.{j}.down_proj" for j in experts),
    }


def parts(
    shapes: dict[str, torch.Size], prefix: str, groups: dict[str, tuple[str, ...]], rest: bool
) -> dict[str, Members]:
    """The engine's parts of the parameters under `prefix` (`shapes`: the trainer's model's, by Hugging Face name):
    each group's modules' parameters stacked in order, with their rows (a bias as "<part>_bias"); with `rest`,
    each other parameter there a part of its own, named by its module (`input_layernorm`, `q_norm`)."""
    out, taken = {}, set()
    for part, modules in groups.items():
        for kind, name in (("weight", part), ("bias", part + "_bias")):
            members = [f"{prefix}{m}.{kind}" for m in modules if f"{prefix}{m}.{kind}" in shapes]
            if members:
                out[name] = tuple((n, shapes[n][0]) for n in members)
                taken.update(members)
    for n in shapes if rest else ():
        if n.startswith(prefix) and n not in taken:
            module, _, kind = n.rpartition(".")
            out[module.rpartition(".")[2] + ("" if kind == "weight" else "_" + kind)] = ((n, shapes[n][0]),)
    return out


class RolloutWeights:
    """The weights one rollout engine samples with, in `dtype`, on `numerics.device`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, numerics: kernels.Numerics):
        self.config, self.dtype, self.device = config, dtype, numerics.device
        self.numerics = numerics  # how the weights compute (every layer's)
        with torch.device("meta"):  # a tied LM head is the embedding: one parameter, under the embedding's name
            shapes = {name: p.shape for name, p in CausalLM(config, numerics).named_parameters()}
        self._shapes = shapes  # every parameter a load must send
        groups = fusions(config)
        # Each stored part's Hugging Face tensors: the root's, then each layer's.
        self.names = [parts(shapes, "", ROOT, rest=False)]
        self.names += [parts(shapes, f"model.layers.{i}.", groups, rest=True) for i in range(config.num_layers)]
        self.root: dict[str, torch.Tensor] = {}  # by `ROOT`'s parts
        self.layers: list[LayerWeights] = []
        self.lm_head_fast: torch.Tensor | None = None  # the LM head as `Numerics.fast_matrix` reorders it
        self.version = -1
        self.layout = 0  # bumped whenever a buffer is allocated anew (see the module docstring)

    @property
    def lm_head(self) -> torch.Tensor:
        return self.root.get("lm_head", self.root["embed"])

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy weights in (Hugging Face names), rounded to the rollout precision, fused, and record their
        version. The first load allocates the buffers; later ones write into them (the same bits as a fresh
        load), so the decode step's graphs stay valid, unless adapters were loaded: a load drops them."""
        missing = sorted(self._shapes.keys() - state.keys())
        if missing:
            raise ValueError(f"weight sync: missing {missing[:4]}")
        if not self.layers or any(layer.lora for layer in self.layers):
            self._allocate()
        for name, stored in self.stored_views().items():
            new = state[name].detach()
            if new.shape != stored.shape:
                raise ValueError(f"weight sync: {name} has shape {tuple(new.shape)}, expected {tuple(stored.shape)}")
            # copy_ rounds to a 16-bit buffer's dtype itself; an FP32-held weight takes the rounded values.
            stored.copy_(new.to(device=stored.device, dtype=self.dtype) if stored.dtype != self.dtype else new)
        self._reorder()
        self.version = version

    def _allocate(self) -> None:
        """Empty buffers for every part (a matmul weight held as `kernels.store_for_engine` keeps it)."""
        held = kernels.store_for_engine(torch.empty(0, dtype=self.dtype, device=self.device), self.dtype).dtype

        def buffers(names: dict[str, Members]) -> dict[str, torch.Tensor]:
            out = {}
            for part, members in names.items():
                shape = (sum(rows for _, rows in members), *self._shapes[members[0][0]][1:])  # members stacked
                out[part] = torch.empty(shape, dtype=held if part in MATRICES else self.dtype, device=self.device)
            return out

        self.root = buffers(self.names[0])
        self.layers = [LayerWeights(self, buffers(names)) for names in self.names[1:]]
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
        unknown, held = set(adapters), self.numerics.adapter_dtype(self.dtype)
        for layer, names in zip(self.layers, self.names[1:]):
            layer.lora = {}
            for part in (p for p in PROJECTIONS if p in names):
                members = [(name.rpartition(".")[0], rows) for name, rows in names[part]]  # module names
                unknown -= {name for name, _ in members}
                pairs = [adapters.get(name) for name, _ in members]
                if all(p is None for p in pairs):
                    continue
                a = torch.cat([p[0] for p in pairs if p is not None])
                # B block-diagonal: each member's output rows against its own rank columns (none without adapter).
                bs = [a.new_zeros(rows, 0) if p is None else p[1].to(a.dtype) for p, (_, rows) in zip(pairs, members)]
                blocks, row, col = [], 0, 0  # each adapted member's (output rows, rank columns) in B
                for p, block in zip(pairs, bs):
                    if p is not None:
                        blocks.append((slice(row, row + block.shape[0]), slice(col, col + block.shape[1])))
                    row, col = row + block.shape[0], col + block.shape[1]
                # Rounded to the rollout precision, held as `Numerics.add_adapter` reads them.
                a, b = (t.to(device=self.device, dtype=self.dtype).to(held) for t in (a, torch.block_diag(*bs)))
                layer.lora[part] = (a, b, blocks)
        if unknown:
            raise ValueError(f"adapter sync: no projection named {sorted(unknown)[:3]}")
        self.version = version
        self.layout += 1

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The weights as loaded, in the rollout precision, under their Hugging Face names (views
        into the fused projections), for checking a weight sync against the sender's checksums."""
        # Weights held in FP32 (`kernels.store_for_engine`) are given in the rollout precision (copies), as sent.
        return {name: t if t.dtype == self.dtype else t.to(self.dtype) for name, t in self.stored_views().items()}

    def stored_views(self) -> dict[str, torch.Tensor]:
        """Every stored weight as held (a matmul weight possibly in FP32), under its Hugging Face name:
        views into the fused projections."""
        out = {}
        for names, tensors in zip(self.names, [self.root] + [layer.tensors for layer in self.layers]):
            for part, tensor in tensors.items():
                members = names[part]
                pieces = tensor.split([rows for _, rows in members]) if len(members) > 1 else (tensor,)
                out.update({name: piece for (name, _), piece in zip(members, pieces)})
        return out
