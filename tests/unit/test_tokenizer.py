"""Tokenization identical to transformers, family by family: plain text, chat templates, special ids.

Each family's tokenizer is built in `families.py` with its real special tokens, pipeline and chat
template; every comparison is against `transformers.AutoTokenizer` loading the same directory.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import normalizers

from families import FAMILIES, Family, write_config, write_tokenizer
from parity.engines.models.config import ModelError
from parity.engines.tokenizer import (
    TOKENIZER_FILES,
    ChatTemplateError,
    copy_tokenizer_files,
    load_tokenizer,
    tokenizer_class_name,
)

TEXTS = [
    "Hello world",
    "What is the capital of France?",
    " leading space,  double  spaces and a trailing one ",
    "Sam has 12 apples and buys 7 more; 1,234 + 3.14 = ?",
    "line one\nline two\n\n\tindented\r\n",
    "Café, naïve, e\u0301 (decomposed), 🙂 and 你好",
    "<|im_start|>user <s> [INST] <bos> <end_of_turn> <|eot_id|> written in the text",
    "def add(a, b):\n    return a + b\n",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": " Why is the sky blue? "}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write a haiku about the sea."},
    ],
]
BOS = {"llama": "<s>", "llama3": "<|begin_of_text|>", "mistral": "<s>", "gemma2": "<bos>", "gemma3": "<bos>"}


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch):
    """Llama 3's template writes today's date (strftime_now): the same fixed day for both libraries."""
    import transformers.utils.chat_template_utils as hf_chat

    import parity.engines.template_sandbox as ours

    class Clock(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2025, 3, 14, 12, 0, 0)

    monkeypatch.setattr(hf_chat, "datetime", Clock)
    monkeypatch.setattr(ours, "datetime", Clock)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, tuple]:
    out = {}
    for name in FAMILIES:
        path = tmp_path_factory.mktemp(name)
        family = write_tokenizer(path, name)
        write_config(path, family)
        out[name] = (path, family)
    return out


def _hf(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _hf_chat(hf, messages) -> list[int]:
    """transformers' chat ids (5.x returns a BatchEncoding by default, 4.x a list)."""
    out = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out if isinstance(out, list) else out["input_ids"])


@pytest.mark.parametrize("name", FAMILIES)
def test_plain_encoding_matches_transformers(family_dirs, name):
    path, family = family_dirs[name]
    ours, hf = load_tokenizer(path), _hf(path)
    for text in TEXTS:
        assert ours.encode(text) == hf(text)["input_ids"], text
        assert ours.encode_prompt(text, "none") == hf(text)["input_ids"]
        ids = ours.encode(text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    assert max(max(ours.encode(t), default=0) for t in TEXTS) < family.vocab_size


@pytest.mark.parametrize("name", FAMILIES)
def test_special_ids(family_dirs, name):
    path, family = family_dirs[name]
    ours, hf = load_tokenizer(path), _hf(path)
    assert ours.eos_ids == family.eos_ids
    assert ours.eos_id == family.eos_ids[0]
    # BOS is what tokenizer.json's post-processor writes: SmolLM2 names <|im_start|> its bos_token, and
    # Qwen names none; neither gets one.
    assert ours.bos_id == (hf.convert_tokens_to_ids(BOS[name]) if name in BOS else None)
    assert ours.special_tokens == hf.special_tokens_map
    bare = hf("x")["input_ids"]
    assert (bare[0] == ours.bos_id) if ours.bos_id is not None else (hf.bos_token_id not in bare)


@pytest.mark.parametrize("name", FAMILIES)
def test_chat_template_matches_transformers(family_dirs, name):
    path, _ = family_dirs[name]
    ours, hf = load_tokenizer(path), _hf(path)
    assert ours.chat_template == hf.get_chat_template()
    for messages in CHATS:
        try:
            expected = _hf_chat(hf, messages)
        except Exception as e:  # the template refuses the conversation (Gemma 2 has no system role)
            with pytest.raises(ChatTemplateError, match=re.escape(str(e))):
                ours.encode_chat(messages)
            continue
        assert ours.encode_chat(messages) == expected
        assert ours.render_chat(messages) == hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
    question = CHATS[0][0]["content"]
    assert ours.encode_prompt(question, "auto") == _hf_chat(hf, CHATS[0])
    assert ours.encode_prompt(CHATS[2], "auto") == _hf_chat(hf, CHATS[2])
    assert ours.uses_chat_template("auto") and not ours.uses_chat_template("none")


@pytest.mark.parametrize("name", FAMILIES)
def test_class_is_the_one_transformers_picks(family_dirs, name):
    path, _ = family_dirs[name]
    cfg = json.loads((path / "config.json").read_text())
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    ours = tokenizer_class_name(
        cfg["model_type"], tok_cfg.get("tokenizer_class"), '"ByteLevel"' in (path / "tokenizer.json").read_text()
    )
    theirs = type(_hf(path)).__name__
    assert ours == theirs or (ours == "PreTrainedTokenizer" and theirs == "TokenizersBackend")


def _variant(src, dst, tok_cfg_edit=None, backend_edit=None):
    shutil.copytree(src, dst)
    if tok_cfg_edit:
        path = dst / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **tok_cfg_edit}))
    if backend_edit:
        tok = Backend.from_file(str(dst / "tokenizer.json"))
        backend_edit(tok)
        tok.save(str(dst / "tokenizer.json"))
    return dst


def _set(attr, value):
    return lambda tok: setattr(tok, attr, value)


@pytest.mark.parametrize(
    "name, tok_cfg_edit, backend_edit",
    [
        # add_bos_token / add_eos_token in tokenizer_config.json change nothing when tokenizer.json exists...
        ("llama3", {"add_bos_token": False, "add_eos_token": True}, None),
        ("qwen2", {"add_bos_token": True, "bos_token": "<|endoftext|>"}, None),
        ("gemma3", {"add_bos_token": False}, None),
        # ...and without a post-processor nothing is added, whatever they say.
        ("llama", {"add_bos_token": True}, _set("post_processor", None)),
        # The class's own pipeline wins over tokenizer.json's: NFC for Qwen2Tokenizer, Metaspace for
        # LlamaTokenizer (prepended to every segment when legacy), byte-level without digit splits for GPT2.
        ("qwen2", None, _set("normalizer", None)),
        ("llama", {"legacy": True}, None),
        ("llama", {"add_prefix_space": False}, None),
        ("smollm2", None, _set("normalizer", normalizers.Lowercase())),
        ("gemma2", None, _set("pre_tokenizer", None)),
        # A special token the config names but tokenizer.json lacks is added; split_special_tokens is honoured.
        ("qwen3", {"pad_token": "<|pad|>"}, None),
        ("mistral", {"split_special_tokens": True}, None),
    ],
)
def test_variants_match_transformers(family_dirs, tmp_path, name, tok_cfg_edit, backend_edit):
    path = _variant(family_dirs[name][0], tmp_path / name, tok_cfg_edit, backend_edit)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 1}))  # room to add
    ours, hf = load_tokenizer(path), _hf(path)
    for text in [*TEXTS, "x <|pad|> y"]:
        assert ours.encode(text) == hf(text)["input_ids"], text
    assert ours.encode_chat(CHATS[0]) == _hf_chat(hf, CHATS[0])


def test_a_token_past_the_models_vocabulary_is_refused_naming_it(family_dirs, tmp_path):
    """A pad token tokenizer_config.json names and tokenizer.json lacks is added after the last id: past the
    embedding it was an IndexError in the first padded batch of train, mismatch and doctor."""
    path = _variant(family_dirs["qwen3"][0], tmp_path / "qwen3", {"pad_token": "<|pad|>"})
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    with pytest.raises(ModelError, match=rf"token '<\|pad\|>' has id {vocab}, past config.json's vocab_size={vocab}"):
        load_tokenizer(path)


def test_chat_template_sources(family_dirs, tmp_path):
    """chat_template.jinja wins over tokenizer_config.json, a list of named templates gives "default", and
    chat_template.json (a processor's file) is read when nothing else names a template."""
    src = family_dirs["qwen2"][0]
    jinja = _variant(src, tmp_path / "jinja")
    (jinja / "chat_template.jinja").write_text("{{ bos_token or '' }}J:{{ messages[0]['content'] }}")
    assert load_tokenizer(jinja).render_chat(CHATS[0]) == "J:What is the capital of France?"
    assert load_tokenizer(jinja).encode_chat(CHATS[0]) == _hf_chat(_hf(jinja), CHATS[0])

    named = _variant(src, tmp_path / "named", {"chat_template": [{"name": "tool_use", "template": "T"}]})
    with pytest.raises(ModelError, match="named chat templates tool_use, none of them 'default'"):
        load_tokenizer(named)

    folder = _variant(src, tmp_path / "folder")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "default.jinja").write_text("F:{{ messages[0]['content'] }}")
    assert load_tokenizer(folder).render_chat(CHATS[0]) == "F:What is the capital of France?"

    processor = _variant(src, tmp_path / "processor")
    tok_cfg = json.loads((processor / "tokenizer_config.json").read_text())
    del tok_cfg["chat_template"]
    (processor / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    assert load_tokenizer(processor).chat_template is None
    (processor / "chat_template.json").write_text(json.dumps({"chat_template": "P:{{ messages[0]['content'] }}"}))
    assert load_tokenizer(processor).render_chat(CHATS[0]) == "P:What is the capital of France?"


def test_template_sandbox_and_helpers(family_dirs, tmp_path):
    """The environment is transformers': helpers, loop controls, {% generation %}, and the sandbox."""
    path = _variant(family_dirs["qwen2"][0], tmp_path / "t")
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
        "{{ ns.n }}{{ dict(a=1) | tojson }}{{ strftime_now('%Y') }}{% if add_generation_prompt %}>{% endif %}"
    )
    (path / "chat_template.jinja").write_text(template)
    ours, hf = load_tokenizer(path), _hf(path)
    messages = [*CHATS[2], {"role": "user", "content": 'naïve "quotes" <tags>'}]
    rendered = ours.render_chat(messages)
    assert rendered == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith('2{"a": 1}2025>')
    for bad, message in [
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{{ messages.__class__.__mro__ }}", "attribute '__class__' of 'list' object is unsafe"),
        ("{{ messages.append(1) }}", "attribute 'append' of 'list' object is unsafe"),
        ("{% set ns = namespace() %}{% set ns._secret = 1 %}", "may not set the attribute '_secret'"),
        ("{% for %}", "chat template: "),
    ]:
        (path / "chat_template.jinja").write_text(bad)
        with pytest.raises(ChatTemplateError, match=message):
            load_tokenizer(path).encode_chat(CHATS[0])


def test_prompt_modes(family_dirs):
    builtin = load_tokenizer("builtin")
    assert builtin.chat_template is None and builtin.bos_id is None
    assert builtin.encode_prompt("12+3=", "auto") == builtin.encode("12+3=") == builtin.encode_prompt("12+3=", "none")
    with pytest.raises(ChatTemplateError, match="list of messages needs a chat template; the model has none"):
        builtin.encode_prompt(CHATS[0], "auto")
    qwen = load_tokenizer(family_dirs["qwen2"][0])
    with pytest.raises(ChatTemplateError, match=r"chat templates are off \(none\)"):
        qwen.encode_prompt(CHATS[0], "none")
    with pytest.raises(ValueError, match="must be one of auto, messages, none, got 'chatml'"):
        qwen.encode_prompt("hi", "chatml")
    # `messages` (TRL's): the template for a prompt given as messages, a string prompt as raw text
    assert qwen.encode_prompt("hi", "messages") == qwen.encode("hi") != qwen.encode_prompt("hi", "auto")
    assert qwen.encode_prompt(CHATS[0], "messages") == qwen.encode_prompt(CHATS[0], "auto")
    with pytest.raises(ChatTemplateError, match="list of messages needs a chat template; the model has none"):
        builtin.encode_prompt(CHATS[0], "messages")


def test_copy_tokenizer_files(family_dirs, tmp_path):
    src = _variant(family_dirs["qwen3"][0], tmp_path / "src")
    for name in ("special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json"):
        (src / name).write_text("{}")
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("T")
    (src / "model.safetensors").write_text("not a tokenizer file")
    dst = tmp_path / "dst"
    dst.mkdir()
    copied = copy_tokenizer_files(src, dst)
    present = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    assert copied == [*present, "additional_chat_templates/tool_use.jinja"]
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file()) == sorted(copied)
    assert (dst / "chat_template.jinja").read_text() == (src / "chat_template.jinja").read_text()
    assert (dst / "additional_chat_templates" / "tool_use.jinja").read_text() == "T"


def _family_model(path, family: Family) -> None:
    """A tiny random Qwen3 beside the family's tokenizer, saved by transformers."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=family.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=family.bos_token_id,
        eos_token_id=family.eos_ids[0],
        pad_token_id=family.pad_token_id,
    )
    Qwen3ForCausalLM(config).save_pretrained(path)


def test_checkpoint_carries_tokenizer_and_chat_template(tmp_path):
    """A checkpoint of a short `parity train` run on chat messages loads in transformers and applies the
    model's chat template exactly as the model it was trained from."""
    from parity.cli import main

    model = tmp_path / "model"
    family = write_tokenizer(model, "qwen3")
    _family_model(model, family)
    data = tmp_path / "chat.jsonl"
    rows = [
        {
            "prompt": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": q}],
            "answer": a,
        }
        for q, a in [("What is 2 + 3?", 5), ("What is 4 times 6?", 24), ("How many legs has a cat?", 4)]
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    argv = ["train", f"model={model}", f"run_dir={run}", f"task.data={data}", "task.name=number", "steps=1"]
    argv += ["prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "tensorboard=false"]
    assert main(argv) == 0
    checkpoint = run / "checkpoints" / "step_000001" / "model"
    for name in TOKENIZER_FILES:
        assert (checkpoint / name).is_file() == (model / name).is_file(), name
    trained, original = _hf(checkpoint), _hf(model)
    assert _hf_chat(trained, rows[0]["prompt"]) == _hf_chat(original, rows[0]["prompt"])
    assert load_tokenizer(checkpoint).encode_prompt(rows[0]["prompt"]) == _hf_chat(original, rows[0]["prompt"])


def test_number_task_prompts_go_through_the_chat_template(tmp_path):
    from parity import config
    from parity.rl.loop import Run
    from parity.rl.train_config import TrainConfig

    model = tmp_path / "model"
    _family_model(model, write_tokenizer(model, "qwen3"))
    keys = [f"model={model}", f"run_dir={tmp_path / 'run'}", "task.name=number", "prompts_per_step=2"]
    keys += ["rollout.group_size=2", "rollout.max_new_tokens=8", "tensorboard=false"]
    run = Run.create(config.load(TrainConfig, None, keys), progress=False)
    metrics = run.step()
    run.rewards.close()
    question = run.problems[0].prompt
    assert question.endswith("?") and "reward/accuracy" in metrics
    expected = _hf_chat(_hf(model), [{"role": "user", "content": question}])
    assert run.tokenizer.encode_prompt(question, "auto") == expected
