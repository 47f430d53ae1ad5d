"""The rollout engine's decode loop as it was at aff8d8d, frozen as a test oracle.

The static-shape engine (`parity.engines.rollout`) must give the same tokens, log-probs and
supports, bit for bit, on the CPU. This module keeps the previous loop — a KV cache grown a block
at a time and copied when finished rows leave, the filtered distribution built over the whole
vocabulary with a [B, V] mask per step — running on a new engine's weights and their layer methods
(`LayerWeights.norm`, `attention_inputs`, ...), so the comparison isolates the loop, the cache and the sampling.

One change from aff8d8d: `filter_logits` (the definition in `sampling.py`, used here) sorts stably.
The old unstable sort left the order of equal logits to the sort's implementation, so which of two
tied tokens top-p kept at its cut was arbitrary; the new engine keeps the lower token id, as a stable
sort does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from parity.engines.batch import FullVocab, RolloutBatch
from parity.engines.kernels import apply_rope
from parity.engines.models.config import FULL, SLIDING, rope_tables
from parity.engines.models.decoder import mlp
from parity.engines.models.modules import rope_angles, softcap
from parity.engines.packing import Routing
from parity.engines.sampling import SamplingParams, filter_logits, sample_categorical

CACHE_BLOCK = 32
ROW_BUCKET = 16
FULL_VOCAB_PER_ROW = 16


def support_ids(kept: torch.Tensor) -> torch.Tensor:
    counts = kept.sum(-1)
    k = int(counts.max()) if counts.numel() else 0
    ids = torch.sort(kept.to(torch.int8), dim=-1, descending=True, stable=True).indices[:, :k]
    return ids.masked_fill(torch.arange(k, device=kept.device) >= counts[:, None], -1)


class KVCache:
    def __init__(self, cfg, batch: int, slots: int, dtype: torch.dtype, device: torch.device):
        store = torch.float32 if device.type == "cpu" else dtype
        shape = (cfg.num_layers, batch, cfg.num_kv_heads)
        self.k = torch.empty((*shape, cfg.head_dim, slots), dtype=store, device=device)
        self.v = torch.empty((*shape, slots, cfg.head_dim), dtype=store, device=device)

    @property
    def slots(self) -> int:
        return self.k.shape[-1]

    def take_rows(self, rows: torch.Tensor, filled: int, slots: int | None = None) -> None:
        k, v = self.k, self.v
        slots = self.slots if slots is None else slots
        self.k = k.new_empty((k.shape[0], len(rows), *k.shape[2:4], slots))
        self.v = v.new_empty((v.shape[0], len(rows), v.shape[2], slots, v.shape[4]))
        self.k[..., :filled] = k[:, rows, ..., :filled]
        self.v[..., :filled, :] = v[:, rows, ..., :filled, :]
        self.k[..., filled:] = 0
        self.v[..., filled:, :] = 0


class FullVocabRecorder:
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
        self.where = self.rows

    def rows_kept(self, keep: torch.Tensor, active: int) -> None:
        position = torch.full((active,), -1, dtype=torch.long, device=keep.device)
        position[keep] = torch.arange(len(keep), device=keep.device)
        self.where = torch.where(self.where >= 0, position[self.where.clamp(min=0)], -1)

    def observe(self, t: int, live: torch.Tensor, logp: torch.Tensor) -> None:
        where = self.where.clamp(min=0)
        slot = self.kept_keys.argmax(-1)
        worst = self.kept_keys[self.index, slot]
        take = (self.where >= 0) & live[where] & (self.keys[:, t] < worst)
        self.kept_keys[self.index, slot] = torch.where(take, self.keys[:, t], worst)
        self.steps[self.index, slot] = torch.where(take, t, self.steps[self.index, slot])
        self.logprobs[self.index, slot] = torch.where(take[:, None], logp[where], self.logprobs[self.index, slot])

    def record(self) -> FullVocab:
        return FullVocab(self.rows, self.steps, self.logprobs)


def decode_attention(numerics, q, k_t, v, key_bias, scale=None, softcap_value=None):
    b, h, _, d = q.shape
    hkv = k_t.shape[1]
    qg = q.view(b, hkv, h // hkv, d)
    scale = d**-0.5 if scale is None else scale
    scores = numerics.matmul(qg.float(), k_t.float()) * scale
    if softcap_value is not None:
        scores = torch.tanh(scores / softcap_value) * softcap_value
    return numerics._weighted_values(scores + key_bias, v, q.dtype).reshape(b, h, 1, d)


def forward(engine, angles, ids, positions, cache, keys=None, last=None):
    cfg = engine.config
    b, t = ids.shape
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = engine.weights.root["embed"][ids].to(engine.dtype)
    if cfg.gemma:
        x = x * torch.tensor(cfg.hidden_size**0.5, dtype=x.dtype)
    angles = {kind: (cos[positions][:, None], sin[positions][:, None]) for kind, (cos, sin) in angles.items()}
    rows = torch.arange(b, device=ids.device)
    window = cfg.sliding_window
    if keys is None:
        masks = {FULL: None, SLIDING: window}
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
    for i, layer in enumerate(engine.weights.layers):
        kind = cfg.layer_type(i)
        cos, sin = angles[kind]
        normed = layer.norm("input_layernorm", x)
        q, k, v = layer.attention_inputs(normed)
        if cfg.qk_norm:
            q, k = layer.norm("q_norm", q), layer.norm("k_norm", k)
        qk, v = torch.cat([q, k], dim=2), v.reshape(b, t, hkv * d)
        q, k = apply_rope(qk.transpose(1, 2), cos, sin).split([h, hkv], dim=1)
        scale, cap = cfg.query_scale, cfg.attn_softcap
        if keys is None:
            cache.k[i, ..., :t] = k.transpose(-1, -2)
            cache.v[i, :, :, :t] = v.view(b, t, hkv, d).transpose(1, 2)
            attn = engine.numerics.attention(
                q, cache.k[i, ..., :t].transpose(-1, -2), cache.v[i, :, :, :t], masks[kind], scale, cap
            )
        else:
            cache.k[i, rows, :, :, positions[:, 0]] = k[:, :, 0].to(cache.k.dtype)
            cache.v[i, rows, :, positions[:, 0]] = v.view(b, hkv, d).to(cache.v.dtype)
            k_t, v_all = cache.k[i, ..., :keys], cache.v[i, :, :, :keys]
            attn = decode_attention(engine.numerics, q, k_t, v_all, masks[kind], scale, cap)
        core = attn.transpose(1, 2).reshape(b, t, h * d)
        attn = layer.attention_output(core)
        if cfg.gemma:
            x = x + layer.norm("post_attention_layernorm", attn)
            out, routed = mlp(layer, layer.norm("pre_feedforward_layernorm", x), cfg, engine.numerics)
            x = x + layer.norm("post_feedforward_layernorm", out)
        else:
            x = x + attn
            out, routed = mlp(layer, layer.norm("post_attention_layernorm", x), cfg, engine.numerics)
            x = x + out
        if routed is not None:
            routing.append(routed[0].view(b, t, -1))
    last_hidden = x[:, 0] if last is None else x[rows, last]
    final = engine.numerics.engine_norm(last_hidden, engine.weights.root["norm"], cfg.rms_norm_eps, cfg.gemma)
    logits = softcap(
        engine.numerics.linear(
            final, engine.weights.lm_head, prerounded=True, fast=engine.weights.lm_head_fast
        ).float(),
        cfg.final_softcap,
    )
    return logits, torch.stack(routing, dim=2) if routing else None


@torch.no_grad()
def generate(
    engine,
    prompts: list[list[int]],
    group_size: int,
    sampling: SamplingParams,
    seed: int,
    full_vocab: int = 0,
    limits: list[int] | None = None,
    stop: Callable[[torch.Tensor], bool] | None = None,
    check_every: int = 1,
) -> RolloutBatch:
    """aff8d8d's `RolloutEngine.generate`, on `engine`'s weights."""
    dev = engine.device
    cfg = engine.config
    angle_tables = {
        kind: rope_angles(torch.arange(cfg.max_position_embeddings, device=dev), inv_freq.to(dev), engine.dtype)
        for kind, inv_freq in rope_tables(cfg).items()
    }
    eos = torch.tensor(sorted(set(engine.eos_ids)), device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    n_prompts = len(prompts)
    lengths_list = [len(p) for p in prompts for _ in range(group_size)]
    limits = limits or [sampling.max_new_tokens] * len(lengths_list)
    max_new, prompt_len = max(limits), max(lengths_list)
    max_len = max(n + limit for n, limit in zip(lengths_list, limits))

    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    ids = torch.full((n_prompts, prompt_len), engine.pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    ids = ids.to(dev)
    positions = torch.arange(prompt_len, device=dev).expand(n_prompts, prompt_len)
    cache = KVCache(cfg, n_prompts, prompt_len, engine.dtype, dev)
    logits, prompt_routes = forward(engine, angle_tables, ids, positions, cache, last=lengths - 1)
    logits = logits.repeat_interleave(group_size, dim=0)

    batch = n_prompts * group_size
    expand = torch.arange(n_prompts, device=dev).repeat_interleave(group_size)
    cache.take_rows(expand, prompt_len, min(max_len, prompt_len + CACHE_BLOCK))
    next_pos = lengths.repeat_interleave(group_size)
    rows = torch.arange(batch, device=dev)
    done = torch.zeros(batch, dtype=torch.bool, device=dev)
    limit = torch.tensor(limits, device=dev)

    tokens = torch.full((batch, max_new), engine.pad_id, dtype=torch.long, device=dev)
    logprobs = torch.zeros(batch, max_new, dtype=torch.float32, device=dev)
    mask_out = torch.zeros(batch, max_new, dtype=torch.bool, device=dev)
    supports: list[tuple[torch.Tensor, torch.Tensor]] = []
    pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    moe = prompt_routes is not None
    if moe:
        response_routes = torch.full((batch, max_new, *prompt_routes.shape[2:]), -1, dtype=torch.long, device=dev)
    recorder = None
    if full_vocab > 0:
        recorder = FullVocabRecorder(full_vocab, batch, max_new, logits.shape[-1], seed, dev)

    for t in range(max_new):
        processed = filter_logits(logits, sampling)
        logp = torch.log_softmax(processed, dim=-1)
        uniforms = torch.rand(batch, 1, generator=gen, device=dev)[rows]
        token = sample_categorical(logp.exp(), uniforms)
        live = ~done
        tokens[rows, t] = torch.where(live, token.squeeze(-1), engine.pad_id)
        logprobs[rows, t] = logp.gather(-1, token).squeeze(-1).masked_fill(done, 0.0)
        mask_out[rows, t] = live
        if recorder is not None:
            recorder.observe(t, live, logp)
        if sampling.filtered:
            pending.append((rows, live, torch.isfinite(processed)))
        token = token.squeeze(-1)
        done = done | torch.isin(token, eos) | (limit[rows] <= t + 1)
        if t == max_new - 1:
            break
        if (t + 1) % check_every == 0:
            supports += [(r[lv], support_ids(k[lv])) for r, lv, k in pending]
            pending = []
            if bool(done.all()):
                break
            if stop is not None:
                finished = torch.ones(batch, dtype=torch.bool, device=dev)
                finished[rows] = done
                if stop(finished):
                    break
            size = -(-int((~done).sum()) // ROW_BUCKET) * ROW_BUCKET
            if int(done.sum()) * 4 >= done.numel() and size < done.numel():
                keep = torch.cat([(~done).nonzero(), done.nonzero()]).squeeze(-1)[:size]
                cache.take_rows(keep, filled=prompt_len + t)
                if recorder is not None:
                    recorder.rows_kept(keep, done.numel())
                rows, token, done, next_pos = rows[keep], token[keep], done[keep], next_pos[keep]
        start = min(prompt_len + t, max_len - 1)
        if start == cache.slots:
            cache.take_rows(torch.arange(len(rows), device=dev), start, min(max_len, start + CACHE_BLOCK))
        logits, routes = forward(engine, angle_tables, token[:, None], next_pos[:, None], cache, keys=start + 1)
        if moe:
            response_routes[rows, t] = routes[:, 0]
        next_pos = (next_pos + 1).clamp(max=max_len - 1)
    supports += [(r[lv], support_ids(k[lv])) for r, lv, k in pending]

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
    ended = torch.isin(tokens.gather(1, (lengths_out - 1).clamp(min=0)[:, None]).squeeze(-1), eos)
    return RolloutBatch(
        prompt_ids=[list(p) for p in prompts for _ in range(group_size)],
        response_ids=tokens,
        response_mask=mask_out,
        rollout_logprobs=logprobs,
        support=support,
        truncated=~ended,
        group_index=torch.arange(n_prompts, device=dev).repeat_interleave(group_size),
        weight_version=engine.weights.version,
        sampling=sampling,
        routing=routing,
        full_vocab=None if recorder is None else recorder.record(),
    )
