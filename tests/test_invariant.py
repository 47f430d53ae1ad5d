"""The batch-invariant kernels of exact mode on CUDA (`engines/kernels/invariant.py`).

On a GPU they run as compiled; without one, in Triton's CPU interpreter (conftest sets
TRITON_INTERPRET), which checks their indexing, masking and arithmetic and the invariances below,
though not the GPU's instruction choice (`benchmarks/gpu.py --exact` does that on a GPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from parity.engines import kernels  # noqa: E402
from parity.engines.kernels import invariant  # noqa: E402
from parity.engines.models import (  # noqa: E402
    BUILTIN_DIR,  # noqa: E402
    export_state,
    load_model,
)
from parity.engines.rollout import RolloutEngine  # noqa: E402
from parity.engines.tokenizer import load_tokenizer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_linear_is_the_rounded_fp32_product_and_a_row_does_not_depend_on_its_batch(dtype):
    x, w, b = randn(70, 96, dtype=dtype), randn(130, 96, dtype=dtype, seed=1), randn(130, dtype=dtype, seed=2)
    out = invariant.linear(x, w, b)
    exact = (x.double() @ w.double().T + b.double()).to(dtype)
    # FP32 sums in another order than float64's: the rounded result is off by at most one unit in the last place.
    assert torch.allclose(out.double(), exact.double(), rtol=2 * torch.finfo(dtype).eps, atol=1e-5)
    for rows in (slice(5, 6), slice(0, 33), slice(64, 70)):
        assert torch.equal(invariant.linear(x[rows], w, b), out[rows])
    # columns too: a fused projection's slice gives its member's bits
    assert torch.equal(invariant.linear(x, w[40:90], b[40:90]), out[:, 40:90])


def test_mean_square_does_not_depend_on_its_batch():
    h = randn(9, 1100)
    ms = invariant.mean_square(h)
    assert torch.allclose(ms, h.pow(2).mean(-1, keepdim=True), rtol=1e-6)
    assert torch.equal(invariant.mean_square(h[3:5]), ms[3:5])


def test_gradients_are_those_of_the_plain_ops():
    x, w, b = (randn(7, 16), randn(5, 16, seed=1), randn(5, seed=2))
    for t in (x, w, b):
        t.requires_grad_()
    invariant.linear(x, w, b).square().sum().backward()
    ours = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    F.linear(x, w, b).square().sum().backward()
    assert all(torch.allclose(a, t.grad, atol=1e-5) for a, t in zip(ours, (x, w, b)))
    h = randn(3, 10).requires_grad_()
    invariant.mean_square(h).sum().backward()
    assert torch.allclose(h.grad, 2 * h.detach() / 10)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16"] if DEVICE == "cpu" else ["fp32", "bf16", "fp16"])
def test_the_two_engines_agree_bit_for_bit_through_the_invariant_kernels(precision):
    """The built-in model with every matmul, softmax and norm statistic through these kernels in both
    engines (as exact mode runs on CUDA): μ = π_old for every token, top-k/top-p sampling, rows
    finishing and compacted, scored in micro-batches of another size. (The interpreter takes a minute
    for one precision; a GPU runs all three.)"""
    from test_exact import FILTERED, random_prompts, trainer_logprobs

    model = load_model("builtin").to(DEVICE)
    model.numerics = kernels.Numerics(torch.device(DEVICE), exact=True, invariant=True)
    tok = load_tokenizer(BUILTIN_DIR)
    engine = RolloutEngine(model.config, precision, tok.eos_ids, tok.pad_id, model.numerics)
    engine.load_weights(export_state(model), version=0)
    batch = engine.generate(random_prompts(5, model.config.vocab_size, seed=4), 3, FILTERED, seed=0)
    assert batch.response_lengths.min() < batch.response_lengths.max()
    pi = trainer_logprobs(model, batch, precision, micro_batch=7)
    assert torch.equal(pi[batch.response_mask], batch.rollout_logprobs[batch.response_mask])
