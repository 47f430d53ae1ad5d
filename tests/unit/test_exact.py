"""Exact mode: the rollout engine's μ and the trainer's π are the same bits for every sampled token."""

from __future__ import annotations

import json

import pytest
import torch

from engine_pair import FILTERED, PLAIN, engines, random_prompts, trainer_logprobs
from parity import config
from parity.cli import main
from parity.config import ConfigError
from parity.engines.locate import first_divergence, locate
from parity.rl.train_config import TrainConfig


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(
    ("prompts", "group_size", "sampling", "micro_batch"),
    [(1, 1, PLAIN, 1), (3, 1, FILTERED, 2), (7, 3, PLAIN, 5), (16, 4, FILTERED, 64), (8, 8, PLAIN, 13)],
    ids=["1-row", "3-rows-topk-topp", "21-rows", "64-rows-topk-topp", "64-rows"],
)
def test_rollout_and_trainer_agree_bit_for_bit(precision, prompts, group_size, sampling, micro_batch):
    """The built-in model (grouped-query attention, tied embeddings): batches of 1 to 64 rows,
    prompts of 1 to 12 tokens, responses of 1 to 20 with rows finishing and compacted, top-k and
    top-p, scored in micro-batches of other sizes."""
    model, engine = engines("builtin", precision)
    batch = engine.generate(random_prompts(prompts, model.config.vocab_size, seed=prompts), group_size, sampling, 3)
    mask = batch.response_mask
    assert batch.response_lengths.min() < batch.response_lengths.max() or len(mask) == 1  # mixed lengths
    pi = trainer_logprobs(model, batch, precision, micro_batch)
    assert torch.equal(pi[mask], batch.rollout_logprobs[mask])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_prompts_that_share_a_prefix_agree_bit_for_bit(precision):
    """Prompts that start with one system prompt, one a prefix of another: the trainer computes the shared
    tokens once (`packing.pack`'s trie), the engine prefills each prompt whole, and μ is π bit for bit."""
    model, engine = engines("builtin", precision)
    system = random_prompts(1, model.config.vocab_size, seed=11)[0] + [5, 6, 7]
    rest = random_prompts(5, model.config.vocab_size, seed=12)
    prompts = [system + r for r in rest] + [system, system + rest[0][:1]]
    batch = engine.generate(prompts, 3, FILTERED, seed=4)
    pi = trainer_logprobs(model, batch, precision, micro_batch=7)
    assert torch.equal(pi[batch.response_mask], batch.rollout_logprobs[batch.response_mask])


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_checkpoints_agree_bit_for_bit(precision, arch, llama_dir, qwen2_dir):
    """Random Llama (untied head) and Qwen2 (Q/K/V biases, tied) checkpoints saved by transformers."""
    model, engine = engines(llama_dir if arch == "llama" else qwen2_dir, precision)
    batch = engine.generate(random_prompts(12, model.config.vocab_size, seed=5), 4, FILTERED, seed=0)
    pi = trainer_logprobs(model, batch, precision, micro_batch=16)
    assert torch.equal(pi[batch.response_mask], batch.rollout_logprobs[batch.response_mask])


@pytest.mark.parametrize("sampling", [PLAIN, FILTERED], ids=["plain", "top-k-top-p"])
def test_reading_the_batch_state_less_often_samples_the_same(sampling):
    """On a GPU the decode loop reads finished rows and supports back every CHECK_EVERY tokens; finished
    rows then stay in the batch longer. In exact mode the samples, μ and supports are the same bits as
    reading every token (each row has its own random number per step, and exact mode makes a row's
    numbers independent of its batch)."""
    model, engine = engines("builtin", "bf16")
    prompts = random_prompts(6, model.config.vocab_size, seed=3)
    batches = []
    for check_every in (1, 5, 64):
        engine.check_every = check_every
        batches.append(engine.generate(prompts, 4, sampling, seed=11))
    first = batches[0]
    assert not first.response_mask.all(), "some rows must finish early for the test to mean anything"
    for other in batches[1:]:
        for name in ("response_ids", "response_mask", "rollout_logprobs", "support", "truncated"):
            a, b = getattr(first, name), getattr(other, name)
            assert (a is None and b is None) or torch.equal(a, b), name


def test_without_exact_mode_the_engines_differ_and_locate_says_where():
    """The default engines differ (the rollout engine's fused RMSNorm rounds once, the trainer's
    twice), and `locate` names the first stage where they part; in exact mode no stage differs."""
    model, engine = engines("builtin", "bf16", exact=False)
    batch = engine.generate(random_prompts(8, model.config.vocab_size, seed=1), 4, PLAIN, seed=0)
    pi = trainer_logprobs(model, batch, "bf16", micro_batch=32)
    assert not torch.equal(pi[batch.response_mask], batch.rollout_logprobs[batch.response_mask])
    response = batch.response_ids[0, : int(batch.response_mask[0].sum())].tolist()
    diffs = locate(model, engine, batch.prompt_ids[0], response, PLAIN, torch.bfloat16)
    assert first_divergence(diffs).stage == "layer0.input_norm"
    assert diffs[-1].stage == "logprob"

    model, engine = engines("builtin", "bf16")
    diffs = locate(model, engine, batch.prompt_ids[0], response, PLAIN, torch.bfloat16)
    assert first_divergence(diffs) is None and all(d.max_abs == 0 for d in diffs)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.precision=bf16", "allow_precision_mismatch=true"], "exact mode makes both engines"),
    ],
)
def test_exact_mode_refuses_what_it_cannot_keep(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.load(TrainConfig, None, [f"run_dir={tmp_path}", "exact=true", *overrides])


def test_mismatch_command_exact_and_locate(tmp_path, capsys):
    out = tmp_path / "mm"

    def mismatch(*overrides: str) -> int:
        small = ["num_prompts=8", "group_size=4", "sampling.max_new_tokens=16"]
        flags = [o for o in overrides if o.startswith("--")]
        return main(["mismatch", *small, *(o for o in overrides if o not in flags), "--out", str(out), *flags])

    assert mismatch("exact=true", "pairs=[fp16/fp16]") == 0
    result = json.loads((out / "mismatch.json").read_text())
    assert result["runs"][0]["exact"] and result["runs"][0]["metrics"]["token_abs_log_ratio_max"] == 0.0
    assert mismatch("pairs=[bf16/bf16]", "--locate") == 0
    printed = capsys.readouterr().out
    assert "first differ at **layer0.input_norm**" in printed
    assert "## Where the engines part: bf16" in (out / "mismatch.md").read_text()
    assert mismatch("exact=true", "pairs=[bf16/fp32]") == 2
    assert "mixes precisions" in capsys.readouterr().err


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "plain"])
@pytest.mark.parametrize("sampling", [PLAIN, FILTERED], ids=["plain", "top-k-top-p"])
def test_the_full_vocabulary_record_from_training_passes_is_the_pass_of_its_own(exact, sampling):
    """`train_on_batch(full_vocab=True)` fills the record from the update's own passes (micro-batches of other
    rows than the recorded ones): exact mode gives the bits of the diagnostic's own pass over the recorded rows,
    and plain mode the same distributions to FP32 rounding."""
    from parity.engines.trainer import OptimConfig, Trainer, full_vocab_logprobs

    model, engine = engines("builtin", "fp32", exact=exact)
    batch = engine.generate(random_prompts(6, model.config.vocab_size, seed=9), 3, sampling, 4, full_vocab=40)
    record = batch.full_vocab
    assert len(record.rows) == 3 and (record.steps >= 0).any() and (record.steps < 0).any()  # short rows too
    own = full_vocab_logprobs(model, batch, torch.float32)
    trainer = Trainer(model, "fp32", OptimConfig(lr=0.0))
    with torch.no_grad():
        for rows in torch.arange(len(batch.prompt_ids)).split(5):
            trainer.batch_logprobs(batch, rows, full_vocab=True)
    got = record.trainer_logprobs
    assert torch.equal(got.isnan(), own.isnan())
    if exact:
        assert torch.equal(got.nan_to_num(), own.nan_to_num())
    else:
        torch.testing.assert_close(got.nan_to_num(), own.nan_to_num(), rtol=0, atol=1e-5)
