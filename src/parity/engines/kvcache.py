"""The rollout engine's KV cache: every row's keys and values for one generate call, allocated once
for the longest row (prompt + new tokens) and reused by the next call of the same shape.

Slot p of a row holds its token at position p (prompts are right-padded), so rows of different
lengths write different slots at each step. Two layouts, chosen by the device (`kv_cache`):

* `SlotKVCache` (CUDA): keys and values in the rollout precision, [rows × slots, KV heads, D] per
  layer. A table maps each active position of the decode batch to its cache row, so a row that
  finishes leaves by a permutation of the table, never a copy, and every shape stays fixed (the
  decode step is captured as a CUDA graph). Attention is the Triton kernel of
  `kernels/attention.py`, reading each row's own length on the device.
* `DenseKVCache` (CPU): FP32 storage holding values rounded to the rollout precision (the CPU's
  attention runs FP32 kernels on rounded inputs), keys transposed ([.., D, slots]) so q·kᵀ reads
  contiguous memory. The decode step attends over the first `keys` slots of the active rows with an
  additive mask; finished rows leave by compacting the active rows (a copy of the slots written so
  far, amortised over the tokens since the last one). These are the numerics the engine always had
  on the CPU, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity.engines import kernels
from parity.engines.kernels import apply_rope
from parity.engines.models.config import FULL, SLIDING, ModelConfig


def roped(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on the query and key heads qk [B, T, heads + KV heads, D] together (one op chain instead of two):
    (q [B, heads, T, D], k [B, KV heads, T, D])."""
    return apply_rope(qk.transpose(1, 2), cos, sin).split([heads, qk.shape[2] - heads], dim=1)


@dataclass
class StepContext:
    """What a decode step's attention needs besides q, k and v, built once per step for every layer."""

    n: int
    positions: torch.Tensor  # [n] each active row's position (where its new token goes)
    masks: dict[str, torch.Tensor] | None = None  # DenseKVCache: additive key bias per attention type
    keys: int = 0  # DenseKVCache: slots attended (the highest position any row reaches, + 1)
    rows: object = None  # SlotKVCache: `attention.Rows` of the step
    at: torch.Tensor | None = None  # SlotKVCache: [n] each row's slot for its new token


@dataclass
class ExtendContext:
    """What `extend`'s attention needs: some active rows, each fed several tokens at once (an episode's
    between-turn ids, continued from the cache)."""

    active: torch.Tensor  # [m] the rows' positions in the decode batch
    positions: torch.Tensor  # [m, K] where each new token goes (a row's last ones past its count are padding)
    counts: torch.Tensor  # [m] real new tokens per row
    masks: dict[str, torch.Tensor] | None = None  # DenseKVCache: additive key bias [m, 1, K, keys] per type
    keys: int = 0  # DenseKVCache: slots attended
    rows: object = None  # SlotKVCache: `attention.Rows`
    at: torch.Tensor | None = None  # SlotKVCache: [m, K] each new token's slot


class DenseKVCache:
    """The CPU cache (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, rows: int, slots: int, dtype: torch.dtype, numerics: kernels.Numerics):
        self.config, self.dtype, self.numerics = cfg, dtype, numerics
        shape = (cfg.num_layers, rows, cfg.num_kv_heads)
        self.k = torch.zeros((*shape, cfg.head_dim, slots), dtype=torch.float32)
        self.v = torch.zeros((*shape, slots, cfg.head_dim), dtype=torch.float32)

    def reset(self, rows: int, slots: int) -> None:
        """Zero what a call of `rows` rows up to `slots` positions may read: a masked key still enters the
        matmul (its weight is then exactly 0), so what a slot holds must be finite."""
        self.k[:, :rows, ..., :slots] = 0
        self.v[:, :rows, :, :slots] = 0

    def prefill(self, layer: int, qk, v, cos, sin, prompt_of_row: torch.Tensor) -> torch.Tensor:
        """Rope the prompts' query and key heads (qk [P, T, H + Hkv, D]), store the keys and values (v [P, T,
        Hkv·D]) in every row of their prompt (`prompt_of_row`) and return the prompts' causal attention [P, H,
        T, D]."""
        cfg = self.config
        q, k = roped(qk, cos, sin, cfg.num_heads)
        p, hkv, t, d = k.shape
        v = v.view(p, t, hkv, d).transpose(1, 2)
        # The attention reads them as stored (FP32 rounded values, keys transposed), as it always has.
        keys = torch.empty((p, hkv, d, t), dtype=self.k.dtype).copy_(k.transpose(-1, -2))
        values = torch.empty((p, hkv, t, d), dtype=self.v.dtype).copy_(v)
        self.k[layer, : len(prompt_of_row), ..., :t] = keys[prompt_of_row]
        self.v[layer, : len(prompt_of_row), :, :t] = values[prompt_of_row]
        return self.numerics.attention(
            q, keys.transpose(-1, -2), values, cfg.window(layer), cfg.query_scale, cfg.attn_softcap
        )

    def _masks(self, positions: torch.Tensor, keys: int) -> dict[str, torch.Tensor]:
        """Per attention type, the additive bias [*positions.shape, keys] that hides the slots a query at
        each of `positions` does not see."""
        slots, window = torch.arange(keys), self.config.sliding_window
        visible = {FULL: slots <= positions[..., None]}
        if window is not None:
            visible[SLIDING] = visible[FULL] & (slots > positions[..., None] - window)
        return {kind: torch.zeros(v.shape).masked_fill(~v, float("-inf")) for kind, v in visible.items()}

    def step_context(self, n: int, positions: torch.Tensor, keys: int) -> StepContext:
        masks = {kind: mask[:, None, None] for kind, mask in self._masks(positions, keys).items()}
        return StepContext(n, positions, masks=masks, keys=keys)

    def decode(self, layer: int, qk, v, cos, sin, ctx: StepContext) -> torch.Tensor:
        """Rope the active rows' new query and key heads (qk [n, 1, H + Hkv, D]), write the keys and values (v
        [n, 1, Hkv·D]) at their positions and return each row's attention over its cache [n, H, 1, D]."""
        q, k = roped(qk, cos, sin, self.config.num_heads)
        n, hkv, _, d = k.shape
        rows = torch.arange(n)
        self.k[layer, rows, :, :, ctx.positions] = k[:, :, 0].to(self.k.dtype)
        self.v[layer, rows, :, ctx.positions] = v.view(n, hkv, d).to(self.v.dtype)
        k_t, values = self.k[layer, :n, ..., : ctx.keys], self.v[layer, :n, :, : ctx.keys]
        return self._attend(layer, q, k_t, values, ctx.masks)

    def _attend(self, layer: int, q, k_t, values, masks: dict[str, torch.Tensor]) -> torch.Tensor:
        cfg = self.config
        mask = masks[cfg.layer_type(layer)]
        return self.numerics.decode_attention(q, k_t, values, mask, scale=cfg.query_scale, softcap=cfg.attn_softcap)

    def extend_context(self, active: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor) -> ExtendContext:
        keys = int(positions.max()) + 1
        masks = {kind: mask[:, None] for kind, mask in self._masks(positions, keys).items()}
        return ExtendContext(active, positions, counts, masks=masks, keys=keys)

    def extend(self, layer: int, qk, v, cos, sin, ctx: ExtendContext) -> torch.Tensor:
        """`decode` for several new tokens per row (qk [m, K, H + Hkv, D], v [m, K, Hkv·D]): their keys and
        values written at their positions, each query attending over its row's cache up to itself -> [m, H,
        K, D]. Each query's bits are the ones `decode` gives it: the same spelled-out attention, whose
        elements depend on no other row (exact mode pads its matmuls)."""
        q, k = roped(qk, cos, sin, self.config.num_heads)
        m, hkv, width, d = k.shape
        values = v.view(m, width, hkv, d)
        for j in range(width):  # as `decode` writes one token per row
            self.k[layer, ctx.active, :, :, ctx.positions[:, j]] = k[:, :, j].to(self.k.dtype)
            self.v[layer, ctx.active, :, ctx.positions[:, j]] = values[:, j].to(self.v.dtype)
        k_t, vs = self.k[layer, ctx.active, ..., : ctx.keys], self.v[layer, ctx.active, :, : ctx.keys]
        return self._attend(layer, q, k_t, vs, ctx.masks)

    def keep(self, keep: torch.Tensor, n: int, filled: int) -> None:
        """Active rows `keep` (their positions among the first n) become the first len(keep): copy them, the
        first `filled` slots (all any live row has written)."""
        self.k[:, : len(keep), ..., :filled] = self.k[:, :n][:, keep, ..., :filled]
        self.v[:, : len(keep), :, :filled] = self.v[:, :n][:, keep, :, :filled]


class SlotKVCache:
    """The CUDA cache (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, rows: int, slots: int, dtype: torch.dtype, numerics: kernels.Numerics):
        self.config, self.dtype, self.numerics, self.slots = cfg, dtype, numerics, slots
        shape = (cfg.num_layers, rows * slots, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=numerics.device)
        self.v = torch.zeros(shape, dtype=dtype, device=numerics.device)
        self.table = torch.arange(rows, device=numerics.device)  # active position -> cache row

    def reset(self, rows: int, slots: int) -> None:
        self.table.copy_(torch.arange(len(self.table), device=self.table.device))

    def prefill(self, layer: int, qk, v, cos, sin, prompt_of_row: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        q, k = roped(qk, cos, sin, cfg.num_heads)
        p, hkv, t, d = k.shape
        v = v.view(p, t, hkv, d).transpose(1, 2)
        rows = self.k[layer].view(-1, self.slots, *self.k.shape[2:])
        rows[: len(prompt_of_row), :t] = k.transpose(1, 2)[prompt_of_row]
        self.v[layer].view_as(rows)[: len(prompt_of_row), :t] = v.transpose(1, 2)[prompt_of_row]
        return self.numerics.attention(q, k, v, cfg.window(layer), cfg.query_scale, cfg.attn_softcap)

    def step_context(self, n: int, positions: torch.Tensor, keys: int) -> StepContext:
        from parity.engines.kernels import attention

        groups = self.config.num_heads // self.config.num_kv_heads
        starts = self.table[:n] * self.slots
        rows = attention.one_query_per_row(positions, starts, groups)
        return StepContext(n, positions, rows=rows, at=starts + positions)

    def decode(self, layer: int, qk, v, cos, sin, ctx: StepContext) -> torch.Tensor:
        from parity.engines.kernels import fused

        heads, d = self.config.num_heads, self.config.head_dim
        if self.k.is_cuda:  # RoPE and the cache write in one kernel; cos and sin [n, 1, 1, D] are each row's
            cos, sin = cos[:, 0, 0], sin[:, 0, 0]
            q = fused.rope_store(qk[:, 0], v[:, 0], cos, sin, self.k[layer], self.v[layer], ctx.at, heads)
        else:  # Triton's interpreter rounds FP32 to BF16 its own way: the eager ops, as the trainer runs them
            q, k = roped(qk, cos, sin, heads)
            self.k[layer, ctx.at] = k[:, :, 0]
            self.v[layer, ctx.at] = v.view(len(ctx.at), -1, d)
            q = q[:, :, 0]
        # every row's one query has its tile: nothing to zero first
        return self._attend(layer, q, ctx, out=torch.empty_like(q))[:, :, None]

    def _attend(self, layer: int, q, ctx, out=None) -> torch.Tensor:
        """Each query row of `ctx.rows` over its cache row, by `attention.py`'s kernel."""
        from parity.engines.kernels import attention

        cfg = self.config
        scale = cfg.head_dim**-0.5 if cfg.query_scale is None else cfg.query_scale
        return attention.rows_attention(
            q, self.k[layer], self.v[layer], ctx.rows, scale, cfg.window(layer), cfg.attn_softcap, out=out
        )

    def extend_context(self, active: torch.Tensor, positions: torch.Tensor, counts: torch.Tensor) -> ExtendContext:
        from parity.engines.kernels import attention

        groups = self.config.num_heads // self.config.num_kv_heads
        m, width = positions.shape
        starts = self.table[active] * self.slots
        q_count = counts.to(torch.int32)
        tile_row, tile_f0 = attention.tiles(q_count, groups)
        rows = attention.Rows(
            q_first=(torch.arange(m, device=positions.device) * width).to(torch.int32),
            q_count=q_count,
            q_pos0=positions[:, 0].to(torch.int32),
            kv_start=starts.to(torch.int32),
            tile_row=tile_row,
            tile_f0=tile_f0,
        )
        return ExtendContext(active, positions, counts, rows=rows, at=starts[:, None] + positions)

    def extend(self, layer: int, qk, v, cos, sin, ctx: ExtendContext) -> torch.Tensor:
        """Several new tokens per row (see `DenseKVCache.extend`), through `attention.py`'s kernel, which gives
        each query the bits the decode step gives it; a row's padding queries are left at 0."""
        heads, d = self.config.num_heads, self.config.head_dim
        q, k = roped(qk, cos, sin, heads)
        m, hkv, width, _ = k.shape
        real = torch.arange(width, device=k.device) < ctx.counts[:, None]  # padding never reaches the cache
        at = ctx.at[real]
        self.k[layer, at] = k.transpose(1, 2)[real]
        self.v[layer, at] = v.view(m, width, hkv, d)[real]
        out = self._attend(layer, q.transpose(1, 2).reshape(m * width, heads, d), ctx)
        return out.view(m, width, heads, d).transpose(1, 2)

    def keep(self, keep: torch.Tensor, n: int, filled: int) -> None:
        self.table[: len(keep)] = self.table[:n][keep]


def kv_cache(cfg: ModelConfig, rows: int, slots: int, dtype: torch.dtype, numerics: kernels.Numerics):
    """The cache for `numerics` (see the module docstring); exact mode's Triton kernels take the CUDA layout
    wherever they run (on the CPU, in Triton's interpreter, as the tests run them)."""
    kind = SlotKVCache if numerics.cache_layout == "slots" else DenseKVCache
    return kind(cfg, rows, slots, dtype, numerics)
