"""`parity doctor`: FP16-safe models get FP16, a model past FP16's range is flagged."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from parity.cli import main
from parity.doctor import run_doctor


def test_builtin_model_is_fp16_safe(tmp_path, capsys):
    assert main(["doctor", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "doctor.json").read_text())
    assert result["recommendation"] == "fp16"
    assert result["mismatch"]["fp16"]["k3"] < result["mismatch"]["bf16"]["k3"]
    assert {r["name"] for r in result["layers"]} >= {"embed_tokens", "layer 0", "lm_head"}
    assert "Recommendation: FP16" in capsys.readouterr().out


def test_llama_and_qwen2_directories(llama_dir, qwen2_dir):
    for path in (llama_dir, qwen2_dir):
        result = run_doctor(str(path), None, num_prompts=4)
        assert result["recommendation"] in ("fp16", "bf16") and result["reason"]
        assert all(r["activation_max"] > 0 for r in result["layers"])


def test_model_past_fp16_range_is_flagged(llama_dir, tmp_path):
    bad = tmp_path / "unsafe"
    bad.mkdir()
    for f in llama_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    state = load_file(str(bad / "model.safetensors"))
    # Scale the MLP output projections so the residual stream grows past FP16's 65504.
    for k in state:
        if k.endswith("mlp.down_proj.weight"):
            state[k] = state[k] * 3e4
    save_file({k: v.contiguous() for k, v in state.items()}, str(bad / "model.safetensors"))
    result = run_doctor(str(bad), None, num_prompts=4)
    assert result["recommendation"] == "bf16"
    assert "FP16" in result["reason"] and ("65504" in result["reason"] or "inf/NaN" in result["reason"])
    assert min(r["headroom"] for r in result["layers"]) < 16
    assert torch.isfinite(torch.tensor(result["mismatch"]["bf16"]["k3"]))
