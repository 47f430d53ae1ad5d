"""The trainer's packed layout: shared prompts, no padding, chunked attention, FLOP count."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import parity.engines.kernels
from parity.engines import kernels
from parity.engines.models.io import load_model
from parity.engines.packing import ROW_MULTIPLE, STREAM_MULTIPLE, common_prefix, pack
from parity.engines.tokenizer import load_tokenizer
from parity.engines.trainer import OptimConfig, Trainer, matmul_flops


def _batch(tok):
    """Two prompts of different lengths, three responses each, ragged (one of length 1)."""
    prompts = [tok.encode("12+34="), tok.encode("123+4567=")]
    prompt_ids = [prompts[0]] * 3 + [prompts[1]] * 3
    lengths = torch.tensor([5, 1, 9, 3, 7, 2])
    response_ids = torch.randint(3, 40, (6, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(9) < lengths[:, None]
    return prompt_ids, response_ids.masked_fill(~mask, 0), mask


def test_packed_logprobs_and_grads_equal_one_row_at_a_time(llama_dir):
    """Sharing prompts and dropping padding changes nothing but round-off: π and the
    gradient of a loss equal those computed row by row, each row alone."""
    tok = load_tokenizer(llama_dir)
    trainer = Trainer(load_model(llama_dir, kernels.numerics()), "fp32", OptimConfig())
    prompt_ids, response_ids, mask = _batch(tok)

    packed = trainer.logprobs(prompt_ids, response_ids, mask)
    (packed * mask).sum().backward()
    packed_grads = [p.grad.clone() for p in trainer.params]
    trainer.optimizer.zero_grad(set_to_none=True)

    rows = []
    for i in range(len(prompt_ids)):
        n = int(mask[i].sum())
        row = trainer.logprobs(prompt_ids[i : i + 1], response_ids[i : i + 1, :n], mask[i : i + 1, :n])
        row.sum().backward()
        rows.append(torch.cat([row[0], torch.zeros(9 - n)]))
    assert torch.allclose(packed, torch.stack(rows), atol=1e-5)
    assert (packed[~mask] == 0).all()
    for got, p in zip(packed_grads, trainer.params):
        assert torch.allclose(got, p.grad, atol=1e-5, rtol=1e-4)


def test_layout_stores_each_prompt_prefix_once_without_padding(llama_dir):
    tok = load_tokenizer(llama_dir)
    prompt_ids, response_ids, mask = _batch(tok)
    packed = pack(prompt_ids, response_ids, mask)
    shared = common_prefix(prompt_ids[0], prompt_ids[3])
    assert shared > 0  # both start with BOS and "12"
    n_prompts = len(prompt_ids[0]) + len(prompt_ids[3]) - shared
    # Each response streams all but its last token.
    assert packed.num_tokens == n_prompts + int((mask.sum(-1) - 1).sum())
    assert packed.seq_lengths.tolist() == [len(p) + int(n) - 1 for p, n in zip(prompt_ids, mask.sum(-1))]
    assert packed.score_index.numel() == int(mask.sum())
    # Every token's attention output is read from exactly one row slot.
    assert packed.from_rows.unique().numel() == packed.num_tokens
    slots = sum(index.numel() for index in packed.attention_rows)
    assert packed.from_rows.max() < slots
    # Chunks are sorted longest first, each padded only to its own longest row.
    widths = [index.shape[1] for index in packed.attention_rows]
    assert widths == sorted(widths, reverse=True) and widths[-1] < widths[0]


def test_prompts_are_stored_as_a_trie():
    """A system prompt that every prompt starts with, a prompt that is another's prefix, identical
    prompts: each token of each distinct prefix is in the stream once, at its position, and each row
    reads its own prompt's tokens; the variable-length layout computes every stream token once."""
    system = [1, 7, 7, 7, 2]
    a, b = system + [10, 11, 12], system + [10, 11, 12, 13, 14]  # a is a prefix of b
    c, d = system + [20, 21], [1, 7, 9]  # d parts from the system prompt after two tokens
    prompts = [b, a, c, a, d, b]
    packed = pack(prompts)
    assert packed.num_tokens == len(system) + 3 + 2 + 2 + 1  # system, a's rest, b's two more, c's rest, d's last
    for row, p in enumerate(prompts):
        index = packed.prompt_index[row, : len(p)]
        assert packed.token_ids[index].tolist() == p
        assert packed.positions[index].tolist() == list(range(len(p)))
    assert packed.prompt_index[0, :5].tolist() == packed.prompt_index[2, :5].tolist()
    assert torch.equal(packed.prompt_index[1, :8], packed.prompt_index[0, :8])
    rows = packed.rows
    assert sorted(rows.q_order.tolist()) == list(range(packed.num_tokens))
    assert int(rows.q_count.sum()) == packed.num_tokens


def test_bucketed_layout_changes_nothing_but_round_off(llama_dir, monkeypatch):
    """Padding the stream, the attention rows and the scored rows to fixed multiples
    (what BF16 on the CPU runs, so that oneDNN reuses its kernels) leaves π and the
    gradients as they are."""
    tok = load_tokenizer(llama_dir)
    trainer = Trainer(load_model(llama_dir, kernels.numerics()), "fp32", OptimConfig())
    prompt_ids, response_ids, mask = _batch(tok)

    def logprobs_and_grads():
        logprobs = trainer.logprobs(prompt_ids, response_ids, mask)
        (logprobs * mask).sum().backward()
        grads = [p.grad.clone() for p in trainer.params]
        trainer.optimizer.zero_grad(set_to_none=True)
        return logprobs, grads

    plain, plain_grads = logprobs_and_grads()
    monkeypatch.setattr(parity.engines.kernels, "per_shape_kernels", lambda dtype, device: True)
    bucketed, bucketed_grads = logprobs_and_grads()
    assert torch.allclose(bucketed, plain, atol=1e-6)
    for got, want in zip(bucketed_grads, plain_grads):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)

    packed = pack(prompt_ids, response_ids, mask, bucket=True)
    assert packed.token_ids.numel() % STREAM_MULTIPLE == 0 and packed.token_ids.numel() > packed.num_tokens
    assert packed.score_index.numel() % STREAM_MULTIPLE == 0
    assert all(index.shape[1] % ROW_MULTIPLE == 0 for index in packed.attention_rows)


def test_empty_prompt_is_an_error():
    with pytest.raises(ValueError, match="prompt of at least one token"):
        pack([[]], torch.zeros((1, 1), dtype=torch.long), torch.ones((1, 1), dtype=torch.bool))


def test_matmul_flops_by_hand(llama_dir):
    model = load_model(llama_dir, kernels.numerics())
    cfg = model.config  # hidden 64, MLP 128, 2 layers, 4 heads / 2 KV heads of 16, vocabulary 64
    packed = pack([[5, 6, 7]], torch.tensor([[8, 9]]), torch.tensor([[True, True]]))
    # Stream: 3 prompt tokens + 1 response token; one row of length 4; 2 scored tokens.
    per_token = 2 * 64 * (64 + 32 + 32 + 64 + 3 * 128)
    attention = 2 * 64 * (4 * 5)  # QKᵀ and PV over the causal triangle: 2 · width · L(L+1)
    expected = 2 * (4 * per_token + attention) + 2 * 64 * 64 * 2
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size) == (64, 128, 2, 64)
    assert matmul_flops(cfg, packed, scored=2) == expected


def test_micro_batches_keep_to_a_token_budget():
    """Rows in order, a prompt counted once per micro-batch that reads it and without the prefix it shares with
    one before it there, a row alone when it is over budget; each micro-batch's count is what `pack` stores."""
    from parity.engines.batch import RolloutBatch
    from parity.engines.sampling import SamplingParams

    mask = torch.arange(6) < torch.tensor([6, 2, 4, 6, 1])[:, None]
    batch = RolloutBatch(
        prompt_ids=[[1] * 4, [1] * 4, [2] * 3, [3] * 20, [3] * 20],
        response_ids=torch.zeros(5, 6, dtype=torch.long),
        response_mask=mask,
        rollout_logprobs=torch.zeros(5, 6),
        support=None,
        truncated=torch.zeros(5, dtype=torch.bool),
        group_index=torch.arange(5),
        weight_version=0,
        sampling=SamplingParams(),
    )
    parts = batch.micro_batches(torch.arange(5), tokens=20)
    # 4+6, +2 (prompt shared) = 12, +3+4 = 19; then 20+6 alone (over budget), then 20+1 alone
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3], [4]]
    assert [p.tolist() for p in batch.micro_batches(torch.tensor([4, 3]), tokens=27)] == [[4, 3]]

    # A system prompt the three prompts share is counted once: 4+2, +1+3, +1+5 = 16; pack stores 16 less
    # one token per response (its last).
    system = [9, 9, 9]
    mask = torch.arange(6) < torch.tensor([2, 3, 5])[:, None]
    batch = dataclasses.replace(
        batch,
        prompt_ids=[system + [1], system + [2], system + [2, 4]],
        response_ids=torch.zeros(3, 6, dtype=torch.long),
        response_mask=mask,
        rollout_logprobs=torch.zeros(3, 6),
        truncated=torch.zeros(3, dtype=torch.bool),
        group_index=torch.arange(3),
    )
    assert [p.tolist() for p in batch.micro_batches(torch.arange(3), tokens=16)] == [[0, 1, 2]]
    assert pack(batch.prompt_ids, batch.response_ids, mask).num_tokens == 16 - 3
    assert [p.tolist() for p in batch.micro_batches(torch.arange(3), tokens=15)] == [[0, 1], [2]]
