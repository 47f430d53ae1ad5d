"""Held-out evaluation, the deployment gap, full-vocabulary parity and the trainer's batch-shape invariance
(issue 27): the config's checks, the metrics against hand computations, a run's evaluation leaving its
training untouched and its resume exact, `parity eval` on a run directory, and exact mode's zeros."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from conftest import TIMING, TINY, metrics
from parity import config
from parity.cli import main
from parity.config import ConfigError
from parity.engines import kernels
from parity.engines.models.io import BUILTIN_DIR, export_state, load_model
from parity.engines.rollout import FULL_VOCAB_PER_ROW, RolloutEngine, _FullVocabRecorder
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import load_tokenizer
from parity.rl.diagnostics import batch_shape_metrics, full_vocab_metrics
from parity.rl.evaluation import changed_responses, evaluation_due, gap_standard_error, heldout_problems
from parity.rl.loop import Run, TrainingError
from parity.rl.tasks import builtin_problems
from parity.rl.train_config import TrainConfig

SMALL = [*TINY, "rollout.max_new_tokens=40"]
EVAL = ["eval.num_prompts=6", "eval.samples=2"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("eval.every=-2", "eval.every: must be in [-1, 1,000,000]"),
        ("eval.num_prompts=0", "eval.num_prompts: must be in [1, 100,000]"),
        ("eval.num_prompts=1000000000", "eval.num_prompts: must be in [1, 100,000]"),
        ("eval.samples=0", "eval.samples: must be >= 1"),
        ("eval.temperature=-1", "eval.temperature: must be >= 0"),
        ("eval.max_new_tokens=0", "eval.max_new_tokens: must be >= 1"),
        ("eval.precisions=[fp32,fp8]", "eval.precisions: expected distinct names from fp32, bf16, fp16"),
        ("eval.precisions=[fp16,fp16]", "eval.precisions: expected distinct names"),
        ("eval.data=/no/such/file.jsonl", "eval.data: '/no/such/file.jsonl' does not exist"),
        ("diagnostics.full_vocab_positions=-1", "diagnostics.full_vocab_positions: must be >= 0"),
    ],
)
def test_eval_keys_are_checked(tmp_path, override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.load(TrainConfig, None, [f"run_dir={tmp_path}", override])


def test_evaluation_is_due_every_n_steps_and_at_the_end():
    assert [s for s in range(1, 11) if evaluation_due(s, 10, 4)] == [4, 8, 10]
    assert [s for s in range(1, 11) if evaluation_due(s, 10, 0)] == [10]
    assert not any(evaluation_due(s, 10, -1) for s in range(1, 11))


def test_held_out_problems_leave_out_the_training_problems():
    trained = builtin_problems("builtin", 1024, seed=0)
    held = heldout_problems("builtin", "standard", 64, seed=0, exclude={p.prompt for p in trained})
    assert len(held) == 64 and len({p.prompt for p in held}) == 64
    assert not {p.prompt for p in held} & {p.prompt for p in trained}
    assert held == heldout_problems("builtin", "standard", 64, seed=0, exclude={p.prompt for p in trained})
    # number's held-out eighth never overlaps its training split
    words = heldout_problems("number", "standard", 16, seed=0, exclude=set())
    assert not {p.prompt for p in words} & {p.prompt for p in builtin_problems("number", 512, seed=0)}


def test_full_vocabulary_metrics_against_a_hand_computation():
    mu = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.5, 0.5, 0.0, 0.0]]).log()
    pi = torch.tensor([[0.6, 0.3, 0.1, 0.0], [0.25, 0.75, 0.0, 0.0]]).log()
    recorded_only = torch.cat([mu, torch.full((1, 4), float("nan"))])  # a slot no token filled
    m = full_vocab_metrics(recorded_only, torch.cat([pi, torch.zeros(1, 4)]))
    kl = [
        0.7 * math.log(0.7 / 0.6) + 0.2 * math.log(0.2 / 0.3),
        0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75),
    ]
    assert m["positions"] == 2
    assert m["tv"] == pytest.approx((0.1 + 0.25) / 2, rel=1e-6)
    assert m["kl"] == pytest.approx(sum(kl) / 2, rel=1e-6)
    assert m["max_abs_log_ratio"] == pytest.approx(math.log(2), rel=1e-6)
    assert m["top1_agree"] == 0.5
    same = full_vocab_metrics(mu, mu.clone())
    assert (same["tv"], same["kl"], same["max_abs_log_ratio"], same["top1_agree"]) == (0.0, 0.0, 0.0, 1.0)
    # As the engines record a short response's missing slot: zeros from the engine, NaN from the trainer.
    engines = full_vocab_metrics(torch.cat([mu, torch.zeros(1, 4)]), torch.cat([pi, torch.full((1, 4), float("nan"))]))
    assert engines == m


def test_the_gap_standard_error_is_paired_by_prompt():
    scores, reference = torch.tensor([0.5, 1.0, 0.25, 0.0]), torch.tensor([0.25, 1.0, 0.0, 0.0])
    d = torch.tensor([0.25, 0.0, 0.25, 0.0])
    assert gap_standard_error(scores, reference) == pytest.approx(float(d.std() / 2))
    assert gap_standard_error(scores + 0.1, reference + 0.1) == pytest.approx(gap_standard_error(scores, reference))


def test_changed_responses_counts_rows_that_differ_in_any_token():
    from parity.engines.batch import RolloutBatch

    def batch(ids: list[list[int]], lengths: list[int]) -> RolloutBatch:
        ids = torch.tensor(ids)
        mask = torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]
        zeros = torch.zeros(len(lengths))
        return RolloutBatch(
            [[1]] * len(lengths), ids, mask, zeros, None, zeros.bool(), zeros.long(), 0, SamplingParams()
        )

    a = batch([[5, 6, 1], [7, 1, 0], [8, 8, 1]], [3, 2, 3])
    b = batch([[5, 6, 1, 0], [7, 1, 9, 9], [8, 9, 1, 0]], [3, 2, 3])  # wider, padding differs; row 2 differs
    assert changed_responses(a, b) == pytest.approx(1 / 3)
    assert changed_responses(a, batch([[5, 6, 1], [7, 1, 0], [8, 8, 1]], [3, 3, 3])) == pytest.approx(1 / 3)


def test_batch_shape_metrics_against_a_hand_computation():
    a = torch.tensor([[0.0, -1.0, -2.0], [-0.5, 0.0, 0.0]])
    b = a + torch.tensor([[0.2, 0.005, 0.0], [-0.02, 0.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    m = batch_shape_metrics(a, b, mask)
    assert m["outside_10pct"] == 0.25 and m["outside_1pct"] == 0.5  # |Δ| 0.2 > log 1.1; 0.02 > log 1.01
    assert m["max_abs_log_ratio"] == pytest.approx(0.2) and m["exact_tokens_frac"] == 0.25


def test_recording_the_whole_distribution_changes_no_sample():
    model, tok = load_model("builtin", kernels.numerics()), load_tokenizer(BUILTIN_DIR)
    engine = RolloutEngine(model.config, "bf16", tok.eos_ids, tok.pad_id, kernels.numerics())
    engine.weights.load(export_state(model), version=0)
    # 48 rows: finished rows leave the decode batch (16 at a time) while recorded rows are still sampling
    prompts = [tok.encode(f"{a}+{b}=") for a, b in ((4705, 386), (12, 9), (99, 999), (5, 123456))] * 2
    sampling = SamplingParams(top_k=6, max_new_tokens=40)
    plain = engine.generate(prompts, 6, sampling, seed=3)
    recorded = engine.generate(prompts, 6, sampling, seed=3, full_vocab=20)
    assert int((recorded.response_lengths <= 30).sum()) > 16  # by step 30 the decode batch shrank from 48 to 32
    assert torch.equal(plain.response_ids, recorded.response_ids)
    assert torch.equal(plain.rollout_logprobs, recorded.rollout_logprobs)
    record = recorded.full_vocab
    per_row = FULL_VOCAB_PER_ROW
    assert record.rollout_logprobs.shape == (-(-20 // per_row), per_row, model.config.vocab_size)
    # each kept position is a real token of its row, and holds the distribution μ was read from
    for i, row in enumerate(record.rows.tolist()):
        for j, t in enumerate(record.steps[i].tolist()):
            if t >= 0:
                assert recorded.response_mask[row, t]
                token = recorded.response_ids[row, t]
                assert record.rollout_logprobs[i, j, token] == recorded.rollout_logprobs[row, t]
                assert torch.isinf(record.rollout_logprobs[i, j]).sum() == model.config.vocab_size - 6


def test_a_recorded_row_that_leaves_the_decode_batch_is_never_live_again():
    recorder = _FullVocabRecorder(2 * FULL_VOCAB_PER_ROW, batch=6, max_new=3, vocab=5, device=torch.device("cpu"))
    recorder.reset(seed=0, batch=6, max_new=3)
    recorder.rows.copy_(torch.tensor([5, 2]))  # two recorded rows
    # Row 5 finished and left the decode batch; row 2 is now at position 1 of three.
    position_of_row = torch.tensor([0, -1, 1, 2, -1, -1])
    columns = torch.zeros(6, dtype=torch.long)  # every output row samples its first response token
    recorder.observe(columns, position_of_row, torch.tensor([True, True, True]), torch.arange(15.0).view(3, 5))
    assert recorder.steps[:, 0].tolist() == [-1, 0] and recorder.logprobs[1, 0].tolist() == [5, 6, 7, 8, 9]


def _run(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    cfg = config.load(TrainConfig, None, [f"run_dir={tmp_path / name}", *SMALL, *overrides])
    Run.create(cfg, progress=False).train()
    return metrics(tmp_path / name)


@pytest.mark.slow
def test_evaluation_leaves_training_untouched_and_a_resumed_run_exact(tmp_path):
    """Steps with and without evaluation train the same; a run resumed after its step-2 checkpoint logs
    what the uninterrupted run logged, evaluations included."""
    common = ["steps=4", "checkpoint_every=2", "eval.every=2", "eval.precisions=[fp32,bf16]", *EVAL]
    whole = _run(tmp_path, "whole", *common)
    assert [("eval/accuracy" in m, "deploy/gap_bf16" in m) for m in whole] == [(False, False), (True, True)] * 2
    assert all("full_vocab/tv" in m for m in whole)
    _run(tmp_path, "without", *common[:2], "eval.every=-1", *EVAL)
    trained = [
        {k: v for k, v in m.items() if not k.startswith(("eval/", "deploy/"))}
        for m in metrics(tmp_path / "whole", drop=TIMING)
    ]
    assert trained == metrics(tmp_path / "without", drop=TIMING)

    # `parity eval RUN_DIR` repeats the run's own evaluation (its eval.num_prompts x eval.samples): it took 64 x 8
    out = tmp_path / "eval"
    assert main(["eval", str(tmp_path / "whole"), "precisions=[fp16]", f"out={out}"]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert (result["prompts"], result["samples"]) == (6, 2)
    assert result["states"][-1]["metrics"]["eval/fp16/accuracy"] == whole[-1]["eval/accuracy"]

    _run(tmp_path, "resumed", *[c.replace("steps=4", "steps=2") for c in common])
    assert main(["train", "--resume", str(tmp_path / "resumed"), "steps=4"]) == 0
    assert metrics(tmp_path / "resumed", drop=TIMING) == metrics(tmp_path / "whole", drop=TIMING)


@pytest.mark.slow
def test_parity_eval_on_a_run_directory(tmp_path, capsys):
    _run(tmp_path, "run", "steps=4", "checkpoint_every=2", "keep_checkpoints=3", "eval.every=-1")
    out = tmp_path / "eval"
    assert main(["eval", str(tmp_path / "run"), "num_prompts=6", "samples=2", f"out={out}"]) == 0
    result = json.loads((out / "eval.json").read_text())
    assert [(s["name"], s["step"]) for s in result["states"]] == [("base", 0), ("step_000002", 2), ("step_000004", 4)]
    assert result["reference"] == "fp16" and result["precisions"] == ["fp32", "bf16", "fp16"]
    for state in result["states"]:
        m = state["metrics"]
        for p in ("fp32", "bf16", "fp16"):
            assert m[f"deploy/gap_{p}"] == pytest.approx(m[f"eval/{p}/accuracy"] - m["eval/trainer/accuracy"])
            assert m[f"deploy/kl_{p}"] >= 0 and 0 <= m[f"deploy/changed_{p}"] <= 1 and m[f"deploy/gap_se_{p}"] >= 0
    assert (out / "eval.png").stat().st_size > 0 and "| step_000004 | 4 | bf16 |" in (out / "eval.md").read_text()

    # one line for each kind of bad input
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run"), "precisions=[fp32,int4]", f"out={out}"]) == 2
    assert "precisions: expected distinct names from fp32, bf16, fp16, got fp32,int4" in capsys.readouterr().err
    _run(tmp_path, "nockpt", "steps=1", "checkpoint_every=-1", "eval.every=-1")
    assert main(["eval", str(tmp_path / "nockpt"), f"out={out}"]) == 2
    assert "the run kept no checkpoint" in capsys.readouterr().err
    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    _run(tmp_path, "math", "steps=1", f"task.data={data}", "task.name=exact", "rollout.group_size=2")
    assert main(["eval", str(tmp_path / "math"), f"out={out}"]) == 2
    assert "and Parity generates no held-out split for it; pass data=FILE" in capsys.readouterr().err


def test_parity_eval_of_an_exact_run_repeats_its_deployment_kls(tmp_path):
    """`parity eval RUN_DIR` scores deploy/kl_* with the run's trainer code path: an exact-mode run's, so its
    figures are the run's own evaluation's, deploy/kl_trainer's 0 included."""
    whole = _run(tmp_path, "exact", "steps=1", "exact=true", "eval.precisions=[bf16]", *EVAL)
    out = tmp_path / "eval"
    assert main(["eval", str(tmp_path / "exact"), "precisions=[bf16]", f"out={out}"]) == 0
    m = json.loads((out / "eval.json").read_text())["states"][-1]["metrics"]
    assert m["deploy/kl_trainer"] == whole[-1]["deploy/kl_trainer"] == 0
    assert m["deploy/kl_bf16"] == whole[-1]["deploy/kl_bf16"]


def test_exact_mode_compares_whole_distributions_and_finds_them_equal(tmp_path):
    lines = _run(tmp_path, "exact", "steps=2", "exact=true", "rollout.top_k=5", "checkpoint_every=-1", "eval.every=-1")
    for m in lines:
        assert m["full_vocab/positions"] == 32
        assert (m["full_vocab/tv"], m["full_vocab/kl"], m["full_vocab/max_abs_log_ratio"]) == (0.0, 0.0, 0.0)
        assert m["full_vocab/top1_agree"] == 1.0


def test_exact_mode_stops_when_a_whole_distribution_differs(tmp_path):
    """Every sampled token agreeing is not enough: one differing entry of a checked distribution stops the
    step before the optimizer moves."""
    cfg = config.load(TrainConfig, None, [f"run_dir={tmp_path / 'r'}", "exact=true", "steps=2", *SMALL])
    run = Run.create(cfg, progress=False)
    generate = run.backend.sampler.engine.generate

    def tampered(*args, **kwargs):
        batch = generate(*args, **kwargs)
        record = batch.full_vocab
        i, j = (record.steps >= 0).nonzero()[0].tolist()
        sampled = batch.response_ids[record.rows[i], record.steps[i, j]]
        other = (sampled + 1) % record.rollout_logprobs.shape[-1]  # not the sampled token
        record.rollout_logprobs[i, j, other] += 1e-3
        return batch

    run.backend.sampler.engine.generate = tampered
    before = {n: p.detach().clone() for n, p in run.backend.trainer.model.named_parameters()}
    with pytest.raises(TrainingError, match="the whole next-token distribution differs though every sampled token"):
        run.train()
    assert all(torch.equal(p, before[n]) for n, p in run.backend.trainer.model.named_parameters())


def test_mismatch_reports_full_vocabulary_and_batch_shape(tmp_path):
    out = tmp_path / "mm"
    args = ["mismatch", "num_prompts=6", "group_size=2", "sampling.max_new_tokens=24", "pairs=[fp32/fp32,bf16/bf16]"]
    assert main([*args, "--out", str(out)]) == 0
    runs = json.loads((out / "mismatch.json").read_text())["runs"]
    for r in runs:
        assert r["full_vocab"]["positions"] > 0 and 0 <= r["full_vocab"]["tv"] < 1
        assert set(r["batch_shape"]) == {"outside_10pct", "outside_1pct", "max_abs_log_ratio", "exact_tokens_frac"}
    assert "trainer vs itself: outside [0.9, 1.1]" in (out / "mismatch.md").read_text()
    assert main([*args, "exact=true", "pairs=[bf16/bf16]", "--out", str(out)]) == 0
    exact = json.loads((out / "mismatch.json").read_text())["runs"][0]
    assert exact["full_vocab"]["tv"] == 0.0 and exact["full_vocab"]["max_abs_log_ratio"] == 0.0


def test_evaluation_reports_each_reward_function(tmp_path):
    """With reward functions of your own, a held-out evaluation reports each one's mean score beside the
    weighted total: in the run's metrics, to `on_eval`, and in `parity eval`'s eval.json and eval.md."""
    import parity

    def correct(completions, answer, **columns):
        return [float(c.rsplit(">", 1)[-1].strip() == str(a)) for c, a in zip(completions, answer)]

    def short(completions, **columns):
        return [-len(c) / 100 for c in completions]

    class Seen(parity.Callback):
        evals: list[dict] = []

        def on_eval(self, step, metrics):
            self.evals.append(metrics)

    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(100, 130) for b in range(10, 13)]
    rewards = [correct, parity.Reward(short, weight=0.5)]
    seen = Seen()
    keys = dict(steps=1, prompts_per_step=4, rollout__group_size=4, rollout__max_new_tokens=40, tensorboard=False)
    keys.update(eval__samples=2, log__completions=0)
    run = tmp_path / "r"
    parity.train(
        "builtin", rows[:60], rewards, eval_dataset=rows[60:], run_dir=run, callbacks=[seen], progress=False, **keys
    )
    logged = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(seen.evals) == 1
    for got in (logged, seen.evals[0]):
        total = got["eval/reward/correct/mean"] + 0.5 * got["eval/reward/short/mean"]
        assert got["eval/reward_mean"] == pytest.approx(total)
        assert -0.5 < got["eval/reward/short/mean"] < 0 <= got["eval/reward/correct/mean"] <= 1
    assert seen.evals[0]["eval/reward/short/mean"] == logged["eval/reward/short/mean"]

    result = parity.evaluate(run, rewards, out=tmp_path / "e", precisions=["fp32"], samples=2, progress=False)
    saved = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert saved["states"] == json.loads(json.dumps(result["states"]))
    for state in saved["states"]:
        m = state["metrics"]
        for label in ("fp32", "trainer"):
            total = m[f"eval/{label}/reward/correct/mean"] + 0.5 * m[f"eval/{label}/reward/short/mean"]
            assert m[f"eval/{label}/reward_mean"] == pytest.approx(total)
    md = (tmp_path / "e" / "eval.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| state |"))
    assert "| reward_mean | reward/correct | reward/short | pass@2 |" in header
    first = next(line for line in md.splitlines() if line.startswith("| base | 0 | fp32 |"))
    base = saved["states"][0]["metrics"]
    assert first.split(" | ")[4:6] == [
        f"{base['eval/fp32/reward/correct/mean']:.3f}",
        f"{base['eval/fp32/reward/short/mean']:.3f}",
    ]


def test_parity_eval_names_the_data_s_columns_by_its_own_keys(tmp_path, capsys):
    """The hint said to set task.answer_column, which parity eval refused as a key it does not take."""
    data = tmp_path / "alt.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "ans": str(a + 1)}) + "\n" for a in range(2)))
    out = tmp_path / "eval"
    assert main(["eval", "builtin", f"data={data}", f"out={out}"]) == 2
    assert capsys.readouterr().err.strip().endswith("set answer_column to the column that holds the answer")
    assert (
        main(["eval", "builtin", f"data={data}", "answer_column=ans", "num_prompts=2", "samples=1", f"out={out}"]) == 0
    )
    assert json.loads((out / "eval.json").read_text())["prompts"] == 2
