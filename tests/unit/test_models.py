"""Loading real Hugging Face checkpoints, numerics against `transformers`, and load errors."""

from __future__ import annotations

import json
import shutil
from functools import partial

import pytest
import torch

from parity.engines import kernels
from parity.engines.models.config import ModelError
from parity.engines.models.io import load_model, resolve_model_dir, save_model
from parity.engines.packing import pack
from parity.engines.tokenizer import copy_tokenizer_files, load_tokenizer
from parity.engines.trainer import OptimConfig, Trainer
from parity.rl.checkpoint import RunState, save_checkpoint


@pytest.mark.parametrize("fixture", ["llama_dir", "qwen2_dir"])
def test_packed_logits_match_transformers_fp32(fixture, request):
    """Shared prompts and a prefix two prompts share stored once, ragged responses, no padding: every
    stream position's logits equal transformers' on the row written out in full."""
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(fixture)
    ours = load_model(path, kernels.numerics())
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    short = torch.randint(3, 40, (3,), generator=gen).tolist()
    long = short[:2] + torch.randint(3, 40, (7,), generator=gen).tolist()
    assert long[2] != short[2]
    prompts = [short, short, long, long, long]
    lengths = [4, 1, 6, 3, 0]
    responses = torch.randint(3, 40, (5, 6), generator=gen)
    mask = torch.arange(6) < torch.tensor(lengths)[:, None]
    packed = pack(prompts, responses, mask)
    # The stream: the prompts' common prefix once, the rest of each distinct prompt once, then every
    # response without its last token.
    streamed = [max(n - 1, 0) for n in lengths]
    assert packed.num_tokens == 2 + 1 + 7 + sum(streamed)
    with torch.no_grad():
        got = ours.logits(ours.hidden_states(packed, torch.float32))
        for row, prompt in enumerate(prompts):
            start = int(packed.response_start[row])
            stream = torch.cat([packed.prompt_index[row, : len(prompt)], torch.arange(start, start + streamed[row])])
            full = torch.tensor(prompt + responses[row, : streamed[row]].tolist())
            assert torch.equal(packed.token_ids[stream], full)
            expected = ref(full[None]).logits[0]
            assert torch.allclose(got[stream], expected, atol=2e-5, rtol=1e-4), (got[stream] - expected).abs().max()


def test_save_roundtrip_loads_in_transformers(llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    ours = load_model(llama_dir, kernels.numerics())
    out = save_model(ours, tmp_path / "copy", partial(copy_tokenizer_files, llama_dir))
    ref = AutoModelForCausalLM.from_pretrained(out)
    for name, p in ref.state_dict().items():
        assert torch.equal(p, ours.state_dict()[name]), name
    assert load_tokenizer(out).eos_id == 2


def test_tokenizer_special_ids(llama_dir):
    tok = load_tokenizer(llama_dir)
    assert (tok.eos_ids, tok.pad_id, tok.bos_id) == ((2,), 0, 1)
    ids = tok.encode("12+3=")
    assert ids[0] == 1 and tok.decode(ids) == "12+3="


def test_builtin_model_loads():
    model = load_model("builtin", kernels.numerics())
    tok = load_tokenizer("builtin")
    assert model.config.architecture == "llama"
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    assert tok.decode(tok.encode("123+45=")) == "123+45="


# ----------------------------------------------------------------------------- errors


def test_missing_directory():
    with pytest.raises(ModelError, match="no such directory"):
        resolve_model_dir("/nonexistent/model")


def _copy(src, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(src, d)
    return d


def test_missing_tokenizer(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="no tokenizer.json"):
        load_tokenizer(d)


def test_pickle_only_weights_refused(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    (d / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    with pytest.raises(ModelError, match="pickle files.*never unpickles"):
        load_model(d, kernels.numerics())


def test_unsupported_architecture(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="unsupported architecture model_type=.gpt2.*llama, mistral, qwen2"):
        load_model(d, kernels.numerics())


def test_missing_config(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(ModelError, match="no config.json"):
        load_model(d, kernels.numerics())


def test_cli_reports_model_error_in_one_line(capsys):
    from parity.cli import main

    assert main(["mismatch", "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such directory" in err


def _stack_experts(src, dst):
    """`src`'s MoE checkpoint with each layer's experts stacked in two tensors, as transformers 5 holds
    them (gate_up_proj [E, 2I, H], down_proj [E, H, I]), written to `dst`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    layers = sorted({k.split("experts.")[0] for k in state if ".mlp.experts." in k})
    for prefix in layers:
        experts = len([k for k in state if k.startswith(prefix + "experts.") and k.endswith(".gate_proj.weight")])

        def take(e, proj, prefix=prefix):
            return state.pop(f"{prefix}experts.{e}.{proj}.weight")

        gate_up = torch.stack([torch.cat([take(e, "gate_proj"), take(e, "up_proj")]) for e in range(experts)])
        state[prefix + "experts.gate_up_proj"] = gate_up
        state[prefix + "experts.down_proj"] = torch.stack([take(e, "down_proj") for e in range(experts)])
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_stacked_experts_load_as_the_per_expert_checkpoint(tmp_path):
    from architectures import save_random_model

    per_expert = save_random_model(tmp_path / "per-expert", "qwen3_moe")
    stacked = _stack_experts(per_expert, tmp_path / "stacked")
    expected, got = (
        load_model(per_expert, kernels.numerics()).state_dict(),
        load_model(stacked, kernels.numerics()).state_dict(),
    )
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def _load_on_rank(rank: int, world: int, model_dirs: dict, checkpoints: dict, init_file, out_dir) -> None:
    """One learner's side of test_each_learner_reads_only_its_rows, for each model of `model_dirs` in turn
    (one process group for all: starting processes costs more than loading these models): the FSDP2 model
    loaded as learners load it, against the model loaded whole, and given the one-process checkpoint in
    `checkpoints`; what it found goes to out_dir/NAME-RANK.json."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for name, model_dir in model_dirs.items():
            found = _sharded_load_findings(world, model_dir, checkpoints[name])
            (out_dir / f"{name}-{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


def _sharded_load_findings(world: int, model_dir, checkpoint) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from parity.config import ConfigError
    from parity.distributed.actors import load_sharded
    from parity.engines.models import io as model_io
    from parity.rl.checkpoint import load_checkpoint

    reads = []
    real_read = model_io._WeightFiles.read

    def recorded(self, name, start, stop):
        reads.append((name, start, stop))
        return real_read(self, name, start, stop)

    model_io._WeightFiles.read = recorded
    try:
        sharded = load_sharded(model_dir, init_device_mesh("cpu", (world,)), kernels.numerics(), "fp32")
        model_io._WeightFiles.read = real_read
        whole = load_model(model_dir, kernels.numerics())
        expected = whole.state_dict()
        local_equal, full_equal, rows_read = [], [], {}
        for name, param in sharded.state_dict().items():
            local, first = model_io._local_rows(param)
            local_equal.append(torch.equal(local, expected[name][first : first + local.shape[0]]))
            full_equal.append(torch.equal(param.full_tensor(), expected[name]))
        for name, start, stop in reads:
            rows_read[name] = rows_read.get(name, 0) + stop - start
        packed = pack([[5, 6, 7, 8]], torch.tensor([[9, 10, 11]]), torch.ones(1, 3, dtype=torch.bool))
        with torch.no_grad():
            logits_equal = torch.equal(sharded(packed, torch.float32), whole(packed, torch.float32))
        # In a 16-bit precision a decoder layer gathers its weights in that precision (MixedPrecisionPolicy),
        # the root FP32; the logits are the whole model's all the same.
        half = load_sharded(model_dir, init_device_mesh("cpu", (world,)), kernels.numerics(), "bf16")
        gathered = {}

        def record(where: str, module: torch.nn.Module, args: tuple) -> None:
            gathered.setdefault(where, str(module.weight.dtype))

        half.model.layers[0].self_attn.q_proj.register_forward_pre_hook(partial(record, "layer"))
        half.model.norm.register_forward_pre_hook(partial(record, "root"))
        with torch.no_grad():
            half_logits_equal = torch.equal(half(packed, torch.bfloat16), whole(packed, torch.bfloat16))
        try:  # a learner given a one-process checkpoint (a learner group writes sharded ones only)
            load_checkpoint(checkpoint, Trainer(sharded, "fp32", OptimConfig()))
            refused = None
        except ConfigError as e:
            refused = str(e)
        return {
            "whole_checkpoint_refused": refused,
            "local_equal": all(local_equal),
            "full_equal": all(full_equal),
            "buffers_equal": all(torch.equal(b, dict(whole.named_buffers())[n]) for n, b in sharded.named_buffers()),
            "tied": sharded.lm_head.weight is sharded.model.embed_tokens.weight,
            "rows_read": rows_read,
            "rows": {k: v.shape[0] for k, v in expected.items()},
            "logits_equal": logits_equal,
            "half_gathered": gathered,
            "half_logits_equal": half_logits_equal,
        }
    finally:
        model_io._WeightFiles.read = real_read


SHARDED_ARCHS = ("llama3", "qwen2", "qwen3_moe-stacked")
SHARDED_WORLD = 3


@pytest.fixture(scope="module")
def sharded_loads(tmp_path_factory):
    """Each of SHARDED_ARCHS loaded by 3 FSDP2 ranks (one spawn for all): {arch: (model_dir, [found per rank])}."""
    import torch.multiprocessing as mp

    from architectures import save_random_model

    root = tmp_path_factory.mktemp("sharded")
    model_dirs, checkpoints = {}, {}
    for arch in SHARDED_ARCHS:
        model_dir = save_random_model(root / arch / "model", arch.removesuffix("-stacked"))
        if arch.endswith("-stacked"):
            model_dir = _stack_experts(model_dir, root / arch / "stacked")
        model_dirs[arch] = model_dir
        whole = Trainer(load_model(model_dir, kernels.numerics()), "fp32", OptimConfig())
        checkpoints[arch] = save_checkpoint(root / f"{arch}-run", whole, RunState(1, 0), model_dir, keep=1)
    world = SHARDED_WORLD
    mp.spawn(_load_on_rank, args=(world, model_dirs, checkpoints, root / "init", root), nprocs=world, join=True)
    return {
        arch: (model_dir, [json.loads((root / f"{arch}-{r}.json").read_text()) for r in range(world)])
        for arch, model_dir in model_dirs.items()
    }


@pytest.mark.parametrize("arch", SHARDED_ARCHS)
def test_each_learner_reads_only_its_rows(sharded_loads, arch):
    """FSDP2 learners build the model on the meta device, shard it and read only their own rows of each
    weight (3 ranks: uneven shards, and a rank with no row of a short tensor); the shards make the
    model loaded whole, bit for bit: tied embeddings stay tied, the RoPE tables are recomputed, and the
    forward pass gives the same logits; in BF16 too, where each decoder layer gathers BF16 weights and the
    root FP32 ones. A learner given a one-process checkpoint refuses it in one line."""
    model_dir, found = sharded_loads[arch]
    world = SHARDED_WORLD
    tied = load_model(model_dir, kernels.numerics()).config.tie_word_embeddings
    for rank in found:
        assert rank["local_equal"] and rank["full_equal"] and rank["buffers_equal"] and rank["logits_equal"]
        assert rank["half_logits_equal"] and rank["half_gathered"] == {
            "layer": "torch.bfloat16",
            "root": "torch.float32",
        }
        assert rank["tied"] == tied
        assert (
            "a one-process checkpoint; a learner group resumes its own sharded ones" in rank["whole_checkpoint_refused"]
        )
    rows = found[0]["rows"]
    for name, total in rows.items():
        if tied and name == "lm_head.weight":
            continue
        per_rank = [rank["rows_read"].get(name, 0) for rank in found]
        assert sum(per_rank) == total, (name, per_rank)  # every row read once, by one learner
        assert max(per_rank) <= -(-total // world), (name, per_rank)


def test_stacked_experts_without_their_down_projection_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from architectures import save_random_model

    stacked = _stack_experts(save_random_model(tmp_path / "per-expert", "qwen3_moe"), tmp_path / "stacked")
    state = load_file(str(stacked / "model.safetensors"))
    del state["model.layers.0.mlp.experts.down_proj"]
    save_file(state, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"model.safetensors: stacked experts must be .*found \(4, 64, 64\) and None"):
        load_model(stacked, kernels.numerics())
