"""Small tokenizers in the shape of real model families, for tests and tiny random checkpoints.

`write_tokenizer(dir, family)` writes what a Hugging Face checkpoint of that family ships for
its tokenizer: `tokenizer.json` (a BPE trained here on a few sentences, with the family's
normalizer, pre-tokenizer, post-processor, decoder and special tokens), `tokenizer_config.json`,
`generation_config.json` and the chat template, written the way that family's repositories
write it. The special-token strings and the chat templates' logic are the families' own; the
vocabularies are tiny (at most `MAX_VOCAB` ids, added tokens included) so that a small random
model of the family's architecture can use them. `write_config(dir, family)` adds the few
config.json keys a tokenizer needs (model_type and the special ids); a model needs more.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

MAX_VOCAB = 512

# What the tokenizers are trained on: chat-like English, numbers, code and punctuation.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Please explain how a rainbow forms after the rain.",
    "You are a helpful assistant. Answer the question as well as you can.",
    "The user asked the assistant a question, and the assistant answered it.",
    "Sam has 12 apples and buys 7 more. How many apples does Sam have now? The answer is 19.",
    "A train travels 60 miles per hour for 3 hours, so it travels 180 miles.",
    "There are 48 cookies shared among 6 children; each child gets 8 cookies.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "Write a short poem about the sea and the sky at night.",
    "Summarize the following paragraph in one sentence, please.",
    "Translate to French: good morning, how are you today?",
    "I think the best answer is to check the facts first, then write.",
    "Here is a list:\n- one\n- two\n- three\n",
    "Numbers like 1,234 and 3.14159 and $25.00 appear in text.",
    "Why is the sky blue? Sunlight scatters off the molecules of the air.",
    "Can you help me plan a trip to the mountains this summer?",
    "The meeting is at 10:30 on Monday, 5 June 2023.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Once upon a time there was a little robot who loved to read books.",
    "Let me think step by step. First, add the numbers. Then, divide by two.",
    "system user assistant model tool function message content role",
    "Hello! How can I help you today? Thank you, that was very helpful.",
    "In 1969, the first people walked on the moon.",
    "The function returns a list of strings sorted by length.",
    "She said: \"It's fine, we'll go tomorrow.\" They didn't mind.",
    "Café, naïve, résumé: words with accents are common in English too.",
]


@dataclass(frozen=True)
class Family:
    """What a model of the family needs to know about its tokenizer (ids as written to config.json)."""

    name: str
    model_type: str
    vocab_size: int  # every id is below this (added tokens included)
    bos_token_id: int | None
    eos_token_id: int | list[int]  # config.json's
    pad_token_id: int | None
    eos_ids: tuple[int, ...]  # every id that ends a response: generation_config's, then the tokenizer's EOS


FAMILIES = ("llama", "llama3", "smollm2", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")

# ----------------------------------------------------------------------------- chat templates
# Written in the form each family's checkpoints use (their control tokens, roles and checks).

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have access to these functions:\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

QWEN2_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

MISTRAL_TEMPLATE = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message["role"] == "user") != (loop.index0 % 2 == 0) %}
        {{- raise_exception("After the optional system message, roles must alternate user/assistant/...") }}
    {%- endif %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"] + eos_token}}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, after an optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

MISTRAL_TOOL_TEMPLATE = (
    "{{- bos_token }}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{%- for message in messages %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endfor %}"
)

GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# ----------------------------------------------------------------------------- tokenizers

# The pre-tokenizer regexes of Llama 3 and Qwen2 (GPT-4 style: words, 1-3 or single digits, punctuation runs).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _special(content: str, special: bool = True) -> AddedToken:
    return AddedToken(content, special=special, normalized=False)


def _byte_level(
    specials_first: list[str],
    specials_last: list[AddedToken],
    pre_tokenizer,
    normalizer=None,
) -> Tokenizer:
    """A byte-level BPE (GPT-2 style): `specials_first` take ids 0.., `specials_last` follow the vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=MAX_VOCAB - len(specials_last),
        special_tokens=[_special(s) for s in specials_first],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens(specials_last)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(specials: list[str], unk: str) -> Tokenizer:
    """A SentencePiece-style BPE ("▁" for spaces, byte fallback): `specials` take ids 0.., then the 256
    byte tokens <0x00>..<0xFF>, then the trained pieces, as in Llama 2, Mistral and Gemma vocabularies."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=MAX_VOCAB - len(specials) - 256, show_progress=False)
    trained.train_from_iterator(CORPUS, trainer)
    spec = json.loads(trained.to_str())["model"]
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": len(specials) + b for b in range(256)})
    for piece, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1]):
        vocab[piece] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.add_special_tokens([_special(s) for s in specials])
    return tok


def _sp_decoder(strip_first_space: bool):
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if strip_first_space else []))


def _bos_template(bos: str, bos_id: int) -> processors.TemplateProcessing:
    return processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )


def _build(family: str) -> tuple[Tokenizer, dict, dict, dict]:
    """(tokenizer, tokenizer_config.json, generation_config.json, chat template files {name: text})."""
    if family == "llama":  # Llama 2: "▁" prepended by the normalizer (legacy), <s> from the post-processor
        tok = _sentencepiece(["<unk>", "<s>", "</s>"], unk="<unk>")
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = _sp_decoder(strip_first_space=True)
        tok.post_processor = _bos_template("<s>", 1)
        tok_cfg = {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": None,
            "legacy": False,
            "clean_up_tokenization_spaces": False,
            "tokenizer_class": "LlamaTokenizer",
            "chat_template": LLAMA2_TEMPLATE,
        }
        return tok, tok_cfg, {"bos_token_id": 1, "eos_token_id": 2}, {}
    if family == "llama3":  # Llama 3.x: byte-level, <|begin_of_text|> from a TemplateProcessing post-processor
        names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|finetune_right_pad_id|>"]
        names += ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
        tok = _byte_level(
            [],
            [_special(s) for s in names],
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            ),
        )
        tok.model.ignore_merges = True
        ids = {s: tok.token_to_id(s) for s in names}
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                _bos_template("<|begin_of_text|>", ids["<|begin_of_text|>"]),
            ]
        )
        tok_cfg = {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "clean_up_tokenization_spaces": True,
            "model_input_names": ["input_ids", "attention_mask"],
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        eos = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
        gen = {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": eos, "do_sample": True, "temperature": 0.6}
        return tok, tok_cfg, gen, {"chat_template.jinja": LLAMA3_TEMPLATE}
    if family == "smollm2":  # GPT-2 style byte-level BPE with single digits; <|im_start|> is BOS but never added
        names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>"]
        names += ["<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>"]
        tok = _byte_level(
            names,
            [],
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            ),
        )
        tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
        tok_cfg = {
            "add_prefix_space": False,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|im_end|>",
            "unk_token": "<|endoftext|>",
            "clean_up_tokenization_spaces": False,
            "model_max_length": 8192,
            "tokenizer_class": "GPT2Tokenizer",
            "vocab_size": 49152,
            "chat_template": SMOLLM2_TEMPLATE,
        }
        return tok, tok_cfg, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}, {}
    if family in ("qwen2", "qwen3"):  # byte-level BPE after NFC; no BOS; ChatML
        names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>"]
        added = [_special(s) for s in names] + [_special("<tool_call>", False), _special("</tool_call>", False)]
        if family == "qwen3":
            added += [_special("<think>", False), _special("</think>", False)]
        tok = _byte_level(
            [],
            added,
            pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(QWEN2_SPLIT), "isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            ),
            normalizer=normalizers.NFC(),
        )
        tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        ids = {s: tok.token_to_id(s) for s in names}
        tok_cfg = {
            "added_tokens_decoder": {
                str(tok.token_to_id(t.content)): {
                    "content": t.content,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": t.special,
                }
                for t in added
            },
            "additional_special_tokens": names[1:],
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "errors": "replace",
            "split_special_tokens": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 131072,
            "tokenizer_class": "Qwen2Tokenizer",
        }
        gen = {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
            "pad_token_id": ids["<|endoftext|>"],
        }
        if family == "qwen2":
            tok_cfg["chat_template"] = QWEN2_TEMPLATE
            return tok, tok_cfg, gen, {}
        return tok, tok_cfg, gen, {"chat_template.jinja": QWEN3_TEMPLATE}
    if family == "mistral":  # Mistral 7B v0.3: Metaspace (prepend first), [INST] as control tokens, <s> BOS
        names = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]"]
        names += ["[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
        tok = _sentencepiece(names, unk="<unk>")
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = _sp_decoder(strip_first_space=True)
        tok.post_processor = _bos_template("<s>", 1)
        tok_cfg = {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "legacy": False,
            "spaces_between_special_tokens": False,
            "tokenizer_class": "LlamaTokenizer",
            "use_default_system_prompt": False,
            # A list of named templates: transformers takes "default" unless tools are passed.
            "chat_template": [
                {"name": "default", "template": MISTRAL_TEMPLATE},
                {"name": "tool_use", "template": MISTRAL_TOOL_TEMPLATE},
            ],
        }
        return tok, tok_cfg, {"bos_token_id": 1, "eos_token_id": 2}, {}
    if family in ("gemma2", "gemma3"):  # "▁" for spaces by the normalizer, <bos> added, <end_of_turn> ends a turn
        names = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
        tok = _sentencepiece(names, unk="<unk>")
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
        tok.decoder = _sp_decoder(strip_first_space=False)
        tok.post_processor = _bos_template("<bos>", 2)
        tok_cfg = {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "unk_token": "<unk>",
            "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
            "clean_up_tokenization_spaces": False,
            "sp_model_kwargs": {},
            "spaces_between_special_tokens": False,
            "tokenizer_class": "GemmaTokenizer",
            "use_default_system_prompt": False,
        }
        gen = {"bos_token_id": 2, "eos_token_id": [1, 6], "pad_token_id": 0, "cache_implementation": "hybrid"}
        if family == "gemma2":
            tok_cfg["chat_template"] = GEMMA2_TEMPLATE
            return tok, tok_cfg, gen, {}
        # Gemma 3 checkpoints carry the template twice: in tokenizer_config.json and, for the processor,
        # in chat_template.json.
        tok_cfg["chat_template"] = GEMMA3_TEMPLATE
        return tok, tok_cfg, gen, {"chat_template.json": json.dumps({"chat_template": GEMMA3_TEMPLATE}, indent=2)}
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


_MODEL_TYPES = {
    "llama": "llama",
    "llama3": "llama",
    "smollm2": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mistral": "mistral",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
}


def write_tokenizer(out_dir: str | Path, family: str) -> Family:
    """Write the family's tokenizer files into `out_dir` (created if needed); returns its ids."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok, tok_cfg, gen, templates = _build(family)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    assert vocab_size <= MAX_VOCAB, (family, vocab_size)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name, text in templates.items():
        (out_dir / name).write_text(text)
    eos = gen["eos_token_id"]
    eos_list = eos if isinstance(eos, list) else [eos]
    own_eos = tok.token_to_id(tok_cfg["eos_token"])
    return Family(
        name=family,
        model_type=_MODEL_TYPES[family],
        vocab_size=vocab_size,
        bos_token_id=gen.get("bos_token_id"),
        eos_token_id=eos,
        pad_token_id=gen.get("pad_token_id"),
        eos_ids=tuple(eos_list + ([own_eos] if own_eos not in eos_list else [])),
    )


def write_config(out_dir: str | Path, family: Family) -> None:
    """A config.json with only what the tokenizer reads: model_type and the special ids."""
    cfg = {
        "model_type": family.model_type,
        "vocab_size": family.vocab_size,
        "bos_token_id": family.bos_token_id,
        "eos_token_id": family.eos_token_id,
        "pad_token_id": family.pad_token_id,
    }
    (Path(out_dir) / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
