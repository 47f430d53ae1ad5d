"""Precision policy: the CPU FP16 fast path and dynamic loss scaling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parity.engines import kernels, precision
from parity.engines.models.io import load_model
from parity.engines.tokenizer import load_tokenizer
from parity.engines.trainer import OptimConfig, Trainer


def test_fp16_fast_path_matches_native_fp16_matmul():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=g).half()
    w = torch.randn(32, 64, generator=g).half()
    b = torch.randn(32, generator=g).half()
    fast = kernels.linear(x, w, b)
    native = F.linear(x, w, b)  # PyTorch's own (slow) CPU FP16 kernel
    assert fast.dtype == torch.float16
    # Both accumulate in FP32 and round once; summation order may differ by one ulp.
    ulp = torch.finfo(torch.float16).eps * native.float().abs().clamp(min=1)
    assert ((fast.float() - native.float()).abs() <= ulp).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_attention_has_flash_numerics(dtype):
    """FP32 scores and softmax on the rounded inputs, probabilities rounded to the
    compute dtype, FP32 products, output rounded: full and decode paths alike."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g).to(dtype) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # two query heads per KV head
    kf, vf = k.float().repeat_interleave(2, dim=1), v.float().repeat_interleave(2, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), kf) / 8**0.5
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(dtype).float()
    ref = torch.einsum("bhqk,bhkd->bhqd", probs, vf).to(dtype)
    ulp = ref.float().abs() * torch.finfo(dtype).eps + 1e-6

    full = kernels.numerics().attention(q, k, v)
    assert full.dtype == dtype and ((full.float() - ref.float()).abs() <= ulp).all()
    last = kernels.numerics().decode_attention(q[:, :, -1:], k.transpose(-1, -2), v, torch.zeros(2, 1, 1, 5))
    assert ((last.float() - ref[:, :, -1:].float()).abs() <= ulp[:, :, -1:]).all()


def test_unknown_precision_is_named():
    with pytest.raises(ValueError, match="unknown precision 'fp8'.*fp32, bf16, fp16"):
        precision.to_dtype("fp8")


def test_scaler_grows_after_clean_steps_and_backs_off():
    s = precision.DynamicLossScaler(enabled=True, init_scale=8.0, growth_interval=2)
    s.update(True)
    assert s.scale == 8.0
    s.update(True)
    assert s.scale == 16.0
    s.update(False)
    assert s.scale == 8.0 and s.skipped_steps == 1
    s.update(True)
    assert s.scale == 8.0  # the clean-step count restarted after the overflow
    off = precision.DynamicLossScaler(enabled=False)
    off.update(True)
    assert off.scale == 1.0


def _fp16_trainer(path):
    tok = load_tokenizer(path)
    trainer = Trainer(
        load_model(path, kernels.numerics()),
        "fp16",
        OptimConfig(lr=1e-2, loss_scale_init=2.0**10, loss_scale_growth_interval=1000),
    )
    ids = [tok.encode("12+34=")] * 2
    resp = torch.tensor([tok.encode("46")[1:] + [tok.eos_id]] * 2)
    mask = torch.ones_like(resp, dtype=torch.bool)
    return trainer, ids, resp, mask


def test_injected_overflow_skips_step_and_halves_scale(llama_dir):
    trainer, ids, resp, mask = _fp16_trainer(llama_dir)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    scale = trainer.scaler.scale
    # A loss this large overflows FP16 gradients at any scale >= 1.
    trainer.backward(-trainer.logprobs(ids, resp, mask).sum() * 1e9)
    stats = trainer.step()
    assert stats.skipped and stats.skipped_total == 1 and stats.loss_scale == scale
    assert trainer.scaler.scale == scale / 2
    assert stats.weight_version == 0
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k
        assert torch.isfinite(v).all(), k
    assert not trainer.optimizer.state  # AdamW state untouched
    # A normal loss then steps, with gradients unscaled before the update.
    trainer.backward(-trainer.logprobs(ids, resp, mask).mean())
    stats = trainer.step()
    assert not stats.skipped and stats.weight_version == 1 and 0 < stats.grad_norm < 1e3
    assert any(not torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())


def test_fp16_gradients_match_fp32_after_unscaling(llama_dir):
    """Loss scaling changes nothing but the representable range: unscaled FP16 grads ≈ FP32 grads."""
    grads = {}
    for prec in ("fp32", "fp16"):
        trainer, ids, resp, mask = _fp16_trainer(llama_dir)
        trainer.dtype = precision.to_dtype(prec)
        trainer.scaler = precision.DynamicLossScaler(enabled=prec == "fp16", init_scale=1024.0)
        trainer.backward(-trainer.logprobs(ids, resp, mask).mean())
        assert torch.isfinite(trainer.scaler.unscale(trainer.params))
        grads[prec] = torch.cat([p.grad.flatten() for p in trainer.params])
    rel = (grads["fp16"] - grads["fp32"]).norm() / grads["fp32"].norm()
    assert rel < 5e-3
