"""Reward functions of your own: the two forms a function may take, the data columns it is given, its
check on the first batch, the weighted sum and each function's own scores.

    batched      fn(prompts, completions, **columns) -> list of numbers, one per completion (TRL's form)
    per sample   fn(prompt, completion, **columns) -> number

A function is batched when a parameter is named `prompts` or `completions`, or when it names none (`**kwargs`:
TRL calls every function by keyword); `Reward(fn, batched=...)` says so where the names do not. Each column
of the data but the prompt is passed by its own name, as the file or dataset holds it (an integer answer
stays an integer; a batched function gets a list per column); a function takes the columns it names, or
every column with `**kwargs`. Its signature is checked against the data's columns before the run starts, and
its first batch's result (a number per completion) before the first update: either failing stops the run
with one line naming the function.
Later failures score that function 0 on the samples concerned and are counted (`rl/rewards.py`).

A function may return None for a sample it does not score (TRL's convention), on any batch: the reward
a sample trains on is the weighted sum over the functions that scored it (`task.reward_weights`, 1 each
when unset), NaN where none did (`rl/algorithms.group_advantages` leaves such a sample out of its group's
baseline, with advantage 0); `reward/<name>/mean` and `reward/<name>/std` log each function's unweighted
scores, over the samples it scored.

Completions are passed as text, or with `task.completion_format=messages` (or `auto` on chat prompts, as
TRL does) as TRL passes them with chat prompts: `[{"role": "assistant", "content": text}]`. As TRL's
`GRPOTrainer` does, a function is also given `completion_ids` (each completion's token ids),
`trainer_state` (`callbacks.TrainerState`), `log_metric(name, value)` and `log_extra(column, values)`; the
data's `prompt`, `completion` and `completion_ids` columns are not passed (TRL keeps them back too). NaN
is not scored, as None. An async function is awaited: a per-sample one's calls of a batch together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from parity.config import ConfigError, described
from parity.rl.callbacks import TrainerState
from parity.rl.data import DataColumns
from parity.rl.problems import Problem
from parity.rl.rewards import (
    IN_PROCESS_TIMEOUT_S,
    WORKER_START_S,
    Interrupted,
    Overran,
    RewardError,
    RewardResult,
    RewardRunner,
    awaited,
    bounded,
    bounded_call,
    exception_summary,
    overran_line,
    report_first_failure,
)
from parity.rl.tasks import TASKS
from parity.rl.train_config import TrainConfig

PROMPT_NAMES = {True: "prompts", False: "prompt"}
STRING_HINT = (
    "completions are strings (task.completion_format=text); task.completion_format=messages passes TRL's "
    "chat form, [{'role': 'assistant', 'content': text}]"
)
COMPLETION_NAMES = {True: "completions", False: "completion"}
# What TRL's GRPOTrainer gives a reward function besides the prompts, the completions and the data's columns.
TRL_ARGUMENTS = ("completion_ids", "trainer_state", "log_extra", "log_metric")
# Data columns not passed to reward functions, as TRL keeps them back: the prompt's, a reference completion's,
# and `completion_ids` (the completions' own are given under that name).
KEPT_BACK = ("prompt", "completion", "completion_ids")


class RewardCheckError(ConfigError):
    """A reward function whose signature or first batch is wrong: the run stops before it trains."""


@dataclass(frozen=True)
class Reward:
    """A reward function with its weight in the sum, the name its metrics go under (the function's own
    name when unset), and its form (None: batched when a parameter is named `prompts` or `completions`)."""

    fn: Callable[..., Any]
    weight: float = 1.0
    name: str | None = None
    batched: bool | None = None

    def __post_init__(self) -> None:
        """Refuse what cannot score a sample, naming the argument, when the Reward is made: before a run."""
        fn, label = self.fn, getattr(self.fn, "__name__", None) or type(self.fn).__name__
        if isinstance(fn, type) or not callable(fn):
            raise ConfigError(f"Reward(fn): expected a function, got {described(fn)}")
        if any(f"{c.__module__}.{c.__name__}" == "torch.nn.modules.module.Module" for c in type(fn).__mro__):
            raise ConfigError(
                f"Reward(fn): got a torch module, {type(fn).__name__} (TRL's reward model): give a function that "
                "scores the completions with it"
            )
        weight = self.weight
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ConfigError(f"Reward({label}, weight=...): expected a finite number, got {described(weight)}")
        object.__setattr__(self, "weight", float(weight))  # a NumPy number becomes the float config.yaml records
        if self.name is not None and not (isinstance(self.name, str) and self.name.strip()):
            raise ConfigError(
                f"Reward({label}, name=...): expected a non-empty string or None, got {described(self.name)}"
            )
        if self.batched is not None and not isinstance(self.batched, bool):
            raise ConfigError(
                f"Reward({label}, batched=...): expected True, False or None, got {described(self.batched)}"
            )


@dataclass(frozen=True)
class BoundReward:
    """A reward function checked against the data: how it is called."""

    fn: Callable[..., Any]
    name: str
    weight: float
    batched: bool
    positional: int  # leading parameters given positionally (a per-sample function's prompt, completion)
    keywords: tuple[str, ...] | None  # the keyword arguments it takes; None: every one (**kwargs)


def function_spec(fn: Callable[..., Any]) -> str:
    """How config.yaml records a Python callable: `module:function`, or `/path/script.py:function` for one
    defined in the script Python ran (its `__main__`), so that `--resume` and `parity eval` find it again."""
    module = getattr(fn, "__module__", "?")
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if module == "__main__" and main_file:
        module = str(Path(main_file).resolve())
    return f"{module}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def found_again(fn: Callable[..., Any]) -> bool:
    """Whether `function_spec(fn)` names `fn` itself: not a lambda, a nested function, a functools.partial or
    a callable object, which `--resume` and `parity eval` cannot import by name."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    found: Any = module
    for part in getattr(fn, "__qualname__", "<none>").split("."):
        found = getattr(found, part, None)
    return module is not None and found is fn


def _import_file(path: Path) -> ModuleType:
    """A Python file as a module named after it, its top level run (a script's `if __name__ == "__main__":`
    part is not)."""
    if not path.is_file():
        raise FileNotFoundError(f"no file {str(path)!r}")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # pickling its functions (reward.isolate=always) finds them by this name
    spec.loader.exec_module(module)
    return module


_importing: list[str] = []  # the user's code `import_reward_fn` is importing now


def importing_user_code() -> str | None:
    """The spec of the user's code being imported now (its top level running), or None."""
    return _importing[-1] if _importing else None


def import_reward_fn(spec: str, timeout_s: float = WORKER_START_S, key: str = "task.reward_fn") -> Callable[..., Any]:
    """`module:function` or `path/file.py:function` -> the function (or class: an environment), named in
    errors by its config `key`. The working directory is searched
    first for a module (as `python -m` does), so a reward module beside the data is found whether or not
    Parity runs from a console script. The import runs in this process (once: a second run of its top level,
    in a child process first, would load a judge model twice, or repeat what it writes), within `timeout_s`
    (`rewards.bounded`); whatever it raises, or an import past `timeout_s`, is a one-line ConfigError, and
    SIGINT or SIGTERM ends it (`Interrupted`)."""
    if spec.count(":") != 1:
        raise ConfigError(f"{key}: expected 'module:function' or 'file.py:function', got {spec!r}")
    module_name, fn_name = spec.split(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    late = f"importing {module_name!r} did not end within reward.import_timeout_s={timeout_s:g} s"
    _importing.append(spec)
    try:
        with bounded(timeout_s, f"parity: error: {key}: {late}, nor when it was interrupted", 2, True):
            if module_name.endswith(".py"):
                module = _import_file(Path(module_name).expanduser().resolve())
            else:
                module = importlib.import_module(module_name)
    except Overran:
        raise ConfigError(f"{key}: {late}; raise it if the import is slow on purpose") from None
    except Interrupted:
        raise
    except BaseException as e:  # noqa: BLE001 - a missing module, a syntax error, or anything its top level raises
        raise ConfigError(f"{key}: importing {module_name!r} failed: {exception_summary(e)}") from None
    finally:
        _importing.pop()
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise ConfigError(f"{key}: module {module_name!r} has no function {fn_name!r}")
    if not callable(fn):
        raise ConfigError(f"{key}: {module_name}.{fn_name} is a {type(fn).__name__}, not a function or class")
    return fn


def bind(reward: Reward | Callable[..., Any], columns: Sequence[str]) -> BoundReward:
    """Check a reward function's signature against the data's `columns`; a RewardCheckError names what
    it asks for that the data does not hold."""
    if not isinstance(reward, Reward):
        reward = Reward(reward)
    fn = reward.fn  # callable, with a finite weight: `Reward` checked both
    name = reward.name or getattr(fn, "__name__", type(fn).__name__)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: trust it with every argument
        batched = bool(reward.batched)
        return BoundReward(fn, name, reward.weight, batched, 0 if batched else 2, None)
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    # TRL calls every function by keyword: one that names no parameter (`**kwargs`, or a decorator's
    # `(*args, **kwargs)` without functools.wraps) is called its way, batched.
    batched = reward.batched if reward.batched is not None else not named or bool(named & {"prompts", "completions"})
    positional = 0 if batched else 2
    heads = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not batched and len(heads) < 2 and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise RewardCheckError(
            f"reward {name}: a per-sample reward takes (prompt, completion, **columns); its parameters are "
            f"({', '.join(p.name for p in params)}) (a batched one names prompts or completions)"
        )
    given = {PROMPT_NAMES[batched], COMPLETION_NAMES[batched], *TRL_ARGUMENTS, *columns}
    rest = [p for p in params[positional:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not batched:
        rest = [p for p in rest if p not in heads[:2]]
    missing = [p.name for p in rest if p.default is p.empty and p.name not in given]
    if missing or any(p.kind == p.POSITIONAL_ONLY for p in rest):
        what = missing[0] if missing else next(p.name for p in rest if p.kind == p.POSITIONAL_ONLY)
        raise RewardCheckError(
            f"reward {name}: parameter {what!r} is not a column of the data (it has {', '.join(sorted(given))}); "
            "rename it, give it a default, or map the data's columns (task.prompt_column, task.answer_column)"
        )
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params)
    keywords = None if takes_all else tuple(p.name for p in rest if p.name in given)
    return BoundReward(fn, name, reward.weight, batched, positional, keywords)


def reward_columns(problems: Sequence[Problem], episodes: bool) -> list[str]:
    """What a reward function may name besides the prompts and completions: the data's columns less
    KEPT_BACK, TRL_ARGUMENTS and, in a run of episodes, EPISODE_COLUMNS. A column named as one of those
    arguments would hide it: a RewardCheckError."""
    data = {k for p in problems for k in p.columns} - set(KEPT_BACK)
    given = {"prompts", "completions", *TRL_ARGUMENTS, *(EPISODE_COLUMNS if episodes else ())}
    clash = sorted(data & given)
    if clash:
        raise RewardCheckError(
            f"the data's column {clash[0]!r} has the name of an argument reward functions are given "
            f"({', '.join(sorted(given))}): rename the column"
        )
    return sorted(data | given - {"prompts", "completions"})


def bind_all(rewards: Sequence[Reward | Callable[..., Any]], columns: Sequence[str]) -> list[BoundReward]:
    bound = [bind(r, columns) for r in rewards]
    names = [b.name for b in bound]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RewardCheckError(
            f"two reward functions are named {twice[0]!r}; their metrics would mix: name one with Reward(fn, name=...) "
            "in Python, or give one of them another name in its module"
        )
    return bound


def _number(value: object) -> float:
    """A reward value as a float (a bool as 1 or 0, as TRL's tensor of the rewards makes it); a TypeError for
    anything else."""
    if not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"returned {type(value).__name__} {value!r:.60}, not a number")
    return float(value)


async def _together(values: list[Any]) -> list[Any]:
    """Each value, awaited together where awaitable (a per-sample async function's calls of one batch); what
    one raises is given in its place, wrapped as `_Raised`."""

    async def one(value: Any) -> Any:
        try:
            return await value if inspect.isawaitable(value) else value
        except Exception as e:  # noqa: BLE001 - a failure of the function's, counted as any other
            return _Raised(e)

    return list(await asyncio.gather(*(one(v) for v in values)))


@dataclass(frozen=True)
class _Raised:
    """What a call raised, held in place of its value."""

    error: BaseException


def is_chat(prompt: Any) -> bool:
    """A prompt that is a list of chat messages (TRL's `is_conversational`: a first item with a role)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def as_messages(completions: list[str]) -> list[list[dict[str, str]]]:
    """Completions in TRL's chat form: each one assistant message."""
    return [[{"role": "assistant", "content": c}] for c in completions]


def _failure(e: BaseException, completions: list[Any]) -> str:
    """A function's failure on one line; a TypeError on string completions says how to get TRL's form
    (a function written for it indexes a string: "string indices must be integers")."""
    line = exception_summary(e)
    indexed = "string indices" in str(e)  # a function written for TRL's chat form, given a string
    if isinstance(e, TypeError) and indexed and completions and isinstance(completions[0], str):
        line = f"{line} ({STRING_HINT})"
    return line


@dataclass
class Scores:
    """One function's scores on a batch: a value per sample (0 where it failed, NaN where it returned
    None) and its failures."""

    values: list[float]
    errors: int = 0
    first_error: str | None = None
    trace: str = ""
    type_error: str | None = None  # the function returned something that is not a reward (a broken function)
    metrics: dict[str, list[float]] = field(default_factory=dict)  # what it gave `log_metric`, by name
    extra: dict[str, list[Any]] = field(default_factory=dict)  # what it gave `log_extra`: a value per sample


class _Logs:
    """The `log_metric` and `log_extra` a function is given (TRL's), keeping what it logs in its `Scores`."""

    def __init__(self, scores: Scores, n: int):
        self.scores, self.n = scores, n

    def metric(self, name: str, value: float) -> None:
        self.scores.metrics.setdefault(str(name), []).append(_number(value))

    def extra(self, column: str, values: list[Any]) -> None:
        if isinstance(values, (str, bytes)) or len(values) != self.n:
            raise ValueError(f"log_extra({column!r}, ...): expected a list of {self.n} values, one per completion")
        self.scores.extra[str(column)] = list(values)

    def extra_of(self, i: int) -> Callable[[str, Any], None]:
        """A per-sample function's `log_extra(column, value)`: its sample's value in the column."""
        return lambda column, value: self.scores.extra.setdefault(str(column), [None] * self.n).__setitem__(i, value)


def call_reward(
    reward: BoundReward,
    prompts: list[Any],
    completions: list[Any],
    columns: dict[str, list[Any]],
    timeout_s: float | None = None,
    state: TrainerState | None = None,
) -> Scores:
    """Call `reward` on a batch, in its form, and collect what it returned, logged and how it failed; each
    call within `timeout_s` (in the training process; `Overran` past it), None in a worker process.
    `columns`: a list per argument given by name (the data's, `completion_ids`); `state`: `trainer_state`."""
    n = len(completions)
    scores = Scores([0.0] * n)
    logs = _Logs(scores, n)
    shared = {"trainer_state": state, "log_metric": logs.metric}

    def keywords(given: dict[str, Any]) -> dict[str, Any]:
        return given if reward.keywords is None else {k: given[k] for k in reward.keywords if k in given}

    if reward.batched:
        given = {PROMPT_NAMES[True]: prompts, COMPLETION_NAMES[True]: completions, **columns, **shared}
        kwargs = keywords({**given, "log_extra": logs.extra})
        try:
            returned = bounded_call(reward.name, timeout_s, lambda: awaited(reward.fn(**kwargs)))
        except (Overran, Interrupted):
            raise
        except BaseException as e:  # noqa: BLE001 - a failure of the function's, as in a worker process
            return Scores([0.0] * n, n, _failure(e, completions), _trace(e))
        if isinstance(returned, (str, bytes, Mapping)) or not hasattr(returned, "__len__"):
            what = f"returned {type(returned).__name__} {returned!r:.60}, not a list of {n} numbers"
            return Scores([0.0] * n, n, what, type_error=what)
        if len(returned) != n:
            what = f"returned {len(returned)} values for {n} completions"
            return Scores([0.0] * n, n, what, type_error=what)
        values = list(returned)
    else:
        values = []
        for i in range(n):
            kwargs = keywords({**{k: v[i] for k, v in columns.items()}, **shared, "log_extra": logs.extra_of(i)})
            call = functools.partial(reward.fn, prompts[i], completions[i], **kwargs)
            try:
                values.append(bounded_call(reward.name, timeout_s, call))
            except (Overran, Interrupted):
                raise
            except BaseException as e:  # noqa: BLE001 - a failure of the function's, as in a worker process
                values.append(_Raised(e))
        if any(inspect.isawaitable(v) for v in values):  # an async function: its calls awaited together
            values = bounded_call(reward.name, timeout_s, lambda: awaited(_together(values)))
    for i, returned in enumerate(values):
        try:
            if isinstance(returned, _Raised):
                raise returned.error
            value = math.nan if returned is None else _number(returned)  # None: not scored by this function
            if math.isinf(value):
                raise ValueError(f"reward is {value}")
            scores.values[i] = value  # NaN too: not scored, as TRL counts it
        except TypeError as e:
            scores.errors += 1
            if scores.type_error is None and str(e).startswith("returned"):
                scores.type_error = f"sample {i}: {e}"
            scores.first_error = scores.first_error or f"sample {i}: {_failure(e, completions)}"
            scores.trace = scores.trace or _trace(e)
        except BaseException as e:  # noqa: BLE001 - a failure of the function's, as in a worker process
            scores.errors += 1
            scores.first_error = scores.first_error or f"sample {i}: {exception_summary(e)}"
            scores.trace = scores.trace or _trace(e)
    return scores


_PARITY_SOURCE = str(Path(__file__).resolve().parents[1])  # src/parity


def _trace(e: BaseException) -> str:
    """The traceback of what a reward function raised, from its own code on (Parity's calling frames left out);
    none for what Parity raised on what it returned (a string, inf): the one line says it all."""
    import traceback

    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PARITY_SOURCE):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb)) if tb is not None else ""


def call_rewards(
    rewards: list[BoundReward],
    prompts: list[Any],
    completions: list[str],
    columns: dict[str, list[Any]],
    state: TrainerState | None,
) -> list[Scores]:
    """Every function on one batch (what a reward worker process runs per batch)."""
    return [call_reward(r, prompts, completions, columns, state=state) for r in rewards]


class UserRewards:
    """The reward functions of a run, called on each step's batch: in this process (each call within
    `in_process_timeout_s`, past which the run stops), or with `isolate` in a long-lived worker process
    started by spawn (it imports the functions once, and is replaced after `timeout_s`). Called like
    `RewardRunner` on (problem, completion, length) items; `completion_format` (task.completion_format):
    the completions as text, or as TRL's chat messages (`messages`, or `auto`: on chat prompts). `state`:
    what `trainer_state` is at each call (the run's; a worker gets it without its `log_history`)."""

    def __init__(
        self,
        rewards: list[BoundReward],
        isolate: bool = False,
        timeout_s: float = 5.0,
        strict=False,
        in_process_timeout_s: float = IN_PROCESS_TIMEOUT_S,
        completion_format: str = "text",
        state: Callable[[], TrainerState] = TrainerState,
    ):
        self.rewards, self.strict, self.isolate, self.state = rewards, strict, isolate, state
        self.completion_format = completion_format
        self.in_process_timeout_s = in_process_timeout_s
        self.worker = RewardRunner(_CallRewards(rewards), True, timeout_s, strict, start="spawn") if isolate else None
        self.checked = False  # the first batch passed its check
        self._shown: set[str] = set()

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def _scores(self, prompts, completions, columns) -> tuple[list[Scores], bool]:
        """Each function's scores, and whether the worker timed out on the batch (every score then failed)."""
        state = self.state()
        if self.worker is None:
            got = []
            for reward in self.rewards:
                try:
                    got.append(call_reward(reward, prompts, completions, columns, self.in_process_timeout_s, state))
                except Overran:
                    raise RewardError(overran_line(reward.name, self.in_process_timeout_s)) from None
            return got, False
        reply, failure = self.worker.call((prompts, completions, columns, dataclasses.replace(state, log_history=[])))
        if failure is None:
            return reply, False
        n = len(completions)
        return [Scores([0.0] * n, n, failure.summary, failure.trace) for _ in self.rewards], failure.timed_out

    def __call__(self, items: list[tuple[Problem, str, int]]) -> RewardResult:
        n = len(items)
        prompts = [p.prompt for p, _, _ in items]
        completions: list[Any] = [c for _, c, _ in items]
        fmt = self.completion_format
        if fmt == "messages" or (fmt == "auto" and prompts and is_chat(prompts[0])):
            completions = as_messages(completions)
        names = sorted({k for p, _, _ in items for k in p.columns} - {"prompt", "completion"})  # as TRL keeps back
        columns = {k: [p.columns.get(k) for p, _, _ in items] for k in names}
        got, timed_out = self._scores(prompts, completions, columns)
        if not self.checked:
            self._check_first(got, n, timed_out)
        # The weighted sum over the functions that scored each sample; NaN where none did (all None).
        result = RewardResult([math.nan] * n, errors=0, timeouts=0, functions=len(self.rewards))
        logged: dict[str, list[float]] = {}  # `log_metric`'s values, by name, over every function
        for reward, scores in zip(self.rewards, got):
            for name, values in scores.metrics.items():
                logged.setdefault(name, []).extend(values)
            result.extra.update(scores.extra)
            for i, v in enumerate(scores.values):
                if not math.isnan(v):
                    before = result.rewards[i]
                    result.rewards[i] = reward.weight * v + (0.0 if math.isnan(before) else before)
            result.per_function[reward.name] = scores.values
            result.weights[reward.name] = reward.weight
            if timed_out:
                result.timeouts += scores.errors
            else:
                result.errors += scores.errors
            if scores.first_error:
                line = f"{reward.name}: {scores.first_error}"
                result.first_error = result.first_error or line
                if reward.name not in self._shown:
                    self._shown.add(reward.name)
                    report_first_failure(f"reward {reward.name}: first failure, {scores.first_error}", scores.trace)
                if self.strict:
                    self.close()
                    raise RewardCheckError(f"reward {line} (reward.strict=true)")
        result.metrics = {name: sum(values) / len(values) for name, values in logged.items()}  # TRL's mean
        return result

    def _check_first(self, got: list[Scores], n: int, timed_out: bool) -> None:
        """The first batch: a function that returned no reward, or failed on every sample, is broken. A
        batch that ran past `reward.timeout_s` says nothing of that: the next batch is checked instead."""
        if timed_out:
            return
        for reward, scores in zip(self.rewards, got):
            if n and all(math.isnan(v) for v in scores.values):
                print(
                    f"WARNING reward {reward.name} returned None or NaN for every completion of the first batch ({n}): "
                    "it scored none of them (None and NaN mean: this function does not apply to the sample)",
                    file=sys.stderr,
                )
            form = "batched" if reward.batched else "per-sample"
            if scores.type_error is not None:
                problem = scores.type_error
            elif n and scores.errors == n:
                problem = f"failed on every sample: {scores.first_error}"
            else:
                continue
            self.close()
            if scores.trace:  # the function's own traceback, before the one line that stops the run
                report_first_failure(f"reward {reward.name}: first failure, {scores.first_error}", scores.trace)
            expected = "a list of one number per completion" if reward.batched else "a number"
            raise RewardCheckError(
                f"reward {reward.name} ({form}) on the first batch of {n} completions: {problem}; "
                f"it must return {expected}; nothing was trained"
            )
        self.checked = True


@dataclass(frozen=True)
class _CallRewards:
    """`call_rewards` over fixed rewards, picklable by reference for the spawned worker."""

    rewards: list[BoundReward]

    def __call__(self, batch: tuple[list[Any], list[str], dict[str, list[Any]], TrainerState | None]) -> list[Scores]:
        return call_rewards(self.rewards, *batch)


# ----------------------------------------------------------------------------- a run's rewards


# What a reward function may name besides the data's columns, in an episode (docs/agents.md): the whole
# conversation, and the sum of the rewards the environment's steps gave.
EPISODE_COLUMNS = ("messages", "environment_reward")


def environment_reward(completions: list[str], environment_reward: list[float], **_: Any) -> list[float]:
    """The reward of a run with an environment and no reward function: what its steps gave."""
    return list(environment_reward)


def data_columns(cfg: TrainConfig) -> DataColumns:
    """The data's prompt and answer columns; the answer is needed by the built-in rewards that compare with it."""
    # An environment of your own scores its episodes (its steps' rewards) unless reward functions are given.
    checks_answer = not cfg.task.reward_fn and TASKS[cfg.task.name].binary and not cfg.task.environment
    return DataColumns(cfg.task.prompt_column, cfg.task.answer_column, answer_required=checks_answer, keys=True)


def binary_reward(cfg: TrainConfig) -> bool:
    """The run's reward is 1 for a correct response and 0 otherwise (then accuracy is logged)."""
    return TASKS[cfg.task.name].binary and not cfg.task.reward_fn


def config_rewards(cfg: TrainConfig) -> list[Reward]:
    """The reward functions `task.reward_fn` names, imported, with `task.reward_weights`."""
    weights = cfg.task.reward_weights or [1.0] * len(cfg.task.reward_fn)
    rewards = []
    for spec, weight in zip(cfg.task.reward_fn, weights):
        fn = import_reward_fn(spec, cfg.reward.import_timeout_s)
        if isinstance(fn, type):  # what a functools.partial or a callable object passed from Python records
            raise ConfigError(
                f"task.reward_fn: {spec} is a class, not a reward function; a run given a functools.partial or a "
                "callable object from Python records its class: give the rewards from Python again (rewards=)"
            )
        rewards.append(Reward(fn, weight=weight))
    return rewards


def run_rewards(
    cfg: TrainConfig,
    problems: list[Problem],
    rewards: list[Reward] | None = None,
    state: Callable[[], TrainerState] = TrainerState,
) -> RewardRunner | UserRewards:
    """What scores a run's samples: `rewards` (Python callables, from the API), else the functions
    `task.reward_fn` names, else `task.name`'s built-in reward. Reward functions of your own run in this
    process unless `reward.isolate=always` (a spawned worker; docs/your-task.md says why, with timings);
    `state` gives their `trainer_state`."""
    if rewards is None and cfg.task.reward_fn:
        rewards = config_rewards(cfg)
    if cfg.task.reward_weights and not rewards:
        raise ConfigError(
            f"task.reward_weights: {len(cfg.task.reward_weights)} weights for 0 reward functions (task.reward_fn); "
            "give one per function, or none (1 each)"
        )
    if cfg.task.environment and not rewards:  # your environment's episodes are scored by its steps' rewards
        rewards = [Reward(environment_reward, name="environment")]
    r = cfg.reward
    if rewards:
        bound = bind_all(rewards, reward_columns(problems, cfg.episodes))
        fmt = cfg.task.completion_format
        return UserRewards(bound, r.isolate == "always", r.timeout_s, r.strict, r.in_process_timeout_s, fmt, state)
    task = TASKS[cfg.task.name]
    isolate = {"auto": not task.trusted, "always": True, "never": False}[r.isolate]
    return RewardRunner(task.reward, isolate, r.timeout_s, r.strict, "fork", r.in_process_timeout_s)
