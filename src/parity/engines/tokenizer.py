"""Tokenizers: a model directory's tokenizer files, read as `transformers` 5 reads them.

Every id a step sees comes from here, so it must tokenize exactly as `transformers` does for the same
directory (docs/design.md, "Rules the code keeps": a different prompt is a different policy): `encode(text)` is
`AutoTokenizer.from_pretrained(DIR)(text)["input_ids"]`, and `encode_chat(messages)` is
`apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`. What transformers (5.x)
does, and so what this module does:

- BOS and EOS come from tokenizer.json's post-processor alone: a TemplateProcessing that writes
  `<s> $A`, `<|begin_of_text|> $A` or `<bos> $A` adds that token, a ByteLevel post-processor or none adds
  nothing. When tokenizer.json exists AutoTokenizer drops tokenizer_config.json's `add_bos_token` and
  `add_eos_token` before it builds the tokenizer, so they change nothing (SmolLM2 names `<|im_start|>`
  as its bos_token, and it is never added).
- The pipeline: AutoTokenizer picks a tokenizer class (`tokenizer_class_name`). LlamaTokenizer,
  GemmaTokenizer, Qwen2Tokenizer and GPT2Tokenizer rebuild the normalizer, pre-tokenizer, decoder and BPE
  options in code, keeping only tokenizer.json's vocabulary, merges, added tokens and post-processor;
  `_rebuild` does what each does. Any other class reads tokenizer.json as written.
- Special tokens (bos_token, eos_token, ...: also the chat template's variables): the class's defaults,
  then tokenizer_config.json, then special_tokens_map.json when tokenizer_config.json has no
  `added_tokens_decoder`; one that tokenizer.json lacks is added as a special token.
- The chat template: chat_template.jinja (or additional_chat_templates/default.jinja), else
  tokenizer_config.json's `chat_template` (a string, or a list of named templates: "default"), else
  chat_template.json, where processors keep it. It is rendered in a sandbox set up as transformers sets
  up its own (`engines/template_sandbox.py`) and encoded without special tokens, since the template writes them.
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path
from typing import Any

from parity.engines import template_sandbox
from parity.engines.models.config import ModelError, config_token_ids
from parity.engines.models.io import BUILTIN_DIR, model_file, not_a_model, read_json, read_text, resolve_model_dir

# task.chat_template (and mismatch/perfectible `chat_template`, doctor --chat-template): `auto` applies the
# model's chat template when it has one, `messages` to prompts given as messages only (a string stays raw
# text, as TRL's GRPOTrainer encodes it), `none` encodes prompts as raw text.
CHAT_TEMPLATE_MODES = ("auto", "messages", "none")

# Every file a model directory may hold for its tokenizer and chat template: a checkpoint copies them all
# (`copy_tokenizer_files`), so that it tokenizes and templates exactly as the model it was trained from.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # named templates, one NAME.jinja each

# A prompt is a string or a list of chat messages ({"role": ..., "content": ...}).
Message = dict[str, Any]
Prompt = str | list[Message]

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# The special tokens each rebuilt class defaults to when tokenizer_config.json does not name them.
_CLASS_SPECIALS: dict[str, dict[str, str]] = {
    "LlamaTokenizer": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "GemmaTokenizer": {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "mask_token": "<mask>",
    },
    "Qwen2Tokenizer": {"eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "GPT2Tokenizer": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"},
}
# transformers' tokenizer class per config.json model_type, for the architectures Parity runs (llama has
# none). Mistral's is MistralCommonBackend when mistral-common is installed, which also falls back to
# tokenizer.json as written unless the directory holds Mistral's own tekken.json.
_REGISTERED_CLASS = {
    "mistral": "TokenizersBackend",
    "qwen2": "Qwen2Tokenizer",
    "qwen3": "Qwen2Tokenizer",
    "qwen3_moe": "Qwen2Tokenizer",
    "gemma2": "GemmaTokenizer",
    "gemma3": "GemmaTokenizer",
    "gemma3_text": "GemmaTokenizer",
}
# Model types whose declared tokenizer_class transformers replaces with the registered one (known to be wrong).
_DECLARED_CLASS_IGNORED = {"qwen2"}
_GENERIC_CLASSES = {"TokenizersBackend", "PreTrainedTokenizer", "PythonBackend"}  # "Fast" suffix removed
# Qwen2Tokenizer's pre-tokenizer split: contractions, letter runs, single digits, punctuation, newlines, spaces.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class ChatTemplateError(ModelError):
    """A chat template that cannot render these messages (a syntax error, or the template's raise_exception)."""


def tokenizer_class_name(model_type: str | None, declared: str | None, byte_level: bool) -> str:
    """The class AutoTokenizer (transformers 5) loads a directory with: `declared` is tokenizer_config.json's
    (or config.json's) `tokenizer_class`, `byte_level` whether tokenizer.json mentions "ByteLevel"."""
    declared = declared.removesuffix("Fast") if declared else None
    registered = _REGISTERED_CLASS.get(model_type or "")
    if declared == "LlamaTokenizer" and byte_level and model_type not in _DECLARED_CLASS_IGNORED:
        return "TokenizersBackend"  # a Llama 3 style byte-level tokenizer declared as LlamaTokenizer
    if declared and registered and declared != registered:
        if registered in _GENERIC_CLASSES:
            return "TokenizersBackend"
        return registered if model_type in _DECLARED_CLASS_IGNORED else declared
    return declared or registered or "TokenizersBackend"


def _rebuild(backend, model: dict[str, Any], cls: str, tok_cfg: dict[str, Any], unk: str | None) -> None:
    """Give `backend` the normalizer, pre-tokenizer, decoder and BPE options that transformers' `cls`
    builds in its constructor (only the vocabulary and merges come from tokenizer.json)."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

    if cls not in _CLASS_SPECIALS or model.get("type") != "BPE":
        return  # tokenizer.json as written; these four classes are BPE tokenizers
    vocab = model.get("vocab") or {}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
    sentencepiece_decoder = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if cls == "LlamaTokenizer":
        prefix = tok_cfg.get("add_prefix_space")
        prefix = True if prefix is None else bool(prefix)
        scheme = ("always" if tok_cfg.get("legacy") else "first") if prefix else "never"
        backend.model = models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True)
        backend.normalizer = None
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
        strip = [decoders.Strip(" ", 1, 0)] if prefix else []
        backend.decoder = decoders.Sequence(sentencepiece_decoder + strip)
    elif cls == "GemmaTokenizer":
        backend.model = models.BPE(vocab, merges, fuse_unk=True, unk_token=unk, byte_fallback=True)
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
        backend.decoder = decoders.Sequence(sentencepiece_decoder)
    else:  # the byte-level classes
        backend.model = models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
        backend.decoder = decoders.ByteLevel()
        prefix = bool(tok_cfg.get("add_prefix_space") or False)
        if cls == "Qwen2Tokenizer":
            backend.normalizer = normalizers.NFC()
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(_QWEN2_SPLIT), "isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=False),
                ]
            )
        else:
            backend.normalizer = None
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix)


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _special_tokens(cls: str, tok_cfg: dict[str, Any], tokens_map: dict[str, Any]) -> tuple[dict[str, str], list]:
    """(named special tokens {key: string}, the extra special tokens as written) as transformers resolves them."""
    merged = {**_CLASS_SPECIALS.get(cls, {}), **tok_cfg}
    if "added_tokens_decoder" not in tok_cfg:  # older checkpoints keep them in special_tokens_map.json
        merged.update(tokens_map)
    named: dict[str, str] = {}
    for key, value in merged.items():
        # The standard names, and any other "*_token" string a model defines (Gemma 3's image_token...).
        if key in SPECIAL_TOKEN_KEYS or (key.endswith("_token") and isinstance(value, str)):
            content = _content(value)
            if content is not None:
                named[key] = content
    extra = merged.get("extra_special_tokens") or merged.get("additional_special_tokens") or []
    if isinstance(extra, dict):  # named extras, e.g. {"image_token": "<image>"}
        named.update({k: c for k, v in extra.items() if (c := _content(v)) is not None})
        extra = []
    return named, list(extra)


def _added_token(value: str | dict[str, Any], special: bool):
    """An AddedToken from its string, or from its fields as tokenizer_config.json writes them."""
    from tokenizers import AddedToken

    if isinstance(value, dict):
        fields = {k: bool(value[k]) for k in ("single_word", "lstrip", "rstrip", "normalized") if k in value}
        return AddedToken(value["content"], special=special, **fields)
    return AddedToken(value, special=special, normalized=False)


def _listed_tokens(tok_cfg: dict[str, Any], where: Path) -> list[dict[str, Any]]:
    """tokenizer_config.json's `added_tokens_decoder` entries, by id."""
    listed = tok_cfg.get("added_tokens_decoder") or {}
    if not isinstance(listed, dict) or not all(
        str(k).isdigit() and isinstance(v, dict) and isinstance(v.get("content"), str) for k, v in listed.items()
    ):
        raise ModelError(f'{where}: added_tokens_decoder: expected {{"ID": {{"content": TOKEN, ...}}, ...}}')
    return [v for _, v in sorted(listed.items(), key=lambda kv: int(kv[0]))]


class Tokenizer:
    """A model directory's tokenizer (`load_tokenizer` builds it), plus the ids generation needs. `eos_ids`
    holds every id that ends a response (instruct models often have several, e.g. end of turn and end of
    text); `eos_id` is the first of them. `bos_id` is the id `encode` puts before the text, or None."""

    def __init__(
        self,
        backend,
        eos_ids: tuple[int, ...],
        pad_id: int,
        special_tokens: dict[str, str],
        chat_template: str | None,
        source: str,
    ):
        self._tok = backend
        self.eos_ids, self.pad_id = eos_ids, pad_id
        self.eos_id = eos_ids[0]
        self.special_tokens = special_tokens  # the chat template's variables: bos_token, eos_token, ...
        self.chat_template = chat_template
        self.source = source  # the model directory, for error messages
        self.vocab_size = backend.get_vocab_size()
        probe = backend.encode("a")
        self.bos_id = probe.ids[0] if probe.special_tokens_mask[:1] == [1] else None

    def encode(self, text: str) -> list[int]:
        """`text` as plain text, with the BOS/EOS tokenizer.json's post-processor adds (as `tokenizer(text)`)."""
        return self._tok.encode(text).ids

    def render_chat(
        self, messages: list[Message], tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True
    ) -> str:
        """The chat template applied to `messages`, by default with the prompt for the assistant's turn.
        `tools` is the template's `tools` variable as transformers passes it: a list of JSON schemas
        (`{"type": "function", "function": {"name", "description", "parameters"}}`, `rl/tools.tool_schema`)."""
        if self.chat_template is None:
            raise ChatTemplateError(f"{self.source}: the model has no chat template")
        import jinja2

        # As transformers does: a key whose value is null is dropped (templates test for missing keys).
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            template = template_sandbox.compile_template(self.chat_template)
            template.environment.deadline = time.monotonic() + template_sandbox.TEMPLATE_SECONDS
            parts, size = [], 0
            variables = dict(
                messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt
            )
            for part in template.generate(**variables, **self.special_tokens):
                size += len(part)
                if size > template_sandbox.TEMPLATE_CHARS:
                    raise jinja2.TemplateError(f"it wrote more than {template_sandbox.TEMPLATE_CHARS:,} characters")
                parts.append(part)
            return "".join(parts)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.source}: chat template: {template_sandbox.one_line(str(e))}") from None
        except Exception as e:  # a template is code from the checkpoint: its failures are the model's
            raise ChatTemplateError(
                f"{self.source}: chat template failed: {type(e).__name__}: {template_sandbox.one_line(str(e))}"
            ) from None

    def encode_chat(
        self, messages: list[Message], tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        """The chat template's text (`render_chat`), encoded by `encode_template`."""
        return self.encode_template(self.render_chat(messages, tools, add_generation_prompt))

    def encode_template(self, text: str) -> list[int]:
        """Text a chat template wrote: its special and added tokens recognised, no BOS/EOS added (the
        template writes its own), as transformers encodes a rendered chat."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """`text` as plain text, without BOS/EOS, where no added token is ever matched: text that spells
        `<|im_end|>`, `<tool_call>` or `<|eot_id|>` is tokenized as the characters it is. For what a tool or a
        user wrote, which must not smuggle control tokens into a conversation. The model's own vocabulary and
        merges still apply, so an added token that is also an ordinary piece of that vocabulary (Gemma's
        runs of newlines, spaces and tabs) comes out where the merges build it, as the model always reads them."""
        return self._plain_backend.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _plain_backend(self):
        """This tokenizer without its added tokens: the same normalizer, pre-tokenizer and model. (The
        `encode_special_tokens` switch would not do: it leaves non-special added tokens such as Qwen's
        `<tool_call>` matched.)"""
        from tokenizers import Tokenizer as Backend

        spec = json.loads(self._tok.to_str())
        spec["added_tokens"] = []
        return Backend.from_str(json.dumps(spec))

    @functools.cached_property
    def added_ids(self) -> frozenset[int]:
        """Every added token's id, special or not (the ones `encode_template` may match in text)."""
        return frozenset(self._tok.get_added_tokens_decoder())

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The ids of the added tokens marked special (control tokens: never text)."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (an added token's content as written), or None."""
        return self._tok.id_to_token(token_id)

    def uses_chat_template(self, mode: str, prompt: Prompt = "") -> bool:
        """Whether `prompt` goes through the chat template under `mode` (one of CHAT_TEMPLATE_MODES)."""
        if mode not in CHAT_TEMPLATE_MODES:
            raise ValueError(f"chat template mode must be one of {', '.join(CHAT_TEMPLATE_MODES)}, got {mode!r}")
        if mode == "none" or self.chat_template is None:
            return False
        return mode == "auto" or not isinstance(prompt, str)

    def encode_prompt(self, prompt: Prompt, chat_template: str = "auto") -> list[int]:
        """The ids of a prompt, the one way every command encodes prompts. With the chat template (`auto` and
        the model has one) a string is one user message; a list of messages needs the template; otherwise
        a string is encoded as plain text."""
        if self.uses_chat_template(chat_template, prompt):
            return self.encode_chat([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt)
        if not isinstance(prompt, str):
            why = "the model has none" if chat_template != "none" else "chat templates are off (none)"
            raise ChatTemplateError(f"{self.source}: a prompt given as a list of messages needs a chat template; {why}")
        return self.encode(prompt)

    def longest_token_bytes(self) -> int:
        """UTF-8 bytes of the longest vocabulary entry (added tokens included)."""
        return max(len(entry.encode("utf-8")) for entry in self._tok.get_vocab(with_added_tokens=True))

    def decode(self, ids: list[int], keep_special: bool = False) -> str:
        """The text of `ids` without end-of-text and padding ids; other special tokens written out with
        `keep_special` (a tool call's markers), dropped otherwise."""
        stop = {*self.eos_ids, self.pad_id}
        return self._tok.decode([i for i in ids if i not in stop], skip_special_tokens=not keep_special)


def _read_chat_template(model_dir: Path, tok_cfg: dict[str, Any]) -> str | None:
    """The template transformers applies by default (module doc), or None when the model has none."""
    named: dict[str, str] = {}
    if model_file(model_dir, "chat_template.jinja").is_file():
        named["default"] = read_text(model_dir / "chat_template.jinja")
    for path in sorted((model_dir / CHAT_TEMPLATE_DIR).glob("*.jinja")):
        named.setdefault(path.stem, read_text(model_file(model_dir, f"{CHAT_TEMPLATE_DIR}/{path.name}")))
    where = str(model_dir / CHAT_TEMPLATE_DIR)
    if not named:
        value = tok_cfg.get("chat_template")
        where = f"{model_dir / 'tokenizer_config.json'}: chat_template"
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("template"), str) for e in value
        ):
            named = {e["name"]: e["template"] for e in value}
        elif value is not None:
            raise ModelError(f'{where}: expected a template, or a list of {{"name": NAME, "template": TEMPLATE}}')
        elif model_file(model_dir, "chat_template.json").is_file():
            value = read_json(model_dir / "chat_template.json").get("chat_template")
            if not isinstance(value, str):
                raise ModelError(f'{model_dir / "chat_template.json"}: expected {{"chat_template": TEMPLATE}}')
            return value
    if not named:
        return None
    if "default" not in named:
        raise ModelError(
            f"{where}: named chat templates {', '.join(sorted(named))}, none of them 'default', which is the one "
            "transformers applies; name one of them 'default'"
        )
    return named["default"]


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    from tokenizers import Tokenizer as Backend

    model_dir = resolve_model_dir(model_dir)
    tokenizer_files(model_dir)  # every file a checkpoint will copy lies inside the directory: checked now
    path = model_file(model_dir, "tokenizer.json")
    if not path.is_file():
        instead = not_a_model(model_dir)  # a folder of Parity's that is not a model
        save = "; save the tokenizer beside the weights (tokenizer.save_pretrained(DIR) writes it)"
        raise ModelError(f"{model_dir}: no tokenizer.json{instead or save}")

    def optional(name: str) -> dict[str, Any]:
        return read_json(model_dir / name) if model_file(model_dir, name).is_file() else {}

    cfg = read_json(model_file(model_dir, "config.json"))
    tok_cfg, gen_cfg = optional("tokenizer_config.json"), optional("generation_config.json")
    text = read_text(path)
    try:
        spec = json.loads(text)
        backend = Backend.from_str(text)
    except Exception as e:  # JSON or the tokenizers library refusing the file
        raise ModelError(f"{path}: not a readable tokenizer.json ({e})") from None
    cls = tokenizer_class_name(
        cfg.get("model_type"), tok_cfg.get("tokenizer_class") or cfg.get("tokenizer_class"), '"ByteLevel"' in text
    )
    special, extra = _special_tokens(cls, tok_cfg, optional("special_tokens_map.json"))
    _rebuild(backend, spec.get("model") or {}, cls, tok_cfg, special.get("unk_token"))
    # Padding and truncation saved in tokenizer.json are off unless a call asks for them.
    backend.no_padding()
    backend.no_truncation()
    backend.encode_special_tokens = bool(tok_cfg.get("split_special_tokens", False))
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    # Tokens the config lists or names that tokenizer.json lacks are added, as transformers adds them.
    listed = [
        _added_token(v, bool(v.get("special"))) for v in _listed_tokens(tok_cfg, model_dir / "tokenizer_config.json")
    ]
    specials = [_added_token(v, True) for v in [*special.values(), *extra] if _content(v) is not None]
    missing = [t for t in listed + specials if t.content not in present]
    for token in missing:
        present.add(token.content)
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])

    # Ids index the model's embedding: config.json's vocab_size bounds them (load_config checks that value).
    declared = cfg.get("vocab_size")
    vocab_size = declared if isinstance(declared, int) and declared > 0 else backend.get_vocab_size()
    token, last = max(backend.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    if last >= vocab_size:  # a token the embedding has no row for (a special token the files name but lack)
        added = " (tokenizer_config.json names it and tokenizer.json lacks it: it was added after the last)"
        raise ModelError(
            f"{model_dir}: the tokenizer's token {token!r} has id {last}, past config.json's vocab_size={vocab_size}: "
            f"the model has no embedding for it{added if token in {t.content for t in missing} else ''}"
        )

    def ids(config: dict[str, Any], key: str, name: str) -> list[int]:
        """The id (or ids) under `key` of config file `name`, each checked against the model's vocabulary."""
        value = config_token_ids(config, key, str(model_dir / name), vocab_size, many=True)
        return [] if value is None else value if isinstance(value, list) else [value]

    def named(key: str) -> list[int]:
        """The id of the special token named `key`, when the tokenizer has it."""
        token = backend.token_to_id(special[key]) if key in special else None
        return [] if token is None else [token]

    # generation_config.json decides when generation stops (transformers' generate reads it);
    # the tokenizer's own EOS token is added so that a model whose generation config forgets it still stops.
    eos: list[int] = []
    generation, config = "generation_config.json", "config.json"
    for found in (ids(gen_cfg, "eos_token_id", generation), named("eos_token"), ids(cfg, "eos_token_id", config)):
        eos += [i for i in found if i not in eos]
    if not eos:
        raise ModelError(
            f"{model_dir}: no EOS token id in generation_config.json, tokenizer_config.json or config.json"
        )
    pads = ids(gen_cfg, "pad_token_id", generation) + named("pad_token") + ids(cfg, "pad_token_id", config)
    pad = pads[0] if pads else eos[0]
    return Tokenizer(backend, tuple(eos), pad, special, _read_chat_template(model_dir, tok_cfg), str(model_dir))


def tokenizer_files(model_dir: Path) -> list[str]:
    """The tokenizer and chat-template files `model_dir` holds (TOKENIZER_FILES and the named templates,
    CHAT_TEMPLATE_DIR/NAME.jinja), each checked to lie inside it (`model_file`): a checkpoint copies them,
    and a checkpoint is what users share."""
    names = [name for name in TOKENIZER_FILES if model_file(model_dir, name).is_file()]
    templates = sorted((model_dir / CHAT_TEMPLATE_DIR).glob("*.jinja"))
    names += [name for p in templates if model_file(model_dir, name := f"{CHAT_TEMPLATE_DIR}/{p.name}").is_file()]
    return names


def has_builtin_tokenizer(model_dir: Path) -> bool:
    """Whether `model_dir` tokenizes as the built-in model does (it is that model, or a checkpoint trained
    from it): its tokenizer.json is the built-in one's, byte for byte."""
    own, builtin = model_dir / "tokenizer.json", BUILTIN_DIR / "tokenizer.json"
    return own.is_file() and own.stat().st_size == builtin.stat().st_size and own.read_bytes() == builtin.read_bytes()


def copy_tokenizer_files(src_dir: str | Path, dst_dir: str | Path) -> list[str]:
    """Copy `tokenizer_files(src_dir)` into `dst_dir`, byte for byte; returns the names copied."""
    src, dst = resolve_model_dir(src_dir), Path(dst_dir)
    names = tokenizer_files(src)
    for name in names:
        (dst / name).parent.mkdir(exist_ok=True)
        shutil.copyfile(src / name, dst / name)
    return names
