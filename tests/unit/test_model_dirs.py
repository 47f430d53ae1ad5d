"""Hostile model directories: each bad file or value ends in one line naming it, exit 2, nothing written."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from parity.cli import main
from parity.engines import kernels
from parity.engines.models.config import ModelError
from parity.engines.models.io import load_model
from parity.engines.template_sandbox import TEMPLATE_CHARS
from parity.engines.tokenizer import ChatTemplateError, load_tokenizer


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


def scale_weights(d: Path, factor: float) -> None:
    """Every projection scaled by `factor`: finite weights whose forward leaves the format's range."""
    state = load_file(str(d / "model.safetensors"))
    for name in state:
        if name.endswith("proj.weight"):
            state[name] = state[name] * factor
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})


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
    (
        "tie_word_embeddings a string",
        config(tie_word_embeddings="false"),
        "tie_word_embeddings: expected true or false",
    ),
    ("attention_bias a string", config(attention_bias="no"), "attention_bias: expected true or false, got 'no'"),
    ("rope_theta 1e-300", rope(rope_theta=1e-300), "give rotation angles beyond FP32's range"),
    ("RoPE factor 1e-320", rope(rope_type="linear", factor=1e-320), "give rotation angles beyond FP32's range"),
    ("weights past FP32's range", lambda d: scale_weights(d, 1e30), "the first forward in fp32 gives inf/NaN logits"),
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
    assert load_model(snapshot, kernels.numerics()).config.vocab_size == 64
    assert load_tokenizer(snapshot).eos_ids == (2,)


@pytest.mark.parametrize(
    "template, message",
    [
        ("{% for i in range(10**9) %}{% endfor %}", "ran longer than"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran longer than"),
        ("{{ 'x' * 10**9 }}", "would build a value beyond"),
        (
            "{% set ns = namespace(s='xx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "'~' would build a value beyond",
        ),
        ("{% for i in range(2000000) %}{{ 'abc' }}{% endfor %}", f"more than {TEMPLATE_CHARS:,} characters"),
    ],
    ids=["long loop", "nested loops", "huge string", "doubling namespace", "huge output"],
)
def test_a_chat_template_gets_a_time_and_size_budget(template, message, model_copy, monkeypatch):
    monkeypatch.setattr("parity.engines.template_sandbox.TEMPLATE_SECONDS", 1.0)
    (model_copy / "chat_template.jinja").write_text(template)
    tok = load_tokenizer(model_copy)
    with pytest.raises(ChatTemplateError, match=message):
        tok.encode_chat([{"role": "user", "content": "hi"}])


# ----------------------------------------------------------------------------- links out of the directory

SECRET = b"-----BEGIN OPENSSH PRIVATE KEY----- b3BlbnNzaC1rZXktdjEAAAAA parity-test-secret"


def _leaked(root: Path) -> list[Path]:
    """Files under `root` holding any byte run of the secret's key material."""
    return [
        p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and b"parity-test-secret" in p.read_bytes()
    ]


def _link(target: Path, at: Path, relative: bool) -> None:
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(Path(os.path.relpath(target, at.parent)) if relative else target)


LINKED = ["vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "additional_chat_templates/x.jinja"]


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
@pytest.mark.parametrize("name", [*LINKED, "additional_chat_templates"])
def test_a_tokenizer_file_linked_outside_never_reaches_a_checkpoint(name, relative, model_copy, tmp_path, capsys):
    """Each file a checkpoint copies (and the named templates' folder), linked to a private key outside
    the model directory: `parity train ... checkpoint_every=1` is refused in one line, writing nothing."""
    outside = tmp_path / "home" / ".ssh"
    outside.mkdir(parents=True)
    (outside / "id_rsa").write_bytes(SECRET)
    (outside / "default.jinja").write_bytes(SECRET)
    target = outside if name == "additional_chat_templates" else outside / "id_rsa"
    _link(target, model_copy / name, relative)
    run_dir = tmp_path / "run"
    args = ["train", f"model={model_copy}", f"run_dir={run_dir}", "task.name=number", "steps=1", "checkpoint_every=1"]
    assert main([*args, "prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "links to" in err and "outside the model directory" in err, err
    assert not run_dir.exists() and not _leaked(tmp_path / "run")


def _cache_snapshot(source: Path, hub: Path) -> Path:
    """`source` laid out as the Hugging Face cache keeps a download: blobs, and a snapshot linking to them."""
    repo = hub / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    return snapshot


def test_a_cache_snapshot_trains_and_its_checkpoint_holds_the_blobs(model_copy, tmp_path, capsys):
    (model_copy / "vocab.json").write_text('{"a": 0}')
    (model_copy / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    snapshot = _cache_snapshot(model_copy, tmp_path / "hub")
    run_dir = tmp_path / "run"
    args = ["train", f"model={snapshot}", f"run_dir={run_dir}", "task.name=number", "steps=1", "checkpoint_every=1"]
    assert main([*args, "prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4"]) == 0
    saved = run_dir / "checkpoints" / "step_000001" / "model"
    for name in ("vocab.json", "chat_template.jinja", "tokenizer.json"):
        assert not (saved / name).is_symlink() and (saved / name).read_bytes() == (model_copy / name).read_bytes()


def test_a_folder_named_snapshots_is_no_cache(model_copy, tmp_path):
    """Only HUB/models--ORG--NAME/snapshots/REV with its blobs/ is a cache snapshot; any other folder named
    snapshots/REV keeps its links inside itself (~/snapshots/rev/chat_template.jinja -> ~/.aws/credentials),
    and a real cache's snapshot may link into its blobs only."""
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_bytes(SECRET)
    fake = home / "snapshots" / "rev"
    shutil.copytree(model_copy, fake)
    (fake / "chat_template.jinja").symlink_to(Path("../../.aws/credentials"))
    with pytest.raises(ModelError, match=r"chat_template.jinja: links to .*credentials, outside the model directory"):
        load_tokenizer(fake)
    snapshot = _cache_snapshot(model_copy, tmp_path / "hub")
    repo = snapshot.parent.parent
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_bytes(SECRET)
    (snapshot / "chat_template.jinja").symlink_to(Path("../../refs/main"))
    with pytest.raises(ModelError, match=r"chat_template.jinja: links to .*refs/main, outside the model directory"):
        load_tokenizer(snapshot)


# ----------------------------------------------------------------------------- models that compute NaN


@pytest.mark.parametrize("precision, factor", [("fp32", 1e30), ("fp16", 1e4)])
def test_a_model_whose_first_forward_is_not_finite_trains_nothing(precision, factor, model_copy, tmp_path, capsys):
    """Finite weights and a valid config, yet the first forward leaves the precision's range: refused before
    anything is written, in the run's precision (FP16's range is 65504)."""
    scale_weights(model_copy, factor)
    run_dir = tmp_path / "run"
    args = ["train", f"model={model_copy}", f"run_dir={run_dir}", "task.name=number", f"precision={precision}"]
    assert main([*args, "steps=3", "prompts_per_step=2", "rollout.group_size=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"the first forward in {precision} gives inf/NaN logits" in err
    assert not run_dir.exists()


def test_doctor_names_a_model_that_computes_nan(model_copy, tmp_path, capsys):
    scale_weights(model_copy, 1e30)
    assert main(["doctor", "--model", str(model_copy), "--prompts", "2"]) == 1
    out = capsys.readouterr().out
    assert "Recommendation: NONE" in out and "the FP32 forward gives inf/NaN from" in out


# ----------------------------------------------------------------------------- prompts that cannot be sampled


EMPTY_TEMPLATES = {
    "empty": "",
    "renders only blanks that trim away": "{% if false %}{{ messages }}{% endif %}\n",
    "comment only": "{# nothing here #}",
}


def _commands(model: Path, tmp_path: Path) -> dict[str, list[str]]:
    """Every command that encodes prompts, on `model`, small; outputs under tmp_path/out-*."""
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    return {
        "train": ["train", f"model={model}", f"run_dir={tmp_path / 'out-train'}", "task.name=number", "steps=1"],
        "mismatch": ["mismatch", "--model", str(model), "--out", str(tmp_path / "out-mismatch"), "num_prompts=2"],
        "doctor": ["doctor", "--model", str(model), "--out", str(tmp_path / "out-doctor"), "--prompts", "2"],
        "perfectible": ["perfectible", f"model={model}", "task=number", f"out={tmp_path / 'out-perfectible.jsonl'}"],
        "eval": ["eval", str(model), f"data={data}", "num_prompts=1", f"out={tmp_path / 'out-eval'}"],
    }


def _refused(argv: list[str], tmp_path: Path, capsys, message: str) -> None:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and message in err, (argv, err)
    assert not list(tmp_path.glob("out-*")), argv


@pytest.mark.parametrize("template", sorted(EMPTY_TEMPLATES))
def test_an_empty_chat_template_is_refused_by_every_command(template, model_copy, tmp_path, capsys):
    (model_copy / "chat_template.jinja").write_text(EMPTY_TEMPLATES[template])
    for argv in _commands(model_copy, tmp_path).values():
        _refused(argv, tmp_path, capsys, "the prompt encodes as no tokens at all")


def test_an_empty_chat_template_stops_a_resume_before_it_writes(model_copy, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["train", f"model={model_copy}", f"run_dir={run_dir}", "task.name=number", "steps=1"]
    assert main([*args, "prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4"]) == 0
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    (model_copy / "chat_template.jinja").write_text("{# nothing #}")
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "steps=2"]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("parity ")]
    assert len(lines) == 1 and "the prompt encodes as no tokens at all" in lines[0]
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_prompts_longer_than_the_context_are_refused_by_every_command(model_copy, tmp_path, capsys):
    """The tiny model holds 256 positions: a 300-character prompt, a template that makes every prompt 300
    characters longer, and max_new_tokens of 10**6 are each refused naming what does not fit."""
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "1" * 300, "answer": "2"}) + "\n")
    mismatch = ["mismatch", "--model", str(model_copy), "--out", str(tmp_path / "out-m"), "num_prompts=2"]
    _refused([*mismatch, f"prompts={long}"], tmp_path, capsys, "at most 160 fit")
    _refused([*mismatch, "sampling.max_new_tokens=10**6"], tmp_path, capsys, "sampling.max_new_tokens")
    _refused([*mismatch, "sampling.max_new_tokens=1000000"], tmp_path, capsys, "at most 255 new tokens fit")
    _refused([*mismatch, "sampling.max_new_tokens=250"], tmp_path, capsys, "at most 6 fit")
    perfectible = ["perfectible", f"model={model_copy}", "task=number", f"out={tmp_path / 'out-p.jsonl'}"]
    _refused([*perfectible, f"data={long}"], tmp_path, capsys, "at most 160 fit")
    _refused([*perfectible, "max_new_tokens=1000000"], tmp_path, capsys, "max_new_tokens=1000000")
    (model_copy / "chat_template.jinja").write_text("{{ 'x' * 300 }}{{ messages[0]['content'] }}")
    for argv in _commands(model_copy, tmp_path).values():
        _refused(argv, tmp_path, capsys, "fit")


# ----------------------------------------------------------------------------- template bombs

BOMBS = {
    "center": "{{ 'x'|center(10**10) }}",
    "indent width": "{{ ('x\\n' * 100000)|indent(100000) }}",
    "indent string": "{{ ('x\\n' * 100000)|indent('y' * 100000) }}",
    "replace": "{% set s = 'a' * 900000 %}{{ s|replace('a', 'a' * 900000) }}",
    "wordwrap": "{{ 'a b'|wordwrap(10**10) }}",
    "batch": "{{ [1]|batch(10**10)|list }}",
    "format filter": "{{ '%1000000000d'|format(5) }}",
    "percent": "{{ '%1000000000d' % 5 }}",
    "str.format": "{{ '{:>1000000000}'.format('x') }}",
    "ljust": "{{ 'x'.ljust(10**10) }}",
    "expandtabs": "{{ ('\\t' * 900000).expandtabs(900000) }}",
    "join": "{% set s = 'a' * 900000 %}{{ [s, s, s]|join(s) }}",
    "concat doubling": "{% set a = 'x' * 600000 %}{% set b = a ~ a %}{% set c = b ~ b %}{{ c|length }}",
    "plus doubling": "{% set a = 'x' * 600000 %}{% set b = a + a %}{{ b|length }}",
    "printed list": "{% set s = 'x' * 900000 %}{{ [s] * 900000 }}",
    "tojson of a long list": "{% set s = 'x' * 900000 %}{{ ([s] * 900000)|tojson }}",
    "tojson nested deep": "{% set ns = namespace(x=[]) %}{% for i in range(5000) %}{% set ns.x = [ns.x] %}"
    "{% endfor %}{{ ns.x|tojson }}",
    "attr": "{{ (messages|attr('__class__'))|attr('__subclasses__') }}",
    "raise_exception with a huge message": "{{ raise_exception(('line\\n' * 100000) ~ 'end') }}",
    "raise_exception with globals": "{{ raise_exception(raise_exception.__globals__) }}",
    "macro recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
}


# One process renders every bomb in turn (a process per bomb cost 4 s each, most of it importing PyTorch):
# each `parity mismatch` call's exit code and stderr go to a JSON line, so a bomb that kills the process
# leaves the bombs after it without a line, and their tests say which one it was.
BOMB_RUNNER = """
import contextlib, io, json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))
from pathlib import Path
from parity.cli import main
root = Path(sys.argv[1])
with open(root / "results.jsonl", "a") as results:
    for model in sorted(p for p in root.iterdir() if p.is_dir()):
        out = model.parent / (model.name + "-out")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["mismatch", "--model", str(model), "--out", str(out), "num_prompts=1", "pairs=[fp32/fp32]"])
        line = {"model": model.name, "code": code, "stderr": err.getvalue(), "wrote": out.exists()}
        results.write(json.dumps(line) + "\\n")
        results.flush()
"""


@pytest.fixture(scope="module")
def bombs_rendered(llama_dir, tmp_path_factory) -> dict[str, dict]:
    root, names = tmp_path_factory.mktemp("bombs"), sorted(BOMBS)
    for i, name in enumerate(names):
        shutil.copytree(llama_dir, root / f"{i:02d}")
        (root / f"{i:02d}" / "chat_template.jinja").write_text(BOMBS[name])
    done = subprocess.run([sys.executable, "-c", BOMB_RUNNER, str(root)], capture_output=True, text=True, timeout=600)
    lines = (root / "results.jsonl").read_text().splitlines() if (root / "results.jsonl").exists() else []
    found = {names[int(r["model"])]: r for r in map(json.loads, lines)}
    return {name: found.get(name, {"died": done.stderr[-2000:]}) for name in BOMBS}


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_a_template_bomb_is_one_line_in_bounded_memory(name, bombs_rendered):
    """Each template, rendered by `parity mismatch` in a process that may map 4 GiB: one line, exit 2,
    nothing written. Before the bounds, center/indent asked the kernel for 10 GB and were killed."""
    result = bombs_rendered[name]
    assert "died" not in result, f"the process rendering the bombs died at or before this one: {result['died']}"
    lines = result["stderr"].strip().splitlines()
    assert result["code"] == 2 and len(lines) == 1 and "chat template" in lines[0], result["stderr"][-2000:]
    assert len(lines[0]) < 600 and not result["wrote"]


def test_the_non_finite_scan_names_exactly_the_tensors_with_inf_or_nan():
    """Sums first, the elementwise check only where a sum is not finite: finite values whose sum overflows
    are not named, and every dtype's inf and NaN are."""
    import torch

    from parity.rl.checkpoint import non_finite_tensors

    tensors = {
        "fine": torch.randn(64, 32),
        "nan": torch.randn(64, 32).index_put_((torch.tensor([5]), torch.tensor([7])), torch.tensor(float("nan"))),
        "overflowing_sum": torch.full((8, 8), 3e38),
        "fp16_inf": torch.tensor([1.0, float("-inf")], dtype=torch.float16),
        "bf16": torch.ones(10, dtype=torch.bfloat16),
        "ints": torch.arange(3),
    }
    assert non_finite_tensors(tensors) == ["nan", "fp16_inf"]
    assert non_finite_tensors({"ints": torch.arange(3)}) == []


def test_a_folder_of_parity_s_given_as_a_model_says_what_it_is(tmp_path):
    """A checkpoint, a run or an adapter folder given where a model directory goes said only 'no
    tokenizer.json; save the tokenizer beside the weights'; an empty model was the working directory."""
    from parity import config
    from parity.config import ConfigError
    from parity.rl.train_config import TrainConfig

    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "model" / "config.json").write_text("{}")
    (ckpt / "state.json").write_text("{}")
    (tmp_path / "run" / "config.yaml").write_text("steps: 1\n")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    for folder, says in [
        (ckpt, f"(a checkpoint: its model is {ckpt / 'model'})"),
        (tmp_path / "run", "(a run directory: `parity eval` takes it"),
        (tmp_path / "adapter", "(a LoRA adapter: `parity eval` takes it"),
    ]:
        with pytest.raises(ModelError, match=re.escape(f"{folder}: no tokenizer.json {says}")):
            load_tokenizer(folder)
    with pytest.raises(ConfigError, match="^model: empty"):
        config.load(TrainConfig, None, ["model="])
