"""The static-shape rollout engine gives, bit for bit, what the engine before it gave (tests/reference_rollout.py)
on the CPU: tokens, μ, supports, the recorded whole distributions and MoE routing, in every precision, exact and
plain, with top-k and top-p, row limits and stops, LoRA adapters, and every architecture."""

from __future__ import annotations

import pytest
import torch

import reference_rollout
from architectures import ARCHITECTURES, save_random_model
from conftest import save_hf_model
from engine_pair import random_prompts, trainer_logprobs
from parity.engines import kernels
from parity.engines.lora import LoRAConfig, adapter_pairs, apply_lora
from parity.engines.models.io import export_state, load_model, resolve_model_dir
from parity.engines.rollout import RolloutEngine
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import load_tokenizer

PLAIN = SamplingParams(max_new_tokens=20)
SAMPLINGS = {
    "plain": PLAIN,
    "top-k-top-p": SamplingParams(temperature=0.8, top_k=6, top_p=0.9, max_new_tokens=20),
    "top-k": SamplingParams(top_k=3, max_new_tokens=20),
    "top-p": SamplingParams(temperature=1.3, top_p=0.7, max_new_tokens=20),
}


def engine_for(model_dir, precision: str, exact: bool) -> tuple[torch.nn.Module, RolloutEngine]:
    model = load_model(model_dir, kernels.numerics())
    tok = load_tokenizer(resolve_model_dir(model_dir))
    engine = RolloutEngine(model.config, precision, tok.eos_ids, tok.pad_id, kernels.numerics(exact=exact))
    engine.weights.load(export_state(model), version=0)
    return model, engine


def assert_same(new, old) -> None:
    for name in ("response_ids", "response_mask", "rollout_logprobs", "support", "truncated", "group_index"):
        a, b = getattr(new, name), getattr(old, name)
        assert (a is None and b is None) or torch.equal(a, b), name
    assert new.prompt_ids == old.prompt_ids
    if old.full_vocab is not None:
        for name in ("rows", "steps", "rollout_logprobs"):
            assert torch.equal(getattr(new.full_vocab, name), getattr(old.full_vocab, name)), f"full_vocab.{name}"
    if old.routing is not None:
        assert torch.equal(new.routing.responses, old.routing.responses)
        assert all(torch.equal(a, b) for a, b in zip(new.routing.prompts, old.routing.prompts))


@pytest.mark.parametrize("exact", [False, True], ids=["plain", "exact"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("sampling", list(SAMPLINGS), ids=list(SAMPLINGS))
def test_the_builtin_model_samples_what_the_previous_engine_sampled(precision, exact, sampling):
    """40 rows finishing at different steps (so rows leave the batch), whole distributions recorded."""
    model, engine = engine_for("builtin", precision, exact)
    prompts = random_prompts(10, model.config.vocab_size, seed=2)
    new = engine.generate(prompts, 4, SAMPLINGS[sampling], seed=5, full_vocab=20)
    assert new.response_lengths.min() < new.response_lengths.max()
    assert_same(new, reference_rollout.generate(engine, prompts, 4, SAMPLINGS[sampling], seed=5, full_vocab=20))


@pytest.fixture(scope="module")
def wide_vocab_dir(tmp_path_factory):
    """A vocabulary wider than top-k's candidate buffer (k + TIE_ROOM), so the draw examines a part of it."""
    return save_hf_model(tmp_path_factory.mktemp("wide"), "llama", seed=3, vocab_size=700)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("exact", [False, True], ids=["plain", "exact"])
def test_top_k_examines_candidates_only_and_keeps_ties(wide_vocab_dir, precision, exact):
    """Top-k picks k + TIE_ROOM candidates (BF16 logits tie often; every tie with the k-th stays) and top-p runs
    over them; then a top-k of 1 with all logits equal needs the whole vocabulary and draws again, wider."""
    model, engine = engine_for(wide_vocab_dir, precision, exact)
    prompts = random_prompts(6, 60, seed=4)
    for sampling in (
        SamplingParams(top_k=40, top_p=0.95, max_new_tokens=12),
        SamplingParams(top_k=5, max_new_tokens=12),
    ):
        new = engine.generate(prompts, 3, sampling, seed=1, full_vocab=8)
        assert_same(new, reference_rollout.generate(engine, prompts, 3, sampling, seed=1, full_vocab=8))
    state = {name: t.float() for name, t in engine.weights.named_weights().items()}
    head = "model.embed_tokens.weight" if "lm_head.weight" not in state else "lm_head.weight"
    state[head] = torch.zeros_like(state[head])  # every logit equal: top-k keeps all 700
    engine.weights.load(state, engine.weights.version + 1)
    new = engine.generate(prompts, 2, SamplingParams(top_k=1, max_new_tokens=5), seed=2)
    assert new.support.shape[-1] == 700
    assert_same(new, reference_rollout.generate(engine, prompts, 2, SamplingParams(top_k=1, max_new_tokens=5), seed=2))


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_dir(request, tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("exact", [False, True], ids=["plain", "exact"])
def test_every_architecture_samples_what_the_previous_engine_sampled(arch_dir, exact):
    """Sliding windows, soft-caps, Q/K norms, RoPE scaling, MoE routing, in BF16 with top-k/top-p."""
    _, engine = engine_for(arch_dir, "bf16", exact)
    prompts = random_prompts(5, 60, seed=7)
    sampling = SamplingParams(temperature=0.9, top_k=8, top_p=0.9, max_new_tokens=24)
    new = engine.generate(prompts, 3, sampling, seed=3)
    assert_same(new, reference_rollout.generate(engine, prompts, 3, sampling, seed=3))


def test_row_limits_stops_and_reuse_of_a_workspace():
    """Per-row limits, a stop callback that ends the call, and calls of one shape in a row (the second reuses
    the first's workspace: nothing of the first call may leak into it)."""
    model, engine = engine_for("builtin", "bf16", exact=False)
    prompts = random_prompts(4, model.config.vocab_size, seed=8)
    limits = [3, 20, 5, 17]
    for seed in (1, 2):
        assert_same(
            engine.generate(prompts, 1, PLAIN, seed, limits=limits),
            reference_rollout.generate(engine, prompts, 1, PLAIN, seed, limits=limits),
        )
    calls_new, calls_old = [], []
    new = engine.generate(prompts, 2, PLAIN, 4, stop=lambda done: calls_new.append(done.clone()) or len(calls_new) == 6)
    old = reference_rollout.generate(
        engine, prompts, 2, PLAIN, 4, stop=lambda done: calls_old.append(done.clone()) or len(calls_old) == 6
    )
    assert_same(new, old)
    assert all(torch.equal(a, b) for a, b in zip(calls_new, calls_old)) and len(calls_new) == 6


@pytest.mark.parametrize("exact", [False, True], ids=["plain", "exact"])
def test_lora_adapters_sample_what_the_previous_engine_sampled(exact):
    model, engine = engine_for("builtin", "bf16", exact)
    apply_lora(model, LoRAConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj")), torch.bfloat16, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    engine.weights.load_adapters(adapter_pairs(model), version=1)
    prompts = random_prompts(6, model.config.vocab_size, seed=9)
    sampling = SAMPLINGS["top-k-top-p"]
    assert_same(engine.generate(prompts, 3, sampling, 0), reference_rollout.generate(engine, prompts, 3, sampling, 0))


@pytest.mark.cuda
@pytest.mark.parametrize("exact", [False, True], ids=["plain", "exact"])
@pytest.mark.parametrize("sampling", ["plain", "top-k-top-p"])
def test_cuda_graphs_replay_what_eager_steps_compute(exact, sampling):
    """On a GPU each batch size's decode step is captured once and replayed: the same tokens, μ, supports and
    recorded distributions as running every step eagerly, over calls whose rows finish (several batch sizes)
    and a second call that replays the first's graphs."""
    model = load_model("builtin", kernels.numerics())
    tok = load_tokenizer(resolve_model_dir("builtin"))
    numerics = kernels.numerics("cuda", exact=exact)
    engines = []
    for graphs in (True, False):
        engine = RolloutEngine(model.config, "bf16", tok.eos_ids, tok.pad_id, numerics)
        engine.use_graphs = graphs
        engine.weights.load(export_state(model), version=0)
        engines.append(engine)
    prompts = random_prompts(24, model.config.vocab_size, seed=6)
    params = SamplingParams(**{**SAMPLINGS[sampling].__dict__, "max_new_tokens": 64})
    for seed in (0, 1):
        captured = engines[0].generate(prompts, 4, params, seed, full_vocab=16)
        assert_same(captured, engines[1].generate(prompts, 4, params, seed, full_vocab=16))
    assert engines[0].graphs_off_reason is None
    assert len(engines[0]._workspace.graphs) >= 2  # the whole batch, and smaller ones as rows finished


@pytest.mark.cuda
def test_varlen_attention_on_cuda_is_the_padded_rows_attention():
    """The trainer's flash attention over variable-length rows gives what attention over padded rows gives, and
    the same gradients (to BF16 round-off)."""
    from parity.engines.kernels import padded_attention, varlen
    from parity.engines.packing import pack

    packed = pack(
        [[3, 4, 5, 6, 7], [8, 9], [3, 4, 5, 6, 7]],
        torch.randint(3, 60, (3, 9), generator=torch.Generator().manual_seed(0)).cuda(),
        (torch.arange(9) < torch.tensor([9, 4, 6])[:, None]).cuda(),
    )
    n = packed.num_tokens
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(n, h, 64, device="cuda", generator=gen).bfloat16().requires_grad_() for h in (8, 2, 2))
    if not varlen.supported(q, None, None, None):
        pytest.skip("this PyTorch has no variable-length attention")
    g = torch.randn(n, 8, 64, device="cuda", generator=gen).bfloat16()
    ours = varlen.packed_attention(q, k, v, packed, None, None)
    (ours.float() * g).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    padded = padded_attention(kernels.numerics("cuda"), q, k, v, packed, None, None, None)
    (padded.float() * g).sum().backward()
    assert (ours.float() - padded.float()).abs().max() < 2e-2
    assert all((a.float() - t.grad.float()).abs().max() < 5e-2 for a, t in zip(grads, (q, k, v)))


def test_reordered_weights_sample_what_the_previous_engine_sampled(monkeypatch):
    """Plain FP32 multiplies by oneDNN-reordered copies of the engine's weights (`Numerics.fast_matrix`, made
    here for every weight whatever its size): the loop, cache and draw give what the previous engine gave on
    them, a weight sync remakes the copies, and μ stays the trainer's π to FP32 round-off."""
    from parity.engines.kernels import ops

    monkeypatch.setattr(ops, "FAST_MIN_ELEMENTS", 0)
    model, engine = engine_for("builtin", "fp32", exact=False)
    assert engine.weights.lm_head_fast is not None and all(layer.fast for layer in engine.weights.layers)
    prompts = random_prompts(10, model.config.vocab_size, seed=2)
    for sampling in (PLAIN, SAMPLINGS["top-k-top-p"]):
        new = engine.generate(prompts, 4, sampling, seed=5, full_vocab=20)
        assert_same(new, reference_rollout.generate(engine, prompts, 4, sampling, seed=5, full_vocab=20))
        pi = trainer_logprobs(model, new, "fp32", micro_batch=40)
        torch.testing.assert_close(pi[new.response_mask], new.rollout_logprobs[new.response_mask], rtol=0, atol=1e-4)
    before = engine.weights.lm_head_fast
    engine.weights.load({n: t * 0.5 for n, t in engine.weights.named_weights().items()}, engine.weights.version + 1)
    assert engine.weights.lm_head_fast is not before


def test_a_decode_steps_query_and_key_heads_are_a_view_of_the_fused_projection():
    """The query and key heads go to RoPE and the cache as one tensor: for the fused projection's output of a
    decode step (one token, whose dimension `view` gives Q and K different strides) that is a view, no copy;
    for heads computed apart (a q/k norm's outputs), a copy. Either way the values of `cat`."""
    from parity.engines.models.decoder import heads_together

    _, engine = engine_for("builtin", "fp32", exact=False)
    cfg = engine.config
    for tokens in (1, 5):
        x = torch.randn(3, tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(tokens))
        q, k, _ = engine.weights.layers[0].attention_inputs(x)
        together = heads_together(q, k)
        assert together.data_ptr() == q.data_ptr(), f"{tokens} token(s): copied"
        assert torch.equal(together, torch.cat([q, k], dim=-2))
    apart = heads_together(q.clone(), k.clone())
    assert apart.data_ptr() != q.data_ptr() and torch.equal(apart, torch.cat([q, k], dim=-2))
