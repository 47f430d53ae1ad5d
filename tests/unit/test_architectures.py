"""Every supported architecture against `transformers`, through both engines, in FP32."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from architectures import ARCHITECTURES, reference, save_random_model
from parity.engines import kernels
from parity.engines.models.io import load_model
from parity.engines.models.modules import final_logits
from parity.engines.packing import pack
from parity.engines.rollout import RolloutEngine
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import copy_tokenizer_files, load_tokenizer
from parity.engines.trainer import sequence_logprobs

PROMPTS = ["12+34=", "7+8=", "123+4567+89=", "5+5="]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_dir(request, tmp_path_factory):
    return request.param, save_random_model(tmp_path_factory.mktemp(request.param), request.param)


def test_trainer_logits_match_transformers(arch_dir):
    """The trainer's packed forward: every stream position's logits equal transformers' on the
    sequence written out in full (sequences longer than any sliding window)."""
    _, path = arch_dir
    ours, ref = load_model(path, kernels.numerics()), reference(path)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=gen).tolist() for n in (5, 5, 14)]
    responses = torch.randint(3, 60, (3, 12), generator=gen)
    mask = torch.arange(12) < torch.tensor([12, 4, 9])[:, None]
    packed = pack(prompts, responses, mask)
    with torch.no_grad():
        got = final_logits(ours(packed, torch.float32), ours.config.final_softcap)
        expected = []
        for row, prompt in enumerate(prompts):
            n = int(mask[row].sum())
            full = torch.tensor([prompt + responses[row, : n - 1].tolist()])
            expected.append(ref(full).logits[0, len(prompt) - 1 :])
    expected = torch.cat(expected)
    assert (got - expected).abs().max() <= 2e-5


def test_rollout_engine_matches_transformers(arch_dir):
    """μ from the rollout engine (fused projections, KV cache, left padding, groups, rows
    dropped as they finish) equals transformers' log-probs of the sampled tokens, and the
    trainer's code path agrees."""
    arch, path = arch_dir
    tok, model, ref = load_tokenizer(path), load_model(path, kernels.numerics()), reference(path)
    engine = RolloutEngine(model.config, "fp32", tok.eos_ids, tok.pad_id, kernels.numerics())
    engine.weights.load(model.state_dict(), version=0)
    prompts = [tok.encode(p) for p in PROMPTS]
    batch = engine.generate(prompts, 3, SamplingParams(max_new_tokens=20), seed=0)
    assert batch.response_lengths.max() > 8  # past the sliding window
    with torch.no_grad():
        _, pi = sequence_logprobs(
            model, batch.prompt_ids, batch.response_ids, batch.response_mask, None, 1.0, torch.float32
        )
        for row in range(batch.response_ids.shape[0]):
            n = int(batch.response_mask[row].sum())
            resp = batch.response_ids[row, :n]
            ids = torch.tensor([batch.prompt_ids[row] + resp.tolist()])
            logits = ref(ids).logits[0, len(batch.prompt_ids[row]) - 1 : -1]
            expected = torch.log_softmax(logits, -1).gather(-1, resp[:, None]).squeeze(-1)
            assert (batch.rollout_logprobs[row, :n] - expected).abs().max() < 2e-5, (arch, row)
    assert (pi - batch.rollout_logprobs).abs().max() < 2e-5
    if arch == "llama3":  # both EOS ids end a response
        assert set(tok.eos_ids) == {2, 3}
        ends = batch.response_ids[~batch.truncated, batch.response_lengths[~batch.truncated] - 1]
        assert set(ends.tolist()) <= {2, 3}


def test_saved_checkpoint_loads_in_transformers(arch_dir, tmp_path):
    from parity.engines.models.io import save_model

    _, path = arch_dir
    ours = load_model(path, kernels.numerics())
    out = save_model(ours, tmp_path / "copy", partial(copy_tokenizer_files, path))
    ref = reference(out)
    ids = torch.tensor([load_tokenizer(path).encode("123+45=67")])
    with torch.no_grad():
        assert torch.allclose(ref(ids).logits, reference(path)(ids).logits)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_exact_mode_gives_the_trainers_bits(arch_dir, precision):
    """exact=true on every family (sliding windows, q/k norms, MoE routing, soft-caps, Gemma's
    (1 + w) norms): μ equals the trainer's π bit for bit on 48 rows with top-k/top-p."""
    from engine_pair import FILTERED, engines, random_prompts, trainer_logprobs

    _, path = arch_dir
    model, engine = engines(path, precision)
    batch = engine.generate(random_prompts(12, model.config.vocab_size, seed=5), 4, FILTERED, seed=0)
    pi = trainer_logprobs(model, batch, precision, micro_batch=16)
    assert torch.equal(pi[batch.response_mask], batch.rollout_logprobs[batch.response_mask])
