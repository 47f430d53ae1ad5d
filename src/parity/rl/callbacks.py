"""Callbacks: the Python API's hooks into a run (`callbacks=`), checked before the run starts and called so
that none can break the step: each hook gets its own copy of the metrics, and one that raises or answers
other than yes or no stops the run after the step is saved (`CallbackError`), naming it."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from parity.config import ConfigError, definition_name, described
from parity.rl.rewards import exception_summary


class Callback:
    """Hooks into a run (the Python API's `callbacks=`): subclass and override what you need. Returning
    True from `on_step_end` stops the run after that step, with a checkpoint. Each hook gets its own copy of
    the metrics."""

    def on_step_end(self, step: int, metrics: dict[str, float]) -> bool | None:
        return None

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        return None


HOOKS = ("on_step_end", "on_eval")


class CallbackError(RuntimeError):
    """A callback raised, or its `on_step_end` answered something other than True, False or None: the run
    stopped after saving the step. The callback's own exception, if any, is the `__cause__`."""


def _callback_name(callback: object) -> str:
    """A module (or function) by its name, an object by its class's."""
    return getattr(callback, "__name__", None) or definition_name(type(callback).__qualname__)


def checked_callbacks(callbacks: object) -> list[Any]:
    """The API's `callbacks=`: None, one callback, or an iterable of them; a callback is an object with
    `on_step_end` and/or `on_eval` methods that take (step, metrics). A one-line ConfigError names the first
    that is not, before the run starts."""
    if callbacks is None:
        return []
    if any(hasattr(callbacks, hook) for hook in HOOKS):
        callbacks = [callbacks]
    elif isinstance(callbacks, (str, bytes, Mapping)) or not isinstance(callbacks, Iterable):
        raise ConfigError(
            f"callbacks: expected a callback (an object with on_step_end or on_eval) or a list of them, got "
            f"{described(callbacks)}"
        )
    out = list(callbacks)
    for i, callback in enumerate(out):
        where = f"callbacks[{i}]"
        if isinstance(callback, type):
            raise ConfigError(f"{where}: {described(callback)}, not a callback; pass an instance of it")
        hooks = {hook: getattr(callback, hook) for hook in HOOKS if hasattr(callback, hook)}
        if not hooks:
            raise ConfigError(
                f"{where}: {described(callback)} has neither on_step_end(step, metrics) nor on_eval(step, metrics); "
                "subclass parity.Callback"
            )
        for hook, method in hooks.items():
            name = f"{_callback_name(callback)}.{hook}"
            if not callable(method):
                raise ConfigError(f"{where}: {name} is {described(method)}, not a method")
            try:
                signature = inspect.signature(method)
            except (TypeError, ValueError):  # a builtin without a signature: it is called as it is
                continue
            try:
                signature.bind(0, {})
            except TypeError:
                raise ConfigError(f"{where}: {name}{signature} cannot be called as {hook}(step, metrics)") from None
    return out


def _stop_asked(answer: object) -> bool | None:
    """`on_step_end`'s answer: True to stop, False to go on; None when it is no answer. None, a bool, or a
    0-d boolean (NumPy's `np.True_`, a torch bool scalar: what a comparison of metrics gives) answer."""
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
    """The callbacks as the loop calls them: every hook gets its own copy of the metrics, so that none can
    change what is logged or what the next sees; a hook that raises, or an `on_step_end` that answers no
    yes or no, is held as `failure` (the loop stops after saving the step) instead of escaping mid-step."""

    def __init__(self, callbacks: list[Any]):
        self.callbacks = callbacks
        self.failure: tuple[str, Exception | None] | None = None  # the first: its line, and what it raised

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        for callback in self.callbacks:
            self._call(callback, "on_eval", step, metrics)

    def on_step_end(self, step: int, metrics: dict[str, float]) -> bool:
        """Whether a callback asked to stop; every callback is asked."""
        answers = [self._call(callback, "on_step_end", step, metrics) for callback in self.callbacks]
        return any(_stop_asked(a) for a in answers)

    def _call(self, callback: object, hook: str, step: int, metrics: dict[str, float]) -> object:
        method = getattr(callback, hook, None)
        if method is None:
            return None
        name = f"callback {_callback_name(callback)}.{hook}"
        try:
            answer = method(step, dict(metrics))
        except Exception as e:
            self.failure = self.failure or (f"step {step}: {name} raised {exception_summary(e)}", e)
            return None
        if hook == "on_step_end" and _stop_asked(answer) is None:
            expected = "return True to stop the run, False or None to go on"
            self.failure = self.failure or (f"step {step}: {name} returned {described(answer)}; {expected}", None)
            return None
        return answer
