"""The benchmark scripts run on the CPU at toy sizes: benchmarks/gpu.py (the acceptance run) and
benchmarks/gpu_probe.py, each in its own process (the numerics they measure: tests/unit/test_kernels.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_the_acceptance_run_works_on_the_cpu(tmp_path):
    """benchmarks/gpu.py at small sizes on the CPU: every arm trains, exact mode logs no mismatch,
    and the decode figures and the numerics record come out."""
    script = Path(__file__).parents[2] / "benchmarks" / "gpu.py"
    out = tmp_path / "gpu.json"
    args = ["--device", "cpu", "--models", "builtin", "--arms", "fp32,bf16,fp16-exact", "--rounds", "1"]
    subprocess.run(
        [sys.executable, str(script), *args, "--steps", "1", "--small", "--json", str(out)],
        check=True,
        capture_output=True,
    )
    record = json.loads(out.read_text())
    assert record["numerics"]["device"] == "cpu" and record["bandwidth_gb_s"] > 0
    arms = record["models"]["builtin"]["arms"]
    assert set(arms) == {"fp32", "bf16", "fp16-exact"}
    assert arms["fp32"]["rollout_vs_fp32"] == 1.0 and arms["bf16"]["train_tokens_per_s"] > 0
    assert arms["fp16-exact"]["max_token_abs_log_ratio"] == 0.0
    decode = record["models"]["builtin"]["decode"]
    assert set(decode) == {"fp32", "bf16", "fp16"} and all(
        d["step_ms"] > 0 and d["floor_ms"] > 0 for d in decode.values()
    )


@pytest.mark.slow
def test_the_gpu_probe_runs_on_the_cpu(tmp_path):
    """benchmarks/gpu_probe.py at toy sizes on the CPU (the previous code measured beside by this checkout
    itself): every section finishes, exact mode's μ equals π_old, and the summary has the issue's figures."""
    script = Path(__file__).parents[2] / "benchmarks" / "gpu_probe.py"
    src = Path(__file__).parents[2] / "src"
    subprocess.run(
        [sys.executable, str(script), "--small", "--device", "cpu", "--out", str(tmp_path), "--baseline-src", str(src)]
        + ["--baseline-sections", "engine"],
        check=True,
        capture_output=True,
    )
    record = json.loads((tmp_path / "probe.json").read_text())
    sections = record["sections"]
    assert set(sections) == {"device", "engine", "train", "matmul", "learners", "baseline-engine"}
    assert all("result" in s and not s.get("error") for s in sections.values()), sections
    # The FSDP2 learner (gloo, world size 1) keeps one process's bits in 16-bit precisions and in exact mode
    # (its decoder layers gathered by MixedPrecisionPolicy in the trainer precision), and FP32 to rounding.
    learners = sections["learners"]["result"]
    assert all(learners[arm]["weights_differing"] == 0 for arm in ("bf16", "fp16", "bf16-exact")), learners
    assert learners["fp32"]["max_rel_loss_or_norm_diff"] < 1e-5, learners["fp32"]
    engine = sections["engine"]["result"]
    assert all(r["differing"] == 0 for r in engine["exact_agreement"])
    assert all(d["step_ms"] > 0 for d in engine["decode"].values())
    assert all(r["fused_columns_same_bits"] for r in sections["matmul"]["result"].values())
    # The micro-batch sweep runs each budget with the LM head whole and a chunk at a time, and the first also
    # without each of the trainer's fused kernels.
    sweep = next(v for k, v in sections["train"]["result"].items() if k.endswith("/micro_batch_tokens"))
    heads = {"whole head", "chunked head", "whole head, PyTorch's log-probabilities", "whole head, eager RoPE"}
    assert {key.split("/")[1] for key in sweep} == heads
    summary = (tmp_path / "summary.md").read_text()
    assert "decode step, batch 16, bf16" in summary and "train bf16@8k" in summary
    assert "FSDP2 learner (world size 1) against one process, bf16-exact" in summary


@pytest.mark.slow
def test_the_agents_benchmark_against_trl_runs(tmp_path):
    """benchmarks/agents_vs_trl.py at smoke scale: both sides run the tool task's episodes (a tool call per
    episode), and the audit finds every sampled id of TRL's loop trained as sampled on builtin-agent's
    template and on Qwen3's (driven by the scripted policy), while a re-tokenizing pipeline drifts there."""
    pytest.importorskip("trl")
    from real_tokenizers import real_tokenizer_dir

    qwen3 = real_tokenizer_dir("qwen3")
    script = Path(__file__).parents[2] / "benchmarks" / "agents_vs_trl.py"
    out = tmp_path / "agents.json"
    args = ["--steps", "1", "--warmup", "1", "--rounds", "1", "--prompts", "2", "--group", "4"]
    args += ["--precisions", "fp32", "--threads", "1", "--audit-steps", "1", "--qwen3-tokenizer", str(qwen3)]
    subprocess.run([sys.executable, str(script), *args, "--json", str(out)], check=True, capture_output=True)
    record = json.loads(out.read_text())
    assert record["machine"]["cpu_capability"] and record["threads"] == 1
    (row,) = record["step_time"]
    assert row["parity_step_s"] > 0 and row["trl_step_s"] > 0 and row["trl_over_parity"] > 0
    assert "qwen3_template" in row["trl_parser"]  # builtin-agent's template is not one TRL knows
    for side in ("parity", "trl"):
        assert all(calls > 0.5 for run in row[f"{side}_tool_calls_mean"] for calls in run)
    for name in ("builtin-agent", "qwen3"):
        audit = record["audit"][name]
        loop = audit["trl_loop"]
        assert loop["sampled"] > 0 and loop["turns_unmatched"] == 0 and audit["tool_calls_mean"] > 0.5
        assert loop["differing"] == 0 and loop["trained_not_sampled"] == 0
    qwen = record["audit"]["qwen3"]
    assert qwen["accuracy"] == [1.0] and qwen["retokenizing_pipeline"]["drifted_tokens"] > 0


def test_the_episodes_benchmark_runs(tmp_path):
    """benchmarks/episodes.py at smoke scale: the KV-cache arm's episodes have turns and fed ids, and both
    arms were timed."""
    script = Path(__file__).parents[2] / "benchmarks" / "episodes.py"
    out = tmp_path / "kv.json"
    args = ["--prompts", "2", "--group", "2", "--prompt-tokens", "16", "--turns", "3", "--fed", "4"]
    args += ["--turn-tokens", "8", "--end-ids", "512", "--repeats", "1", "--json", str(out)]
    subprocess.run([sys.executable, str(script), *args], check=True, capture_output=True)
    record = json.loads(out.read_text())
    assert record["turns_mean"] > 1 and record["fed_tokens"] > 0
    assert record["seconds"]["kv_cache"] > 0 and record["seconds"]["prefill_again"] > 0


def test_the_gpu_probe_reads_its_figures_against_the_cards_specification():
    """The summary states a decode step against the (weights + KV) floor at the named card's published
    bandwidth and MFU against its published dense rate, each beside the same figure against what the probe
    measured on the card; a device without a specification is read against the measured ceilings and says so."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import gpu_probe

    assert gpu_probe.card_spec("NVIDIA H200")[0] == "H200"
    assert gpu_probe.card_spec("NVIDIA H100 80GB HBM3")[0] == "H100"
    assert gpu_probe.card_spec("NVIDIA H100 PCIe")[0] == "H100 PCIe"
    assert gpu_probe.card_spec("NVIDIA A100-SXM4-80GB")[0] == "A100-SXM4-80GB"
    assert gpu_probe.card_spec("cpu") is None
    decode = {"bf16": {"rows": 128, "step_ms": 1.82, "weight_bytes": 0.9e9, "kv_bytes": 0.1e9}}
    train = {"bf16@8k": {"tflops": 247.25, "tokens_per_s": 1000.0, "seconds": 1.0}}
    record = {
        "device": "cuda",
        "sections": {
            "device": {"result": {"card": "NVIDIA H200", "bandwidth_gb_s": 4000.0, "peak_tflops": {"bf16": 750.0}}},
            "engine": {"result": {"decode": decode}},
            "train": {"result": train},
        },
    }
    summary = gpu_probe.summary(record)
    # 1 GB read: 0.2083 ms at the H200's 4.8 TB/s, 0.25 ms at the 4 TB/s measured
    assert "1.820 ms = 8.7× spec floor, 7.3× measured" in summary
    assert "MFU 25.0% of spec, 33.0% of measured" in summary  # 247.25 of 989 and of 750 TFLOP/s
    record["sections"]["device"]["result"]["card"] = "cpu"
    assert "no specification for this device" in gpu_probe.summary(record)


def test_an_fsdp2_learner_with_a_chunked_head_keeps_one_processs_bits(tmp_path, monkeypatch):
    """`gpu_probe.learners_match` (one FSDP2 learner on gloo against one process, two GRPO steps) with every LM
    head chunked (3 chunks of a micro-batch): the same weights bit for bit in FP32, BF16 and BF16 exact."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    from tests.architectures import save_random_model

    import gpu_probe
    from parity.engines import trainer
    from parity.engines.models import modules

    monkeypatch.setattr(modules, "CHUNKED_HEAD_BYTES", 0)
    monkeypatch.setattr(trainer, "CHUNKED_HEAD_ELEMENTS", {"cpu": 7 * 64})
    chunked = []
    forward = trainer.ChunkedHeadLogProbs.forward
    monkeypatch.setattr(trainer.ChunkedHeadLogProbs, "forward", lambda *a: chunked.append(1) or forward(*a))
    model_dir = save_random_model(tmp_path / "qwen2", "qwen2")
    for arm in ("fp32", "bf16", "bf16-exact"):
        result = gpu_probe.learners_match(str(model_dir), "cpu", arm, (4, 2, 6, 8), 2)
        assert result["weights_differing"] == 0 and result["max_rel_loss_or_norm_diff"] == 0.0, (arm, result)
    assert chunked
