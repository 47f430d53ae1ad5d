"""The LM head a chunk of rows at a time (`trainer.chunked_head`, `ChunkedHeadLogProbs`): the log-probabilities
and every gradient of the whole-head pass, exact mode's bits, and no [tokens, vocabulary] tensor kept. The head's
log-probabilities and gradient in one Triton pass per row (`kernels/head.py`, plain numerics on CUDA; here in
Triton's interpreter): PyTorch's values, whole or chunked."""

from __future__ import annotations

import pytest
import torch
from tests import architectures
from tests.architectures import save_random_model

from parity.engines import kernels
from parity.engines import trainer as trainer_mod
from parity.engines.models.io import load_model

PROMPTS = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]


def _batch(vocab: int, gen: torch.Generator):
    responses = torch.randint(1, vocab, (3, 7), generator=gen)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 5:] = False
    # Each token's support: itself and up to 5 others (top-k/top-p's), padded with -1.
    offsets = torch.stack([torch.randperm(vocab - 1, generator=gen)[:5] + 1 for _ in range(21)]).view(3, 7, 5)
    support = torch.cat([responses[..., None], (responses[..., None] + offsets) % vocab], -1)
    padding = torch.arange(6) > (torch.arange(21) % 6).view(3, 7, 1)
    return responses, mask, support.masked_fill(padding, -1)


def _pass(model_dir, chunked: bool, dtype, exact: bool, filtered: bool, temperature: float, numerics=None):
    """(log-probs [3, 7], every parameter's gradient, the saved tensors' shapes) of one pass and its backward."""
    model = load_model(model_dir, numerics or kernels.numerics(exact=exact))
    model.chunked_head = chunked
    vocab = model.config.vocab_size
    responses, mask, support = _batch(vocab, torch.Generator().manual_seed(0))
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        _, logprobs = trainer_mod.sequence_logprobs(
            model, PROMPTS, responses, mask, support if filtered else None, temperature, dtype
        )
    weights = torch.linspace(-1, 1, logprobs.numel()).view_as(logprobs)
    (logprobs * weights).sum().backward()
    return logprobs.detach(), {n: p.grad for n, p in model.named_parameters()}, shapes


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])  # a tied head; a soft-capped one
@pytest.mark.parametrize(
    "dtype, exact, filtered",
    [(torch.float32, False, False), (torch.float32, True, True), (torch.bfloat16, False, True)],
    ids=["fp32", "fp32-exact-filtered", "bf16-filtered"],
)
def test_the_chunked_head_gives_the_whole_heads_logprobs_and_gradients(
    tmp_path, monkeypatch, arch, dtype, exact, filtered
):
    """Chunks of 3 rows of 19 scored tokens: log-probs equal (exact mode: bit for bit), every gradient close, and
    no tensor with a vocabulary-wide last dimension is kept for the backward, where the whole head keeps one."""
    monkeypatch.setattr(trainer_mod, "LOGPROB_CHUNK_ELEMENTS", {"cpu": 3 * 96})
    monkeypatch.setattr(trainer_mod, "CHUNKED_HEAD_ELEMENTS", {"cpu": 3 * 96})
    monkeypatch.setattr(architectures, "COMMON", {**architectures.COMMON, "vocab_size": 96})  # apart from hidden
    model_dir = save_random_model(tmp_path / arch, arch)
    whole, whole_grads, whole_saved = _pass(model_dir, False, dtype, exact, filtered, 0.7)
    chunked, chunked_grads, chunked_saved = _pass(model_dir, True, dtype, exact, filtered, 0.7)
    vocab = load_model(model_dir, kernels.numerics()).config.vocab_size
    assert any(shape[-1:] == (vocab,) for shape in whole_saved)
    assert not any(shape[-1:] == (vocab,) for shape in chunked_saved)
    if exact:
        assert torch.equal(chunked, whole)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0.05, "atol": 0.05}
    for name, grad in whole_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, **tolerance, msg=name)


def test_auto_chunks_only_a_head_larger_than_the_limit(tmp_path, monkeypatch):
    from parity.engines.models import modules

    model = load_model(save_random_model(tmp_path / "m", "qwen2"), kernels.numerics())
    vocab = model.config.vocab_size
    monkeypatch.setattr(modules, "CHUNKED_HEAD_BYTES", 100 * vocab * 4)
    assert model.chunked_head == "auto"
    assert not model.chunks_head(100, torch.float32) and model.chunks_head(101, torch.float32)
    assert not model.chunks_head(200, torch.bfloat16) and model.chunks_head(201, torch.bfloat16)
    model.chunked_head = False
    assert not model.chunks_head(10**6, torch.float32)


def test_a_run_trains_and_records_the_full_vocabulary_with_a_chunked_head(tmp_path):
    """`trainer.chunked_head=always` through `parity train`: the training pass fills the full-vocabulary record
    from the chunked pass (exact mode: the same bits as the rollout engine's, so every full_vocab/ figure is 0),
    and a misspelt mode is refused in one line naming the key."""
    from tests.conftest import metrics

    from parity.cli import main

    run = tmp_path / "run"
    common = ["train", "steps=2", "prompts_per_step=2", "rollout.group_size=2", "tensorboard=false"]
    assert main([*common, f"run_dir={run}", "exact=true", "trainer.chunked_head=always"]) == 0
    rows = metrics(run)
    assert len(rows) == 2
    assert all(row["full_vocab/positions"] > 0 and row["full_vocab/max_abs_log_ratio"] == 0.0 for row in rows)
    assert main([*common, f"run_dir={tmp_path / 'bad'}", "trainer.chunked_head=on"]) == 2
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_exact_mode_on_cuda_keeps_the_whole_heads_bits(dtype, monkeypatch):
    """CUDA's exact numerics (`TritonExact`, here in Triton's interpreter): the batch-invariant matmul gives each
    chunk's rows the bits of the whole head, so the chunked log-probabilities are the whole head's, bit for bit."""
    pytest.importorskip("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    numerics = kernels.TritonExact(device)
    monkeypatch.setattr(trainer_mod, "CHUNKED_HEAD_ELEMENTS", {device.type: 5 * 96})
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(19, 32, generator=gen).to(device, dtype)
    weight = (torch.randn(96, 32, generator=gen) / 4).to(device, dtype)
    tokens = torch.randint(0, 96, (19,), generator=gen).to(device)
    whole = trainer_mod.token_logprobs(numerics.linear(hidden, weight), tokens, None, 0.8, 5.0, numerics)
    chunked = trainer_mod.ChunkedHeadLogProbs.apply(hidden, weight, tokens, None, 0.8, 5.0, numerics)
    assert torch.equal(chunked, whole)


class FusedHead(kernels.Numerics):
    """Plain numerics that take the fused head on the CPU, as they do on CUDA (Triton's interpreter runs it)."""

    def fused_head(self, head, support) -> bool:
        return support is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("temperature, cap", [(1.0, None), (0.7, None), (1.3, 5.0)], ids=["t1", "t0.7", "capped"])
def test_the_fused_head_gives_pytorchs_logprobs_and_gradient(dtype, temperature, cap):
    """Rows of 3,000 entries (three blocks, the last partial): log p(token) and the log-normaliser to FP32
    round-off, and the gradient, in the head's dtype, to one rounding of PyTorch's FP32 one, written apart or
    into the head itself. On a GPU (gpu_probe.py --tests) compiled, here in Triton's interpreter."""
    pytest.importorskip("triton")
    from parity.engines.kernels import head as fused

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    plain = kernels.Numerics(device)  # PyTorch's ops, whatever the device
    plain.fused_head = lambda head, support: False
    head = (torch.randn(5, 3000, generator=gen) * 4).to(device, dtype)
    tokens = torch.randint(0, 3000, (5,), generator=gen).to(device)
    grad = torch.randn(5, generator=gen).to(device)
    picked, lse = fused.logprobs(head, tokens, temperature, cap)
    expected_picked, expected_lse = plain.token_logprobs(trainer_mod._scaled(head, temperature, cap), tokens, None)
    torch.testing.assert_close(picked, expected_picked, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-6, atol=1e-5)
    expected = torch.empty(head.shape, device=device)
    trainer_mod._head_gradient(head, tokens, lse, grad, None, temperature, cap, plain, expected)
    apart = fused.gradient(head, tokens, lse, grad, temperature, cap, torch.empty_like(head))
    in_place = fused.gradient(head.clone(), tokens, lse, grad, temperature, cap, head.clone())
    # 16-bit: one rounding of PyTorch's FP32 gradient; FP32: the exponentials' round-off
    ulp = torch.finfo(dtype).eps
    tolerance = {"rtol": 2e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": ulp, "atol": ulp * 1e-3}
    for got in (apart, in_place):
        torch.testing.assert_close(got.float(), expected.to(dtype).float(), **tolerance)
    written = head.clone()
    fused.gradient(written, tokens, lse, grad, temperature, cap, written)
    assert torch.equal(written, apart)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels on CPU tensors, in Triton's interpreter")
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_the_trainer_takes_the_fused_head_where_the_numerics_say_so(tmp_path, monkeypatch, chunked):
    """Through `sequence_logprobs` on a soft-capped model, whole head and chunked: with the fused head the
    log-probabilities and every gradient are PyTorch's to round-off, the kernels run (the whole head's rows in one
    call each way), and a top-k/top-p support keeps PyTorch's path. Exact mode never takes it (its
    log-normaliser is the rollout engine's)."""
    pytest.importorskip("triton")
    from parity.engines.kernels import head as fused

    monkeypatch.setattr(trainer_mod, "LOGPROB_CHUNK_ELEMENTS", {"cpu": 3 * 96})
    monkeypatch.setattr(trainer_mod, "CHUNKED_HEAD_ELEMENTS", {"cpu": 3 * 96})
    monkeypatch.setattr(architectures, "COMMON", {**architectures.COMMON, "vocab_size": 96})
    model_dir = save_random_model(tmp_path / "gemma2", "gemma2")
    calls = []
    for name in ("logprobs", "gradient"):
        original = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, original=original, name=name: calls.append(name) or original(*a))
    expected, expected_grads, _ = _pass(model_dir, chunked, torch.float32, False, False, 0.7)
    assert not calls
    got, grads, _ = _pass(model_dir, chunked, torch.float32, False, False, 0.7, FusedHead(torch.device("cpu")))
    assert {"logprobs", "gradient"} <= set(calls)
    if not chunked:  # the whole head's rows in one call each way: no FP32 copy of them to bound
        assert calls.count("logprobs") == calls.count("gradient") == 1
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    calls.clear()
    _pass(model_dir, chunked, torch.float32, False, True, 0.7, FusedHead(torch.device("cpu")))
    assert not calls
    assert not kernels.TritonExact(torch.device("cpu")).fused_head(torch.zeros(2, 3), None)
