"""`parity doctor`: the verdict follows a measured FP16 training pass and the measured mismatch."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from parity.cli import main
from parity.commands.doctor import FP16Pass, LayerReport, measure_fp16_pass, recommend, run_doctor
from parity.engines import kernels
from parity.engines.models.io import load_model
from parity.engines.tokenizer import load_tokenizer


def edited_copy(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of the checkpoint `src` whose weights `edit` changed in place."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"))
    return dst


def test_builtin_model_is_fp16_safe(tmp_path, capsys):
    assert main(["doctor", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "doctor.json").read_text())
    assert result["recommendation"] == "fp16"
    assert result["fp16_pass"]["forward_finite"] and result["fp16_pass"]["backward_finite"]
    assert result["non_finite_weights"] == []
    assert result["mismatch"]["fp16"]["k3"] < result["mismatch"]["bf16"]["k3"]
    assert {r["name"] for r in result["layers"]} >= {"embed_tokens", "layer 0", "lm_head"}
    out = capsys.readouterr().out
    assert "Recommendation: FP16" in out and "FP16 training pass: forward finite" in out


def test_llama_and_qwen2_directories(llama_dir, qwen2_dir):
    for path in (llama_dir, qwen2_dir):
        result = run_doctor(str(path), None, num_prompts=4)
        assert result["recommendation"] == "fp16", result["reason"]
        assert "smaller than BF16's" in result["reason"]
        assert all(r["activation_max"] > 0 for r in result["layers"])


def test_nan_weight_is_untrainable(llama_dir, tmp_path, capsys):
    def poison(state):
        state["model.layers.1.self_attn.k_proj.weight"][3, 5] = float("nan")

    bad = edited_copy(llama_dir, tmp_path / "nan", poison)
    assert main(["doctor", "--model", str(bad), "--out", str(tmp_path / "out"), "--prompts", "4"]) == 1
    captured = capsys.readouterr()
    assert "Recommendation: NONE" in captured.out
    assert "model.layers.1.self_attn.k_proj.weight holds 1 NaN/inf value" in captured.out
    assert "restore or fix the checkpoint" in captured.out
    assert "Traceback" not in captured.err
    result = json.loads((tmp_path / "out" / "doctor.json").read_text())
    assert result["recommendation"] == "none"
    assert result["non_finite_weights"] == [{"name": "model.layers.1.self_attn.k_proj.weight", "count": 1}]
    assert result["fp16_pass"] is None and result["mismatch"] == {}
    layers = {r["name"]: r for r in result["layers"]}
    # NaN is written null: doctor.json is strict JSON
    assert math.isfinite(layers["layer 0"]["activation_max"]) and layers["layer 1"]["weight_max"] is None


def test_large_activation_with_finite_fp16_pass_gets_fp16(llama_dir, tmp_path):
    def amplify(state):
        # The residual stream reaches ~2.5e4 (like SmolLM2-135M's first-token activation): near 65504, not past it.
        state["model.layers.0.mlp.down_proj.weight"] *= 4000

    loud = edited_copy(llama_dir, tmp_path / "loud", amplify)
    result = run_doctor(str(loud), None, num_prompts=4)
    tightest = min(result["layers"], key=lambda r: r["headroom"])
    assert 2e4 < tightest["activation_max"] < 65504 and tightest["headroom"] < 16  # the old rule said BF16
    assert result["fp16_pass"]["forward_finite"] and result["fp16_pass"]["backward_finite"]
    assert result["recommendation"] == "fp16", result["reason"]
    assert f"caution: {tightest['name']} reaches" in result["reason"]


def test_model_past_fp16_range_is_flagged(llama_dir, tmp_path):
    def amplify(state):
        # Scale the MLP output projections so the residual stream grows past FP16's 65504.
        for k in state:
            if k.endswith("mlp.down_proj.weight"):
                state[k] = state[k] * 3e4

    bad = edited_copy(llama_dir, tmp_path / "unsafe", amplify)
    result = run_doctor(str(bad), None, num_prompts=4)
    assert result["recommendation"] == "bf16"
    assert "FP16 forward produced inf/NaN (first in layer 0)" in result["reason"]
    assert result["fp16_pass"]["overflow_layer"] == "layer 0" and not result["fp16_pass"]["forward_finite"]
    assert min(r["headroom"] for r in result["layers"]) < 16
    assert math.isfinite(result["mismatch"]["bf16"]["k3"])


def test_gradient_overflow_backs_off_the_loss_scale(llama_dir, tmp_path):
    def sharpen(state):
        # Logits 100x larger: their gradient times 65536 overflows FP16 until the scale comes down.
        state["lm_head.weight"] *= 100

    model = load_model(edited_copy(llama_dir, tmp_path / "sharp", sharpen), kernels.numerics())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tok = load_tokenizer(llama_dir)
    fp16 = measure_fp16_pass(model, [tok.encode(t) for t in ("the quick brown fox", "once upon a time", "12 + 35 =")])
    assert fp16.forward_finite and fp16.backward_finite
    assert fp16.backoffs > 0 and fp16.loss_scale == 2.0**16 / 2**fp16.backoffs
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # no optimizer step


def test_recommend_weighs_gradient_overflow_and_mismatch():
    reports = [LayerReport("layer 0", weight_max=1.0, activation_max=10.0, tiny_weight_frac=0.0)]
    fp16_metrics = {"k3": 1e-6, "token_abs_log_ratio_mean": 1e-3, "seq_abs_log_ratio": 1e-2}
    bf16_metrics = {"k3": 1e-4, "token_abs_log_ratio_mean": 1e-2, "seq_abs_log_ratio": 1e-1}
    finite = FP16Pass(forward_finite=True, backward_finite=True, loss_scale=2.0**16, backoffs=0, overflow_layer=None)
    grads_overflow = FP16Pass(
        forward_finite=True, backward_finite=False, loss_scale=None, backoffs=16, overflow_layer=None
    )

    precision, reason = recommend(reports, finite, {"fp16": fp16_metrics, "bf16": bf16_metrics})
    assert precision == "fp16" and "100x smaller than BF16's in k3 (10x in mean |Δ| per token)" in reason
    assert "caution" not in reason
    precision, reason = recommend(reports, grads_overflow, {"fp16": fp16_metrics, "bf16": bf16_metrics})
    assert precision == "bf16" and "loss scaling cannot fix" in reason
    precision, reason = recommend(reports, finite, {"fp16": bf16_metrics, "bf16": fp16_metrics})
    assert precision == "bf16" and "not smaller than BF16's" in reason


def test_prompts_that_are_all_one_token_are_one_line():
    """A chat template rendering every probe as one token built an empty float mask: an IndexError."""
    import pytest

    from parity.commands.doctor import teacher_forced
    from parity.config import ConfigError

    contexts, ids, mask = teacher_forced([[5], [1, 2, 3]])
    assert contexts == [[1]] and ids.tolist() == [[2, 3]] and mask.dtype == torch.bool
    with pytest.raises(ConfigError, match="^every probe prompt encodes as one token"):
        teacher_forced([[5], [7]])
