"""The rollout engine and the trainer: μ against a reference, support records, weight sync."""

from __future__ import annotations

import contextlib

import pytest
import torch

from parity.engines import kernels
from parity.engines import trainer as trainer_mod
from parity.engines.kernels import cpu
from parity.engines.models.io import load_model
from parity.engines.rollout import RolloutEngine
from parity.engines.sampling import SamplingParams, filter_logits
from parity.engines.tokenizer import load_tokenizer
from parity.engines.trainer import OptimConfig, Trainer
from parity.rl.diagnostics import mismatch_metrics

PROMPTS = ["12+34=", "7+8=", "123+4567=", "5+5="]


def _setup(path, precision="fp32"):
    tok = load_tokenizer(path)
    model = load_model(path, kernels.numerics())
    trainer = Trainer(model, precision, OptimConfig(lr=1e-3))
    engine = RolloutEngine(model.config, precision, tok.eos_ids, tok.pad_id, kernels.numerics())
    engine.weights.load(*trainer.export_weights())
    return tok, trainer, engine


def _reference_logits(path, prompt_ids, response_ids, n):
    """FP32 logits from `transformers` for the n response tokens of one unpadded sequence."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids + response_ids[:n]])
    with torch.no_grad():
        logits = ref(ids).logits[0]
    return logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + n]


def test_mu_equals_reference_fp32(llama_dir):
    tok, _, engine = _setup(llama_dir)
    sampling = SamplingParams(temperature=0.7, max_new_tokens=24)
    batch = engine.generate([tok.encode(p) for p in PROMPTS], 3, sampling, seed=0)
    for row in (0, 5, 11):
        n = int(batch.response_mask[row].sum())
        resp = batch.response_ids[row, :n].tolist()
        logits = _reference_logits(llama_dir, batch.prompt_ids[row], resp, n)
        ref_mu = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
        assert torch.allclose(batch.rollout_logprobs[row, :n], ref_mu, atol=1e-5), row


def test_support_recorded_for_top_k_and_top_p(llama_dir):
    tok, trainer, engine = _setup(llama_dir)
    for sampling in (SamplingParams(top_k=5, max_new_tokens=16), SamplingParams(top_p=0.6, max_new_tokens=16)):
        batch = engine.generate([tok.encode(p) for p in PROMPTS[:2]], 2, sampling, seed=1)
        assert batch.support is not None
        for row in range(batch.response_ids.shape[0]):
            n = int(batch.response_mask[row].sum())
            resp = batch.response_ids[row, :n].tolist()
            logits = _reference_logits(llama_dir, batch.prompt_ids[row], resp, n)
            for t in range(n):
                kept = set(torch.isfinite(filter_logits(logits[t : t + 1], sampling)[0]).nonzero().flatten().tolist())
                recorded = {i for i in batch.support[row, t].tolist() if i >= 0}
                assert recorded == kept, (row, t)
                assert resp[t] in recorded
            # μ is normalised over the support: the sampled token's mass is relative to the kept mass.
            probs = torch.softmax(logits, -1)
            for t in range(n):
                ids = [i for i in batch.support[row, t].tolist() if i >= 0]
                expected = torch.log(probs[t, resp[t]] / probs[t, ids].sum())
                assert abs(float(batch.rollout_logprobs[row, t]) - float(expected)) < 1e-5
        # The trainer scores on the same support: π matches μ at FP32 round-off.
        with torch.no_grad():
            pi = trainer.logprobs(batch.prompt_ids, batch.response_ids, batch.response_mask, batch.support)
        assert (pi - batch.rollout_logprobs).abs().max() < 1e-4
        assert sampling.top_k == 0 or (batch.support >= 0).sum(-1).max() <= sampling.top_k


def test_generation_is_seeded_and_stops_at_eos(llama_dir):
    tok, _, engine = _setup(llama_dir)
    prompts = [tok.encode(p) for p in PROMPTS]
    sampling = SamplingParams(max_new_tokens=40)
    a = engine.generate(prompts, 4, sampling, seed=3)
    b = engine.generate(prompts, 4, sampling, seed=3)
    c = engine.generate(prompts, 4, sampling, seed=4)
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids, c.response_ids)
    assert a.response_ids.shape[0] == 16 and a.group_index.tolist() == [i // 4 for i in range(16)]
    for row in range(16):
        n = int(a.response_mask[row].sum())
        ended = a.response_ids[row, n - 1] == tok.eos_id
        assert bool(ended) != bool(a.truncated[row])
        assert (a.response_ids[row, : n - 1] != tok.eos_id).all()  # nothing sampled after EOS
        assert (a.response_ids[row, n:] == tok.pad_id).all()


def test_a_workspace_is_allocated_once_per_shape_of_call(llama_dir):
    """Calls of one shape reuse the KV cache and buffers of the first (nothing of an earlier call leaks:
    a fresh engine samples the same), and a call of another shape gets its own."""
    tok, _, engine = _setup(llama_dir)
    prompts = [tok.encode(p) for p in PROMPTS]
    sampling = SamplingParams(max_new_tokens=40)
    engine.generate(prompts, 4, sampling, seed=1)
    cache = engine._workspace.cache.k.data_ptr()
    again = engine.generate(prompts[::-1], 4, sampling, seed=2)
    assert engine._workspace.cache.k.data_ptr() == cache
    _, _, fresh = _setup(llama_dir)
    expected = fresh.generate(prompts[::-1], 4, sampling, seed=2)
    assert torch.equal(again.response_ids, expected.response_ids)
    assert torch.equal(again.rollout_logprobs, expected.rollout_logprobs)
    engine.generate(prompts, 5, sampling, seed=1)
    assert engine._workspace.cache.k.data_ptr() != cache


def test_decode_batch_shrinks_in_row_buckets(llama_dir, monkeypatch):
    """Dropping finished rows keeps the decode batch at multiples of ROW_BUCKET (topped
    up with finished rows), and the finished rows' outputs stay padding."""
    import parity.engines.rollout

    tok, _, engine = _setup(llama_dir)
    sizes = []
    prefill, step = engine.prefill, engine.decode_step
    monkeypatch.setattr(engine, "prefill", lambda prompts, *a: sizes.append(len(prompts)) or prefill(prompts, *a))
    monkeypatch.setattr(engine, "decode_step", lambda tokens, *a: sizes.append(len(tokens)) or step(tokens, *a))
    batch = engine.generate([tok.encode(p) for p in PROMPTS], 10, SamplingParams(max_new_tokens=40), seed=2)
    assert sizes[0] == 4 and sizes[1] == 40  # prefill of the prompts, then the whole batch
    assert len(set(sizes[1:])) > 1  # rows were dropped
    assert all(n % parity.engines.rollout.ROW_BUCKET == 0 for n in sizes[2:] if n != 40)
    lengths = batch.response_mask.sum(-1)
    assert ((batch.response_ids == tok.pad_id) | batch.response_mask).all()
    assert (batch.rollout_logprobs[~batch.response_mask] == 0).all() and lengths.min() < lengths.max()


@pytest.mark.parametrize("fixture", ["llama_dir", "qwen2_dir"])
def test_weight_sync_fp32_agrees_to_round_off(fixture, request):
    """After a real optimizer step and export, rollout μ and trainer π agree at FP32."""
    path = request.getfixturevalue(fixture)
    tok, trainer, engine = _setup(path)
    prompts = [tok.encode(p) for p in PROMPTS]
    sampling = SamplingParams(max_new_tokens=24)
    batch = engine.generate(prompts, 2, sampling, seed=0)
    logp = trainer.logprobs(batch.prompt_ids, batch.response_ids, batch.response_mask)
    trainer.backward(-logp.sum() / batch.num_tokens)
    stats = trainer.step()
    assert not stats.skipped and stats.weight_version == 1
    engine.weights.load(*trainer.export_weights())
    assert engine.weights.version == 1
    batch = engine.generate(prompts, 2, sampling, seed=1)
    assert batch.weight_version == 1
    with torch.no_grad():
        pi = trainer.logprobs(batch.prompt_ids, batch.response_ids, batch.response_mask)
    metrics = mismatch_metrics(pi, batch.rollout_logprobs, batch.response_mask)
    assert metrics["token_abs_log_ratio_max"] < 1e-4
    assert metrics["k3"] < 1e-9


def test_weights_stored_in_rollout_precision(llama_dir):
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        _, trainer, engine = _setup(llama_dir, precision)
        layer = engine.weights.layers[0]
        # Matmul weights are kept in FP32 where the precision's matmuls run the FP32 kernel
        # (`kernels.store_for_engine`).
        held = torch.float32 if dtype in cpu.emulated_dtypes() else dtype
        for weight in (engine.weights.root["embed"], layer.tensors["qkv"], layer.tensors["gate_up"]):
            assert weight.dtype == held and torch.equal(weight, weight.to(dtype).to(held))
        assert layer.tensors["input_layernorm"].dtype == dtype
        assert engine.weights.named_weights()["model.embed_tokens.weight"].dtype == dtype
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_later_sync_fills_the_buffers_of_the_first(llama_dir, precision):
    """The second and later weight syncs copy into the buffers the first built (no new model on the
    device): the same bits as loading those weights into a fresh engine."""
    _, trainer, engine = _setup(llama_dir, precision)
    buffers = {name: t.data_ptr() for name, t in engine.weights.stored_views().items()}
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 1e-2)
    engine.weights.load(*trainer.export_weights())
    assert {name: t.data_ptr() for name, t in engine.weights.stored_views().items()} == buffers
    fresh = RolloutEngine(engine.config, precision, [engine.pad_id], engine.pad_id, kernels.numerics())
    fresh.weights.load(*trainer.export_weights())
    moved, expected = engine.weights.named_weights(), fresh.weights.named_weights()
    assert moved.keys() == expected.keys()
    assert all(torch.equal(moved[name], expected[name]) for name in expected)
    before = engine.weights.named_weights()["model.norm.weight"].clone()
    with torch.no_grad():  # the engine holds copies, not the sender's tensors
        trainer.model.model.norm.weight.add_(1.0)
    assert torch.equal(engine.weights.named_weights()["model.norm.weight"], before)
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        engine.weights.load({**trainer.export_weights()[0], "model.norm.weight": torch.ones(3)}, 2)


def test_sampler_matches_the_distribution():
    from parity.engines.sampling import sample_categorical

    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(20000, 4)
    draws = sample_categorical(probs, torch.rand(20000, 1, generator=torch.Generator().manual_seed(0))).squeeze(-1)
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert freq[1] == 0  # a zero-probability token is never drawn
    assert torch.allclose(freq, probs[0], atol=0.015)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_activation_checkpointing_gives_the_same_gradients(arch, llama_dir, tmp_path):
    """Recomputing each layer in the backward changes memory, not numbers: identical bits."""
    from architectures import save_random_model
    from parity.engines.packing import pack

    path = llama_dir if arch == "llama" else save_random_model(tmp_path / arch, arch)
    grads = []
    for checkpointing in (False, True):
        model = load_model(path, kernels.numerics())
        model.activation_checkpointing = checkpointing
        packed = pack(
            [[3, 4, 5, 6], [7, 8]],
            torch.tensor([[9, 10, 11], [12, 13, 0]]),
            torch.tensor([[1, 1, 1], [1, 1, 0]]).bool(),
        )
        model(packed, torch.bfloat16).logsumexp(-1).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


def _gradients_cast_each_time_and_once(model_dir, dtype: torch.dtype) -> tuple[list[dict], dict]:
    """Two micro-batches' gradients with each weight cast in every forward, then inside `CausalLM.casting_once`
    (each weight cast once for both, a tied head too), and what the scope held at its end."""
    from parity.engines.models.modules import Linear
    from parity.engines.packing import pack

    micro_batches = [
        pack(
            [[3, 4, 5, 6], [7, 8]],
            torch.tensor([[9, 10, 11], [12, 13, 0]]),
            torch.tensor([[1, 1, 1], [1, 1, 0]]).bool(),
        ),
        pack([[5, 6, 7]], torch.tensor([[20, 21, 22, 23]]), torch.ones(1, 4, dtype=torch.bool)),
    ]
    grads, held = [], {}
    for once in (False, True):
        model = load_model(model_dir, kernels.numerics())
        with model.casting_once() if once else contextlib.nullcontext():
            for packed in micro_batches:
                model(packed, dtype).logsumexp(-1).sum().backward()
            if once:
                held = dict(next(m for m in model.modules() if isinstance(m, Linear)).casts)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert all(m.casts is None for m in model.modules() if isinstance(m, Linear))
    return grads, held


def test_weights_cast_once_per_update_give_the_same_gradients(qwen2_dir):
    """BF16: each weight cast once for both micro-batches gives the gradients of casting it in every forward,
    bit for bit, and the casts are made once."""
    from parity.engines.models.modules import Linear

    grads, held = _gradients_cast_each_time_and_once(qwen2_dir, torch.bfloat16)
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name
    model = load_model(qwen2_dir, kernels.numerics())
    assert len(held) == sum(isinstance(m, Linear) for m in model.modules()) + 1  # and the embedding's


def test_an_fp32_update_on_onednn_gives_mkls_gradients(qwen2_dir, monkeypatch):
    """FP32 inside `CausalLM.casting_once`: every linear layer's forward and backward run on oneDNN by the
    weights as stored (`ops.on_onednn`, here for every weight whatever its size; no reordered copies are made),
    and the gradients are those of MKL's matmuls (`F.linear`) to FP32 round-off."""
    from parity.engines.kernels import ops
    from parity.engines.models.modules import Linear

    calls = []
    onednn = ops._fast_linear
    monkeypatch.setattr(ops, "_fast_linear", lambda *args: calls.append(args[1]) or onednn(*args))
    monkeypatch.setattr(ops, "FAST_MIN_ELEMENTS", 0)
    monkeypatch.setattr(ops, "MIN_ROWS", 1)
    on_onednn = _gradients_cast_each_time_and_once(qwen2_dir, torch.float32)[0][1]
    model = load_model(qwen2_dir, kernels.numerics())
    weights = {id(m.weight) for m in model.modules() if isinstance(m, Linear)}
    assert len(calls) >= 2 * 3 * len(weights) and not any(t.is_mkldnn for t in calls)  # 2 micro-batches, 3 products
    monkeypatch.setattr(ops, "on_onednn", lambda weight: False)
    on_mkl = _gradients_cast_each_time_and_once(qwen2_dir, torch.float32)[0][1]
    for name in on_mkl:
        torch.testing.assert_close(on_onednn[name], on_mkl[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature, cap", [(1.0, None), (0.7, None), (0.8, 3.0)])
@pytest.mark.parametrize(
    "support, exact", [(False, False), (True, False), (True, True)], ids=["all", "support", "exact"]
)
@pytest.mark.parametrize("reuse", [False, True], ids=["fresh", "reused-head"])
def test_chunked_head_logprobs_equal_autograds_log_softmax(dtype, temperature, cap, support, exact, reuse, monkeypatch):
    """Over the whole vocabulary or a support (top-k/top-p), in chunks; exact mode's values are the bits of the
    rollout engine's arithmetic (a log-softmax of the whole row, the tokens outside the support at -inf). With
    `reuse_head` the gradient is written into the head's own storage, with the same values."""
    monkeypatch.setattr(trainer_mod, "LOGPROB_CHUNK_ELEMENTS", {"cpu": 64})  # 37 rows of 50: 29 chunks, the last short
    gen = torch.Generator().manual_seed(0)
    head = (torch.randn(37, 50, generator=gen) * 3).to(dtype)
    tokens, g = torch.randint(0, 50, (37,), generator=gen), torch.randn(37, generator=gen)
    kept = None
    if support:  # each row's token and up to 5 others, padded with -1
        offsets = torch.stack([torch.randperm(49, generator=gen)[:5] + 1 for _ in range(37)])
        kept = torch.cat([tokens[:, None], (tokens[:, None] + offsets) % 50], 1)
        kept = kept.masked_fill(torch.arange(6) > torch.arange(37)[:, None] % 6, -1)
    fused = head.clone().requires_grad_()
    numerics = kernels.numerics(exact=exact)
    given = fused * 1 if reuse else fused  # reused: an intermediate, as the LM head's output is
    logprobs = trainer_mod.token_logprobs(given, tokens, kept, temperature, cap, numerics, reuse_head=reuse)
    (logprobs * g).sum().backward()
    if reuse:
        assert not torch.equal(given.detach(), head)  # the storage took the gradient
    plain = head.clone().requires_grad_()
    logits = plain.float() if cap is None else torch.tanh(plain.float() / cap) * cap
    expected = torch.log_softmax(kernels.restrict(logits / temperature, kept), -1).gather(-1, tokens[:, None])[:, 0]
    (expected * g).sum().backward()
    assert logprobs.dtype == torch.float32 and fused.grad.dtype == dtype
    if exact:
        assert torch.equal(logprobs, expected)
    assert (logprobs - expected).abs().max() < 4e-6
    assert (fused.grad.float() - plain.grad.float()).abs().max() < (4e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_refused_without_a_gpu():
    from parity.config import ConfigError
    from parity.rl.train_config import TrainConfig

    with pytest.raises(ConfigError, match="device=cuda: PyTorch sees no CUDA device"):
        TrainConfig(device="cuda").validate()


@pytest.mark.cuda
@pytest.mark.parametrize("arm", ["precision=bf16", "precision=fp16", "precision=fp32", "exact=true"])
def test_train_on_cuda(tmp_path, arm):
    from parity.cli import main

    args = ["train", f"run_dir={tmp_path / 'r'}", "device=cuda", arm, "steps=2", "prompts_per_step=4"]
    assert main([*args, "rollout.group_size=4", "tensorboard=false"]) == 0
