"""The batch-invariant kernels of exact mode on CUDA at sizes that take the Triton CPU interpreter from seconds
to a minute (conftest sets TRITON_INTERPRET without a GPU): the large and small tiles, the Gumbel draw over
a thousand rows and split over the vocabulary, and both engines of the built-in model through the kernels.
The kernels' other tests: tests/unit/test_invariant.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from engine_pair import FED, Turns, trainer_logprobs  # noqa: E402
from kernel_inputs import DEVICE, DTYPES, randn  # noqa: E402
from parity.engines import kernels  # noqa: E402
from parity.engines.kernels import invariant  # noqa: E402
from parity.engines.models.io import BUILTIN_DIR, export_state, load_model  # noqa: E402
from parity.engines.rollout import RolloutEngine  # noqa: E402
from parity.engines.sampling import SamplingParams  # noqa: E402
from parity.engines.tokenizer import load_tokenizer  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_a_row_gets_the_same_bits_from_the_small_and_the_large_tiles(dtype):
    """Thousands of rows take the large tiles, a few rows the small ones (`invariant.tiles_for`): every row the
    same bits either way, and under every other tile shape. The interpreter has one tile shape for every
    size, so there a few tiles each way (5 × 3 of them, 8 chunks of K) show the same."""
    m, k, n = (1500, 896, 1152) if DEVICE == "cuda" else (300, 256, 192)
    x, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype, seed=1)
    many = invariant.linear(x, w)
    assert invariant.tiles_for(m, dtype) != invariant.tiles_for(7, dtype) or dtype == torch.float32 or DEVICE == "cpu"
    for rows in (slice(0, 7), slice(m // 2 - 20, m // 2 + 110), slice(m - 1, m)):
        assert torch.equal(invariant.linear(x[rows], w), many[rows])
    if DEVICE == "cuda":  # the interpreter sums each K chunk as one NumPy dot: its chunks set its bits
        for t in invariant.TILES.values():
            if (t == invariant.TILES["fma"]) == (dtype == torch.float32):
                assert torch.equal(invariant.matmul(x[:200], w.t(), tiles=t), many[:200])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16"] if DEVICE == "cpu" else ["fp32", "bf16", "fp16"])
def test_the_two_engines_agree_bit_for_bit_through_the_invariant_kernels(precision):
    """The built-in model with every matmul, softmax and norm statistic through these kernels in both
    engines (as exact mode runs on CUDA): μ = π_old for every token, top-k/top-p sampling, rows
    finishing and compacted, scored in micro-batches of another size. (The interpreter takes half a minute
    for one precision; a GPU runs all three.)"""
    from engine_pair import FILTERED, random_prompts, trainer_logprobs

    model = load_model("builtin", kernels.TritonExact(torch.device(DEVICE)))
    tok = load_tokenizer(BUILTIN_DIR)
    engine = RolloutEngine(model.config, precision, tok.eos_ids, tok.pad_id, model.numerics)
    engine.weights.load(export_state(model), version=0)
    short = dataclasses.replace(FILTERED, max_new_tokens=8)  # each token is a decode step in the interpreter
    batch = engine.generate(random_prompts(4, model.config.vocab_size, seed=4), 3, short, seed=0)
    assert batch.response_lengths.min() < batch.response_lengths.max()
    pi = trainer_logprobs(model, batch, precision, micro_batch=7)
    assert torch.equal(pi[batch.response_mask], batch.rollout_logprobs[batch.response_mask])


def test_the_gumbel_draw_samples_the_softmax_and_a_row_alone_gets_the_same_token():
    """Token frequencies follow softmax(z / T); the log-probability returned is the token's under it (or, given
    log-probabilities, exactly theirs); -inf is never drawn; and a row's token depends on its number only."""
    from parity.engines.kernels import gumbel

    z = torch.tensor([1.0, float("-inf"), 2.5, 0.3, -1.0, 2.0] * 20, device=DEVICE)[:100]
    rows = 1000  # each frequency within 0.03 is more than 4 standard deviations at this count
    uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    tokens, logprobs = gumbel.sample(z.expand(rows, -1), uniforms, normalised=False, temperature=0.7)
    expected = torch.softmax(z / 0.7, -1)
    freq = torch.bincount(tokens, minlength=100).float() / rows
    assert (freq[torch.isinf(z)] == 0).all()
    assert (freq - expected).abs().max() < 0.03
    assert torch.allclose(logprobs, torch.log_softmax(z / 0.7, -1)[tokens], atol=1e-5)
    alone, _ = gumbel.sample(z.expand(5, -1), uniforms[100:105], normalised=False, temperature=0.7)
    assert torch.equal(alone, tokens[100:105])
    logp = torch.log_softmax(randn(7, 300), -1)
    picked, values = gumbel.sample(logp, uniforms[:7], normalised=True)
    assert torch.equal(values, logp.gather(-1, picked[:, None])[:, 0])


def test_the_gumbel_draw_gives_the_same_token_however_the_vocabulary_is_split():
    """One program per span of the vocabulary, then the best span: the same tokens as one pass over the whole
    row (the same bits for log-probabilities given; the log-sum-exp of logits to rounding), ties included."""
    from parity.engines.kernels import gumbel

    z = randn(8, 1000) * 3
    z[:, 500:] = float("-inf")  # whole spans with no finite entry
    z[:4] = z[:4].round()  # equal values: ties decided by the noise, the same in any split
    uniforms = torch.rand(8, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    one = gumbel.sample(z, uniforms, normalised=False, temperature=0.9, span=1024)
    logp = torch.log_softmax(z, -1)
    one_normalised = gumbel.sample(logp, uniforms, normalised=True, span=1024)
    for span in (32, 96, 256):
        tokens, logprobs = gumbel.sample(z, uniforms, normalised=False, temperature=0.9, span=span)
        assert torch.equal(tokens, one[0]) and torch.allclose(logprobs, one[1], atol=1e-6, rtol=0)
        tokens, values = gumbel.sample(logp, uniforms, normalised=True, span=span)
        assert torch.equal(tokens, one_normalised[0]) and torch.equal(values, one_normalised[1])


@pytest.mark.slow
def test_an_episode_continued_from_the_cache_agrees_bit_for_bit_through_the_invariant_kernels():
    """Episodes on CUDA's cache layout (`SlotKVCache.extend`: the ids fed between turns written by one forward
    through the decode step's Triton kernel): μ = π_old for every sampled token of every turn."""
    model = load_model("builtin", kernels.TritonExact(torch.device(DEVICE)))
    tok = load_tokenizer(BUILTIN_DIR)
    engine = RolloutEngine(model.config, "bf16", tok.eos_ids, tok.pad_id, model.numerics)
    engine.weights.load(export_state(model), version=0)
    turns = Turns(2, limit=4)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    # Solutions written out to their last digits: the first turn ends within a few tokens.
    prompts = [tok.encode(p) for p in ("4705+386=5+6=11,0+8+1=9,7+3=10,4+0+1=5>50", "12+34=2+4=6,1+3=4>4")]
    batch = engine.generate(prompts, 2, sampling, 3, limits=[4] * 4, between=turns)
    assert bool(batch.env_mask.any()), "no row ended its first turn"
    sampled = batch.sampled_mask
    pi = trainer_logprobs(model, batch, "bf16", micro_batch=3)
    assert torch.equal(pi[sampled], batch.rollout_logprobs[sampled])
    assert all(
        batch.response_ids[r, j : j + len(FED)].tolist() == FED for r, j in batch.env_mask.nonzero()[:1].tolist()
    )
