"""Padding-free, prefix-shared layout of a batch of sequences for the trainer.

An RL batch is `group_size` responses to each prompt. Padding every row to the
longest sequence and repeating each prompt once per response wastes most of the
trainer's matmuls on short batches (a third of the positions were padding on the
built-in task, and prompts were computed eight times). Here every token the model
must see is stored once, in one stream of N tokens:

    [ prompt tokens, each prefix once | response 0 | response 1 | ... ]

(each response without its last token, which predicts nothing and is attended by
nothing). The prompts are stored as a trie: a prefix that several prompts start
with (a chat template's system prompt, a task's instructions, a tool list, the
whole prompt within a group) is computed once, since a causal model gives its
tokens the same keys, values and outputs in every sequence that starts with it.
Every position-wise op (embedding, norms, projections, MLP, LM head) runs on that
stream. Only attention needs whole sequences: `gather_rows(x, index)` lays the
stream out as right-padded rows (prompt then response; a shared prefix is read by
each of its rows), sorted by length into a few chunks so that short rows are not
padded to the longest, causal attention runs on each chunk, and `from_rows` picks
each token's output back from one row. Gradients flow back through the same gathers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

ATTENTION_CHUNKS = 4  # length-sorted row chunks for attention: less padding, few kernel calls
# With `bucket=True` the stream is padded to a multiple of STREAM_MULTIPLE tokens and each
# chunk's rows to a multiple of ROW_MULTIPLE slots, so that a run sees a few shapes over
# and over (for kernels built per shape; see `kernels.per_shape_kernels`).
STREAM_MULTIPLE = 64
ROW_MULTIPLE = 16


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`table[index]` for a 2-D `table`, with a deterministic backward.

    `F.embedding`'s CPU backward sums repeated indices in a fixed order; plain
    indexing's accumulating backward does not, and repeated indices (a prompt read
    by every row of its group) would make FP32 runs differ bit-wise.
    """
    return F.embedding(index, table)


@dataclass(frozen=True)
class PackedBatch:
    token_ids: torch.Tensor  # [N] each prompt prefix once, then each response but its last token
    positions: torch.Tensor  # [N] position of each token in its own sequence
    seq_lengths: torch.Tensor  # [B] stream tokens each row attends over (its prompt and response)
    attention_rows: tuple[torch.Tensor, ...]  # chunks of rows [b_k, L_k]: stream index per slot (padding -> 0)
    from_rows: torch.Tensor  # [N] slot holding each token's attention output (chunks flattened, in order)
    score_index: torch.Tensor  # [M] stream token whose output predicts each response token (row-major), then padding
    num_tokens: int  # real stream tokens; any after them are padding that nothing reads
    # Per row: the stream index of each of its prompt's tokens ([B, longest prompt], padding 0), its prompt's
    # length, where its response starts, and the first prompt position whose token it computes (the tokens
    # before it are another row's: the prefix it shares with a row before it in the trie's order).
    prompt_index: torch.Tensor
    prompt_len: torch.Tensor
    response_start: torch.Tensor
    computes_from: torch.Tensor
    routing: torch.Tensor | None = None  # [N, MoE layers, k] experts to replay per stream token

    @cached_property
    def rows(self) -> RowLayout:
        """The rows as variable-length attention reads them (`RowLayout`)."""
        device = self.token_ids.device
        b = len(self.seq_lengths)
        kv_count = self.seq_lengths
        kv_start = torch.cumsum(kv_count, 0) - kv_count
        total = int(kv_count.sum())
        row = torch.repeat_interleave(torch.arange(b, device=device), kv_count, output_size=total)
        slot = torch.arange(total, device=device) - kv_start[row]
        kv_order = _stream_index(self.prompt_index, self.prompt_len, self.response_start, row, slot)
        q_pos0 = self.computes_from
        q_count = kv_count - q_pos0
        as_int = {"dtype": torch.int32}
        return RowLayout(
            q_order=kv_order[slot >= q_pos0[row]],
            q_first=(torch.cumsum(q_count, 0) - q_count).to(**as_int),
            q_count=q_count.to(**as_int),
            q_pos0=q_pos0.to(**as_int),
            kv_order=kv_order.to(**as_int),
            kv_start=kv_start.to(**as_int),
            max_q=int(q_count.max()),
            max_k=int(kv_count.max()),
        )


@dataclass(frozen=True)
class RowLayout:
    """A packed batch's rows for variable-length attention: each row's queries are the stream tokens it
    computes (its prompt's from `computes_from` on, then its response), `q_order` listing them row after row
    (each stream token once); its keys are its whole sequence, `kv_order[kv_start[r] + p]` being the stream
    index of row r's position p. Query j of row r is at position q_pos0[r] + j."""

    q_order: torch.Tensor  # [num_tokens] stream index of each query, row by row
    q_first: torch.Tensor  # [B] int32: row r's first query in q_order
    q_count: torch.Tensor  # [B] int32
    q_pos0: torch.Tensor  # [B] int32
    kv_order: torch.Tensor  # [sum of lengths] int32
    kv_start: torch.Tensor  # [B] int32
    max_q: int
    max_k: int


@dataclass(frozen=True)
class Routing:
    """The experts a MoE model's rollout engine chose, per row: `prompts[r]` [P_r, layers, k]
    for row r's prompt tokens, `responses` [B, T, layers, k] for its response tokens (-1 where
    none: a response's last token is never fed to the model)."""

    prompts: list[torch.Tensor]
    responses: torch.Tensor

    def rows(self, index: torch.Tensor) -> Routing:
        return Routing([self.prompts[i] for i in index.tolist()], self.responses[index])

    def to(self, device: torch.device | str) -> Routing:
        return Routing([p.to(device) for p in self.prompts], self.responses.to(device))


def _stream_index(
    prompt_index: torch.Tensor, prompt_len: torch.Tensor, response_start: torch.Tensor, row: torch.Tensor, slot
) -> torch.Tensor:
    """The stream index of position `slot` of row `row` (broadcast together): a prompt token where the trie put
    it (`prompt_index`), a response token after its row's `response_start`."""
    in_prompt = prompt_index[row, slot.clamp(max=prompt_index.shape[1] - 1)]
    return torch.where(slot < prompt_len[row], in_prompt, response_start[row] + slot - prompt_len[row])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest prefix two token sequences share."""
    if a == b:
        return len(a)
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _prompt_trie(prompt_ids: list[list[int]]) -> tuple[list[int], list[int], list[int]]:
    """The prompts as a trie: the rows in the lexicographic order of their prompts, and per row the row
    before it in that order (-1 for the first) and the length of the prefix they share, which is the
    longest prefix the row shares with any row before it."""
    order = sorted(range(len(prompt_ids)), key=prompt_ids.__getitem__)
    before, shared = [-1] * len(order), [0] * len(order)
    for prev, row in zip(order, order[1:]):
        before[row], shared[row] = prev, common_prefix(prompt_ids[prev], prompt_ids[row])
    return order, before, shared


def pack(
    prompt_ids: list[list[int]],
    response_ids: torch.Tensor | None = None,
    response_mask: torch.Tensor | None = None,
    bucket: bool = False,
    routing: Routing | None = None,
    device: torch.device | str = "cpu",
) -> PackedBatch:
    """Pack rows of prompt + response. A prefix that several prompts share is stored once.

    `response_ids` [B, T] and `response_mask` [B, T] (True on real tokens, a prefix
    of each row) may be None to pack prompts alone. Each response token is scored
    from the stream token just before it. `bucket` pads the shapes to the multiples above.
    `routing`, the rollout engine's experts for the rows' tokens, is laid out like the stream.
    The batch is built where `response_ids` is, or on `device` for prompts alone.
    """
    b = len(prompt_ids)
    if b == 0 or any(len(p) == 0 for p in prompt_ids):
        raise ValueError("pack() needs at least one row, each with a prompt of at least one token")
    device = response_ids.device if response_ids is not None else torch.device(device)
    if response_ids is None:
        response_ids = torch.zeros((b, 0), dtype=torch.long, device=device)
        response_mask = torch.zeros((b, 0), dtype=torch.bool, device=device)

    # Each row's prompt tokens in the stream: the shared prefix where the row before it in the trie has
    # them, then the tokens it computes itself, appended to the stream in the trie's order.
    order, before, shared = _prompt_trie(prompt_ids)
    index: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * b
    start = 0
    for row in order:
        own = torch.arange(start, start + len(prompt_ids[row]) - shared[row])
        index[row] = torch.cat([index[before[row]][: shared[row]], own]) if shared[row] else own
        start += len(own)
    n_prompt = start
    prompt_index = torch.nn.utils.rnn.pad_sequence(index, batch_first=True).to(device)
    computes_from = torch.tensor(shared, device=device)
    p_len = torch.tensor([len(p) for p in prompt_ids], device=device)

    # A response's last token predicts nothing and is attended by nothing: not in the stream.
    t = response_ids.shape[1]
    slot_t = torch.arange(t, device=device).expand(b, t)
    resp_len = (response_mask.sum(-1) - 1).clamp(min=0)
    in_stream = slot_t < resp_len[:, None]
    resp_start = n_prompt + torch.cumsum(resp_len, 0) - resp_len

    own_ids = [tok for row in order for tok in prompt_ids[row][shared[row] :]]
    token_ids = torch.cat([torch.tensor(own_ids, dtype=torch.long, device=device), response_ids[in_stream]])
    prompt_positions = torch.cat([torch.arange(shared[row], len(prompt_ids[row])) for row in order]).to(device)
    # The row that computes each of those tokens.
    owned = torch.tensor([len(prompt_ids[row]) - shared[row] for row in order], device=device)
    computed_by = torch.tensor(order, device=device).repeat_interleave(owned)
    positions = torch.cat([prompt_positions, (p_len[:, None] + slot_t)[in_stream]])

    # Row layout: slot i of row r is prompt token i, then response token i - p_len.
    # Rows are sorted by length into a few chunks, each padded only to its own longest.
    seq_len = p_len + resp_len
    attention_rows, row_base = [], torch.zeros(b, dtype=torch.long, device=device)
    offset = 0
    for rows in torch.argsort(seq_len, descending=True, stable=True).tensor_split(min(ATTENTION_CHUNKS, b)):
        width = int(seq_len[rows].max())
        if bucket:
            width = -(-width // ROW_MULTIPLE) * ROW_MULTIPLE
        slot = torch.arange(width, device=device)[None]
        index_k = _stream_index(prompt_index, p_len, resp_start, rows[:, None], slot)
        attention_rows.append(index_k.masked_fill(slot >= seq_len[rows][:, None], 0))
        row_base[rows] = offset + torch.arange(len(rows), device=device) * width
        offset += len(rows) * width

    # Each token's output comes from one row: a prompt token's from the row that computes it.
    prompt_from = row_base[computed_by] + prompt_positions
    resp_from = (row_base[:, None] + p_len[:, None] + slot_t)[in_stream]
    from_rows = torch.cat([prompt_from, resp_from])

    # Response token j is predicted by token j-1, or by the prompt's last token for j = 0.
    last = prompt_index.gather(1, (p_len - 1)[:, None])
    prev = torch.where(slot_t == 0, last, resp_start[:, None] + slot_t - 1)
    num_tokens, score_index = token_ids.numel(), prev[response_mask]
    stream_routing = None
    if routing is not None:
        prompt_routes = [routing.prompts[row][-len(prompt_ids[row]) :][shared[row] :] for row in order]
        stream_routing = torch.cat([*prompt_routes, routing.responses[in_stream]])
    if bucket:
        # Padding tokens (id 0 at position 0) are computed but attended by nothing; the
        # padded scored rows read token 0, and the trainer drops their log-probs.
        extra = (0, -num_tokens % STREAM_MULTIPLE)
        token_ids, positions, from_rows = F.pad(token_ids, extra), F.pad(positions, extra), F.pad(from_rows, extra)
        score_index = F.pad(score_index, (0, -score_index.numel() % STREAM_MULTIPLE))
        if stream_routing is not None:  # padding tokens route to expert 0 (read by nothing)
            stream_routing = F.pad(stream_routing, (0, 0, 0, 0, *extra))
    return PackedBatch(
        token_ids=token_ids,
        positions=positions,
        seq_lengths=seq_len,
        attention_rows=tuple(attention_rows),
        from_rows=from_rows,
        score_index=score_index,
        num_tokens=num_tokens,
        prompt_index=prompt_index,
        prompt_len=p_len,
        response_start=resp_start,
        computes_from=computes_from,
        routing=stream_routing,
    )
