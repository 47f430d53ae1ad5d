"""LoRA: PEFT loads Parity's adapters and computes the same logits, only adapters train, merged
weights give the rollout engine the trainer's π, resume is exact, and bad keys are named."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TIMING, TINY, metrics
from parity import config
from parity.cli import main
from parity.config import ConfigError
from parity.engines import kernels
from parity.engines.kernels import cpu
from parity.engines.lora import (
    ATTENTION,
    CONFIG_FILE,
    PEFT_PREFIX,
    PLAIN_LORA_OPTIONS,
    TARGETS,
    AdapterError,
    LoRAConfig,
    LoRALinear,
    adapted,
    peft_config,
    read_adapter,
    save_adapter,
)
from parity.engines.models.io import BUILTIN_DIR, load_model
from parity.engines.packing import pack
from parity.engines.rollout import RolloutEngine
from parity.engines.sampling import SamplingParams
from parity.engines.tokenizer import load_tokenizer
from parity.engines.trainer import OptimConfig, Trainer
from parity.rl.checkpoint import RunState, checkpoints, load_checkpoint, save_checkpoint
from parity.rl.loop import Run
from parity.rl.train_config import TrainConfig

LORA = LoRAConfig(rank=4, alpha=8.0)


def _random_adapters(trainer: Trainer, seed: int) -> None:
    """Non-zero B everywhere, so the adapters change every projection's output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in adapted(trainer.model):
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=gen) * 0.2)


def _stream_logits(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Parity's FP32 logits over `ids[:-1]` (one packed row) and the tokens they were computed on."""
    response = torch.tensor([ids[4:]])
    packed = pack([ids[:4]], response, torch.ones_like(response, dtype=torch.bool))
    with torch.no_grad():
        return model.logits(model.hidden_states(packed, torch.float32)), packed.token_ids


def _peft_logits(base_dir, adapter_dir, tokens: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(tokens[None]).logits[0]


def _ids(seed: int, n: int = 20) -> list[int]:
    return torch.randint(3, 40, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "override, message",
    [
        (["lora.rank=4", "lora.targets=q_proj,qkv_proj"], r"lora.targets: expected distinct names from q_proj, k_proj"),
        (["lora.rank=4", "lora.targets=q_proj,q_proj"], "lora.targets: expected distinct names"),
        (["lora.rank=4", "lora.targets=[]"], "lora.targets: .* got none"),
        (["lora.rank=-1"], r"lora.rank: must be >= 0"),
        (["lora.rank=4", "lora.alpha=0"], r"lora.alpha: must be > 0"),
        (["lora.alpha=16"], "lora.alpha=16 has no effect with lora.rank=0"),
        (["lora.rank=4", "algorithm.ratio_source=shadow"], "ratio_source=shadow with lora.rank > 0"),
        (["lora.rank=4", "distributed.rollout_workers=1"], "lora.rank > 0 runs in one process only"),
        (["lora.merge=false"], "lora.merge=false has no effect with lora.rank=0"),
        (["lora.rank=4", "lora.merge=false", "algorithm.probe=true"], "the probe scores merged weights"),
    ],
)
def test_bad_lora_keys_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        config.load(TrainConfig, None, override)


def test_lora_keys_resolve():
    cfg = config.load(TrainConfig, None, ["lora.rank=8", "lora.targets=q_proj, v_proj"])
    assert cfg.lora_config() == LoRAConfig(8, 16.0, ("q_proj", "v_proj"))  # alpha: 2 x rank
    assert config.load(TrainConfig, None, []).lora_config() is None
    assert config.load(TrainConfig, None, ["lora.rank=4", "lora.alpha=4"]).lora_config().scale == 1.0


def test_the_learning_rate_default_follows_the_model(llama_dir):
    def lr(*keys):
        return config.load(TrainConfig, None, list(keys)).trainer.lr

    assert lr() == lr(f"model={BUILTIN_DIR}") == 2e-4  # the built-in model, by name or directory
    assert lr(f"model={llama_dir}") == 1e-6 and lr(f"model={llama_dir}", "lora.rank=4") == 1e-5
    assert lr(f"model={llama_dir}", "trainer.lr=3e-6") == 3e-6


# ----------------------------------------------------------------------------- PEFT compatibility


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from architectures import save_random_model

    return save_random_model(tmp_path_factory.mktemp("moe"), "qwen3_moe")


@pytest.mark.parametrize("fixture", ["llama_dir", "qwen2_dir", "moe_dir"])
def test_peft_computes_the_trainer_logits_from_saved_adapters(fixture, request, tmp_path):
    """Untied and tied heads, Q/K/V biases, a MoE model (attention adapted): PEFT's FP32 logits
    with Parity's adapters are the trainer's."""
    path = request.getfixturevalue(fixture)
    lora = LoRAConfig(4, 8.0, ATTENTION) if fixture == "moe_dir" else LORA
    trainer = Trainer(load_model(path, kernels.numerics()), "fp32", OptimConfig(), lora, seed=1)
    _random_adapters(trainer, seed=2)
    adapter = save_adapter(trainer.model, lora, tmp_path / "adapter", base_model=str(path))
    ours, tokens = _stream_logits(trainer.model, _ids(0))
    theirs = _peft_logits(path, adapter, tokens)
    assert (ours - theirs).abs().max() < 2e-5
    base, _ = _stream_logits(load_model(path, kernels.numerics()), _ids(0))
    assert (ours - base).abs().max() > 1e-2  # the adapters matter at this tolerance


def test_mlp_targets_are_refused_on_a_moe_model(moe_dir):
    """PEFT (transformers 5) reads gate/up/down_proj on a MoE model as the stacked experts."""
    with pytest.raises(AdapterError, match="lora.targets: gate_proj, up_proj, down_proj on a qwen3_moe"):
        Trainer(load_model(moe_dir, kernels.numerics()), "fp32", OptimConfig(), LORA)


def test_a_parity_train_checkpoint_loads_in_peft(llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = [f"model={llama_dir}", "task.name=length", "precision=fp32", "lora.rank=4", "trainer.lr=0.01"]
    assert main(["train", f"run_dir={run_dir}", "steps=2", *TINY, *args]) == 0
    ckpt = checkpoints(run_dir)[-1]
    assert not (ckpt / "model").exists()
    saved = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())
    assert (saved["peft_type"], saved["r"], saved["lora_alpha"], saved["task_type"]) == ("LORA", 4, 8.0, "CAUSAL_LM")
    keys = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    assert f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight" in keys and len(keys) == 2 * 7 * 2
    trainer = Trainer(load_model(llama_dir, kernels.numerics()), "fp32", OptimConfig(), LoRAConfig(4, 8.0), seed=0)
    load_checkpoint(ckpt, trainer, base_dir=llama_dir)
    assert any(m.lora_B.abs().max() > 0 for _, m in adapted(trainer.model))  # it trained
    ours, tokens = _stream_logits(trainer.model, _ids(1))
    assert (ours - _peft_logits(llama_dir, ckpt / "adapter", tokens)).abs().max() < 2e-5


# ----------------------------------------------------------------------------- training


def test_only_the_adapters_train_and_the_base_stays_bit_identical(tmp_path):
    run = Run.create(
        config.load(TrainConfig, None, [f"run_dir={tmp_path}", "precision=bf16", "lora.rank=4", "steps=2", *TINY]),
        progress=False,
    )
    model = run.backend.trainer.model
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not n.endswith(("lora_A", "lora_B"))}
    start = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(("lora_A", "lora_B"))}
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for n, p in model.named_parameters() if n in base)
    assert all(p.dtype == torch.float32 and p.requires_grad for n, p in model.named_parameters() if n in start)
    assert {id(p) for p in run.backend.trainer.params} == {id(p) for n, p in model.named_parameters() if n in start}
    assert len(start) == 2 * 7 * model.config.num_layers
    run.step()
    run.step()
    run.rewards.close()
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in base.items())
    assert all(not torch.equal(after[n], t) for n, t in start.items() if n.endswith("lora_B"))
    # The sync sent the merged weights: the engine's projection is W + scale·B·A rounded to BF16.
    q = model.model.layers[0].self_attn.q_proj
    merged = (q.weight.float() + (q.lora_B @ q.lora_A) * q.scale).to(torch.bfloat16)
    assert torch.equal(
        run.backend.sampler.engine.weights.named_weights()["model.layers.0.self_attn.q_proj.weight"], merged
    )


def test_merged_weights_give_the_rollout_engine_the_trainers_pi(llama_dir):
    tok = load_tokenizer(llama_dir)
    trainer = Trainer(load_model(llama_dir, kernels.numerics()), "fp32", OptimConfig(), LORA, seed=0)
    _random_adapters(trainer, seed=3)
    state, version = trainer.export_weights()
    assert not any(k.endswith(("lora_A", "lora_B")) for k in state) and "lm_head.weight" in state
    assert isinstance(trainer.model.model.layers[0].mlp.down_proj, LoRALinear)
    engine = RolloutEngine(trainer.model.config, "fp32", tok.eos_ids, tok.pad_id, kernels.numerics())
    engine.weights.load(state, version)
    batch = engine.generate([tok.encode(p) for p in ("12+34=", "7+8=")], 4, SamplingParams(max_new_tokens=24), 0)
    with torch.no_grad():
        pi = trainer.logprobs(batch.prompt_ids, batch.response_ids, batch.response_mask)
    assert (pi - batch.rollout_logprobs).abs().max() < 2e-5
    base = load_model(llama_dir, kernels.numerics()).state_dict()["model.layers.0.mlp.down_proj.weight"]
    assert (state["model.layers.0.mlp.down_proj.weight"] - base).abs().max() > 1e-2


@pytest.mark.parametrize("targets", [TARGETS, ("q_proj", "v_proj", "down_proj")])
def test_unmerged_adapters_give_the_rollout_engine_the_trainers_pi(llama_dir, targets):
    tok = load_tokenizer(llama_dir)
    trainer = Trainer(
        load_model(llama_dir, kernels.numerics()), "fp32", OptimConfig(), LoRAConfig(4, 8.0, targets), seed=0
    )
    _random_adapters(trainer, seed=3)
    engine = RolloutEngine(trainer.model.config, "fp32", tok.eos_ids, tok.pad_id, kernels.numerics())
    engine.weights.load(*trainer.export_weights(merge=False))
    engine.weights.load_adapters(*trainer.export_adapters())
    parts = {"q_proj": "qkv", "v_proj": "qkv", "k_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up"}
    assert set(engine.weights.layers[0].lora) == {
        parts.get(t, "down" if t == "down_proj" else "gate_up") for t in targets
    }
    batch = engine.generate([tok.encode(p) for p in ("12+34=", "7+8=")], 4, SamplingParams(max_new_tokens=24), 0)
    with torch.no_grad():
        pi = trainer.logprobs(batch.prompt_ids, batch.response_ids, batch.response_mask)
    assert (pi - batch.rollout_logprobs).abs().max() < 2e-5
    with pytest.raises(ValueError, match="no projection named"):
        engine.weights.load_adapters({"model.layers.0.self_attn.x_proj": (torch.zeros(4, 8), torch.zeros(8, 4))}, 1)


def test_unmerged_lora_shares_the_base_and_syncs_only_adapters(tmp_path, monkeypatch):
    # The base is shared where the engine holds it in BF16 (native BF16 matmuls; a CPU without them
    # holds it in FP32 and cannot share it): force that path whatever this processor has.
    monkeypatch.setattr(cpu, "emulated_dtypes", lambda: frozenset({torch.float16}))
    run = Run.create(
        config.load(
            TrainConfig,
            None,
            [f"run_dir={tmp_path}", "precision=bf16", "lora.rank=4", "lora.merge=false", "steps=2", *TINY],
        ),
        progress=False,
    )
    model, engine = run.backend.trainer.model, run.backend.sampler.engine
    o_proj = model.model.layers[0].self_attn.o_proj
    # The frozen base is held once: a projection the engine does not fuse is the trainer's own BF16
    # tensor, and the trainer's Q, K, V, gate and up are views into the engine's fused projections.
    assert engine.weights.layers[0].tensors["o"].data_ptr() == o_proj.weight.data_ptr()
    layer = model.model.layers[1]
    fused = {
        engine.weights.layers[1].tensors["qkv"].untyped_storage().data_ptr(),
        engine.weights.layers[1].tensors["gate_up"].untyped_storage().data_ptr(),
    }
    for proj in (*(getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj")), layer.mlp.up_proj):
        assert proj.weight.untyped_storage().data_ptr() in fused
    run.step()
    run.step()
    run.rewards.close()
    a, b, _ = engine.weights.layers[0].lora["o"]  # BF16 values, held in FP32 on the CPU (LayerWeights.project)
    assert a.dtype == b.dtype == torch.float32
    assert torch.equal(a, o_proj.lora_A.to(torch.bfloat16).float())
    assert torch.equal(b, (o_proj.lora_B * o_proj.scale).to(torch.bfloat16).float()) and b.abs().max() > 0
    assert engine.weights.version == run.backend.trainer.weight_version == 2


# ----------------------------------------------------------------------------- checkpoints


def test_resume_with_lora_is_exact_and_refuses_a_changed_base(tmp_path, capsys):
    base_dir = tmp_path / "base"
    shutil.copytree(BUILTIN_DIR, base_dir)
    args = [f"model={base_dir}", "precision=fp16", "lora.rank=4", "lora.targets=q_proj,v_proj,down_proj", *TINY]
    # eval.every=-1: the shorter first run would evaluate after its own last step, where the reference does not
    args += ["checkpoint_every=1", "algorithm.name=grpo", "algorithm.ppo_epochs=2", "eval.every=-1"]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    assert main(["train", f"run_dir={reference}", "steps=3", *args]) == 0
    assert main(["train", f"run_dir={resumed}", "steps=1", *args]) == 0
    assert main(["train", "--resume", str(resumed), "steps=3"]) == 0
    assert "continuing from step 1" in capsys.readouterr().err
    assert metrics(resumed, drop=TIMING) == metrics(reference, drop=TIMING)
    for name in ("adapter/adapter_model.safetensors", "optimizer.safetensors"):
        a, b = (load_file(str(checkpoints(r)[-1] / name)) for r in (reference, resumed))
        for saved in (a, b):  # the global RNG state differs after any resume; sampling has its own seeds
            saved.pop("rng.torch", None)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name

    weights = load_file(str(base_dir / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.01
    save_file(weights, str(base_dir / "model.safetensors"), metadata={"format": "pt"})
    assert main(["train", "--resume", str(resumed), "steps=4"]) == 2
    assert "is not the one this run's LoRA adapters were trained on" in capsys.readouterr().err
    assert [p.name for p in checkpoints(resumed)] == ["step_000002", "step_000003"]  # nothing set aside
    assert not (resumed / "checkpoints" / "corrupt").exists()


def test_a_moved_base_model_is_given_its_new_place_and_checked(tmp_path, capsys):
    """A run or an adapter whose base model moved could not be evaluated or resumed: `model=` now gives a LoRA
    run's base where it is, checked against the fingerprint its checkpoints record; a full run's record none, so
    its base stays where config.yaml says (a symlink will do)."""
    base, moved, other = tmp_path / "base", tmp_path / "moved", tmp_path / "other"
    shutil.copytree(BUILTIN_DIR, base)
    run, full = tmp_path / "run", tmp_path / "full"
    tiny = [*TINY, "steps=1", "checkpoint_every=1", "eval.every=-1"]
    assert main(["train", f"model={base}", "lora.rank=4", f"run_dir={run}", *tiny]) == 0
    assert main(["train", f"model={base}", f"run_dir={full}", *tiny]) == 0
    base.rename(moved)
    shutil.copytree(moved, other)  # the same shapes, another model: the adapters would load on it
    weights = load_file(str(other / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.01
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    adapter = checkpoints(run)[-1] / "adapter"
    keys = ["num_prompts=2", "samples=1", "precisions=[bf16]"]

    def refused(args: list[str], message: str) -> None:
        assert main(args) == 2
        assert message in capsys.readouterr().err

    for target in (run, adapter):
        refused(["eval", str(target), *keys, f"out={tmp_path / 'e'}"], "moved, give its place: model=DIR")
        refused(["eval", str(target), f"model={other}", *keys], "is not the one this run's LoRA adapters were trained")
        assert main(["eval", str(target), f"model={moved}", *keys, f"out={tmp_path / ('eval-' + target.name)}"]) == 0
    refused(["eval", str(full), f"model={moved}", *keys], "a full run's checkpoints do not record their base model")
    refused(["eval", "builtin", f"model={moved}", *keys], "builtin is neither")

    refused(["train", "--resume", str(run), "steps=2"], "if the run's model moved, give its place: model=DIR")
    refused(["train", "--resume", str(run), "steps=2", f"model={other}"], "give that base (model=DIR where it is now)")
    assert f"model: {base}" in (run / "config.yaml").read_text()  # a refused resume changes nothing
    assert main(["train", "--resume", str(run), "steps=2", f"model={moved}"]) == 0
    assert f"model: {moved}" in (run / "config.yaml").read_text() and len(checkpoints(run)) == 2
    refused(["train", "--resume", str(full), "steps=2"], "put it back there (a symlink will do)")
    refused(["train", "--resume", str(full), "steps=2", f"model={moved}"], "cannot change on resume of a full run")
    (full / "config.yaml").write_text((full / "config.yaml").read_text().replace(f"model: {base}", f"model: {moved}"))
    refused(["train", "--resume", str(full), "steps=2"], "config.yaml differs from the config the run was trained with")


def test_lora_and_full_checkpoints_do_not_cross(tmp_path):
    def trainer(lora):
        return Trainer(load_model("builtin", kernels.numerics()), "fp16", OptimConfig(), lora)

    lora_ckpt = save_checkpoint(tmp_path / "a", trainer(LORA), RunState(1, 0, 0), BUILTIN_DIR, keep=1)
    full_ckpt = save_checkpoint(tmp_path / "b", trainer(None), RunState(1, 0, 0), BUILTIN_DIR, keep=1)
    with pytest.raises(ConfigError, match="holds LoRA adapters, but this trainer trains full weights"):
        load_checkpoint(lora_ckpt, trainer(None), base_dir=BUILTIN_DIR)
    with pytest.raises(ConfigError, match="holds full weights, but this trainer trains LoRA adapters"):
        load_checkpoint(full_ckpt, trainer(LORA), base_dir=BUILTIN_DIR)
    assert load_checkpoint(lora_ckpt, trainer(LORA), base_dir=BUILTIN_DIR).step == 1


# ----------------------------------------------------------------------------- hostile adapter folders


def _hostile_adapter_configs() -> dict[str, tuple[str, str | bytes]]:
    """adapter_config.json files to refuse, by name: (what the refusal names after the file, the file's text).
    Each field Parity reads gets values of every wrong kind and out of its range, or goes missing; each PEFT
    option that changes the arithmetic gets a value other than its plain one; and files that are not a JSON
    object."""
    valid = peft_config(LORA, "builtin")
    kinds = {"string": "x", "true": True, "null": None, "list": [4], "object": {"a": 1}, "fraction": 4.5}
    bad = {
        "r": {**kinds, "0": 0, "-4": -4, "10**30": 10**30, "100000": 100_000, "4.0": 4.0, "'4'": "4"},
        "lora_alpha": {
            **{k: v for k, v in kinds.items() if k != "fraction"},
            "0": 0,
            "-8": -8,
            "NaN": float("nan"),
            "Infinity": float("inf"),
            "'8'": "8",
        },
        "target_modules": {
            **kinds,
            "a regex string": "q_proj|v_proj",
            "a name string": "q_proj",
            "empty": [],
            "unknown name": ["q_proj", "qkv_proj"],
            "twice": ["q_proj", "q_proj"],
        },
        "peft_type": {**kinds, "IA3": "IA3", "lower case": "lora"},
        "base_model_name_or_path": {k: v for k, v in kinds.items() if k != "string"} | {"empty": ""},
    }
    for key, plain in PLAIN_LORA_OPTIONS.items():
        bad[key] = {k: v for k, v in (kinds | {"all": "all", "1": 1}).items() if v not in plain}
    # PEFT options outside that list that change what an adapter computes (aLoRA was read as plain LoRA)
    bad |= {
        "alora_invocation_tokens": {"list": [1000, 1001]},
        "lora_bias": {"true": True},
        "layer_replication": {"list": [[0, 1]]},
        "trainable_token_indices": {"list": [5]},
        "a field of a later PEFT": {"string": "x"},
    }
    cases = {}
    for key, values in bad.items():
        cases |= {f"{key}={name}": (key, json.dumps(valid | {key: value})) for name, value in values.items()}
    for key in ("peft_type", "r", "lora_alpha", "target_modules", "base_model_name_or_path"):
        cases[f"no {key}"] = (key, json.dumps({k: v for k, v in valid.items() if k != key}))
    cases["a list"] = ("expected a JSON object", "[" + json.dumps(valid) + "]")
    cases["nested 100,000 deep"] = ("JSON nested more than 100 deep", "[" * 100_000 + "]" * 100_000)
    cases["cut short"] = ("invalid JSON", json.dumps(valid)[:40])
    cases["not UTF-8"] = ("not UTF-8", b'{"r": "\xff"}')
    return cases


HOSTILE_ADAPTERS = _hostile_adapter_configs()


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    trainer = Trainer(load_model("builtin", kernels.numerics()), "fp32", OptimConfig(), LORA, seed=1)
    return save_adapter(trainer.model, LORA, tmp_path_factory.mktemp("adapter") / "adapter", base_model="builtin")


@pytest.mark.parametrize("case", HOSTILE_ADAPTERS)
def test_a_hostile_adapter_config_is_one_line_naming_file_and_key(adapter_dir, tmp_path, capsys, case):
    """`parity eval` on a LoRA adapter folder: r 0 divided by zero, a negative r built a tensor of negative size,
    a string or unknown target_modules took min() of nothing, 100,000-deep nesting overflowed the stack."""
    what, text = HOSTILE_ADAPTERS[case]
    folder = tmp_path / "adapter"
    shutil.copytree(adapter_dir, folder)
    config_file = folder / CONFIG_FILE
    config_file.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = tmp_path / "out"
    assert main(["eval", str(folder), "--out", str(out), "precisions=fp32", "num_prompts=1", "samples=1"]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("parity ")]
    assert len(lines) == 1 and re.search(rf"{re.escape(str(config_file))}(:\d+)?: {re.escape(what)}", lines[0]), lines
    assert not out.exists()
    if what != "base_model_name_or_path":  # a checkpoint's adapters, read by the same rules: set aside, no crash
        with pytest.raises(AdapterError, match=re.escape(str(config_file))):
            read_adapter(folder, LORA)


def test_an_adapter_config_that_is_a_fifo_is_refused_unread(adapter_dir, tmp_path, capsys):
    folder = tmp_path / "adapter"
    shutil.copytree(adapter_dir, folder)
    (folder / CONFIG_FILE).unlink()
    os.mkfifo(folder / CONFIG_FILE)  # no writer: a read would wait for ever
    assert main(["eval", str(folder), "--out", str(tmp_path / "out")]) == 2
    assert f"{folder / CONFIG_FILE} is not a regular file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", [float("nan"), "int32"])
def test_adapter_tensors_that_are_not_finite_floats_are_refused(adapter_dir, tmp_path, capsys, value):
    """An adapter holding NaN was evaluated, its NaN KL written; an integer one was cast silently."""
    folder = tmp_path / "adapter"
    shutil.copytree(adapter_dir, folder)
    tensors = load_file(folder / "adapter_model.safetensors")
    name = next(k for k in tensors if "lora_B" in k)
    if value == "int32":
        tensors[name] = (tensors[name] * 100).to(torch.int32)
    else:
        tensors[name][0, 0] = value
    save_file(tensors, folder / "adapter_model.safetensors")
    out = tmp_path / "out"
    assert main(["eval", str(folder), "--out", str(out), "precisions=fp32", "num_prompts=1", "samples=1"]) == 2
    assert f"adapter tensors that are not finite floating-point numbers: {name}" in capsys.readouterr().err
    assert not out.exists()
