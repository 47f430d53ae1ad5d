"""The rollout (inference) engine: `prefill` the prompts, then one static-shape `decode_step` per token.

A call samples `group_size` responses per prompt: each prompt is prefilled once into every cache row of its
group, then each decode step feeds the active rows their last tokens and samples the next on the device
(`sampling.draw`), recording μ, the token's log-probability under the distribution actually sampled from (after
temperature, top-k and top-p), and with filtering that distribution's support. A step touches only a
`_Workspace` of fixed shapes, reused by the next call of the same shape; each row's random numbers are drawn up
front per (row, step), so a sample never depends on which rows share its batch. On CUDA a step is a CUDA graph
per batch size and the host reads the batch every `CHECK_EVERY` steps; on the CPU the same code runs eagerly,
reading it after every token, bit for bit tests/reference_rollout.py.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from parity.engines import kernels
from parity.engines import precision as prec
from parity.engines.batch import FullVocab, RolloutBatch
from parity.engines.kvcache import StepContext, kv_cache
from parity.engines.models.config import ModelConfig, rope_tables
from parity.engines.models.decoder import heads_together, layer_tap, scale_embeddings, stream
from parity.engines.models.families import family
from parity.engines.models.modules import rope_angles, softcap
from parity.engines.packing import Routing
from parity.engines.sampling import SamplingParams, Widths, draw, filter_logits, log_distribution, supports_in_id_order
from parity.engines.weights import RolloutWeights

# Decode batch sizes stay multiples of this: each size is one CUDA graph (and, on the CPU, oneDNN builds
# BF16 kernels per shape), so a handful of sizes serve every rollout.
ROW_BUCKET = 16
# On a GPU the decode loop reads the batch's state back every this many tokens.
CHECK_EVERY = 16
# `generate(full_vocab=N)`: the positions are taken this many per recorded row (fewer rows to score again).
FULL_VOCAB_PER_ROW = 16
# A workspace serves calls whose longest row and new-token count round up to the same multiple of these. On
# the CPU the cache is as long as the call's longest row: its attention reads strided views, which cost more
# the longer each cached row (a CPU has no graphs to keep).
SLOT_MULTIPLE = {"cpu": 1, "cuda": 64}
STEP_MULTIPLE = 64

Angles = dict[str, tuple[torch.Tensor, torch.Tensor]]  # RoPE's (cos, sin) per attention type
# What comes between two model turns of an episode, asked on the host as soon as rows end a turn with an end-of-turn
# token: between(rows, their tokens so far, the columns each has left) -> {row: (ids to feed it, fewer than its
# room; its next turn's token limit)} for each row that goes on; a row left out is over.
Between = Callable[[list[int], list[list[int]], list[int]], dict[int, tuple[list[int], int]]]


class _FullVocabRecorder:
    """The whole next-token distribution at `per_row` positions of a few rows, chosen uniformly among each row's
    sampled tokens: a reservoir kept with tensor ops in the decode step (a row keeps the positions with the
    smallest of its random keys). Its own generator: recording changes nothing that is sampled."""

    def __init__(self, positions: int, batch: int, max_new: int, vocab: int, device: torch.device):
        self.per_row = min(positions, FULL_VOCAB_PER_ROW)
        count = min(batch, -(-positions // self.per_row))
        self.rows = torch.zeros(count, dtype=torch.long, device=device)
        self.keys = torch.zeros(count, max_new, device=device)
        self.kept_keys = torch.zeros(count, self.per_row, device=device)
        self.steps = torch.zeros(count, self.per_row, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(count, self.per_row, vocab, device=device)
        self.index = torch.arange(count, device=device)

    def reset(self, seed: int, batch: int, max_new: int) -> None:
        device = self.rows.device
        gen = torch.Generator(device=device).manual_seed(seed + 0x5EED)
        self.rows.copy_(torch.randperm(batch, generator=gen, device=device)[: len(self.rows)])
        self.keys[:, :max_new] = torch.rand(len(self.rows), max_new, generator=gen, device=device)
        self.kept_keys.fill_(float("inf"))
        self.steps.fill_(-1)
        self.logprobs.zero_()

    def observe(self, columns: torch.Tensor, position_of_row: torch.Tensor, live: torch.Tensor, logp) -> None:
        """A step: `columns` [output rows] the column each row samples, `position_of_row` its position in the
        decode batch (-1 once it left), `live` the batch's rows that sample, `logp` [rows, V] the distribution
        each sampled from (or a function giving its rows at given positions)."""
        where = position_of_row[self.rows]
        at = where.clamp(min=0)
        slot = self.kept_keys.argmax(-1)
        worst = self.kept_keys[self.index, slot]
        t = columns[self.rows]
        key = self.keys.gather(1, t[:, None]).squeeze(1)
        take = (where >= 0) & live[at] & (key < worst)
        self.kept_keys[self.index, slot] = torch.where(take, key, worst)
        self.steps[self.index, slot] = torch.where(take, t, self.steps[self.index, slot])
        rows = logp(at) if callable(logp) else logp[at]
        self.logprobs[self.index, slot] = torch.where(take[:, None], rows, self.logprobs[self.index, slot])

    def record(self) -> FullVocab:
        return FullVocab(self.rows.clone(), self.steps.clone(), self.logprobs.clone())


@dataclass
class _Workspace:
    """One shape of call's device state. Per active position of the decode batch: `order` (its output row),
    `token`, `position` (where its next token goes), `done`; per output row: `limit`, `column` (where its next
    token goes), `position_of_row` (-1 once it left the batch) and the outputs. `starts`: each buffer's value at a
    call's start (the others are set from the call's arguments)."""

    key: tuple
    cache: object
    angles: Angles
    sampling: SamplingParams
    widths: Widths | None
    recorder: _FullVocabRecorder | None
    starts: dict[str, object]
    order: torch.Tensor
    position_of_row: torch.Tensor
    token: torch.Tensor
    position: torch.Tensor
    done: torch.Tensor
    limit: torch.Tensor
    column: torch.Tensor
    step: torch.Tensor  # [1]: the response index sampled next
    max_position: torch.Tensor  # the last slot a row may write this call (0-d)
    uniforms: torch.Tensor  # [steps, rows]: each row's number at each step
    tokens: torch.Tensor
    logprobs: torch.Tensor
    mask: torch.Tensor
    kept_ids: torch.Tensor | None = None  # [rows, steps, widths.support] int32
    kept_most: torch.Tensor | None = None  # the most ids a live row kept at a step (0-d)
    candidates_most: torch.Tensor | None = None  # the most candidates a live row needed (0-d)
    routes: torch.Tensor | None = None  # MoE: [rows, steps, MoE layers, k]
    fed: torch.Tensor | None = None  # episodes: [rows, steps] whether a column was fed between turns
    over: set[int] = field(default_factory=set)  # episodes: the output rows whose episode is over (host side)
    budgets: list[int] = field(default_factory=list)  # the columns each output row may fill in its episode
    pausing: bool = False  # `stop` answered yes: rows that end a turn now stop there, fed what comes next
    graphs: dict[int, torch.cuda.CUDAGraph] | None = None  # per batch size; None: eager steps
    warmed: set[int] = field(default_factory=set)
    pool: object = None


def _grown(have: int, need: int) -> int:
    """A buffer width that holds `need` with room to spare (a multiple of 64), or `have` if it already does."""
    return have if need <= have else -(-2 * need // 64) * 64


class RolloutEngine:
    """Samples from a copy of the policy whose weights are stored in the rollout precision."""

    def __init__(
        self, config: ModelConfig, precision: str, eos_ids: Sequence[int], pad_id: int, numerics: kernels.Numerics
    ):
        self.config, self.precision, self.dtype = config, precision, prec.to_dtype(precision)
        self.device, self.pad_id = numerics.device, pad_id
        self.eos_ids = tuple(sorted(set(eos_ids)))
        self._eos = torch.tensor(self.eos_ids, device=self.device)
        self.weights = RolloutWeights(config, self.dtype, numerics)
        # Decode tokens between host reads of the batch's state (`generate`): free on the CPU, a wait on a GPU.
        self.check_every = 1 if self.device.type == "cpu" else CHECK_EVERY
        # CUDA graphs for the decode step (False: eager steps). A capture that fails turns them off, saying why.
        self.use_graphs = self.device.type == "cuda"
        self.graphs_off_reason: str | None = None
        self._workspace: _Workspace | None = None
        self._capture_stream = torch.cuda.Stream(self.device) if self.use_graphs else None
        self._tap: Callable[[str, torch.Tensor], None] | None = None  # `trace`'s: each stage's output as it runs

    @property
    def numerics(self) -> kernels.Numerics:
        """The device and exact mode (exact: the trainer's norm and attention numerics, μ its π bit for bit), given
        with no default; the weights compute with it."""
        return self.weights.numerics

    @numerics.setter
    def numerics(self, value: kernels.Numerics) -> None:
        self.weights.numerics = value

    # ------------------------------------------------------------------ one forward through the layers

    def _layers(
        self, ids: torch.Tensor, positions: torch.Tensor, angles: Angles, attend: Callable[..., torch.Tensor], ctx
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states [B, T, H] of `ids` [B, T] at `positions` ([B, T] or [1, T]) after every layer (its
        family's layer function on the stored weights), before the final norm, and the experts each MoE layer
        chose ([B, T, MoE layers, k]; None for a dense model). `attend(layer, qk, v, cos, sin, ctx)` is the
        cache's `prefill`, `decode` or `extend`: it ropes the query and key heads qk [B, T, heads + KV heads, D],
        stores the keys and values v [B, T, KV heads · D] and returns the attention [B, heads, T, D]."""
        cfg = self.config
        b, t = ids.shape
        angles = {kind: (cos[positions][:, None], sin[positions][:, None]) for kind, (cos, sin) in angles.items()}
        x = scale_embeddings(self.weights.root["embed"][ids].to(self.dtype), cfg)
        pending = None  # the last MLP's output, added to the stream by the next norm's pass
        routing, decoder_layer = [], family(cfg).layer
        for i, layer in enumerate(self.weights.layers):

            def core(q, k, v, i=i, cos_sin=angles[cfg.layer_type(i)]):
                out = attend(i, heads_together(q, k), v.flatten(-2), *cos_sin, ctx)
                return out.transpose(1, 2).reshape(b, t, -1)

            x, pending, routed = decoder_layer(layer, x, pending, core, cfg, self.numerics, tap=layer_tap(self._tap, i))
            if routed is not None:
                routing.append(routed[0].view(b, t, -1))
        return stream(x, pending), torch.stack(routing, dim=2) if routing else None

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of hidden states [B, H] (final norm, LM head, soft-cap), in the LM head's dtype (FP32
        with a soft-cap): the fused draw reads 16-bit logits, not a [B, V] FP32 copy (78 MB a step at 128 rows
        of Qwen2's)."""
        cfg = self.config
        final = self.numerics.engine_norm(hidden, self.weights.root["norm"], cfg.rms_norm_eps, cfg.gemma)
        logits = self.numerics.linear(final, self.weights.lm_head, prerounded=True, fast=self.weights.lm_head_fast)
        if cfg.final_softcap is not None:
            logits = softcap(logits.float(), cfg.final_softcap)
        if self._tap is not None:
            self._tap("norm", final)
            self._tap("logits", logits)
        return logits

    def _padded(self, rows: list[list[int]]) -> torch.Tensor:
        """Token rows right-padded to the longest, on the device (one copy, not one per row)."""
        width = max(map(len, rows))
        return torch.tensor([list(row) + [self.pad_id] * (width - len(row)) for row in rows], device=self.device)

    def prefill(
        self, prompts: list[list[int]], cache, prompt_of_row: torch.Tensor, angles: Angles
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run each prompt once, right-padded (slot = position, as in the trainer), its keys and values written to
        every cache row of its group (`prompt_of_row`), attending causally (nothing attends to a pad). Returns the
        logits [P, V] after each prompt's last token, and each MoE layer's experts ([P, T, MoE layers, k])."""
        dev, ids = self.device, self._padded(prompts)
        hidden, routes = self._layers(
            ids, torch.arange(ids.shape[1], device=dev)[None], angles, cache.prefill, prompt_of_row
        )
        last = torch.tensor([len(p) - 1 for p in prompts], device=dev)
        return self._logits(hidden[torch.arange(len(prompts), device=dev), last]), routes

    def decode_step(
        self, tokens: torch.Tensor, cache, ctx: StepContext, angles: Angles
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed each of the first n active rows its token `tokens` [n] at `ctx.positions` (its keys and values to
        the cache, attending over it): the logits [n, V] of its next token and each MoE layer's experts ([n, 1,
        MoE layers, k]). Device ops on fixed shapes only."""
        hidden, routes = self._layers(tokens[:, None], ctx.positions[:, None], angles, cache.decode, ctx)
        return self._logits(hidden[:, 0]), routes

    # ------------------------------------------------------------------ sampling loop

    def _angles(self, slots: int) -> Angles:
        # Computed where the trainer computes its angles, on the device: a GPU's cos and sin differ from the
        # CPU's in the last bit (measured on an H200: exact mode parted at position 1).
        positions = torch.arange(slots, device=self.device)
        return {
            kind: rope_angles(positions, inv_freq.to(self.device), self.dtype)
            for kind, inv_freq in rope_tables(self.config).items()
        }

    def _workspace_for(
        self, rows: int, max_len: int, max_new: int, sampling: SamplingParams, widths, full_vocab: int, episodes: bool
    ) -> _Workspace:
        multiple = SLOT_MULTIPLE.get(self.device.type, 1)
        slots = -(-max_len // multiple) * multiple
        steps = -(-max_new // STEP_MULTIPLE) * STEP_MULTIPLE
        # Everything a captured step bakes in: the buffers' shapes, the sampling settings, the weights' buffers.
        key = (rows, slots, steps, dataclasses.replace(sampling, max_new_tokens=1), widths, full_vocab, episodes)
        key += (self.weights.layout,)
        ws = self._workspace
        if ws is not None and ws.key == key:
            return ws
        self._workspace = None  # the old one's memory (and graphs) go first
        cfg, long, flag = self.config, torch.long, torch.bool
        # Each buffer's shape, dtype and the value a call starts it with (None: set from the call's arguments).
        buffers = {
            "order": ((rows,), long, None),
            "position_of_row": ((rows,), long, None),
            "token": ((rows,), long, None),
            "position": ((rows,), long, None),
            "limit": ((rows,), long, None),
            "done": ((rows,), flag, False),
            "column": ((rows,), long, 0),
            "step": ((1,), long, 0),
            "max_position": ((), long, None),
            "uniforms": ((steps, rows), torch.float32, None),
            "tokens": ((rows, steps), long, self.pad_id),
            "logprobs": ((rows, steps), torch.float32, 0.0),
            "mask": ((rows, steps), flag, False),
        }
        if widths is not None:
            buffers["kept_ids"] = ((rows, steps, widths.support), torch.int32, -1)
            if widths.support < cfg.vocab_size:  # a buffer the draw could outgrow: watched
                buffers |= {"kept_most": ((), long, 0), "candidates_most": ((), long, 0)}
        if cfg.moe_layers:
            buffers["routes"] = ((rows, steps, len(cfg.moe_layers), cfg.experts_per_token), long, -1)
        if episodes:
            buffers["fed"] = ((rows, steps), flag, False)
        recorder = _FullVocabRecorder(full_vocab, rows, steps, cfg.vocab_size, self.device) if full_vocab > 0 else None
        ws = _Workspace(
            key,
            kv_cache(cfg, rows, slots, self.dtype, self.numerics),
            self._angles(slots),
            sampling,
            widths,
            recorder,
            starts={name: start for name, (_, _, start) in buffers.items() if start is not None},
            **{
                name: torch.zeros(shape, dtype=dtype, device=self.device) for name, (shape, dtype, _) in buffers.items()
            },
        )
        # The decode step as a CUDA graph: dense models only (a MoE layer reads its experts back to the host).
        if self.use_graphs and self.device.type == "cuda" and self.graphs_off_reason is None and not cfg.moe_layers:
            ws.graphs, ws.pool = {}, torch.cuda.graph_pool_handle()
        self._workspace = ws
        return ws

    def _reset(
        self, ws: _Workspace, lengths: list[int], limits: list[int], budgets: list[int], max_len: int, seed: int
    ) -> None:
        rows, dev, max_new = len(lengths), self.device, max(budgets)
        ws.cache.reset(rows, max_len)
        ws.order.copy_(torch.arange(rows, device=dev))
        ws.position_of_row.copy_(ws.order)
        ws.position.copy_(torch.tensor(lengths, device=dev))
        ws.limit.copy_(torch.tensor(limits, device=dev))
        ws.max_position.fill_(max_len - 1)
        for name, value in ws.starts.items():
            getattr(ws, name).fill_(value)
        gen = torch.Generator(device=dev).manual_seed(seed)
        # One number per row per step, in the order the steps draw them.
        ws.uniforms[:max_new] = torch.cat([torch.rand(rows, 1, generator=gen, device=dev) for _ in range(max_new)], 1).T
        if ws.recorder is not None:
            ws.recorder.reset(seed, rows, max_new)
        ws.budgets, ws.over, ws.pausing = budgets, set(), False

    def _sample(self, ws: _Workspace, n: int, logits: torch.Tensor) -> None:
        """Sample the next token of the first n active rows from their logits [n, V] and record it, each at its
        row's column (the step's, but for a row of an episode, which has been fed ids between turns)."""
        t, rows = ws.step, ws.order[:n]
        column = ws.column[rows]
        uniforms = ws.uniforms.index_select(0, t)[0, rows][:, None]
        sampled = draw(logits, ws.sampling, uniforms, ws.widths, self.numerics)
        live = ~ws.done[:n]
        # Rows that finished earlier keep their (pad) outputs.
        ws.tokens.index_put_((rows, column), torch.where(live, sampled.token, self.pad_id))
        ws.logprobs.index_put_((rows, column), sampled.logprob.masked_fill(~live, 0.0))
        ws.mask.index_put_((rows, column), live)
        if ws.recorder is not None:
            logp = sampled.logp
            if logp is None:  # the draw did not compute the whole distribution: the recorded rows' only
                logp = lambda at: log_distribution(logits[at].float(), ws.sampling)  # noqa: E731
            ws.recorder.observe(ws.column, ws.position_of_row, live, logp)
        if sampled.kept_ids is not None:
            ws.kept_ids.index_put_((rows, column), sampled.kept_ids.masked_fill(~live[:, None], -1))
        if ws.kept_most is not None:
            torch.maximum(ws.kept_most, sampled.kept.masked_fill(~live, 0).max(), out=ws.kept_most)
            if sampled.candidates_needed is not None:
                needed = sampled.candidates_needed.masked_fill(~live, 0).max()
                torch.maximum(ws.candidates_most, needed, out=ws.candidates_most)
        ws.token[:n] = sampled.token
        ws.done[:n] |= torch.isin(sampled.token, self._eos) | (ws.limit[rows] <= column + 1)
        ws.column[rows] = column + live
        ws.step += 1

    def _step(self, ws: _Workspace, n: int, keys: int) -> None:
        """One decode step of the first n active rows: feed their last tokens, sample the next. Captured as a
        CUDA graph per n; `keys` (the slots the CPU cache attends over) is read by the CPU only."""
        positions = ws.position[:n]
        ctx = ws.cache.step_context(n, positions, keys)
        logits, routes = self.decode_step(ws.token[:n], ws.cache, ctx, ws.angles)
        if routes is not None:  # the experts of the token just fed: the response token before the row's column
            rows = ws.order[:n]
            if ws.fed is None:  # one turn: every row's column is the step's (a finished row's is past its end)
                ws.routes.index_put_((rows, (ws.step - 1).expand(n)), routes[:, 0])
            else:  # an episode's rows run ahead of the step by what they were fed: the live ones record
                live = ~ws.done[:n]
                ws.routes.index_put_((rows[live], ws.column[rows][live] - 1), routes[live, 0])
        ws.position[:n] = torch.minimum(positions + 1, ws.max_position)
        self._sample(ws, n, logits)

    def _run_step(self, ws: _Workspace, n: int, keys: int) -> None:
        if ws.graphs is None:
            self._step(ws, n, keys)
            return
        graph = ws.graphs.get(n)
        if graph is not None:
            graph.replay()
            return
        stream = self._capture_stream
        if n not in ws.warmed:  # a size's first step runs eagerly on the capture stream: kernels compile, handles
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._step(ws, n, keys)
            torch.cuda.current_stream().wait_stream(stream)
            ws.warmed.add(n)
            return
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=ws.pool, stream=stream):
                self._step(ws, n, keys)
        except RuntimeError as e:  # a capture records nothing it runs: the step runs eagerly instead
            torch.cuda.synchronize()
            self.graphs_off_reason = f"capturing the decode step at {n} rows failed: {e}"
            warnings.warn(f"CUDA graphs off for this engine: {self.graphs_off_reason}", stacklevel=2)
            ws.graphs = None
            self._step(ws, n, keys)
            return
        ws.graphs[n] = graph
        graph.replay()

    def _widths_needed(self, ws: _Workspace) -> Widths | None:
        """Wider buffers if a step's draw needed them (read from the device)."""
        if ws.kept_most is None:  # buffers as wide as the vocabulary
            return None
        kept, candidates = (int(v) for v in torch.stack([ws.kept_most, ws.candidates_most]).tolist())
        have = ws.widths
        if kept <= have.support and candidates <= have.candidates:
            return None
        vocab = self.config.vocab_size
        wider = Widths(min(vocab, _grown(have.candidates, candidates)), min(vocab, _grown(have.support, kept)))
        return Widths(wider.candidates, min(wider.support, wider.candidates))

    def _next_turns(self, ws: _Workspace, n: int, between: Between) -> None:
        """Rows that just ended a turn: `between` says which go on, with which ids, and they continue from their
        cache (`_extend`); a row done at its limit, without an end-of-turn token, is over. Once the call is
        `pausing`, a row that goes on gets its ids in its outputs and stops there (a later call continues it)."""
        order, done = ws.order[:n].tolist(), ws.done[:n].tolist()
        new = {row: at for at, (row, d) in enumerate(zip(order, done)) if d and row not in ws.over}
        if not new:
            return
        rows = list(new)
        column = ws.column[rows]  # each row's next free column: its turn ended just before it
        columns, last = column.tolist(), ws.tokens[rows, column - 1].tolist()
        ended = {row: c for row, c, token in zip(rows, columns, last) if token in self.eos_ids}
        going_on = {}
        if ended:
            tokens = ws.tokens[list(ended), : max(ended.values())].tolist()
            going_on = between(
                list(ended),
                [ids[:c] for ids, c in zip(tokens, ended.values())],
                [ws.budgets[row] - c for row, c in ended.items()],
            )
        ws.over.update(row for row in rows if row not in going_on)
        feeds = []
        for row, (ids, limit) in going_on.items():
            if row not in ended:
                raise ValueError(f"between(): row {row} did not just end a turn (the rows asked: {list(ended)})")
            c, budget = ended[row], ws.budgets[row]
            if not 0 < len(ids) < budget - c or limit < 1:
                raise ValueError(
                    f"between(): row {row} got {len(ids)} ids and a limit of {limit} with {budget - c} columns left"
                )
            # The ids are the row's outputs (fed, μ 0), whether they are fed now or by a later call.
            ws.tokens[row, c : c + len(ids)] = torch.tensor(ids, device=self.device)
            ws.mask[row, c : c + len(ids)] = True
            ws.fed[row, c : c + len(ids)] = True
            if ws.pausing:  # paused at the turn boundary: fed by the call that continues it
                ws.column[row] = c + len(ids)  # past them: a finished row's later draws write pad there
                ws.over.add(row)
            else:
                feeds.append((new[row], row, c, ids, limit))
        if feeds:
            self._extend(ws, feeds)

    def _extend(self, ws: _Workspace, feeds: list[tuple[int, int, int, list[int], int]]) -> None:
        """Continue rows from their caches. `feeds`: (active position, output row, next column, ids, limit of
        the next turn), the ids already in the outputs. One forward writes the keys and values of the turn's
        last token and the ids but the last, which becomes the row's next input: its next turn is then sampled
        by the decode steps as any token is."""
        dev = self.device
        at = torch.tensor([f[0] for f in feeds], device=dev)
        inputs = self._padded([[self.pad_id, *ids[:-1]] for _, _, _, ids, _ in feeds])
        inputs[:, 0] = ws.token[at]  # the turn's last token
        for _, row, c, ids, limit in feeds:
            ws.limit[row] = min(c + len(ids) + limit, ws.budgets[row])
        start, count = ws.position[at], torch.tensor([len(f[3]) for f in feeds], device=dev)
        positions = (start[:, None] + torch.arange(inputs.shape[1], device=dev)).clamp(max=ws.max_position)
        ctx = ws.cache.extend_context(at, positions, count)
        _, routes = self._layers(inputs, positions, ws.angles, ws.cache.extend, ctx)
        rows = torch.tensor([f[1] for f in feeds], device=dev)
        if routes is not None:  # the experts of each token fed: the turn's last token's column and the ids'
            first = ws.column[rows] - 1
            for j in range(inputs.shape[1]):
                real = j < count
                ws.routes.index_put_((rows[real], (first + j)[real]), routes[real, j])
        ws.token[at] = torch.tensor([f[3][-1] for f in feeds], device=dev)
        ws.position[at] = torch.minimum(start + count, ws.max_position)
        ws.column[rows] += count
        ws.done[at] = False

    def _check(
        self, ws: _Workspace, n: int, filled: int, stop: Callable[[torch.Tensor], bool] | None
    ) -> tuple[int, bool]:
        """Read the batch's state: (active rows from now on, whether the call is over). Finished rows are
        dropped once they are a quarter of the batch, down to a multiple of ROW_BUCKET rows, topped up with
        finished ones; the cache keeps the `filled` slots every live row has written."""
        if self._widths_needed(ws) is not None:  # the call runs again with wider buffers (`generate`)
            return n, True
        done = ws.done[:n]
        finished = int(done.sum())
        if finished == n:
            return n, True
        if stop is not None and not ws.pausing:
            flags = torch.ones(len(ws.order), dtype=torch.bool, device=self.device)
            flags[ws.order[:n]] = done
            if stop(flags):
                if ws.fed is None:
                    return n, True
                ws.pausing = True  # an episode's rows stop at their turns' ends
        size = -(-(n - finished) // ROW_BUCKET) * ROW_BUCKET
        if finished * 4 >= n and size < n:
            keep = torch.cat([(~done).nonzero(), done.nonzero()]).squeeze(-1)[:size]
            ws.cache.keep(keep, n, filled)
            for buffer in (ws.order, ws.token, ws.position, ws.done):
                buffer[:size] = buffer[:n][keep]
            ws.position_of_row.fill_(-1)
            ws.position_of_row[ws.order[:size]] = torch.arange(size, device=self.device)
            n = size
        return n, False

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
        between: Between | None = None,
        budgets: list[int] | None = None,
    ) -> RolloutBatch:
        """`group_size` samples per prompt. `full_vocab`: also keep the whole distribution at about that many
        positions (`RolloutBatch.full_vocab`). `limits`: each output row's token limit (default
        `sampling.max_new_tokens`). `stop`: called with the output rows' finished flags whenever the host reads
        them; True ends the call, leaving unfinished rows as they are (partial rollouts continue them later).

        `between`: episodes of several model turns (`Between`). A row that ends a turn is fed the ids `between`
        gives (a tool's answer, the next turn's prompt) from its cache on, then samples its next turn; its
        outputs hold both (`RolloutBatch.env_mask` marks the fed ids). `budgets` (default
        `sampling.max_new_tokens`) then bounds each row's whole episode and `limits` its first turn; the host
        reads the batch after every token. Once `stop` answers yes, a row that ends a turn gets what `between`
        gives in its outputs, unfed, and stops there; the call ends when every row has."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate() needs at least one prompt, each with at least one token")
        if not self.weights.layers:
            raise RuntimeError("RolloutEngine.generate() before engine.weights.load()")
        lengths = [len(p) for p in prompts for _ in range(group_size)]
        limits = limits or [sampling.max_new_tokens] * len(lengths)
        if len(limits) != len(lengths) or min(limits) < 1:
            raise ValueError(f"generate(): expected {len(lengths)} row limits >= 1, got {limits}")
        if between is None:
            budgets = limits
        else:
            budgets = budgets or [sampling.max_new_tokens] * len(lengths)
            if len(budgets) != len(lengths) or any(b < limit for b, limit in zip(budgets, limits)):
                raise ValueError(f"generate(): expected {len(lengths)} row budgets >= their limits, got {budgets}")
        # The columns a row may fill: its limit, or in an episode the whole budget.
        max_new = max(budgets)
        # The furthest position any row may reach; rows that finished keep decoding, clamped below it.
        max_len = max(n + budget for n, budget in zip(lengths, budgets))
        if max_len > self.config.max_position_embeddings:
            raise ValueError(
                f"prompt + new tokens ({max_len}) exceeds the model's "
                f"max_position_embeddings ({self.config.max_position_embeddings})"
            )
        widths = Widths.initial(sampling, self.config.vocab_size) if sampling.filtered else None
        while True:  # a filtered draw that outgrew its buffers runs the call again with wider ones
            ws = self._workspace_for(len(lengths), max_len, max_new, sampling, widths, full_vocab, between is not None)
            self._reset(ws, lengths, limits, budgets, max_len, seed)
            prompt_routes = self._decode(ws, prompts, group_size, max_len, stop, between)
            if (widths := self._widths_needed(ws)) is None:
                return self._batch(ws, prompts, group_size, prompt_routes)

    def _decode(
        self, ws: _Workspace, prompts, group_size: int, max_len: int, stop, between: Between | None
    ) -> torch.Tensor | None:
        """Prefill, then decode steps until every row is done, `stop` says so or a filtered draw outgrew its
        buffers. Returns the experts the prompts' tokens chose (MoE)."""
        n, prompt_len = len(ws.budgets), max(map(len, prompts))
        check_every = 1 if between is not None else self.check_every
        prompt_of_row = torch.arange(len(prompts), device=self.device).repeat_interleave(group_size)
        logits, prompt_routes = self.prefill(prompts, ws.cache, prompt_of_row, ws.angles)
        self._sample(ws, n, logits.repeat_interleave(group_size, dim=0))

        def reach() -> int:  # the highest slot an active row writes next (episodes' rows run ahead by their feeds)
            return prompt_len + t if between is None else int(ws.position[:n].max())

        for t in range(max(ws.budgets) - 1):  # t: the response token just sampled
            if (t + 1) % check_every == 0:
                if between is not None:
                    self._next_turns(ws, n, between)
                n, over = self._check(ws, n, reach(), stop)
                if over:
                    break
            self._run_step(ws, n, min(reach(), max_len - 1) + 1)  # finished rows are clamped below max_len
        return prompt_routes

    def _batch(self, ws: _Workspace, prompts, group_size: int, prompt_routes) -> RolloutBatch:
        """The call's outputs, copied out of the workspace (the next call reuses it)."""
        used = int(ws.mask.sum(0).nonzero().max()) + 1
        tokens, logprobs, mask = (t[:, :used].clone() for t in (ws.tokens, ws.logprobs, ws.mask))
        support = None if ws.kept_ids is None else supports_in_id_order(ws.kept_ids[:, :used])
        routing = None
        if ws.routes is not None:
            per_prompt = [prompt_routes[i, : len(p)] for i, p in enumerate(prompts)]
            routing = Routing(
                [per_prompt[i] for i in range(len(prompts)) for _ in range(group_size)], ws.routes[:, :used].clone()
            )
        fed = None
        if ws.fed is not None:
            fed = ws.fed[:, :used].clone()
            if support is not None:  # a fed id's support is itself: the trainer's log-probability of it is 0
                support = support.masked_fill(fed[..., None], -1)
                support[..., 0] = torch.where(fed, tokens, support[..., 0])
        lengths = mask.sum(-1)
        ended = torch.isin(tokens.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(-1), self._eos)
        # The batch stays on the engine's device; rewards read its tokens, the RL arithmetic runs there.
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompts for _ in range(group_size)],
            response_ids=tokens,
            response_mask=mask,
            rollout_logprobs=logprobs,
            support=support,
            truncated=~ended,
            group_index=torch.arange(len(prompts), device=self.device).repeat_interleave(group_size),
            weight_version=self.weights.version,
            sampling=ws.sampling,
            routing=routing,
            full_vocab=None if ws.recorder is None else ws.recorder.record(),
            env_mask=fed,
        )

    @torch.no_grad()
    def trace(self, prompt: list[int], response: list[int], sampling: SamplingParams) -> dict[str, torch.Tensor]:
        """Replay one sequence as sampling ran it (prefill the prompt, then feed each response token but the last):
        every stage's output, FP32, a row per position fed (`norm`, `logits`, `logprob`: per response token), as
        `locate` compares them."""
        stages: dict[str, list[torch.Tensor]] = {}
        self._tap = lambda name, value: stages.setdefault(name, []).append(value.float().reshape(-1, value.shape[-1]))
        try:
            dev, n = self.device, len(prompt)
            slots = n + len(response)
            cache = kv_cache(self.config, 1, slots, self.dtype, self.numerics)
            angles = self._angles(slots)
            logits = [self.prefill([prompt], cache, torch.zeros(1, dtype=torch.long, device=dev), angles)[0]]
            for j, token in enumerate(response[:-1]):
                position = torch.tensor([n + j], device=dev)
                ctx = cache.step_context(1, position, n + j + 1)
                logits.append(self.decode_step(torch.tensor([token], device=dev), cache, ctx, angles)[0])
        finally:
            self._tap = None
        logp = torch.log_softmax(filter_logits(torch.cat(logits).float(), sampling), dim=-1)
        stages["logprob"] = [logp.gather(-1, torch.tensor(response, device=dev)[:, None])]
        return {name: torch.cat(values).cpu() for name, values in stages.items()}
