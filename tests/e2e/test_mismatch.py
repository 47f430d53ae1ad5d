"""`parity mismatch` end to end: on test-built Llama/Qwen2 directories and on the built-in model."""

from __future__ import annotations

import json

import pytest

from parity.cli import main

REQUIRED_METRICS = {
    "k1",
    "k2",
    "k3",
    "chi2_token",
    "seq_abs_log_ratio",
    "token_abs_log_ratio_mean",
    "token_abs_log_ratio_max",
    "prob_abs_diff_mean",
    "prob_abs_diff_max",
}


def _check_schema(doc: dict, model: str, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], dict]:
    assert doc["model"] == model
    runs = {}
    for run in doc["runs"]:
        assert isinstance(run["num_sequences"], int) and isinstance(run["num_tokens"], int)
        assert REQUIRED_METRICS <= set(run["metrics"])
        assert all(isinstance(v, float) for v in run["metrics"].values())
        runs[(run["trainer_precision"], run["rollout_precision"])] = run
    assert list(runs) == pairs
    return runs


@pytest.mark.parametrize("fixture", ["llama_dir", "qwen2_dir"])
def test_mismatch_on_hf_checkpoint(fixture, request, tmp_path, capsys):
    path = request.getfixturevalue(fixture)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["12+34=", "hello ", "7+8=", "abc"]))
    out = tmp_path / "out"
    code = main(
        [
            "mismatch",
            "--model",
            str(path),
            "--out",
            str(out),
            f"prompts={prompts}",
            "group_size=2",
            "sampling.max_new_tokens=24",
            "pairs=fp32/fp32,bf16/bf16,fp16/fp16,bf16/fp32",
        ]
    )
    assert code == 0
    doc = json.loads((out / "mismatch.json").read_text())
    runs = _check_schema(doc, str(path), [("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32")])
    assert runs[("fp32", "fp32")]["metrics"]["token_abs_log_ratio_max"] < 1e-4
    assert runs[("fp16", "fp16")]["metrics"]["k3"] < runs[("bf16", "bf16")]["metrics"]["k3"]
    for name in ("mismatch.md", "mismatch_scatter.png", "seq_log_ratio_vs_length.png"):
        assert (out / name).stat().st_size > 0
    assert "× fp16" in (out / "mismatch.md").read_text()
    assert "| fp16 | fp16 |" in capsys.readouterr().out


def test_mismatch_rejects_bad_prompt_file(tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "1+1="}\n{"text": 3}\n')
    assert main(["mismatch", f"prompts={bad}", "--out", str(tmp_path / "o")]) == 2
    assert f"{bad}:2: expected an object with a non-empty string (or list of" in capsys.readouterr().err


@pytest.mark.slow
def test_mismatch_builtin_precision_ordering(tmp_path):
    """On the built-in model: FP32 at round-off, FP16 several times below BF16 (token level)."""
    out = tmp_path / "out"
    assert main(["mismatch", "--out", str(out), "num_prompts=32", "group_size=4"]) == 0
    runs = _check_schema(
        json.loads((out / "mismatch.json").read_text()),
        "builtin",
        [("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32")],
    )
    k3 = {pair: run["metrics"]["k3"] for pair, run in runs.items()}
    tok = {pair: run["metrics"]["token_abs_log_ratio_mean"] for pair, run in runs.items()}
    assert k3[("fp32", "fp32")] < 1e-9
    assert k3[("bf16", "bf16")] > 4 * k3[("fp16", "fp16")]
    assert tok[("bf16", "bf16")] > 2 * tok[("fp16", "fp16")] > 100 * tok[("fp32", "fp32")]


def test_long_prompt_set_and_the_length_table():
    """`prompts=long` draws from the shipped long-answer requests; the report's length table gives each bin's
    mean |sequence log-ratio| and number of sequences per pair, and BF16 over FP16 per bin."""
    from parity.commands.mismatch import MismatchConfig, length_table, load_prompts, run_mismatch
    from parity.commands.prompts import LONG_ANSWER_REQUESTS

    drawn = load_prompts("long", 5, seed=3, model="some-dir")
    assert len(set(drawn)) == 5 and set(drawn) <= set(LONG_ANSWER_REQUESTS)
    assert drawn == load_prompts("long", 5, seed=3, model="some-dir") != load_prompts("long", 5, seed=4, model="x")
    cfg = MismatchConfig(
        num_prompts=24, group_size=2, pairs=["bf16/bf16", "fp16/fp16"], shape_micro_batch=0, full_vocab_positions=0
    )
    bf16, fp16 = results = run_mismatch(cfg, progress=False)
    rows = [line.split(" | ") for line in length_table(results).splitlines()[2:]]
    assert len(rows) >= 2
    counts = 0
    for row in rows:
        key = "seq_abs_log_ratio/len_" + row[0].removeprefix("| ")
        assert row[1] == f"{bf16.by_length[key]:.3g} ({row[1].split('(')[1]}"
        counts += int(row[1].split("(")[1].rstrip(")"))
        assert row[3] == f"{bf16.by_length[key] / fp16.by_length[key]:.1f}× |"
    assert counts == 48


def test_mismatch_on_a_checkpoint_of_the_built_in_model_takes_its_prompts(tiny_run, tmp_path):
    """Only the literal `builtin` used to select the arithmetic prompts; a checkpoint of the built-in model
    (its tokenizer byte for byte) was given chat questions longer than its 128 positions."""
    run = tiny_run
    model = run / "checkpoints" / "step_000001" / "model"
    args = [f"model={model}", "num_prompts=4", "group_size=1", "pairs=[fp32/fp32]", f"out={tmp_path / 'm'}"]
    assert main(["mismatch", *args]) == 0
    doc = json.loads((tmp_path / "m" / "mismatch.json").read_text())
    assert doc["runs"][0]["num_sequences"] == 4
