"""Hostile model directories: each bad file or value ends in one line naming it, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from parity.cli import main
from parity.engines.models import ModelError, load_model
from parity.engines.tokenizer import TEMPLATE_CHARS, ChatTemplateError, load_tokenizer


def edit_json(name: str, change):
    """A case that rewrites one JSON file of the directory: `change(data)` returns the new content."""

    def apply(d: Path) -> None:
        path = d / name
        data = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps(change(data)))

    return apply


def config(**values):
    return edit_json("config.json", lambda c: {**c, **values})


def rope(**values):
    """RoPE parameters as transformers 5 writes them (`rope_parameters`, which rope_theta/rope_scaling yield to)."""
    return config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **values})


def old_rope(**values):
    """The older layout: rope_theta and rope_scaling at the top level."""
    return edit_json("config.json", lambda c: {**{k: v for k, v in c.items() if k != "rope_parameters"}, **values})


def drop(key: str):
    return edit_json("config.json", lambda c: {k: v for k, v in c.items() if k != key})


def write(name: str, content: bytes | str):
    def apply(d: Path) -> None:
        (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())

    return apply


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def shard_index(weight_map):
    def apply(d: Path) -> None:
        (d / "model.safetensors").rename(d / "shard-1.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps(weight_map))

    return apply


def nan_weight(d: Path) -> None:
    state = load_file(str(d / "model.safetensors"))
    state["model.norm.weight"][0] = float("nan")
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


# (case, change to a valid tiny Llama directory, what the one-line error must say)
CASES = [
    ("hidden_size a string", config(hidden_size="big"), "hidden_size: expected an integer, got 'big'"),
    ("rms_norm_eps a string", config(rms_norm_eps="tiny"), "rms_norm_eps: expected a positive number"),
    ("rope_theta a string", rope(rope_theta="abc"), "rope_theta: expected a positive number, got 'abc'"),
    ("rope_theta negative", rope(rope_theta=-5.0), "rope_theta: expected a positive number, got -5.0"),
    ("old rope_theta negative", old_rope(rope_theta=-5.0), "rope_theta: expected a positive number"),
    ("config a list", write("config.json", "[1, 2]"), "expected a JSON object {...} at the top level, got a list"),
    ("num_attention_heads missing", drop("num_attention_heads"), "num_attention_heads is missing"),
    ("rope_scaling a string", old_rope(rope_scaling="linear"), "rope_scaling: expected an object"),
    ("rope_parameters a list", config(rope_parameters=[1]), "rope_parameters: expected an object"),
    ("linear RoPE without factor", rope(rope_type="linear"), "RoPE factor is missing"),
    ("linear RoPE factor 0", old_rope(rope_scaling={"type": "linear", "factor": 0}), "factor: expected a positive"),
    ("negative hidden_size", config(hidden_size=-64), "hidden_size: expected an integer >= 1, got -64"),
    ("pad id beyond the vocabulary", config(pad_token_id=64), "pad_token_id: expected an integer between 0 and 63"),
    ("eos id beyond int64", config(eos_token_id=2**70), "eos_token_id: expected an integer between 0 and 63"),
    ("negative eos id", config(eos_token_id=-1), "eos_token_id: expected an integer between 0 and 63"),
    ("eos id list with a string", config(eos_token_id=[2, "x"]), "eos_token_id: expected an integer, got 'x'"),
    ("kv heads not dividing", config(num_key_value_heads=3), "num_key_value_heads (3) must divide"),
    ("vocab_size 10**12", config(vocab_size=10**12), "but model.embed_tokens.weight is (64, 64)"),
    ("layers 10**6", config(num_hidden_layers=10**6), "num_hidden_layers 1000000, but the weights hold 2 layers"),
    ("intermediate_size huge", config(intermediate_size=10**9), "intermediate_size make model.layers.0.mlp.gate_proj"),
    ("max_position_embeddings 10**15", config(max_position_embeddings=10**15), "between 1 and 2097152"),
    (
        "generation eos beyond vocabulary",
        edit_json("generation_config.json", lambda c: {"eos_token_id": 99}),
        "generation_config.json: eos_token_id",
    ),
    ("tokenizer.json not UTF-8", write("tokenizer.json", b"\xff\xfe\x00garbage"), "tokenizer.json: not UTF-8 text"),
    ("tokenizer.json a list", write("tokenizer.json", "[]"), "tokenizer.json: not a readable tokenizer.json"),
    ("tokenizer_config not UTF-8", write("tokenizer_config.json", b"\x80"), "tokenizer_config.json: not UTF-8 text"),
    ("tokenizer_config a list", write("tokenizer_config.json", "[]"), "tokenizer_config.json: expected a JSON object"),
    ("index without weight_map", shard_index({"metadata": {}}), 'expected {"weight_map"'),
    ("index a list", shard_index([]), "model.safetensors.index.json: expected a JSON object"),
    ("config nested 100k deep", write("config.json", nested(100_000)), "config.json: JSON nested too deeply"),
    ("NaN weights", nan_weight, "weights hold inf/NaN (model.norm.weight)"),
]


@pytest.fixture
def model_copy(llama_dir, tmp_path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(llama_dir, out)
    return out


@pytest.mark.parametrize("case, change, message", CASES, ids=[c[0] for c in CASES])
def test_a_bad_model_directory_is_one_line_and_exit_2(case, change, message, model_copy, tmp_path, capsys):
    change(model_copy)
    out = tmp_path / "out.json"
    args = ["mismatch", "--model", str(model_copy), "num_prompts=2", "group_size=1", "pairs=[fp32/fp32]"]
    code = main([*args, "sampling.max_new_tokens=4", f"out={out}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and message in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    "change, message",
    [(config(pad_token_id=64), "pad_token_id"), (nan_weight, "weights hold inf/NaN (model.norm.weight)")],
    ids=["pad id beyond the vocabulary", "NaN weights"],
)
def test_a_bad_model_stops_training_before_anything_is_written(change, message, model_copy, tmp_path, capsys):
    change(model_copy)
    run_dir = tmp_path / "run"
    assert main(["train", f"model={model_copy}", f"run_dir={run_dir}", "task.name=number", "steps=1"]) == 2
    assert message in capsys.readouterr().err and not run_dir.exists()


def test_files_linked_from_outside_the_directory_are_refused(model_copy, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("{{ 'root:x:0:0' }}")
    (model_copy / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(ModelError, match="chat_template.jinja: links to .*secret.txt, outside the model directory"):
        load_tokenizer(model_copy)
    (model_copy / "chat_template.jinja").unlink()
    outside = tmp_path / "elsewhere.json"
    (model_copy / "tokenizer.json").rename(outside)
    (model_copy / "tokenizer.json").symlink_to(outside)
    with pytest.raises(ModelError, match="tokenizer.json: links to"):
        load_tokenizer(model_copy)


def test_a_hugging_face_cache_snapshot_links_to_its_blobs(llama_dir, tmp_path):
    """The Hub cache keeps files in blobs/ and links snapshots/REV/NAME to them: that is inside the repository."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in llama_dir.iterdir():
        shutil.copy(f, repo / "blobs" / f.name)
        (snapshot / f.name).symlink_to(Path("../../blobs") / f.name)
    assert load_model(snapshot).config.vocab_size == 64
    assert load_tokenizer(snapshot).eos_ids == (2,)


@pytest.mark.parametrize(
    "template, message",
    [
        ("{% for i in range(10**9) %}{% endfor %}", "ran longer than"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran longer than"),
        ("{{ 'x' * 10**9 }}", "would build a value beyond"),
        (
            "{% set ns = namespace(s='xx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "more than",
        ),
        ("{% for i in range(2000000) %}{{ 'abc' }}{% endfor %}", f"more than {TEMPLATE_CHARS:,} characters"),
    ],
    ids=["long loop", "nested loops", "huge string", "doubling namespace", "huge output"],
)
def test_a_chat_template_gets_a_time_and_size_budget(template, message, model_copy, monkeypatch):
    monkeypatch.setattr("parity.engines.tokenizer.TEMPLATE_SECONDS", 1.0)
    (model_copy / "chat_template.jinja").write_text(template)
    tok = load_tokenizer(model_copy)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=message):
        tok.encode_chat([{"role": "user", "content": "hi"}])
    assert time.monotonic() - start < 10
