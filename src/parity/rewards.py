"""Running reward functions so that a bad one cannot take the run down.

A reward call that raises, returns a non-number, or runs past `timeout_s` gives
that sample reward 0 and is counted; with `strict=True` it stops the run instead.
Untrusted or slow rewards (math-verify, user functions) run one at a time in a
worker process that is killed and replaced on a timeout; the built-in rewards
run in-process.
"""

from __future__ import annotations

import math
import multiprocessing as mp
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parity.tasks import Problem, RewardFn

if TYPE_CHECKING:
    from parity.models import Tokenizer
    from parity.rollout import RolloutBatch


class RewardError(RuntimeError):
    """A reward failure under `reward.strict=true`."""


@dataclass
class RewardResult:
    rewards: list[float]
    errors: int  # raised or returned a non-finite / non-number value
    timeouts: int


def _check(value: object) -> float:
    reward = float(value)  # type: ignore[arg-type]
    if not math.isfinite(reward):
        raise ValueError(f"reward is {reward}")
    return reward


def _worker(fn: RewardFn, conn) -> None:
    while True:
        item = conn.recv()
        if item is None:
            return
        index, problem, response, length = item
        try:
            conn.send((index, _check(fn(problem, response, length)), None))
        except BaseException as e:  # noqa: BLE001 - reported to the parent, never raised here
            conn.send((index, 0.0, f"{type(e).__name__}: {e}"))


class RewardRunner:
    def __init__(self, fn: RewardFn, isolate: bool, timeout_s: float = 5.0, strict: bool = False):
        self.fn, self.isolate, self.timeout_s, self.strict = fn, isolate, timeout_s, strict
        self._proc: mp.process.BaseProcess | None = None
        self._conn = None

    def _start(self) -> None:
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(self.fn, child), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
        self._proc, self._conn = None, None

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        self._kill()

    def _fail(self, what: str) -> None:
        if self.strict:
            self.close()
            raise RewardError(
                f"reward function {getattr(self.fn, '__qualname__', self.fn)} {what} (reward.strict=true)"
            )

    def __call__(self, items: list[tuple[Problem, str, int]]) -> RewardResult:
        rewards = [0.0] * len(items)
        errors = timeouts = 0
        if not self.isolate:
            for i, (problem, response, length) in enumerate(items):
                try:
                    rewards[i] = _check(self.fn(problem, response, length))
                except Exception as e:
                    errors += 1
                    self._fail(f"raised {type(e).__name__}: {e}")
            return RewardResult(rewards, errors, timeouts)
        for i, item in enumerate(items):
            if self._proc is None:
                self._start()
            try:
                self._conn.send((i, *item))
                result = self._conn.recv() if self._conn.poll(self.timeout_s) else None
            except (EOFError, OSError):  # the worker died (os._exit, a crash)
                result = (i, 0.0, "the worker process died")
                self._kill()
            if result is None:
                timeouts += 1
                self._kill()  # the next item starts a fresh worker
                self._fail(f"timed out after {self.timeout_s}s")
                continue
            _, rewards[i], error = result
            if error is not None:
                errors += 1
                self._fail(f"raised {error}")
        return RewardResult(rewards, errors, timeouts)


def score_rollouts(
    batch: RolloutBatch, problems: list[Problem], tokenizer: Tokenizer, runner: RewardRunner
) -> RewardResult:
    """Decode each response and score it against its prompt's problem (`problems[group]`)."""
    lengths = batch.response_lengths.tolist()
    items = [
        (problems[g], tokenizer.decode(batch.response_ids[i, :n].tolist()), n)
        for i, (g, n) in enumerate(zip(batch.group_index.tolist(), lengths))
    ]
    return runner(items)
