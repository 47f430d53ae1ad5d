"""The rollout (inference) engine: batched sampling with a KV cache.

The engine runs its own inference path over the policy's weights, stored in the
rollout precision with the Q/K/V and gate/up projections fused into one matmul
each (as inference engines do). One call samples `group_size` responses for each
prompt. Each prompt is prefilled once and its cache copied to its group; finished
sequences are dropped from the batch as they stop. For every sampled token the engine records μ, its
log-probability under the distribution actually sampled from (after temperature,
top-k and top-p), and, when filtering is on, the ids of that distribution's
support so the trainer can score π on the same support.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from parity.engines import kernels
from parity.engines import precision as prec
from parity.engines.batch import FullVocab, RolloutBatch
from parity.engines.models import (
    FULL,
    SLIDING,
    CausalLM,
    ModelConfig,
    activation,
    apply_rope,
    rms_norm,
    rope_angles,
    rope_tables,
    route,
    sliding_mask,
    softcap,
)
from parity.engines.packing import Routing
from parity.engines.sampling import SamplingParams, filter_logits, sample_categorical, support_ids

CACHE_BLOCK = 32  # decode-time KV slots are added this many at a time
# Decode batch sizes stay multiples of this. On the CPU, BF16 matmuls run oneDNN kernels
# generated for each shape; a handful of batch sizes, reused by every rollout, costs
# nothing after the first, where every new size cost a kernel build per layer.
ROW_BUCKET = 16
# On a GPU the decode loop reads finished rows and sampling supports back every this many tokens.
CHECK_EVERY = 16
# `generate(full_vocab=N)`: the positions are taken this many per recorded row (fewer rows to score again).
FULL_VOCAB_PER_ROW = 16


class KVCache:
    """Key/value storage. Keys are kept transposed, [layers, batch, kv_heads,
    head_dim, slots], so the decode-time q·kᵀ reads contiguous memory. Slot p of a row
    holds its token at position p (prompts are right-padded), so rows of different
    prompt lengths write different slots at each step; a slot no row has written yet
    holds zeros, read only under a -inf mask.

    Decoding adds slots a block at a time rather than reserving `max_new_tokens` up
    front: rows stay short, so each step's reads are dense (the decode step's small
    kernels wait on memory more than on arithmetic), and a batch that stops early
    never pays for the slots it does not use. The copy at each block boundary is
    amortised over the block.

    On the CPU, attention runs FP32 kernels on rounded inputs (flash-attention
    numerics), so keys and values are stored in FP32, holding their values rounded to
    the rollout precision: nothing is converted at each decode step, and no BF16
    kernel is generated for each new cache length."""

    def __init__(self, cfg: ModelConfig, batch: int, slots: int, dtype: torch.dtype, device: torch.device):
        store = torch.float32 if device.type == "cpu" else dtype
        shape = (cfg.num_layers, batch, cfg.num_kv_heads)
        self.k = torch.empty((*shape, cfg.head_dim, slots), dtype=store, device=device)
        self.v = torch.empty((*shape, slots, cfg.head_dim), dtype=store, device=device)

    @property
    def slots(self) -> int:
        return self.k.shape[-1]

    def take_rows(self, rows: torch.Tensor, filled: int, slots: int | None = None) -> None:
        """Keep batch rows `rows` (in that order; repeats give one copy per group member,
        omissions drop finished sequences), with room for `slots` positions (default:
        as now). Only the `filled` slots are copied."""
        k, v = self.k, self.v
        slots = self.slots if slots is None else slots
        self.k = k.new_empty((k.shape[0], len(rows), *k.shape[2:4], slots))
        self.v = v.new_empty((v.shape[0], len(rows), v.shape[2], slots, v.shape[4]))
        self.k[..., :filled] = k[:, rows, ..., :filled]
        self.v[..., :filled, :] = v[:, rows, ..., :filled, :]
        self.k[..., filled:] = 0
        self.v[..., filled:, :] = 0


@dataclass
class _Layer:
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
    # each adapted member's (output columns, rank columns) in it, for exact mode (`_project`).
    lora: dict[str, tuple[torch.Tensor, torch.Tensor, list[tuple[slice, slice]]]] = field(default_factory=dict)


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


def _support_ids(
    pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(output rows, support ids) of each decode step's live rows, from (rows, live, kept mask) per step."""
    return [(rows[live], support_ids(kept[live])) for rows, live, kept in pending]


class _FullVocabRecorder:
    """Keeps the whole next-token distribution at `per_row` positions of each of a few rows while they are
    sampled, chosen uniformly among each row's tokens: every (row, step) has a random key and a row keeps
    the positions with the smallest keys among those it sampled (a reservoir, updated with tensor ops, so
    a GPU never waits on the host). Its random numbers come from a generator of its own: recording
    changes nothing that is sampled."""

    def __init__(self, positions: int, batch: int, max_new: int, vocab: int, seed: int, device: torch.device):
        per_row = min(positions, FULL_VOCAB_PER_ROW)
        gen = torch.Generator(device=device).manual_seed(seed + 0x5EED)
        self.rows = torch.randperm(batch, generator=gen, device=device)[: -(-positions // per_row)]
        count = len(self.rows)
        self.keys = torch.rand(count, max_new, generator=gen, device=device)
        self.kept_keys = torch.full((count, per_row), float("inf"), device=device)
        self.steps = torch.full((count, per_row), -1, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(count, per_row, vocab, device=device)
        self.index = torch.arange(count, device=device)
        self.where = self.rows  # each recorded row's index among the active rows (all rows are active at first)

    def rows_kept(self, keep: torch.Tensor, active: int) -> None:
        """The decode batch of `active` rows was cut to rows `keep` (their indices before); a recorded row
        that left it has finished and is never live again (-1)."""
        position = torch.full((active,), -1, dtype=torch.long, device=keep.device)
        position[keep] = torch.arange(len(keep), device=keep.device)
        self.where = torch.where(self.where >= 0, position[self.where.clamp(min=0)], -1)

    def observe(self, t: int, live: torch.Tensor, logp: torch.Tensor) -> None:
        """Step `t`: `live` marks the active rows that sampled a token, `logp` [active rows, V] the
        distribution each sampled from."""
        where = self.where.clamp(min=0)
        slot = self.kept_keys.argmax(-1)
        worst = self.kept_keys[self.index, slot]
        take = (self.where >= 0) & live[where] & (self.keys[:, t] < worst)
        self.kept_keys[self.index, slot] = torch.where(take, self.keys[:, t], worst)
        self.steps[self.index, slot] = torch.where(take, t, self.steps[self.index, slot])
        self.logprobs[self.index, slot] = torch.where(take[:, None], logp[where], self.logprobs[self.index, slot])

    def record(self) -> FullVocab:
        return FullVocab(self.rows, self.steps, self.logprobs)


class RolloutEngine:
    """Samples from a copy of the policy whose weights are stored in the rollout precision."""

    def __init__(
        self,
        config: ModelConfig,
        precision: str,
        eos_ids: Sequence[int],
        pad_id: int,
        numerics: kernels.Numerics | None = None,
    ):
        self.config = config
        self.precision = precision
        # The device, and exact mode: the trainer's norm and attention numerics, so that μ is the
        # trainer's π bit for bit.
        self.numerics = numerics or kernels.numerics()
        self.dtype = prec.to_dtype(precision)
        self.device = self.numerics.device
        self.pad_id = pad_id
        # Decode tokens between host reads of the batch's state (`generate`): free on the CPU, a wait on a GPU.
        self.check_every = 1 if self.device.type == "cpu" else CHECK_EVERY
        self._eos = torch.tensor(sorted(set(eos_ids)), device=self.device)
        with torch.device("meta"):
            names = CausalLM(config).state_dict().keys()
        self._expected = {n for n in names if not (config.tie_word_embeddings and n == "lm_head.weight")}
        # The tables are computed where the trainer computes its angles, on the device: a GPU's cos and sin
        # differ from the CPU's in the last bit (measured on an H200: exact mode parted at position 1).
        positions = torch.arange(config.max_position_embeddings, device=self.device)
        self._angles = {
            kind: rope_angles(positions, inv_freq.to(self.device), self.dtype)
            for kind, inv_freq in rope_tables(config).items()
        }
        self.layers: list[_Layer] = []
        self.weight_version = -1
        # `trace` sets this to record each stage's output (stage name, tensor) as `_forward` runs.
        self._tap: Callable[[str, torch.Tensor], None] | None = None

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Copy weights in (Hugging Face names), cast to the rollout precision, fuse, and
        record their version."""
        missing = sorted(self._expected - state.keys())
        if missing:
            raise ValueError(f"weight sync: missing {missing[:4]}")
        if self.layers and not any(layer.lora for layer in self.layers):
            self._copy_into_held(state)
            self.weight_version = version
            return

        def w(name: str, matrix: bool = False) -> torch.Tensor | None:
            """The tensor in the rollout precision; a matmul weight as `kernels.hold` keeps it."""
            if name not in state:
                return None
            source = state[name].detach()
            t = source.to(self.device)
            t = kernels.hold(t, self.dtype) if matrix else t.to(self.dtype)
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
                _Layer(
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
        self.weight_version = version

    @torch.no_grad()
    def _copy_into_held(self, state: dict[str, torch.Tensor]) -> None:
        """A later sync: each weight rounded to the rollout precision into the buffers the first load
        built, on their device (the same bits as a fresh load, without allocating the model again)."""
        for name, held in self._held_views().items():
            new = state[name].detach()
            if new.shape != held.shape:
                raise ValueError(f"weight sync: {name} has shape {tuple(new.shape)}, expected {tuple(held.shape)}")
            # copy_ rounds to a 16-bit buffer's dtype itself; an FP32-held weight takes the rounded values.
            held.copy_(new.to(device=held.device, dtype=self.dtype) if held.dtype != self.dtype else new)

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
                # BF16 on the CPU: held as BF16-rounded values in FP32 (see `_project`), but not in exact
                # mode, which computes what the trainer does.
                a, b = (t.to(device=self.device, dtype=self.dtype) for t in (a, b))
                if kernels.per_shape_kernels(self.dtype, self.device) and not self.numerics.exact:
                    a, b = a.float(), b.float()
                layer.lora[part] = (a, b, blocks)
        if unknown:
            raise ValueError(f"adapter sync: no projection named {sorted(unknown)[:3]}")
        self.weight_version = version

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The weights as loaded, in the rollout precision, under their Hugging Face names (views
        into the fused projections), for checking a weight sync against the sender's checksums."""
        # Weights held in FP32 (`kernels.hold`) are given in the rollout precision (copies), as sent.
        return {name: t if t.dtype == self.dtype else t.to(self.dtype) for name, t in self._held_views().items()}

    def _held_views(self) -> dict[str, torch.Tensor]:
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

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm, the fused kind (FP32 inside, one rounding), as inference engines run it;
        the trainer follows the Hugging Face form (for Llama, two roundings), and so does
        exact mode."""
        if self.numerics.exact or self.config.gemma:  # Gemma scales by (1 + w), which the fused kernel has no form for
            return rms_norm(x, weight, self.config.rms_norm_eps, self.numerics, self.config.gemma)
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)

    def _project(self, layer: _Layer, part: str, x: torch.Tensor) -> torch.Tensor:
        """The projection `part` of `layer` (qkv, o, gate_up, down), with its unmerged adapter."""
        out = self.numerics.linear(x, getattr(layer, part), getattr(layer, part + "_bias"), held=True)
        if part in layer.lora:
            a, b, blocks = layer.lora[part]
            if self.numerics.exact:
                # The trainer adds each member's adapter to its own output: the block-diagonal B would
                # sum over the other members' (zero) rank columns too, in another order.
                low = self.numerics.linear(x, a)
                for columns, ranks in blocks:
                    out[..., columns] += self.numerics.linear(low[..., ranks], b[columns, ranks])
                return out
            if a.dtype == x.dtype:
                return out + kernels.linear(kernels.linear(x, a), b)
            # BF16 on the CPU would build a oneDNN kernel for each of these rank-wide matmuls at every
            # decode batch size (1.5x the rollout's time, measured); FP32 on the BF16 values, each
            # product rounded to BF16, computes what the BF16 kernel does, to the order of its sums.
            low = kernels.linear(x.float(), a).to(x.dtype)
            out = out + kernels.linear(low.float(), b).to(x.dtype)
        return out

    def _mlp(self, layer: _Layer, x: torch.Tensor, routing: list[torch.Tensor]) -> torch.Tensor:
        act = self.config.activation
        if layer.router is None:
            gate, up = self._project(layer, "gate_up", x).chunk(2, dim=-1)
            return self._project(layer, "down", activation(act, gate) * up)
        flat = x.reshape(-1, x.shape[-1])
        cfg = self.config
        used, weights, _ = route(
            self.numerics.linear(flat, layer.router, held=True), cfg.experts_per_token, cfg.norm_topk_prob
        )
        routing.append(used.view(*x.shape[:-1], -1))
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        for e in used.unique().tolist():
            token, slot = (used == e).nonzero(as_tuple=True)
            gate, up = self.numerics.linear(flat[token], layer.experts_gate_up[e], held=True).chunk(2, dim=-1)
            y = (
                self.numerics.linear(activation(act, gate) * up, layer.experts_down[e], held=True)
                * weights[token, slot, None]
            )
            out.index_add_(0, token, y)
        return out.view_as(x)

    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        keys: int | None = None,
        last: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, V] (FP32) at index `last` of each row (default: its only token), and the
        experts each MoE layer chose ([B, T, MoE layers, k], None for a dense model).

        Prefill (`keys` None): the rows are right-padded prompts in slots 0..T-1, attending
        causally (a pad attends to the real tokens before it; nothing attends to a pad).
        Decode (T = 1): each row's token is written to the slot of its position, and attends
        over the cache's first `keys` slots up to that one.
        """
        cfg = self.config
        b, t = ids.shape
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = self.embed[ids].to(self.dtype)
        if cfg.gemma:
            x = x * torch.tensor(cfg.hidden_size**0.5, dtype=x.dtype)
        angles = {kind: (cos[positions][:, None], sin[positions][:, None]) for kind, (cos, sin) in self._angles.items()}
        rows = torch.arange(b, device=ids.device)
        # One mask per attention type, for every layer of that type: a boolean mask (None = causal)
        # for prefill, an additive FP32 key bias [B, 1, 1, keys] for decoding.
        window = cfg.sliding_window
        if keys is None:
            masks = {FULL: None, SLIDING: None if window is None else sliding_mask(t, window, ids.device)}
        else:
            pos, slots = positions[:, :1], torch.arange(keys, device=ids.device)
            visible = {FULL: slots <= pos}
            if window is not None:
                visible[SLIDING] = visible[FULL] & (slots > pos - window)
            masks = {
                kind: torch.zeros(v.shape, device=ids.device).masked_fill(~v, float("-inf"))[:, None, None]
                for kind, v in visible.items()
            }
        routing: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            kind = cfg.layer_type(i)
            cos, sin = angles[kind]
            normed = self._norm(x, layer.input_norm)
            qkv = self._project(layer, "qkv", normed)
            qk, v = qkv.split([(h + hkv) * d, hkv * d], dim=-1)
            qk = qk.view(b, t, h + hkv, d)
            if layer.q_norm is not None:
                q, k = qk.split([h, hkv], dim=2)
                qk = torch.cat([self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)], dim=2)
            # RoPE on the query and key heads together: one op chain instead of two.
            q, k = apply_rope(qk.transpose(1, 2), cos, sin).split([h, hkv], dim=1)
            scale, cap = cfg.query_scale, cfg.attn_softcap
            if keys is None:
                cache.k[i, ..., :t] = k.transpose(-1, -2)
                cache.v[i, :, :, :t] = v.view(b, t, hkv, d).transpose(1, 2)
                attn = self.numerics.attention(
                    q,
                    cache.k[i, ..., :t].transpose(-1, -2),
                    cache.v[i, :, :, :t],
                    mask=masks[kind],
                    causal=masks[kind] is None,
                    scale=scale,
                    softcap=cap,
                )
            else:
                cache.k[i, rows, :, :, positions[:, 0]] = k[:, :, 0].to(cache.k.dtype)
                cache.v[i, rows, :, positions[:, 0]] = v.view(b, hkv, d).to(cache.v.dtype)
                k_t, v_all = cache.k[i, ..., :keys], cache.v[i, :, :, :keys]
                attn = self.numerics.decode_attention(q, k_t, v_all, masks[kind], scale=scale, softcap=cap)
            core = attn.transpose(1, 2).reshape(b, t, h * d)
            attn = self._project(layer, "o", core)
            if cfg.gemma:
                x = x + self._norm(attn, layer.post_norm)
                mlp = self._mlp(layer, self._norm(x, layer.pre_mlp_norm), routing)
                x = x + self._norm(mlp, layer.post_mlp_norm)
            else:
                x = x + attn
                mlp = self._mlp(layer, self._norm(x, layer.post_norm), routing)
                x = x + mlp
            if self._tap is not None:
                for part, value in (("input_norm", normed), ("attention_core", core), ("attention", attn)):
                    self._tap(f"layer{i}.{part}", value)
                self._tap(f"layer{i}.mlp", mlp)
                self._tap(f"layer{i}.output", x)
        final = self._norm(x[:, 0] if last is None else x[rows, last], self.norm)
        logits = softcap(self.numerics.linear(final, self.lm_head, held=True).float(), cfg.final_softcap)
        if self._tap is not None:
            self._tap("norm", final)
            self._tap("logits", logits)
        return logits, torch.stack(routing, dim=2) if routing else None

    @torch.no_grad()
    def trace(self, prompt: list[int], response: list[int], sampling: SamplingParams) -> dict[str, torch.Tensor]:
        """Replay one sequence as sampling ran it (prefill the prompt, then feed each response
        token but the last) and return every stage's output, FP32, one row per position fed
        (`norm`, `logits` and `logprob`: one per response token): what `locate` compares."""
        stages: dict[str, list[torch.Tensor]] = {}
        self._tap = lambda name, value: stages.setdefault(name, []).append(value.float().reshape(-1, value.shape[-1]))
        try:
            dev, n = self.device, len(prompt)
            ids = torch.tensor([prompt], device=dev)
            cache = KVCache(self.config, 1, n + len(response), self.dtype, dev)
            last = torch.tensor([n - 1], device=dev)
            logits = [self._forward(ids, torch.arange(n, device=dev)[None], cache, last=last)[0]]
            for j, token in enumerate(response[:-1]):
                position = torch.tensor([[n + j]], device=dev)
                logits.append(self._forward(torch.tensor([[token]], device=dev), position, cache, keys=n + j + 1)[0])
        finally:
            self._tap = None
        logp = torch.log_softmax(filter_logits(torch.cat(logits), sampling), dim=-1)
        stages["logprob"] = [logp.gather(-1, torch.tensor(response, device=dev)[:, None])]
        return {name: torch.cat(values).cpu() for name, values in stages.items()}

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        group_size: int,
        sampling: SamplingParams,
        seed: int,
        full_vocab: int = 0,
        limits: list[int] | None = None,
        stop: Callable[[torch.Tensor], bool] | None = None,
    ) -> RolloutBatch:
        """`group_size` samples per prompt. `full_vocab`: also keep the whole distribution at about that
        many positions (`RolloutBatch.full_vocab`), for comparing it with the trainer's. `limits`: each
        output row's own token limit (default `sampling.max_new_tokens`). `stop`: called with the output
        rows' finished flags whenever the host reads them; True ends the call, leaving unfinished rows
        as they are (partial rollouts continue them later)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate() needs at least one prompt, each with at least one token")
        if not self.layers:
            raise RuntimeError("RolloutEngine.generate() before load_weights()")
        dev = self.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        n_prompts = len(prompts)
        lengths_list = [len(p) for p in prompts for _ in range(group_size)]
        limits = limits or [sampling.max_new_tokens] * len(lengths_list)
        if len(limits) != len(lengths_list) or min(limits) < 1:
            raise ValueError(f"generate(): expected {len(lengths_list)} row limits >= 1, got {limits}")
        max_new, prompt_len = max(limits), max(lengths_list)
        # The furthest position any row may reach; rows that finished keep decoding, clamped below it.
        max_len = max(n + limit for n, limit in zip(lengths_list, limits))
        if max_len > self.config.max_position_embeddings:
            raise ValueError(
                f"prompt + new tokens ({max_len}) exceeds the model's "
                f"max_position_embeddings ({self.config.max_position_embeddings})"
            )

        # Prefill each prompt once, right-padded to a common length: slot = position, as in the trainer.
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        ids = torch.full((n_prompts, prompt_len), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        ids = ids.to(dev)  # one copy to the device, not one per prompt
        positions = torch.arange(prompt_len, device=dev).expand(n_prompts, prompt_len)
        cache = KVCache(self.config, n_prompts, prompt_len, self.dtype, dev)
        logits, prompt_routes = self._forward(ids, positions, cache, last=lengths - 1)
        logits = logits.repeat_interleave(group_size, dim=0)

        # Expand to the groups; from here on `rows` maps active rows to output rows.
        batch = n_prompts * group_size
        expand = torch.arange(n_prompts, device=dev).repeat_interleave(group_size)
        cache.take_rows(expand, prompt_len, min(max_len, prompt_len + CACHE_BLOCK))
        next_pos = lengths.repeat_interleave(group_size)
        rows = torch.arange(batch, device=dev)
        done = torch.zeros(batch, dtype=torch.bool, device=dev)
        limit = torch.tensor(limits, device=dev)

        tokens = torch.full((batch, max_new), self.pad_id, dtype=torch.long, device=dev)
        logprobs = torch.zeros(batch, max_new, dtype=torch.float32, device=dev)
        mask_out = torch.zeros(batch, max_new, dtype=torch.bool, device=dev)
        supports: list[tuple[torch.Tensor, torch.Tensor]] = []  # (output rows, support ids) per step
        pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, live, kept) since the last check
        moe = prompt_routes is not None
        if moe:
            response_routes = torch.full((batch, max_new, *prompt_routes.shape[2:]), -1, dtype=torch.long, device=dev)
        recorder = None
        if full_vocab > 0:
            recorder = _FullVocabRecorder(full_vocab, batch, max_new, logits.shape[-1], seed, dev)

        for t in range(max_new):
            processed = filter_logits(logits, sampling)
            logp = torch.log_softmax(processed, dim=-1)
            # Every output row has its own number at every step, whichever rows are still in the batch:
            # the samples do not depend on when finished rows leave it.
            uniforms = torch.rand(batch, 1, generator=gen, device=dev)[rows]
            token = sample_categorical(logp.exp(), uniforms)
            live = ~done
            # Rows that finished earlier keep their (pad) outputs.
            tokens[rows, t] = torch.where(live, token.squeeze(-1), self.pad_id)
            logprobs[rows, t] = logp.gather(-1, token).squeeze(-1).masked_fill(done, 0.0)
            mask_out[rows, t] = live
            if recorder is not None:
                recorder.observe(t, live, logp)
            if sampling.filtered:
                pending.append((rows, live, torch.isfinite(processed)))
            token = token.squeeze(-1)
            done = done | torch.isin(token, self._eos) | (limit[rows] <= t + 1)
            if t == max_new - 1:
                break
            # The host reads the batch's state (finished rows, supports) only every `check_every` tokens:
            # on a GPU every read waits for the queued kernels. Between reads finished rows keep decoding.
            if (t + 1) % self.check_every == 0:
                supports += _support_ids(pending)
                pending = []
                if bool(done.all()):
                    break
                if stop is not None:
                    finished = torch.ones(batch, dtype=torch.bool, device=dev)
                    finished[rows] = done
                    if stop(finished):
                        break
                # Drop finished rows once they are a quarter of the batch (cache copy amortised),
                # down to a multiple of ROW_BUCKET rows, topped up with finished ones.
                size = -(-int((~done).sum()) // ROW_BUCKET) * ROW_BUCKET
                if int(done.sum()) * 4 >= done.numel() and size < done.numel():
                    keep = torch.cat([(~done).nonzero(), done.nonzero()]).squeeze(-1)[:size]
                    cache.take_rows(keep, filled=prompt_len + t)
                    if recorder is not None:
                        recorder.rows_kept(keep, done.numel())
                    rows, token, done, next_pos = rows[keep], token[keep], done[keep], next_pos[keep]
            # The highest slot a row writes now (a live row with the longest prompt; finished rows are clamped).
            start = min(prompt_len + t, max_len - 1)
            if start == cache.slots:
                cache.take_rows(torch.arange(len(rows), device=dev), start, min(max_len, start + CACHE_BLOCK))
            logits, routes = self._forward(token[:, None], next_pos[:, None], cache, keys=start + 1)
            if moe:  # the experts of the token just fed: response token t
                response_routes[rows, t] = routes[:, 0]
            next_pos = (next_pos + 1).clamp(max=max_len - 1)
        supports += _support_ids(pending)

        used = int(mask_out.sum(0).nonzero().max()) + 1
        tokens, logprobs, mask_out = tokens[:, :used], logprobs[:, :used], mask_out[:, :used]
        support = None
        if sampling.filtered:
            width = max(kept.shape[1] for _, kept in supports)
            support = torch.full((batch, used, width), -1, dtype=torch.long, device=dev)
            for t, (out_rows, kept) in enumerate(supports[:used]):
                support[out_rows, t, : kept.shape[1]] = kept
        routing = None
        if moe:
            per_prompt = [prompt_routes[i, : len(p)] for i, p in enumerate(prompts)]
            routing = Routing(
                [per_prompt[i] for i in range(n_prompts) for _ in range(group_size)], response_routes[:, :used]
            )
        lengths_out = mask_out.sum(-1)
        ended = torch.isin(tokens.gather(1, (lengths_out - 1).clamp(min=0)[:, None]).squeeze(-1), self._eos)
        # The batch stays on the engine's device; rewards read its tokens, the RL arithmetic runs there.
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
            routing=routing,
            full_vocab=None if recorder is None else recorder.record(),
        )
