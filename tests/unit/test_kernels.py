"""The numerics layer: the matmul path each precision takes per processor, its agreement with the
native kernel, exact mode under either path, and the record a run keeps of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from parity import config
from parity.config import ConfigError
from parity.engines import kernels
from parity.engines.kernels import cpu, ops
from parity.rl.loop import Run
from parity.rl.train_config import TrainConfig

BF16, FP16 = torch.bfloat16, torch.float16


def features(capability="AVX512", isa=None, bf16_dot=False, fp16_dot=False) -> cpu.CpuFeatures:
    return cpu.CpuFeatures(capability, isa, bf16_dot, fp16_dot)


@pytest.mark.parametrize(
    ("cpu_features", "bf16", "fp16"),
    [
        (features("AVX2"), False, False),  # AVX2-only EPYC / laptop: no 16-bit dot products
        (features(bf16_dot=True), True, False),  # Zen 4 / Cooper Lake: AVX512-BF16
        (features(isa="AVX2", bf16_dot=True), False, False),  # the same, oneDNN held to AVX2
        (features(isa="AVX512_CORE", bf16_dot=True), False, False),
        (features(isa="AVX512_CORE_BF16", bf16_dot=True), True, False),
        (features(isa="ALL", bf16_dot=True), True, False),
        (features(bf16_dot=True, fp16_dot=True), True, True),  # Granite Rapids: AMX-FP16
        (features(isa="AVX512_CORE_BF16", bf16_dot=True, fp16_dot=True), True, False),
    ],
)
def test_kernel_choice_per_processor(cpu_features, bf16, fp16):
    assert cpu_features.native(torch.float32)
    assert cpu_features.native(BF16) is bf16
    assert cpu_features.native(FP16) is fp16


def test_onednn_isa_limit_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    assert cpu.CpuFeatures.read().onednn_isa == "AVX2"
    assert not cpu.CpuFeatures.read().native(BF16)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "avx512_core")  # oneDNN's former name
    assert cpu.CpuFeatures.read().onednn_isa == "AVX512_CORE"


def test_a_process_under_the_avx2_emulation_takes_the_fp32_path():
    """The environment a BF16-less CPU is emulated with turns both 16-bit precisions to the FP32
    kernel, and `describe` (numerics.json) says so."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    code = "import json; from parity.engines import kernels; print(json.dumps(kernels.numerics().describe()))"
    described = json.loads(
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True).stdout
    )
    assert described["cpu_capability"] == "AVX2" and described["onednn_max_cpu_isa"] == "AVX2"
    assert described["matmul_bf16"] == described["matmul_fp16"] == cpu.EMULATED
    assert described["matmul_fp32"] == cpu.NATIVE


@pytest.fixture
def force_path(monkeypatch):
    """Force the 16-bit matmul path: `force_path(emulated=True)` runs BF16 and FP16 on the FP32 kernel."""

    def force(emulated: bool) -> None:
        monkeypatch.setattr(cpu, "emulated_dtypes", lambda: frozenset({BF16, FP16}) if emulated else frozenset())

    return force


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_emulated_and_native_matmuls_agree_within_rounding(dtype, force_path):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(40, 96, generator=g), torch.randn(48, 96, generator=g), torch.randn(48, generator=g)
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    force_path(True)
    emulated = kernels.linear(x, w, b)
    assert torch.equal(emulated, F.linear(x.float(), w.float(), b.float()).to(dtype))  # rounded in, FP32, rounded out
    force_path(False)
    native = kernels.linear(x, w, b)
    assert native.dtype == emulated.dtype == dtype
    # Both accumulate in FP32 and round once; only the order of the sums may differ: one ulp at most.
    ulp = torch.finfo(dtype).eps * native.float().abs().clamp(min=1)
    assert ((emulated.float() - native.float()).abs() <= ulp).all()


def test_per_shape_kernels_only_for_native_bf16(force_path):
    cpu_device = torch.device("cpu")
    force_path(False)
    assert kernels.per_shape_kernels(BF16, cpu_device) and not kernels.per_shape_kernels(FP16, cpu_device)
    force_path(True)
    assert not kernels.per_shape_kernels(BF16, cpu_device)
    assert not kernels.per_shape_kernels(BF16, torch.device("cuda"))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_exact_mode_holds_on_the_emulated_path(precision, force_path):
    """A CPU without 16-bit dot products: the engines still compute the same bits."""
    from engine_pair import FILTERED, engines, random_prompts, trainer_logprobs

    force_path(True)
    model, engine = engines("builtin", precision)
    batch = engine.generate(random_prompts(9, model.config.vocab_size, seed=2), 3, FILTERED, seed=1)
    pi = trainer_logprobs(model, batch, precision, micro_batch=7)
    assert torch.equal(pi[batch.response_mask], batch.rollout_logprobs[batch.response_mask])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_exact_linear_rows_do_not_depend_on_the_batch_and_gradients_are_linears(dtype):
    """Exact mode on the CPU: a row's bits are the same alone and among 200 others; the backward is the
    plain linear's (to round-off: one matmul instead of one per block)."""
    exact = kernels.numerics("cpu", exact=True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 96, generator=gen).to(dtype)
    weight, bias = torch.randn(80, 96, generator=gen), torch.randn(80, generator=gen)
    together = exact.linear(x, weight, bias)
    alone = torch.cat([exact.linear(x[i : i + 1], weight, bias) for i in (0, 63, 64, 199)])
    assert torch.equal(together[[0, 63, 64, 199]], alone)
    assert together.shape == (200, 80) and together._base is None  # the matmul's own tensor, not a view

    x64 = torch.randn(70, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    w64 = torch.randn(5, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    b64 = torch.randn(5, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w, b: exact.linear(a, w, b), (x64, w64, b64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_attention_does_not_depend_on_the_masked_keys_after_a_query(dtype):
    """Exact mode on the CPU: a query's attention over its 167 keys has the same bits in the trainer's causal
    attention over 300 positions and in a decode step over its cache followed by any number of masked keys
    (the furthest row's in the step). MKL splits a sum of more than 192 terms where the term count says, so
    p·v is summed in blocks of `EXACT_KEY_BLOCK` keys."""
    exact = kernels.numerics("cpu", exact=True)
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, d, length, position = 4, 2, 32, 300, 166
    q = torch.randn(1, heads, length, d, generator=gen).to(dtype)
    k, v = (torch.randn(1, kv_heads, length, d, generator=gen).to(dtype) for _ in range(2))
    trainer = exact.attention(q, k, v)[:, :, position : position + 1]

    def decode(keys: int) -> torch.Tensor:
        bias = torch.zeros(1, 1, 1, keys).masked_fill(torch.arange(keys) > position, float("-inf"))
        k_t = k.float().transpose(-1, -2)[..., :keys]
        return exact.decode_attention(q[:, :, position : position + 1], k_t, v.float()[:, :, :keys], bias)

    for keys in [position + 1, 192, 193, 200, 224, 260, length]:
        assert torch.equal(decode(keys), trainer), keys


def test_numerics_is_one_object_per_device_and_mode():
    assert kernels.numerics() is kernels.numerics("cpu", False)
    exact = kernels.numerics("cpu", exact=True)
    assert exact.exact and exact is not kernels.numerics() and exact.device == torch.device("cpu")


def test_device_values_are_checked():
    with pytest.raises(ConfigError, match="device: unknown value 'tpu'; allowed: cpu, cuda"):
        kernels.check_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device=cuda: PyTorch sees no CUDA device"):
            kernels.check_device("cuda")


def test_a_run_records_its_numerics(tmp_path):
    cfg = config.load(TrainConfig, None, [f"run_dir={tmp_path / 'run'}", "steps=1", "exact=true"])
    run = Run.create(cfg, progress=False)
    run.close()
    recorded = json.loads((tmp_path / "run" / "numerics.json").read_text())
    threads = torch.get_num_threads()
    assert recorded == {**kernels.numerics("cpu", True).describe(), "threads": threads, "run_threads": threads}
    assert recorded["exact"] == "true" and recorded["matmul_fp32"] == cpu.NATIVE
    assert run.backend.trainer.model.numerics is run.backend.sampler.engine.numerics is run.numerics


@pytest.mark.cuda
def test_cuda_numerics_accumulate_in_fp32():
    """On CUDA the numerics turn off TF32 and reduced-precision reductions (FP32 accumulation)."""
    n = kernels.numerics("cuda")
    matmul = torch.backends.cuda.matmul
    assert not matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert not matmul.allow_fp16_reduced_precision_reduction and not matmul.allow_bf16_reduced_precision_reduction
    assert n.describe()["gpu"] == torch.cuda.get_device_name()


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_exact_mode_on_cuda(precision):
    """The rollout engine and the trainer compute the same bits on a GPU too."""
    from engine_pair import FILTERED, random_prompts, trainer_logprobs
    from parity.engines.models.io import BUILTIN_DIR, export_state, load_model
    from parity.engines.rollout import RolloutEngine
    from parity.engines.tokenizer import load_tokenizer

    model = load_model("builtin", kernels.numerics("cuda", exact=True))
    tok = load_tokenizer(BUILTIN_DIR)
    engine = RolloutEngine(model.config, precision, tok.eos_ids, tok.pad_id, model.numerics)
    engine.weights.load(export_state(model), version=0)
    batch = engine.generate(random_prompts(24, model.config.vocab_size, seed=4), 4, FILTERED, seed=0)
    pi = trainer_logprobs(model, batch, precision, micro_batch=40)
    assert torch.equal(pi[batch.response_mask], batch.rollout_logprobs[batch.response_mask])


def test_the_choice_can_be_overridden(monkeypatch):
    for value, expected in (("native", frozenset()), ("emulated", frozenset({BF16, FP16}))):
        monkeypatch.setenv(cpu.OVERRIDE_ENV, value)
        cpu.emulated_dtypes.cache_clear()
        assert cpu.emulated_dtypes() == expected
    monkeypatch.setenv(cpu.OVERRIDE_ENV, "fast")
    cpu.emulated_dtypes.cache_clear()
    with pytest.raises(ValueError, match="PARITY_CPU_KERNELS='fast': expected auto, native or emulated"):
        cpu.emulated_dtypes()
    monkeypatch.delenv(cpu.OVERRIDE_ENV)
    cpu.emulated_dtypes.cache_clear()


@pytest.mark.parametrize("out_features", [576, ops.ONEDNN_GRAD_WEIGHT_MAX_ROWS + 16])
def test_fp32_matmuls_on_onednn_give_f_linears_values_and_gradients(out_features, monkeypatch):
    """A large FP32 weight's matmuls go to oneDNN (`ops.on_onednn`), by the weight as stored or by the copy
    `Numerics.fast_matrix` reorders, forward and backward (a vocabulary-sized weight's gradient by MKL), and
    give `F.linear`'s values and gradients to FP32 round-off at any row count; small, 16-bit and exact-mode
    weights get no copy."""
    numerics = kernels.numerics()
    calls = []
    onednn = ops._fast_linear
    monkeypatch.setattr(ops, "_fast_linear", lambda *args: calls.append(args[1].shape) or onednn(*args))
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, 576, generator=gen)  # SmolLM2's Q and O projections: 2**18 elements
    fast = numerics.fast_matrix(weight)
    assert fast is not None and fast.is_mkldnn
    for rows, copy in ((1, fast), (16, None), (300, fast), (300, None)):
        x = torch.randn(rows, 576, generator=gen)
        grad = torch.randn(rows, out_features, generator=gen)
        ours, theirs = ((x.clone().requires_grad_(), weight.clone().requires_grad_()) for _ in range(2))
        calls.clear()
        out = numerics.linear(ours[0], ours[1], fast=copy)
        out.backward(grad)
        assert len(calls) == (3 if out_features <= ops.ONEDNN_GRAD_WEIGHT_MAX_ROWS else 2)  # forward, both gradients
        expected = F.linear(*theirs)
        expected.backward(grad)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)  # sums of 576 terms near 24 in size
        for mine, reference in zip(ours, theirs):  # the input's gradient: sums of out_features terms
            torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-5, atol=1e-5 * out_features**0.5)
        with torch.no_grad():  # the rollout engine's call: no autograd node
            torch.testing.assert_close(numerics.linear(x, weight, fast=copy), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    calls.clear()
    numerics.linear(torch.randn(4, 384), torch.randn(128, 384))  # the built-in model's: MKL is faster there
    kernels.numerics(exact=True).linear(torch.randn(4, 576), weight)
    assert not calls
    assert numerics.fast_matrix(torch.randn(128, 384)) is None
    assert numerics.fast_matrix(weight.bfloat16()) is None
    assert kernels.numerics(exact=True).fast_matrix(weight) is None
