"""The rollout engine's episodes (`generate(between=...)`): ids fed between turns from the KV cache, the
sampled ids kept, and in exact mode μ = π_old for every sampled token of every turn."""

from __future__ import annotations

import pytest

from engine_pair import FED, Turns, engines, random_prompts, trainer_logprobs
from parity.engines.sampling import SamplingParams

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=90)
FILTERED = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, max_new_tokens=90)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("sampling", [SAMPLING, FILTERED], ids=["plain", "filtered"])
def test_exact_mode_holds_across_turns(precision, sampling):
    model, engine = engines("builtin", precision)
    turns = Turns(3)
    batch = engine.generate(
        random_prompts(4, model.config.vocab_size, seed=1), 4, sampling, seed=7, limits=[24] * 16, between=turns
    )
    assert turns.seen, "no row ended a turn"
    sampled = batch.sampled_mask
    pi = trainer_logprobs(model, batch, precision, micro_batch=5)
    assert bool(((pi == batch.rollout_logprobs) | ~sampled).all())
    assert int(batch.env_mask.sum()) >= len(FED)
    # Every row's fed spans are FED, whole, right after a sampled end-of-turn token.
    for row in range(16):
        ids, fed = batch.response_ids[row].tolist(), batch.env_mask[row].tolist()
        spans = [j for j in range(len(fed)) if fed[j] and (j == 0 or not fed[j - 1])]
        for j in spans:
            assert ids[j : j + len(FED)] == FED and all(fed[j : j + len(FED)])
            assert ids[j - 1] == 1 and not fed[j - 1]
        assert len(spans) == min(turns.ended.get(row, 0), 2)
    assert bool((batch.rollout_logprobs[batch.env_mask] == 0).all())
    turn = batch.turn_index()
    assert int(turn.max()) <= 2 and bool((turn[batch.env_mask] == -1).all())


def test_exact_mode_holds_past_192_keys():
    """Episodes on the built-in agent model (256 positions) whose rows pass 192 keys, at different positions
    (rows fed between turns run ahead). MKL's FP32 GEMM splits a sum of more than 192 terms where the term
    count says, so a query's p·v over the decode step's keys (the furthest row's) and over the trainer's
    padded row differed in the last bit (2 tokens, AMD EPYC) until exact mode summed it in fixed blocks of keys."""
    model, engine = engines("builtin-agent", "bf16")
    turns = Turns(4, limit=60)
    prompts = random_prompts(4, model.config.vocab_size, seed=3)
    sampling = SamplingParams(max_new_tokens=240)
    batch = engine.generate(prompts, 2, sampling, seed=3, limits=[200] * 8, between=turns)
    assert len(turns.ended) >= 2 and int(batch.env_mask.sum()) > 0  # episodes, rows at different positions
    assert min(len(p) for p in prompts) + int(batch.response_lengths.max()) > 192
    sampled = batch.sampled_mask
    pi = trainer_logprobs(model, batch, "bf16", micro_batch=8)
    assert bool(((pi == batch.rollout_logprobs) | ~sampled).all())


def test_a_turn_limit_cuts_the_turn_and_the_episode_stops():
    model, engine = engines("builtin", "fp32", exact=False)
    turns = Turns(4, limit=2)
    batch = engine.generate(
        random_prompts(2, model.config.vocab_size, seed=3), 4, SAMPLING, seed=2, limits=[30] * 8, between=turns
    )
    for row in range(8):
        fed = batch.env_mask[row].tolist()
        spans = [j for j in range(len(fed)) if fed[j] and (j == 0 or not fed[j - 1])]
        if spans:  # after a fed span the turn is at most 2 tokens, and it was not fed again unless it ended
            last = batch.response_lengths[row].item()
            after = last - (spans[-1] + len(FED))
            assert 1 <= after <= 2
    # A row whose last turn was cut at its limit is reported cut off (no end-of-turn as its last token).
    assert bool(batch.truncated.any()) or all(t == 4 for t in turns.ended.values())


def test_a_stop_pauses_episodes_at_turn_boundaries():
    """Partial rollouts' `stop` in an episode: once it answers yes, rows in a turn sample it to its end, and a
    row that ends a turn gets the fed ids in its outputs, unfed, and stops there. Before that the call is the
    one without `stop`; `stop` is not asked again; every row's budget bounds its columns."""
    model, engine = engines("builtin", "fp32", exact=False)
    prompts = random_prompts(2, model.config.vocab_size, seed=4)  # rows 0-3 end turns early
    free = engine.generate(prompts, 4, SAMPLING, seed=7, limits=[24] * 8, between=Turns(3))
    asked = []

    def stop(done):
        asked.append(int(done.sum()))
        return True  # after the first token: rows 0-3 are in their second turns, rows 4-7 in their first

    turns = Turns(3)
    paused = engine.generate(prompts, 4, SAMPLING, seed=7, limits=[24] * 8, stop=stop, between=turns)
    assert len(asked) == 1
    for row in range(8):
        n = int(paused.response_lengths[row])
        ids, fed = paused.response_ids[row, :n].tolist(), paused.env_mask[row, :n].tolist()
        assert ids == free.response_ids[row, :n].tolist()  # the same draws up to where it stopped
        if fed[-1]:  # paused after its turn: the turn's end-of-turn token, then FED
            assert ids[-len(FED) :] == FED and ids[-len(FED) - 1] == 1
            assert turns.ended[row] == sum(f and not p for f, p in zip(fed[1:], fed[:-1]))  # its fed spans
        else:  # its episode ended within the call (the limit or its last turn)
            assert n == int(free.response_lengths[row])
    assert any(paused.env_mask[row, int(paused.response_lengths[row]) - 1] for row in range(8))
    budgets = [30, 90, 40, 90, 50, 90, 60, 90]
    bounded = engine.generate(prompts, 4, SAMPLING, seed=7, limits=[24] * 8, between=Turns(9), budgets=budgets)
    assert all(int(n) <= b for n, b in zip(bounded.response_lengths, budgets))
    with pytest.raises(ValueError, match="row budgets >= their limits"):
        engine.generate(prompts, 4, SAMPLING, seed=7, limits=[24] * 8, between=Turns(2), budgets=[20] * 8)


def test_a_between_that_answers_for_a_row_it_was_not_asked_about_is_refused():
    """`between` may only continue the rows it was given (rows that just ended a turn): an answer for another
    row, or ids that do not fit the row's room, is a ValueError naming the row."""
    model, engine = engines("builtin", "fp32", exact=False)
    prompts = random_prompts(2, model.config.vocab_size, seed=4)  # rows 0-3 end turns early

    def stranger(rows, tokens, rooms):
        return {max(rows) + 100: (FED, 4)}

    with pytest.raises(ValueError, match=r"between\(\): row \d+ did not just end a turn"):
        engine.generate(prompts, 4, SAMPLING, seed=7, limits=[24] * 8, between=stranger)

    def too_long(rows, tokens, rooms):
        return {row: ([5] * room, 4) for row, room in zip(rows, rooms)}

    with pytest.raises(ValueError, match=r"between\(\): row \d+ got \d+ ids and a limit of 4"):
        engine.generate(prompts, 4, SAMPLING, seed=7, limits=[24] * 8, between=too_long)
