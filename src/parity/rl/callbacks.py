"""Callbacks: the Python API's hooks into a run (`callbacks=`), checked before the run starts and called so
that none can break the step: each hook gets its own copy of the metrics, and one that raises or answers
what the run cannot use stops the run after the step is saved (`CallbackError`), naming it.

Two forms are taken. transformers' (`TrainerCallback`: a TRL user's callbacks as they are, duck-typed by
their methods): `on_EVENT(args, state, control, **kwargs)` for the events of `EVENTS`, where `args` is the
run's `TrainConfig` (a copy), `state` a `TrainerState` and `control` a `TrainerControl` whose switches the
run honours. And Parity's first form (`Callback`): `on_step_end(step, metrics)` answering True to stop, and
`on_eval(step, metrics)`, called where `on_log` and `on_evaluate` are.

The order within a step: `on_step_begin`, the step, `on_step_end(metrics=)`, the held-out evaluation when
due or asked (`control.should_evaluate`) and `on_evaluate(metrics=)`, the step's line in metrics.jsonl and
`on_log(logs=)`, a checkpoint when due or asked (`control.should_save`, `control.should_training_stop`) and
`on_save(checkpoint=)`. `on_train_begin` comes before the first step, `on_train_end` after the last.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from parity.config import ConfigError, definition_name, described
from parity.rl.rewards import exception_summary

# transformers' events that a Parity run has, and what each gets besides (args, state, control).
EVENTS = {
    "on_train_begin": (),
    "on_step_begin": (),
    "on_step_end": ("metrics",),
    "on_evaluate": ("metrics",),
    "on_log": ("logs",),
    "on_save": ("checkpoint",),
    "on_train_end": (),
}
HOOKS = ("on_step_end", "on_eval")  # the first form's
LEGACY_EVENTS = {"on_log": "on_step_end", "on_evaluate": "on_eval"}  # where the first form's hooks are called
SWITCHES = ("should_training_stop", "should_save", "should_evaluate", "should_log")


@dataclass
class TrainerState:
    """Where the run stands, as transformers' `TrainerState` names it: the steps done (`global_step`) of
    `max_steps`, the passes over the training prompts so far (`epoch`), and every step's logged metrics
    (`log_history`: metrics.jsonl's lines, a resumed run's earlier steps too). A run is driven by one
    process, so it is both the local and the world's process zero."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True


@dataclass
class TrainerControl:
    """The switches a callback sets to steer the run (transformers' `TrainerControl`): `should_training_stop`
    ends the run after the step, with a checkpoint; `should_save` saves a checkpoint of this step;
    `should_evaluate` runs the held-out evaluation after this step (before it is logged: set it in
    `on_step_begin` or `on_step_end`); `should_log` is True at `on_step_end`, for every step is logged.
    `should_save`, `should_evaluate` and `should_log` are reset before each step."""

    should_training_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def new_step(self) -> None:
        self.should_save = self.should_evaluate = self.should_log = False


class TrainerCallback:
    """transformers' callback form: subclass and override the events you need; each is called as
    `on_EVENT(args, state, control, **kwargs)` (see the module's docstring) and may set `control`'s switches,
    or return a control to use from then on. A `transformers.TrainerCallback` subclass is taken as it is."""

    def on_train_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any:
        return None

    def on_step_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any:
        return None

    def on_step_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any:
        return None

    def on_evaluate(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any:
        return None

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any:
        return None

    def on_save(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any:
        return None

    def on_train_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> Any:
        return None


class Callback:
    """Hooks into a run (the Python API's `callbacks=`), Parity's first form: subclass and override what you
    need. Returning True from `on_step_end` stops the run after that step, with a checkpoint. Each hook gets
    its own copy of the metrics."""

    def on_step_end(self, step: int, metrics: dict[str, float]) -> bool | None:
        return None

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        return None


class CallbackError(RuntimeError):
    """A callback raised, or answered what the run cannot use: the run stopped after saving the step. The
    callback's own exception, if any, is the `__cause__`."""


def _callback_name(callback: object) -> str:
    """A module (or function) by its name, an object by its class's."""
    return getattr(callback, "__name__", None) or definition_name(type(callback).__qualname__)


def _binds(method: Any, *args: Any, **kwargs: Any) -> inspect.Signature | None:
    """None when `method` can be called so (or shows no signature), else its signature."""
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):  # a builtin without a signature: it is called as it is
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return signature
    return None


def uses_events(callback: object) -> bool:
    """Whether `callback` takes transformers' events rather than the first form's hooks: a `TrainerCallback`
    (Parity's or transformers', by name in its classes), one with an event the first form lacks, or one
    whose `on_step_end` cannot take (step, metrics)."""
    if isinstance(callback, Callback):
        return False
    if any(c.__name__ == "TrainerCallback" for c in type(callback).__mro__):
        return True
    if any(hasattr(callback, event) for event in EVENTS if event != "on_step_end"):
        return True
    if hasattr(callback, "on_eval"):
        return False
    method = getattr(callback, "on_step_end", None)
    return callable(method) and _binds(method, 0, {}) is not None and _binds(method, 0, 0, 0) is None


def checked_callbacks(callbacks: object) -> list[Any]:
    """The API's `callbacks=`: None, one callback, or an iterable of them, each in either form. A one-line
    ConfigError names the first that is not, before the run starts."""
    if callbacks is None:
        return []
    if any(hasattr(callbacks, hook) for hook in (*EVENTS, *HOOKS)):
        callbacks = [callbacks]
    elif isinstance(callbacks, (str, bytes, Mapping)) or not isinstance(callbacks, Iterable):
        raise ConfigError(
            f"callbacks: expected a callback (an object with on_step_end or on_eval, or transformers' "
            f"TrainerCallback events) or a list of them, got {described(callbacks)}"
        )
    out = list(callbacks)
    for i, callback in enumerate(out):
        where = f"callbacks[{i}]"
        if isinstance(callback, type):
            raise ConfigError(f"{where}: {described(callback)}, not a callback; pass an instance of it")
        events = uses_events(callback)
        hooks = {hook: getattr(callback, hook) for hook in (EVENTS if events else HOOKS) if hasattr(callback, hook)}
        if not hooks:
            raise ConfigError(
                f"{where}: {described(callback)} has neither on_step_end(step, metrics) nor on_eval(step, metrics) "
                "nor a TrainerCallback event (on_log, ...); subclass parity.Callback or parity.TrainerCallback"
            )
        for hook, method in hooks.items():
            name = f"{_callback_name(callback)}.{hook}"
            if not callable(method):
                raise ConfigError(f"{where}: {name} is {described(method)}, not a method")
            if events:
                kwargs = dict.fromkeys(EVENTS[hook])
                signature = _binds(method, None, None, None, **kwargs)
                called = f"{hook}(args, state, control{''.join(f', {k}=...' for k in kwargs)})"
            else:
                signature, called = _binds(method, 0, {}), f"{hook}(step, metrics)"
            if signature is not None:
                raise ConfigError(f"{where}: {name}{signature} cannot be called as {called}")
    return out


def _stop_asked(answer: object) -> bool | None:
    """A yes or no: True, False; None when it is no answer. None, a bool, or a 0-d boolean (NumPy's
    `np.True_`, a torch bool scalar: what a comparison of metrics gives) answer."""
    if answer is None or isinstance(answer, bool):
        return bool(answer)
    shape = getattr(answer, "shape", None)
    if isinstance(shape, tuple) and not shape:
        try:
            item = answer.item()
        except Exception:
            return None
        if isinstance(item, bool):
            return item
    return None


class Callbacks:
    """The callbacks as the loop calls them (`event`), holding the run's `state` and `control`. Every hook
    gets its own copy of the metrics, so that none can change what is logged or what the next sees; a hook
    that raises, answers what the run cannot use, or leaves a switch that is no yes or no, is held as
    `failure` (the loop stops after saving the step) instead of escaping mid-step."""

    def __init__(self, callbacks: list[Any], args: Any, state: TrainerState):
        self.callbacks = [(c, uses_events(c)) for c in callbacks]
        self.args, self.state, self.control = args, state, TrainerControl()
        self.failure: tuple[str, Exception | None] | None = None  # the first: its line, and what it raised

    def event(self, event: str, **payload: Any) -> None:
        """Call `event` on every callback that has it (the first form's hooks where they belong)."""
        for callback, events in self.callbacks:
            hook = event if events else LEGACY_EVENTS.get(event)
            method = getattr(callback, hook, None) if hook else None
            if method is not None:
                self._call(callback, hook, events, method, payload)

    def switch(self, name: str) -> bool:
        """A switch of the control, as the loop reads it (checked to be a yes or no after every call)."""
        return bool(_stop_asked(getattr(self.control, name, False)))

    def _call(self, callback: object, hook: str, events: bool, method: Any, payload: dict[str, Any]) -> None:
        copies = {k: dict(v) if isinstance(v, dict) else v for k, v in payload.items()}
        step = self.state.global_step
        where = {"on_train_begin": f"before step {step + 1}", "on_step_begin": f"before step {step + 1}"}.get(
            hook, f"after step {step}" if hook == "on_train_end" else f"step {step}"
        )
        name = f"callback {_callback_name(callback)}.{hook}"
        try:
            if events:
                answer = method(self.args, self.state, self.control, **copies)
            else:
                answer = method(step, next(iter(copies.values())))
        except Exception as e:
            self._fail(f"{where}: {name} raised {exception_summary(e)}", e)
            return
        if not events:
            if hook == "on_step_end":
                asked = _stop_asked(answer)
                if asked is None:
                    expected = "return True to stop the run, False or None to go on"
                    self._fail(f"{where}: {name} returned {described(answer)}; {expected}")
                elif asked:
                    self.control.should_training_stop = True
            return
        if answer is not None and answer is not self.control:
            if not all(hasattr(answer, s) for s in SWITCHES):
                self._fail(f"{where}: {name} returned {described(answer)}; return the control, or None")
                return
            self.control = answer  # transformers' rule: a control returned is the control from then on
        for switch in SWITCHES:
            value = getattr(self.control, switch)
            if _stop_asked(value) is None:
                self._fail(f"{where}: {name} set control.{switch} to {described(value)}; expected True or False")
                setattr(self.control, switch, False)

    def _fail(self, line: str, cause: Exception | None = None) -> None:
        self.failure = self.failure or (line, cause)
