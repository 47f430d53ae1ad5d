"""Multi-turn episodes, token in and token out: the ids between two model turns, and the tool calls in a turn.

The ids the model sampled are never decoded and tokenized again: re-tokenizing a turn can split its text
differently (`drifted_tokens` measures it), and the trainer would then score tokens the model never chose.
Between two model turns only the ids of what came between are appended (`TurnRenderer.between_ids`): the
chat template's text after the sampled end-of-turn token, the tool or user messages, and the next generation
prompt. The text a tool or user wrote is encoded as plain text (`Tokenizer.encode_text`), so a tool output
that spells `<|im_end|>` cannot end a turn.

Tool calls are read from the decoded text of an assistant turn (decoded with its special tokens kept) in the
format of the model's family (`STYLES`, `call_style`, `parse_assistant`); a malformed call is returned as
text with the problems found, for the environment to tell the model.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from difflib import SequenceMatcher
from typing import Any

from parity.engines.tokenizer import ChatTemplateError, Message, Tokenizer

# hermes: Qwen2.5/Qwen3 and ChatML models (<tool_call>{json}</tool_call>); llama3: Llama 3.1/3.2 (the whole
# message a JSON object, after <|python_tag|> or not); mistral: [TOOL_CALLS][...] or [TOOL_CALLS]name[ARGS]{...};
# gemma: Gemma 3, which has no tool tokens (```tool_code name(arg=value)``` or a JSON object).
STYLES = ("hermes", "llama3", "mistral", "gemma")

_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FENCE = re.compile(r"```(tool_code|tool_call|json)[ \t]*\n(.*?)```", re.DOTALL)


def call_style(tokenizer: Tokenizer) -> str | None:
    """The tool-call style of the model's family, read off its chat template and special tokens; None for a
    template none of STYLES fits (pass the style explicitly then)."""
    template = tokenizer.chat_template or ""
    specials = " ".join(tokenizer.special_tokens.values())

    def has(marker: str) -> bool:
        return marker in template or marker in specials

    if has("[TOOL_CALLS]") or has("[INST]") and "tool" in template:
        return "mistral"
    if has("<tool_call>") or has("<|im_start|>"):
        return "hermes"
    if has("<|python_tag|>") or has("<|start_header_id|>"):
        return "llama3"
    if has("<start_of_turn>"):
        return "gemma"
    return None


def tool_role(tokenizer: Tokenizer) -> str:
    """The role a tool's answer takes in the model's chat template: "tool" where the template renders one,
    else "user" (Gemma 3's refuses one; a template that leaves a tool message out renders none)."""
    probe = "tool answer 7301"
    conversation = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "content": probe},
    ]
    try:
        return "tool" if probe in tokenizer.render_chat(conversation, add_generation_prompt=True) else "user"
    except ChatTemplateError:
        return "user"


def _call(name: Any, arguments: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(an OpenAI-style tool call, None), or (None, the problem) for a name or arguments that are not usable."""
    if not isinstance(name, str) or not name.strip():
        return None, "the call has no function name"
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return None, f"{name}: the arguments are not valid JSON ({e.msg} at character {e.pos})"
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None, f"{name}: the arguments must be a JSON object, got {type(arguments).__name__}"
    return {"type": "function", "function": {"name": name, "arguments": arguments}}, None


def _json_call(text: str, arguments_key: str) -> tuple[dict[str, Any] | None, str | None]:
    """One call written as a JSON object {"name": ..., arguments_key: {...}}."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"
    if not isinstance(value, dict):
        return None, f"the tool call must be a JSON object, got {type(value).__name__}"
    key = arguments_key if arguments_key in value else "arguments" if "arguments" in value else "parameters"
    return _call(value.get("name"), value.get(key))


def _python_call(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """One call written in Python syntax, `name(arg=value, ...)`, the values literals (never evaluated)."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        return None, f"the tool call is not a Python call ({e.msg})"
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return None, "the tool call must be one call name(arg=value, ...)"
    if node.args or any(k.arg is None for k in node.keywords):
        return None, f"{node.func.id}: pass every argument by name (arg=value)"
    arguments = {}
    for keyword in node.keywords:
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            return None, f"{node.func.id}: argument {keyword.arg} is not a literal value"
    return _call(node.func.id, arguments)


def _strip_all(text: str, spans: list[tuple[int, int]]) -> str:
    """`text` without the character spans (start, end), sorted and disjoint."""
    kept, at = [], 0
    for start, end in spans:
        kept.append(text[at:start])
        at = end
    kept.append(text[at:])
    return "".join(kept)


def _parse_hermes(text: str) -> tuple[str, list, list[str]]:
    calls, problems, spans = [], [], []
    for match in _HERMES_CALL.finditer(text):
        call, problem = _json_call(match.group(1).strip(), "arguments")
        if call is None:
            problems.append(problem)
        else:
            calls.append(call)
            spans.append(match.span())
    content = _strip_all(text, spans)
    if content.count("<tool_call>") > content.count("</tool_call>"):
        problems.append("a <tool_call> is not closed by </tool_call>")
    return content, calls, problems


def _parse_llama3(text: str) -> tuple[str, list, list[str]]:
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    if not (tagged or body.startswith("{")):
        return text, [], []  # an answer in words
    call, problem = _json_call(body, "parameters")
    if call is None:
        return text, [], [problem]
    return "", [call], []


def _parse_mistral(text: str) -> tuple[str, list, list[str]]:
    marker = "[TOOL_CALLS]"
    if marker not in text:
        return text, [], []
    content, rest = text.split(marker, 1)
    calls, problems = [], []
    rest = rest.strip()
    if rest.startswith("["):  # [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
        try:
            values = json.loads(rest)
        except json.JSONDecodeError as e:
            return text, [], [f"the tool calls are not a valid JSON list ({e.msg} at character {e.pos})"]
        for value in values if isinstance(values, list) else [values]:
            value = value if isinstance(value, dict) else {}
            call, problem = _call(value.get("name"), value.get("arguments", value.get("parameters")))
            calls.append(call) if call else problems.append(problem)
    else:  # [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name2[ARGS]{...}
        for part in rest.split(marker):
            name, sep, arguments = part.partition("[ARGS]")
            if not sep:
                problems.append(f"{name.strip() or 'a call'}: no [ARGS] after the function name")
                continue
            call, problem = _call(name.strip(), arguments.strip() or "{}")
            calls.append(call) if call else problems.append(problem)
    if problems:
        return text, [], problems
    return content.rstrip(), calls, []


def _parse_gemma(text: str) -> tuple[str, list, list[str]]:
    calls, problems, spans = [], [], []
    for match in _FENCE.finditer(text):
        kind, body = match.group(1), match.group(2).strip()
        call, problem = _python_call(body) if kind == "tool_code" else _json_call(body, "parameters")
        if call is None:
            problems.append(problem)
        else:
            calls.append(call)
            spans.append(match.span())
    if not calls and not problems and text.strip().startswith("{"):  # the whole message one JSON object
        call, problem = _json_call(text.strip(), "parameters")
        return (text, [], [problem]) if call is None else ("", [call], [])
    return _strip_all(text, spans), calls, problems


_PARSERS = {"hermes": _parse_hermes, "llama3": _parse_llama3, "mistral": _parse_mistral, "gemma": _parse_gemma}


def parse_assistant(text: str, style: str) -> Message:
    """The assistant message of a sampled turn, OpenAI/transformers style: `{"role": "assistant", "content":
    the text without its well-formed calls, "tool_calls": [{"type": "function", "function": {"name", "arguments":
    {...}}}]}`. `text` is the turn decoded with its special tokens kept (Mistral's [TOOL_CALLS] is one). A
    malformed call (bad JSON, no name, positional arguments) stays in the content and is described, one line
    each, under "problems". "tool_calls" and "problems" are there only when not empty: a template may treat an
    empty list differently from none."""
    if style not in _PARSERS:
        raise ValueError(f"unknown tool-call style {style!r}; known: {', '.join(STYLES)}")
    content, calls, problems = _PARSERS[style](text)
    message: Message = {"role": "assistant", "content": content.strip() if calls else content}
    if calls:
        message["tool_calls"] = calls
    if problems:
        message["problems"] = problems
    return message


# Around each observation's sentinel while rendering: whitespace the template keeps or trims shows which.
_PAD = "\n \t"


class TurnRenderer:
    """The ids of a multi-turn episode around the model's own: `prompt_ids` for the first prompt, then after
    each sampled turn (which ends with its end-of-turn id) `between_ids` for what comes before the next.

    `append_only` stays True while every conversation rendered so far was a prefix of its continuation; a
    template that rewrites past turns (Qwen3's drops earlier <think> blocks once a new user message comes)
    sets it False, with a line in `notes`, and the ids between turns are then taken from a neutral
    conversation (a stand-in for the last assistant turn, carrying its tool calls)."""

    def __init__(self, tokenizer: Tokenizer, tools: list[dict[str, Any]] | None = None, style: str | None = None):
        if tokenizer.chat_template is None:
            raise ChatTemplateError(f"{tokenizer.source}: multi-turn episodes need a chat template; the model has none")
        self.tokenizer, self.tools = tokenizer, tools
        self.style = style if style is not None else call_style(tokenizer)
        if self.style is not None and self.style not in STYLES:
            raise ValueError(f"unknown tool-call style {self.style!r}; known: {', '.join(STYLES)}")
        self.append_only = True
        self.notes: list[str] = []
        self._eot = [t for i in tokenizer.eos_ids if (t := tokenizer.token_text(i))]

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """The first prompt: the template with the tools and the generation prompt, as `encode_chat`."""
        return self.tokenizer.encode_chat(messages, self.tools, add_generation_prompt=True)

    def parse(self, text: str) -> Message:
        """`parse_assistant` in this renderer's style."""
        if self.style is None:
            raise ValueError(f"{self.tokenizer.source}: no tool-call style known for this template; pass style=")
        return parse_assistant(text, self.style)

    def between_ids(self, conversation: list[Message], observations: list[Message]) -> list[int]:
        """The ids after the sampled end-of-turn token: the rest of the template's text for the assistant
        turn (ChatML's "\\n" after <|im_end|>), the `observations` (messages of role "tool" or "user" with
        string content), and the next generation prompt. `conversation` is every message so far, ending with
        the assistant message just sampled (as `parse_assistant` gave it).

        Each piece is encoded on its own: the template's text with its special tokens recognised, each
        observation's content as plain text (`Tokenizer.encode_text`, so no control token comes from it),
        exactly as the template writes it (trimmed where the template trims). No token merges across a
        piece boundary, so these ids can differ from tokenizing the whole rendered conversation at once; that
        is deliberate: these ids are what the rollout engine and the trainer both see."""
        return [i for _, ids, _ in self.between_pieces(conversation, observations) for i in ids]

    def between_pieces(
        self, conversation: list[Message], observations: list[Message]
    ) -> list[tuple[str, list[int], bool]]:
        """`between_ids` piece by piece: (text, its ids, whether it is an observation's content)."""
        if not conversation or conversation[-1].get("role") != "assistant":
            raise ValueError("the conversation must end with the assistant message just sampled")
        for message in observations:
            if not isinstance(message.get("content"), str):
                raise ValueError(f"an observation's content must be a string, got {message.get('content')!r}")
        render = self.tokenizer.render_chat
        tag = secrets.token_hex(8)  # sentinels no conversation text contains
        sentinels = [f"PARITY{tag}OBS{n}END" for n in range(len(observations))]
        marked = [{**m, "content": _PAD + s + _PAD} for m, s in zip(observations, sentinels)]

        before = render(conversation, self.tools, add_generation_prompt=False)
        after = render(conversation + marked, self.tools, add_generation_prompt=True)
        if after.startswith(before):
            start, head = self._after_eot(before, 0, len(before)), conversation
        else:
            # Not append-only: the delta is taken where the last assistant turn is a stand-in the template
            # keeps as it is, with the same tool calls (templates may refer to them later).
            if self.append_only:
                self.append_only = False
                self.notes.append(
                    f"{self.tokenizer.source}: the chat template rewrites earlier turns when the conversation "
                    "grows (not append-only); the ids between turns come from a neutral conversation"
                )
            stand_in = {"role": "assistant", "content": f"PARITY{tag}ASSISTANT"}
            if conversation[-1].get("tool_calls"):
                stand_in["tool_calls"] = conversation[-1]["tool_calls"]
            head = conversation[:-1] + [stand_in]
            after = render(head + marked, self.tools, add_generation_prompt=True)
            found = after.find(stand_in["content"])
            if found < 0:
                raise ChatTemplateError(f"{self.tokenizer.source}: the chat template drops the assistant's content")
            first = min([p for s in sentinels if (p := after.find(s)) >= 0], default=len(after))
            start = self._after_eot(after, found, first)
        pieces = self._split(after[start:], observations, sentinels)
        # The template must write each observation as given (or trimmed): checked against a real rendering.
        real = render(head + list(observations), self.tools, add_generation_prompt=True)[start:]
        if "".join(text for text, _ in pieces) != real:
            raise ChatTemplateError(
                f"{self.tokenizer.source}: the chat template changes an observation's content beyond trimming it; "
                "its ids cannot be told apart from the template's"
            )
        encode = {True: self.tokenizer.encode_text, False: self.tokenizer.encode_template}
        return [(text, encode[is_content](text), is_content) for text, is_content in pieces if text]

    def _after_eot(self, text: str, lo: int, hi: int) -> int:
        """Where the last end-of-turn token string in text[lo:hi] ends (the assistant turn's end)."""
        ends = [p + len(eot) for eot in self._eot if (p := text.rfind(eot, lo, hi)) >= 0]
        if not ends:
            raise ChatTemplateError(
                f"{self.tokenizer.source}: the chat template does not end the assistant's turn with an "
                f"end-of-turn token ({', '.join(self._eot)})"
            )
        return max(ends)

    @staticmethod
    def _split(delta: str, observations: list[Message], sentinels: list[str]) -> list[tuple[str, bool]]:
        """The rendered delta cut at the sentinels: (template text, False) and (content as written, True)."""
        pieces, at = [], 0
        for message, sentinel in zip(observations, sentinels):
            found = delta.find(sentinel, at)
            if found < 0:
                raise ChatTemplateError(f"the chat template does not write a {message.get('role')} message's content")
            end = found + len(sentinel)
            lead = delta[found - len(_PAD) : found] == _PAD
            trail = delta[end : end + len(_PAD)] == _PAD
            content = message["content"]
            content = content if lead else content.lstrip()
            content = content if trail else content.rstrip()
            pieces.append((delta[at : found - len(_PAD) if lead else found], False))
            pieces.append((content, True))
            at = end + len(_PAD) if trail else end
        pieces.append((delta[at:], False))
        return pieces


def retokenized_ids(tokenizer: Tokenizer, messages: list[Message], tools: list[dict[str, Any]] | None = None):
    """What a re-tokenizing pipeline trains on (TRL before 1.16, verl's chat-completion loop): the whole
    conversation, its assistant turns as decoded text with their parsed tool calls, rendered by the
    template and encoded at once."""
    return tokenizer.encode_chat(messages, tools, add_generation_prompt=False)


def drifted_tokens(sampled_ids: list[int], trained: list[bool], retokenized: list[int]) -> list[int]:
    """The indices of the trained (model-sampled) tokens of `sampled_ids` that `retokenized` does not
    reproduce: the two id lists are aligned (difflib, no junk heuristic) and a trained token outside every
    matching block drifted. `trained` marks, position by position, the tokens the model sampled."""
    if len(trained) != len(sampled_ids):
        raise ValueError(f"trained has {len(trained)} marks for {len(sampled_ids)} ids")
    matcher = SequenceMatcher(None, list(sampled_ids), list(retokenized), autojunk=False)
    matched = [False] * len(sampled_ids)
    for block in matcher.get_matching_blocks():
        matched[block.a : block.a + block.size] = [True] * block.size
    return [i for i, (t, m) in enumerate(zip(trained, matched)) if t and not m]


def replacing_tokens(sampled_ids: list[int], trained: list[bool], retokenized: list[int]) -> list[int]:
    """The indices of `retokenized` that stand where drifted tokens were (`drifted_tokens`): in each span
    the alignment does not match, those of the re-tokenized side when the sampled side holds a trained
    token. What a re-tokenizing pipeline trains in their place."""
    matcher = SequenceMatcher(None, list(sampled_ids), list(retokenized), autojunk=False)
    out = []
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag != "equal" and any(trained[a0:a1]):
            out.extend(range(b0, b1))
    return out
