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

from kernel_inputs import DEVICE, DTYPES, randn  # noqa: E402
from parity.engines import kernels  # noqa: E402
from parity.engines.kernels import invariant  # noqa: E402


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


def _rows_case(dtype, heads: int, kv_heads: int, seed: int):
    """A packed stream of two prompts (the first read by two rows) and three responses: queries in row order,
    the key table, and each query's keys written out, for a float64 reference."""
    from parity.engines.kernels import attention

    d = 32
    prompt_a, prompt_b, responses = 7, 5, [9, 4, 11]
    stream = prompt_a + prompt_b + sum(responses)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(stream, h, d, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    start = prompt_a + prompt_b
    keys = []
    for r, prompt in zip(responses, (range(prompt_a), range(prompt_a), range(prompt_a, start))):
        keys.append(list(prompt) + list(range(start, start + r)))
        start += r
    owned = [keys[0], keys[1][prompt_a:], keys[2]]  # the second row reads the first row's prompt
    counts, pos0 = [len(o) for o in owned], [0, prompt_a, 0]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    q_first = [0, counts[0], counts[0] + counts[1]]
    kv_start = [0, len(keys[0]), len(keys[0]) + len(keys[1])]
    tile_row, tile_f0 = attention.tiles(i32(counts), heads // kv_heads)
    kv_order = i32([s for row in keys for s in row])
    rows = attention.Rows(i32(q_first), i32(counts), i32(pos0), i32(kv_start), tile_row, tile_f0, kv_order)
    order = torch.tensor([s for row in owned for s in row])
    return q[order].contiguous().to(DEVICE), k.to(DEVICE), v.to(DEVICE), rows, keys, owned, pos0


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("window, softcap", [(None, None), (5, None), (None, 3.0)], ids=["causal", "window", "softcap"])
@pytest.mark.parametrize("heads", [6, 36], ids=["3-per-kv-head", "18-per-kv-head"])
def test_rows_attention_is_attention_and_a_query_gets_the_same_bits_alone(dtype, window, softcap, heads):
    """The kernel over a packed stream (queries in tiles of several positions and heads, keys through a table)
    equals float64 attention; and each query computed alone, its keys read directly from a cache row as the
    decode step reads them, gives the same bits."""
    from parity.engines.kernels import attention

    q, k, v, rows, keys, owned, pos0 = _rows_case(dtype, heads, 2, seed=1)
    scale = 32**-0.5
    out = attention.rows_attention(q, k, v, rows, scale, window, softcap)
    expected, decode_q, positions, starts = [], [], [], []
    slots = 32
    cache_k = torch.zeros(3 * slots, 2, 32, dtype=dtype, device=DEVICE)
    cache_v = torch.zeros_like(cache_k)
    j = 0
    for r, (row_keys, row_queries) in enumerate(zip(keys, owned)):
        index = torch.tensor(row_keys, device=DEVICE)
        cache_k[r * slots : r * slots + len(row_keys)] = k[index]
        cache_v[r * slots : r * slots + len(row_keys)] = v[index]
        kk, vv = (t[index].double().repeat_interleave(heads // 2, 1) for t in (k, v))
        for i in range(len(row_queries)):
            p = pos0[r] + i
            s = torch.einsum("hd,lhd->hl", q[j].double(), kk[: p + 1]) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            if window is not None:
                s[:, : max(0, p - window + 1)] = float("-inf")
            expected.append(torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vv[: p + 1]))
            decode_q.append(q[j])
            positions.append(p)
            starts.append(r * slots)
            j += 1
    expected = torch.stack(expected)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    assert ((out.double() - expected).norm() / expected.norm()) < tolerance
    alone = attention.one_query_per_row(
        torch.tensor(positions, device=DEVICE), torch.tensor(starts, device=DEVICE), heads // 2
    )
    decoded = attention.rows_attention(torch.stack(decode_q), cache_k, cache_v, alone, scale, window, softcap)
    assert torch.equal(decoded, out)


def test_exact_packed_attention_has_the_gradients_of_plain_attention():
    from parity.engines.packing import pack

    responses = torch.tensor([[9, 10, 11, 12], [13, 14, 0, 0]], device=DEVICE)
    packed = pack([[3, 4, 5], [7, 8]], responses, torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], device=DEVICE).bool())
    n = packed.num_tokens
    q, k, v = (randn(n, h, 16, seed=s).requires_grad_() for s, h in ((1, 4), (2, 2), (3, 2)))
    g = randn(n, 4, 16, seed=4)
    exact = kernels.TritonExact(torch.device(DEVICE))
    plain = kernels.numerics(DEVICE)
    (exact.packed_attention(q, k, v, packed) * g).sum().backward()
    ours = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    reference = plain.packed_attention(q, k, v, packed)
    assert torch.allclose(exact.packed_attention(q, k, v, packed), reference, atol=1e-5)
    (reference * g).sum().backward()
    assert all(torch.allclose(a, t.grad, atol=1e-5) for a, t in zip(ours, (q, k, v)))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_fused_rope_and_cache_write_give_the_eager_bits(dtype):
    """The decode step's fused kernel ropes as `apply_rope` does, op by op, and writes each row's key and value
    to its slot. (Triton's interpreter converts FP32 to BF16 by its own rounding: BF16 is checked on a GPU.)"""
    from parity.engines.kernels import apply_rope, fused

    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the interpreter's BF16 conversion is not round-to-nearest-even")
    n, heads, kv_heads, d = 5, 6, 2, 32
    qkv = randn(n, 1, (heads + 2 * kv_heads) * d, dtype=dtype)
    qk, v = qkv.split([(heads + kv_heads) * d, kv_heads * d], -1)
    qk = qk.view(n, 1, heads + kv_heads, d)
    cos, sin = randn(n, d, dtype=dtype, seed=1), randn(n, d, dtype=dtype, seed=2)
    keys = torch.zeros(20, kv_heads, d, dtype=dtype, device=DEVICE)
    values = torch.zeros_like(keys)
    at = torch.tensor([3, 7, 0, 19, 11], device=DEVICE)
    q = fused.rope_store(qk[:, 0], v[:, 0], cos, sin, keys, values, at, heads)
    expected = apply_rope(qk.transpose(1, 2), cos[:, None, None], sin[:, None, None])[:, :, 0]
    assert torch.equal(q, expected[:, :heads]) and torch.equal(keys[at], expected[:, heads:])
    assert torch.equal(values[at], v[:, 0].view(n, kv_heads, d))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_the_trainers_fused_rope_gives_the_eager_bits_forward_and_backward(dtype):
    """The trainer's RoPE in one pass each way (`fused.rope`, what `Numerics.rope` runs on CUDA): the bits of
    `apply_rope`'s eager ops and of their autograd, for the query heads of a projection's output (a strided
    view) as for contiguous heads."""
    from parity.engines.kernels import apply_rope, fused

    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the interpreter's BF16 conversion is not round-to-nearest-even")
    n, heads, d = 7, 3, 32
    projection = randn(n, (heads + 1) * d, dtype=dtype)
    cos, sin = randn(n, 1, d, dtype=dtype, seed=1), randn(n, 1, d, dtype=dtype, seed=2)
    grad = randn(n, heads, d, dtype=dtype, seed=3)
    for x in (projection[:, : heads * d].view(n, heads, d), projection[:, d:].reshape(n, heads, d).clone()):
        ours, eager = x.detach().requires_grad_(), x.detach().requires_grad_()
        out = fused.rope(ours, cos, sin)
        expected = apply_rope(eager, cos, sin)
        assert torch.equal(out, expected)
        out.backward(grad)
        expected.backward(grad)
        assert torch.equal(ours.grad, eager.grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_fused_rms_norm_is_the_norm_and_a_row_does_not_depend_on_its_batch(dtype, gemma):
    """One pass per row: the eager norm's value to a unit in the last place (another sum order inside), and a
    row's bits whatever rows share the call; rows longer than one block are read in two passes."""
    from parity.engines.kernels import fused

    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the interpreter's BF16 conversion is not round-to-nearest-even")
    x, w = randn(9, 1100, dtype=dtype), randn(1100, dtype=dtype, seed=1)
    out = fused.rms_norm(x, w, 1e-6, gemma)
    eager = kernels.Numerics(x.device).rms_norm(x, w, 1e-6, gemma)
    assert torch.allclose(out.float(), eager.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
    assert torch.equal(fused.rms_norm(x[3:5], w, 1e-6, gemma), out[3:5])
    # a strided view (the query heads of a projection's output) gives the contiguous rows' bits
    wide = torch.cat([x, x], -1)
    assert torch.equal(fused.rms_norm(wide[:, :1100], w, 1e-6, gemma), out)
    if not gemma:  # the rollout engine's residual addition and norm in one pass: the sum's bits, F.rms_norm's value
        delta = randn(9, 1100, dtype=dtype, seed=2)
        summed, normed = fused.norm_rows(x, w, 1e-6, delta=delta, one_rounding=True)
        assert torch.equal(summed, x + delta)
        expected = F.rms_norm(x + delta, (1100,), w, 1e-6)
        assert torch.allclose(normed.float(), expected.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_fused_silu_mul_is_the_two_ops_and_reads_the_halves_of_one_projection(dtype):
    from parity.engines.kernels import fused

    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the interpreter's BF16 conversion is not round-to-nearest-even")
    gate_up = randn(6, 1, 2 * 1500, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    out = fused.silu_mul(gate, up)
    eager = F.silu(gate) * up
    assert out.shape == gate.shape
    assert torch.allclose(out.float(), eager.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
    assert torch.equal(fused.silu_mul(gate.contiguous()[2:4], up.contiguous()[2:4]), out[2:4])


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_the_fused_norm_and_activation_have_the_eager_gradients(gemma, monkeypatch):
    """Their backward kernels give the eager ops' gradients (x, the FP32 weight; gate and up), over rows split
    among the backward's programs (3 rows each here, the last program's run passing the end)."""
    from parity.engines.kernels import fused

    monkeypatch.setattr(fused, "BACKWARD_PROGRAMS", 32)
    fused_rows, eager = kernels.TritonExact(torch.device(DEVICE)), kernels.Numerics(torch.device("cpu"))
    x, w = randn(70, 40).requires_grad_(), (randn(40, seed=1) * 0.1 + (0 if gemma else 1)).requires_grad_()
    g = randn(70, 40, seed=4)
    grads = []
    for numerics in (fused_rows, eager):
        x.grad = w.grad = None
        (numerics.rms_norm(x, w, 1e-5, gemma) * g).sum().backward()
        grads.append((x.grad.clone(), w.grad.clone()))
    assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in zip(*grads))
    gate, up = randn(5, 30, seed=2).requires_grad_(), randn(5, 30, seed=3).requires_grad_()
    (fused_rows.gated_activation("silu", gate, up) * g[:5, :30]).sum().backward()
    ours = [gate.grad.clone(), up.grad.clone()]
    gate.grad = up.grad = None
    (F.silu(gate) * up * g[:5, :30]).sum().backward()
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, (gate.grad, up.grad)))
