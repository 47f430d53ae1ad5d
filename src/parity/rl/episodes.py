"""Episodes: several model turns with tools or an environment between them, token in and token out.

An episode starts from a data row: the environment's `reset` gives the first messages (and the tools it
offers), the model samples a turn, the environment's `step` answers it (tool results, or any messages,
whether the episode is over, optionally a reward), and the model samples again from where it stopped.
What reaches the model between two turns is appended as ids (`engines/turns.TurnRenderer.between_ids`:
the chat template's text after the sampled end-of-turn token, the observations as plain text, the next
generation prompt); the ids the model sampled are never decoded and encoded again. The rollout engine
continues each row from its KV cache (`RolloutEngine.generate(between=...)`), and the trainer scores the
same ids, with the loss on the model's own tokens only (`RolloutBatch.sampled_mask`).

`tools=[fn, ...]` is the common case without an environment of your own (`ToolEnvironment`): the model's
tool calls are parsed in its family's format and each function is called, bounded as a reward is; a call
that raises, runs past `episode.tool_timeout_s` or returns something that is not text becomes the text the
model reads next, never a crash.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from parity.config import ConfigError, described
from parity.engines.batch import RolloutBatch
from parity.engines.tokenizer import Message, Tokenizer
from parity.engines.trainer import sequence_logprobs
from parity.engines.turns import TurnRenderer, drifted_tokens, replacing_tokens, retokenized_ids, tool_role
from parity.rl.lookup import LOOKUP_SCHEMA, TOOL_NAME, lookup_tool, parse_table
from parity.rl.problems import Problem
from parity.rl.reward_fns import import_reward_fn
from parity.rl.rewards import Interrupted, Overran, awaited, bounded, exception_summary
from parity.rl.tasks import TASKS
from parity.rl.tools import tool_schema
from parity.rl.train_config import TrainConfig

TOOL_TEXT_CHARS = 4000  # of a tool's answer that reaches the model; the rest is cut, and the cut said
# How an episode ended: the model answered without a tool call or the environment said done; the turn
# limit; a turn cut off at its token limit; no room left for the next observation and turn; the
# environment's step raised.
ENDS = ("done", "max_turns", "turn_cut_off", "no_room", "environment_error")
TRUNCATED_ENDS = ("max_turns", "turn_cut_off", "no_room")


@dataclass
class Step:
    """An environment's answer to an assistant turn."""

    # What the model reads next (tool or user messages); with `done`, the environment's last word, recorded
    # in the episode (rewards and the completions file see it) and never fed to the model.
    messages: list[Message] = field(default_factory=list)
    done: bool = False  # the episode is over: nothing more is sampled
    reward: float | None = None  # added to the episode's `environment_reward` (None: nothing)


class Environment(Protocol):
    """What `parity.train(environment=...)` instantiates once per episode (a class, or any callable
    returning one). `tools`, if it has it, lists the functions (or JSON schemas) the chat template offers."""

    def reset(self, row: dict[str, Any]) -> list[Message] | str:
        """The first messages of the episode on a data row (a string is one user message)."""
        ...

    def step(self, assistant: Message) -> Step:
        """Answer an assistant turn: `assistant` is {"role": "assistant", "content": ..., "tool_calls": [...]}."""
        ...


def tool_text(value: Any) -> tuple[str, bool]:
    """(what a tool's return value looks like to the model, whether it is a failure): text as it is, a
    JSON value as JSON, anything else a line saying what came back."""
    failed = False
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, allow_nan=False)  # NaN is no JSON
        except (TypeError, ValueError):
            text, failed = f"error: the tool returned {type(value).__name__!r}, not text or JSON", True
    if not failed and (problem := not_utf8(text)):
        text, failed = f"error: the tool's answer {problem}", True
    if len(text) > TOOL_TEXT_CHARS:
        text = text[:TOOL_TEXT_CHARS] + f" [cut: {len(text) - TOOL_TEXT_CHARS} more characters]"
    return text, failed


def not_utf8(text: str) -> str:
    """What keeps `text` from being UTF-8, which a tokenizer reads ('' if nothing): a lone surrogate, as text
    read with errors="surrogateescape" holds for each byte it could not decode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"is not UTF-8 text: a lone surrogate {text[e.start]!r} at character {e.start}"
    return ""


def call_tool(fn: Callable[..., Any], name: str, arguments: Any, timeout_s: float) -> tuple[str, bool]:
    """(the text the model reads, whether the call failed): `fn(**arguments)` within `timeout_s` in this
    process (`rewards.bounded`: SIGALRM ends a sleep or a blocking read, and a call that will not end stops
    the run). SIGINT and SIGTERM end it with `Interrupted`, as they end a reward."""
    if not isinstance(arguments, dict):
        return f"error: the arguments of {name} must be a JSON object, got {type(arguments).__name__}", True
    late = f"parity: the run stopped: tool {name} went on after episode.tool_timeout_s={timeout_s:g} s"
    try:
        with bounded(timeout_s, late, 1):
            value = awaited(fn(**arguments))  # an async tool's coroutine, awaited
    except Overran:
        return f"error: {name} did not return within {timeout_s:g} s", True
    except Interrupted:
        raise
    except BaseException as e:  # noqa: BLE001 - the tool's failure is the model's to read
        return f"error: {exception_summary(e)}", True
    return tool_text(value)


class ToolEnvironment:
    """The environment `tools=[fn, ...]` builds: the data row's prompt is the first message; a turn with
    tool calls gets each call's result as a tool message; a turn without one ends the episode. Where the
    chat template has no tool role (`turns.tool_role`: Gemma 3's), the results come as one user message,
    each in a ```tool_output block (Gemma's convention), since its turns must alternate."""

    def __init__(self, tools: Sequence[Callable[..., Any]], prompt_column: str, timeout_s: float, role: str = "tool"):
        self.tools = list(tools)
        self.by_name = {fn.__name__: fn for fn in self.tools}
        self.prompt_column, self.timeout_s, self.role = prompt_column, timeout_s, role
        self.errors = 0

    def reset(self, row: dict[str, Any]) -> list[Message] | str:
        return row[self.prompt_column]

    def step(self, assistant: Message) -> Step:
        calls = assistant.get("tool_calls") or []
        if not calls:
            return Step(done=True)
        answers = []
        for call in calls:
            function = call.get("function", {})
            name = function.get("name")
            fn = self.by_name.get(name)
            if fn is None:
                text, failed = f"error: no tool named {name!r}; the tools are {', '.join(self.by_name)}", True
            else:
                text, failed = call_tool(fn, name, function.get("arguments"), self.timeout_s)
            self.errors += failed
            answers.append({"role": "tool", "name": str(name), "content": text})
        if self.role == "user":
            blocks = [f"```tool_output\n{answer['content']}\n```" for answer in answers]
            return Step([{"role": "user", "content": "\n".join(blocks)}])
        return Step(answers)


class LookupEnvironment(ToolEnvironment):
    """The built-in tool task's environment (task.name=lookup, `rl/lookup.py`): the data row's hidden table
    behind the `lookup` tool. Its chat template (builtin-agent's) lists no tools: the model knows its one."""

    tools = [LOOKUP_SCHEMA]

    def __init__(self, timeout_s: float = 10.0):
        super().__init__([], "prompt", timeout_s)

    def reset(self, row: dict[str, Any]) -> list[Message]:
        self.by_name = {TOOL_NAME: lookup_tool(parse_table(row["table"]))}
        return row["prompt"]


@dataclass
class Episode:
    """One row's episode, as the rewards, the completions file and the metrics see it."""

    messages: list[Message]  # the first messages, then every assistant turn and observation
    first: int = 0  # how many messages came from `reset`
    turns: int = 0  # model turns sampled
    tool_calls: int = 0
    tool_errors: int = 0
    malformed_calls: int = 0  # turns whose tool call could not be read (`parse_assistant`'s problems)
    environment_reward: float = 0.0  # the sum of the rewards the environment's steps gave
    end: str = ""  # one of ENDS
    error: str = ""  # the environment's exception, with end=environment_error

    @property
    def truncated(self) -> bool:
        return self.end in TRUNCATED_ENDS

    def transcript(self) -> str:
        """The episode after its first messages, one line per message, for a person to read."""
        lines = []
        for message in self.messages[self.first :]:
            text = message.get("content") or ""
            for call in message.get("tool_calls") or []:
                function = call.get("function", {})
                arguments = json.dumps(function.get("arguments"), ensure_ascii=False)
                text += f" [call {function.get('name')}({arguments})]"
            name = f" {message['name']}" if message.get("name") else ""
            lines.append(f"{message['role']}{name}: {text.strip()}")
        return "\n".join(lines)

    @property
    def answer(self) -> str:
        """The last assistant turn's text without its tool calls: what a reward checks."""
        for message in reversed(self.messages):
            if message["role"] == "assistant":
                return message.get("content") or ""
        return ""


def episode_setup(cfg: TrainConfig, tokenizer: Tokenizer, tools=None, environment=None) -> EpisodeSetup:
    """A run's episodes from its config: `tools` and `environment` are the API's Python objects, else the
    ones task.tools and task.environment name are imported (each within reward.import_timeout_s)."""
    if tokenizer.chat_template is None:
        raise ConfigError(
            f"task.environment/task.tools: episodes are conversations, rendered by the model's chat template; "
            f"{cfg.model} has none"
        )
    timeout_s = cfg.reward.import_timeout_s
    if TASKS[cfg.task.name].episodes and not (cfg.task.environment or cfg.task.tools):  # lookup's environment
        make = functools.partial(LookupEnvironment, cfg.episode.tool_timeout_s)
    elif cfg.task.environment:
        make = environment or import_reward_fn(cfg.task.environment, timeout_s, "task.environment")
        if not callable(make):
            raise ConfigError(f"environment: expected a class (or a function making one), got {type(make).__name__}")
        if isinstance(make, type):
            _check_environment(make, make.__name__)
    else:
        tools = tools or [import_reward_fn(spec, timeout_s, "task.tools") for spec in cfg.task.tools]
        for fn in tools:
            tool_schema(fn)  # a function whose parameters cannot be described is refused now, naming it
        names = [fn.__name__ for fn in tools]
        if len(set(names)) != len(names):
            raise ConfigError(f"task.tools: two tools are named {sorted(n for n in names if names.count(n) > 1)[0]!r}")
        role = tool_role(tokenizer)
        make = functools.partial(ToolEnvironment, tools, cfg.task.prompt_column, cfg.episode.tool_timeout_s, role)
    e = cfg.episode
    return EpisodeSetup(
        tokenizer,
        make,
        cfg.task.prompt_column,
        e.max_turns,
        cfg.turn_tokens,
        e.tool_timeout_s,
        None if e.tool_format == "auto" else e.tool_format,
        e.retokenization,
    )


@dataclass
class EpisodeSetup:
    """A run's episodes: how to make an environment, the chat template's renderer, the limits."""

    tokenizer: Tokenizer
    make_environment: Callable[[], Any]
    prompt_column: str
    max_turns: int
    turn_tokens: int  # the token limit of each model turn
    tool_timeout_s: float
    style: str | None = None  # the tool-call format (`turns.call_style`); None: the template's
    retokenization: bool = True  # count what a re-tokenizing pipeline would train on, every step
    renderer: TurnRenderer | None = None  # made from the first environment's tools
    tools: list[dict[str, Any]] | None = None
    noted: set[str] = field(default_factory=set)

    def start(self, problems: list[Problem], group_size: int) -> tuple[Episodes, list[list[int]]]:
        return Episodes.start(self, problems, group_size)

    def resume(self, episodes: list[tuple[Any, Episode]]) -> Episodes:
        """Episodes begun earlier, (environment, record) each, as the rows of a new engine call."""
        return Episodes(self, [env for env, _ in episodes], [episode for _, episode in episodes])

    def note_once(self, line: str) -> None:
        if line not in self.noted:
            self.noted.add(line)
            print(f"parity: {line}", file=sys.stderr)


def _schemas(env: Any) -> list[dict[str, Any]] | None:
    """The JSON schemas of an environment's `tools` (functions, or schemas as they are); a ConfigError for
    tools that are not a list of functions and schemas that name their function."""
    name = type(env).__name__
    try:
        tools = getattr(env, "tools", None)
    except Exception as e:  # noqa: BLE001 - a property of yours: one line naming it
        raise ConfigError(f"environment: {name}.tools failed: {exception_summary(e)}") from None
    if not tools:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ConfigError(f"environment: {name}.tools is {described(tools)}; expected a list of functions or schemas")
    for t in tools:
        schema = t.get("function", t) if isinstance(t, dict) else None  # OpenAI's form, or the function's own
        if isinstance(t, dict) and not (isinstance(schema, dict) and isinstance(schema.get("name"), str)):
            raise ConfigError(f"environment: {name}.tools holds {t!r:.80}, a schema that names no function")
    return [t if isinstance(t, dict) else tool_schema(t) for t in tools]


def _checked_messages(messages: Any, what: str) -> list[Message]:
    """`messages` if it is a list of chat messages with text content; else a TypeError saying what came."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise TypeError(f"{what} is {messages!r:.80}, not a list of messages with text content")
    for i, m in enumerate(messages):
        if problem := not_utf8(m["content"]):
            raise TypeError(f"{what}[{i}]'s content {problem}")
    return copy.deepcopy(messages)


def environment_step(env: Any, assistant: Message, timeout_s: float) -> Step:
    """`env.step` on a copy of the assistant's turn, within `timeout_s` (as a tool is bounded: past it the
    episode ends), its answer checked: a `Step` whose messages are chat messages with text content."""
    late = f"parity: the run stopped: {type(env).__name__}.step() went on after episode.tool_timeout_s={timeout_s:g} s"
    try:
        with bounded(timeout_s, late, 1):
            step = env.step(copy.deepcopy(assistant))
    except Overran:
        raise TimeoutError(f"step() did not return within episode.tool_timeout_s={timeout_s:g} s") from None
    if not isinstance(step, Step):
        raise TypeError(f"step() returned {type(step).__name__}, not parity.Step")
    reward = step.reward
    if reward is not None:  # a number as reward functions give one: a NumPy or 0-d torch scalar too
        number = None
        if not isinstance(reward, (bool, str, bytes)) and hasattr(reward, "__float__"):
            try:
                number = float(reward)
            except (TypeError, ValueError, RuntimeError):  # a tensor of several values
                pass
        if number is None or not math.isfinite(number):
            raise TypeError(f"step().reward is {reward!r:.40}, not a finite number or None")
        reward = number
    if not isinstance(step.done, bool):  # `bool("no")` is True: a string would end the episode
        raise TypeError(f"step().done is {step.done!r:.40}, not True or False")
    return Step(_checked_messages(step.messages, "step().messages"), step.done, reward)


def _check_environment(environment: object, name: str) -> None:
    """An environment (or its class) has the methods an episode calls: a ConfigError naming the one it lacks."""
    for method in ("reset", "step"):
        if not callable(getattr(environment, method, None)):
            raise ConfigError(
                f"environment: {name} has no method {method}(); an environment has reset(row) -> the first "
                "messages and step(action) -> parity.Step (docs/agents.md)"
            )


def _new_episode(make: Callable[[], Any], row: dict[str, Any], timeout_s: float) -> tuple[Any, list[Message]]:
    """An environment made and reset on a data row, within `timeout_s`: (it, the first messages). Its failure
    is every episode's, so it stops the run, in one line (ConfigError)."""
    name = getattr(make, "__name__", None) or getattr(getattr(make, "func", None), "__name__", type(make).__name__)
    late = f"parity: the run stopped: environment {name} went on after episode.tool_timeout_s={timeout_s:g} s"
    try:
        with bounded(timeout_s, late, 1):
            env = make()
            _check_environment(env, name)
            messages = env.reset(row)
    except Overran:
        raise ConfigError(
            f"environment: {name} (made and reset on a data row) did not return within episode.tool_timeout_s="
            f"{timeout_s:g} s"
        ) from None
    except Interrupted:
        raise
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - code of yours: one line naming it
        raise ConfigError(f"environment: {name} failed as it was made or reset: {exception_summary(e)}") from None
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if messages == []:
        raise ConfigError(f"environment: {name}.reset() gave no first messages; the model needs a prompt to answer")
    try:
        return env, _checked_messages(messages, f"{name}.reset()'s answer")
    except TypeError as e:
        raise ConfigError(f"environment: {e} (a string is one user message)") from None


class Episodes:
    """Episodes in an engine call: their environments and records by output row, and the `between` the
    engine calls. A call may continue episodes an earlier call began (partial rollouts): each row's
    tokens in the call then follow its episode so far."""

    def __init__(self, setup: EpisodeSetup, environments: list[Any], episodes: list[Episode]):
        self.setup, self.environments, self.episodes = setup, environments, episodes
        self.turn_start = [0] * len(episodes)  # each row's column where its current turn began
        self.next_limit: dict[int, int] = {}  # a row that went on: the token limit of its next turn
        self.drifted: list[tuple] = []  # `count_drift`: (row, drifted columns, re-tokenized ids, their stand-ins)
        self.seconds = 0.0  # spent in `between`: parsing turns, the environments' steps, rendering what follows

    @classmethod
    def start(cls, setup: EpisodeSetup, problems: list[Problem], group_size: int) -> tuple[Episodes, list[list[int]]]:
        """New episodes, `group_size` per data row, and each row's first prompt's ids."""
        environments, episodes, prompts = [], [], []
        for problem in problems:
            row = {setup.prompt_column: problem.prompt, **problem.columns}
            first = None
            for _ in range(group_size):
                env, messages = _new_episode(setup.make_environment, row, setup.tool_timeout_s)
                if first is None:
                    first = messages
                elif messages != first:
                    raise ConfigError(
                        f"environment: {type(env).__name__}.reset() gave different first messages for the same "
                        f"data row ({problem.prompt!r:.60}); a group's episodes start from one prompt"
                    )
                environments.append(env)
                episodes.append(Episode(messages, len(messages)))
            if setup.renderer is None:
                setup.tools = _schemas(environments[0])
                setup.renderer = TurnRenderer(setup.tokenizer, setup.tools, setup.style)
            prompts.append(setup.renderer.prompt_ids(first))
        return cls(setup, environments, episodes), prompts

    def parse(self, turn: list[int]) -> Message:
        """A sampled turn's ids as an assistant message (its control tokens kept: Mistral's [TOOL_CALLS] is one)."""
        text, renderer = self.setup.tokenizer.decode(turn, keep_special=True), self.setup.renderer
        if renderer.style is None:  # a template of no known tool-call format: the turn is its text
            return {"role": "assistant", "content": text}
        return renderer.parse(text)

    def between(self, rows: list[int], tokens: list[list[int]], rooms: list[int]) -> dict[int, tuple[list[int], int]]:
        """`RolloutEngine.generate`'s `between`: each row that ended a turn is answered by its environment."""
        start = time.perf_counter()
        setup, going_on = self.setup, {}
        for row, ids, room in zip(rows, tokens, rooms):
            episode = self.episodes[row]
            assistant = self.parse(ids[self.turn_start[row] :])
            problems = assistant.pop("problems", [])
            episode.messages.append(assistant)
            episode.turns += 1
            episode.malformed_calls += bool(problems)
            episode.tool_calls += len(assistant.get("tool_calls") or [])
            env = self.environments[row]
            if isinstance(env, ToolEnvironment) and episode.turns >= setup.max_turns and assistant.get("tool_calls"):
                episode.end = "max_turns"  # the tools' answers could not be fed: they are not run for nothing
                continue
            before = getattr(env, "errors", 0)
            try:
                step = environment_step(env, assistant, setup.tool_timeout_s)
            except Interrupted:
                raise
            except BaseException as e:  # noqa: BLE001 - the environment's failure (SystemExit too) ends its episode
                episode.end, episode.error = "environment_error", exception_summary(e)
                setup.note_once(f"environment {type(env).__name__}.step() failed (the episode ends): {episode.error}")
                continue
            episode.tool_errors += getattr(env, "errors", 0) - before
            if step.reward is not None:
                episode.environment_reward += step.reward
            episode.messages.extend(step.messages)  # a last word with `done` is recorded, never fed
            if step.done or not step.messages:
                episode.end = "done"
                continue
            if episode.turns >= setup.max_turns:
                episode.end = "max_turns"
                continue
            try:
                fed = setup.renderer.between_ids(episode.messages[: -len(step.messages)], step.messages)
            except Exception as e:  # noqa: BLE001 - messages the chat template cannot render end the episode
                del episode.messages[-len(step.messages) :]  # never fed: the conversation is what the model saw
                episode.end, episode.error = "environment_error", f"its messages do not render: {exception_summary(e)}"
                setup.note_once(f"environment {type(env).__name__}.step(): {episode.error} (the episode ends)")
                continue
            if len(fed) + 1 >= room:
                episode.end = "no_room"
                continue
            self.turn_start[row] = len(ids) + len(fed)
            going_on[row] = (fed, min(setup.turn_tokens, room - len(fed)))
            self.next_limit[row] = going_on[row][1]
        for note in setup.renderer.notes:
            setup.note_once(note)
        self.seconds += time.perf_counter() - start
        return going_on

    def finish(self, batch: RolloutBatch, count_drift: bool) -> None:
        """The episodes' ends into the batch: the last turn of each row, what cut it off, and the records
        (`batch.episodes`, an `EpisodeBatch`); with `count_drift`, what re-tokenizing would have changed."""
        lengths = batch.response_lengths.tolist()
        for row, episode in enumerate(self.episodes):
            if not episode.end:
                self.end_turn(row, batch.response_ids[row, : lengths[row]].tolist(), bool(batch.truncated[row]))
        batch.truncated = torch.tensor([e.truncated for e in self.episodes], device=batch.truncated.device)
        start = time.perf_counter()
        drift = self.count_drift(batch) if count_drift else None
        batch.episodes = EpisodeBatch(self.episodes, self.seconds, drift, time.perf_counter() - start)

    def end_turn(self, row: int, tokens: list[int], cut_off: bool) -> None:
        """Row `row`'s episode ends with its last turn, which the engine stopped without the environment:
        at the turn's or the episode's token limit (`cut_off`), or with an end-of-turn token in the very last
        column. `tokens`: the row's outputs in the call."""
        episode = self.episodes[row]
        assistant = self.parse(tokens[self.turn_start[row] :])
        assistant.pop("problems", None)
        episode.messages.append(assistant)
        episode.turns += 1
        episode.end = "turn_cut_off" if cut_off else "no_room"

    def count_drift(self, batch: RolloutBatch) -> tuple[int, int, int]:
        """What a pipeline that re-tokenizes the conversation would have trained on: episodes whose
        re-tokenized ids differ from the sampled ones, sampled tokens it would not reproduce, sampled tokens."""
        lengths = batch.response_lengths.tolist()
        sampled = batch.sampled_mask
        episodes = tokens = 0
        self.drifted = []
        for row, episode in enumerate(self.episodes):
            ids = batch.prompt_ids[row] + batch.response_ids[row, : lengths[row]].tolist()
            trained = [False] * len(batch.prompt_ids[row]) + sampled[row, : lengths[row]].tolist()
            again = retokenized_ids(self.setup.tokenizer, episode.messages, self.setup.tools)
            drifted = drifted_tokens(ids, trained, again)
            if drifted:
                start = len(batch.prompt_ids[row])
                self.drifted.append((row, [i - start for i in drifted], again, replacing_tokens(ids, trained, again)))
            episodes += bool(drifted)
            tokens += len(drifted)
        return episodes, tokens, int(sampled.sum())

    def drift_logprobs(self, batch: RolloutBatch, model, dtype: torch.dtype) -> None:
        """`episode.retokenization_logprob`: the log-probability, under the trainer's code path on the weights
        that sampled, of the tokens a re-tokenizing pipeline trains where the sampled ones drifted, beside μ
        of the sampled tokens it loses (`EpisodeBatch.logprobs`): one forward of the drifting episodes."""
        if not self.drifted:
            return
        sequences = [again for _, _, again, _ in self.drifted]
        width = max(len(s) for s in sequences) - 1
        ids = torch.full((len(sequences), width), self.setup.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.bool)
        for i, s in enumerate(sequences):
            ids[i, : len(s) - 1], mask[i, : len(s) - 1] = torch.tensor(s[1:]), True
        with torch.no_grad():
            _, logp = sequence_logprobs(
                model, [s[:1] for s in sequences], ids, mask, None, batch.sampling.temperature, dtype
            )
        replacing = [float(logp[i, j - 1]) for i, (_, _, _, at) in enumerate(self.drifted) for j in at if j > 0]
        lost = [float(batch.rollout_logprobs[row, j]) for row, at, _, _ in self.drifted for j in at]
        batch.episodes.logprobs = (sum(replacing) / max(len(replacing), 1), sum(lost) / max(len(lost), 1))


@dataclass
class EpisodeBatch:
    """A batch's episode records (`RolloutBatch.episodes`), made where the episodes ran (this process or a
    rollout worker, which sends them with the batch): what rewards, the completions file and the metrics
    read."""

    episodes: list[Episode]
    seconds: float = 0.0  # in `between` on the host (the slowest worker's, joined)
    drift: tuple[int, int, int] | None = None  # `Episodes.count_drift`'s counts
    drift_seconds: float = 0.0
    # `Episodes.drift_logprobs`: mean log-probability of what a re-tokenizing pipeline trains in place of the
    # drifted tokens, and mean μ of those; None when off or nothing drifted
    logprobs: tuple[float, float] | None = None

    @staticmethod
    def join(parts: list[EpisodeBatch]) -> EpisodeBatch:
        """Several workers' records as one batch's (`engines/batch.concat_batches`)."""
        drifts = [p.drift for p in parts]
        drift = None if None in drifts else tuple(sum(d[i] for d in drifts) for i in range(3))
        logprobs = [p.logprobs for p in parts if p.logprobs is not None]  # each worker's means, averaged
        return EpisodeBatch(
            [e for p in parts for e in p.episodes],
            max(p.seconds for p in parts),
            drift,
            max(p.drift_seconds for p in parts),
            tuple(sum(x) / len(logprobs) for x in zip(*logprobs)) if logprobs else None,
        )

    def broken(self) -> list[bool]:
        """The episodes their environment broke (`environment_error`): not the model's doing, so not scored
        (`rl/step.trained_rewards`)."""
        return [e.end == "environment_error" for e in self.episodes]

    def reward_items(self, problems: list[Problem], lengths: list[int]) -> list[tuple]:
        """What the rewards score (`UserRewards`' items): each episode's last answer, with its data row's
        columns (`problems`: each episode's) plus EPISODE_COLUMNS, the messages a copy (a reward that edits
        them leaves the episode's record as it was)."""
        items = []
        for episode, problem, length in zip(self.episodes, problems, lengths):
            columns = {
                **problem.columns,
                "messages": copy.deepcopy(episode.messages),
                "environment_reward": episode.environment_reward,
            }
            items.append((Problem(problem.prompt, problem.answer, columns), episode.answer, length))
        return items

    def records(self, batch: RolloutBatch) -> list[dict[str, Any]]:
        """What the completions file adds per episode: its messages, turns, how it ended, and which of its
        tokens trained (sampled) and which were fed between turns."""
        sampled, fed = batch.sampled_mask.sum(-1).tolist(), batch.env_mask.sum(-1).tolist()
        return [
            {
                "messages": e.messages,
                "turns": e.turns,
                "tool_calls": e.tool_calls,
                "end": e.end,
                "sampled_tokens": s,
                "fed_tokens": f,
            }
            for e, s, f in zip(self.episodes, sampled, fed)
        ]

    def transcripts(self) -> list[str]:
        return [e.transcript() for e in self.episodes]

    def times(self) -> dict[str, float]:
        """`time/environment` (the host's part of the rollout: parsing turns, the environments' steps,
        rendering what comes between) and `time/retokenization`."""
        return {"environment": self.seconds, "retokenization": self.drift_seconds}

    def metrics(self, batch: RolloutBatch) -> dict[str, float]:
        """The step's episode metrics (docs/metrics.md, "Episodes")."""
        metrics = episode_metrics(self.episodes, batch.env_mask, self.drift)
        if self.logprobs is not None:
            metrics["retokenization/logprob_mean"], metrics["retokenization/sampled_logprob_mean"] = self.logprobs
        return metrics


def episode_metrics(
    episodes: list[Episode], fed_mask: torch.Tensor, drift: tuple[int, int, int] | None
) -> dict[str, float]:
    n = len(episodes)
    fed = fed_mask.sum(-1).float()
    metrics = {
        "episode/turns_mean": sum(e.turns for e in episodes) / n,
        "episode/tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
        "episode/tool_errors": float(sum(e.tool_errors for e in episodes)),
        "episode/malformed_calls": float(sum(e.malformed_calls for e in episodes)),
        "episode/environment_errors": float(sum(e.end == "environment_error" for e in episodes)),
        "episode/fed_tokens_mean": float(fed.mean()),
    }
    for end in ENDS:
        metrics[f"episode/end_{end}_frac"] = sum(e.end == end for e in episodes) / n
    if drift is not None:
        drifted_episodes, drifted_tokens_, sampled = drift
        metrics["retokenization/episodes_frac"] = drifted_episodes / n
        metrics["retokenization/tokens_frac"] = drifted_tokens_ / max(sampled, 1)
    return metrics
