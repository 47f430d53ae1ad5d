"""Running reward functions so that a bad one cannot take the run down.

A reward call that raises, returns a non-number, or runs past `timeout_s` gives
that sample reward 0 and is counted; with `strict=True` it stops the run instead.
The first failure a runner sees is printed on stderr with its traceback, so a
broken reward function is visible at once; later ones are only counted, and
`RewardHealth` turns the per-step counts into a warning or a stop.

Untrusted or slow rewards (math-verify, user functions) run one at a time in a
worker process that is killed and replaced on a timeout, and that exits when the
run does, even a SIGKILLed run; the built-in rewards run in-process. Code run in
the training process (a reward module's import, an in-process reward call) is
bounded too (`bounded`): no worker can be killed for it, so past its bound it is
interrupted and the run refused or stopped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import math
import multiprocessing as mp
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from parity import stopping
from parity.rl.builtin_rewards import RewardFn
from parity.rl.problems import Problem

if TYPE_CHECKING:
    import torch

    from parity.engines.batch import RolloutBatch
    from parity.engines.tokenizer import Tokenizer

_PARENT_CHECK_S = 1.0  # how often an idle worker checks that the run is still there
WORKER_START_S = 300.0  # how long a worker may take to start (spawn: a fresh interpreter imports torch)
IN_PROCESS_TIMEOUT_S = 300.0  # `reward.in_process_timeout_s` unset: a reward call in the training process


class RewardError(RuntimeError):
    """A reward failure under `reward.strict=true`, rewards that keep failing (`RewardHealth`), or a reward
    call in the training process past `reward.in_process_timeout_s`."""


# ----------------------------------------------------------------------------- your code in this process


class Overran(BaseException):
    """Raised into code run under `bounded` once it runs past its bound. A BaseException, so that the code's
    own `except Exception` does not take it for one of its errors."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM came while `bounded` ran code that the signal ends: the program stops (exit code
    128 + `signum`). Not the code's own KeyboardInterrupt, which `bounded` lets through as the code's error."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


GRACE_S = 10.0  # how long code that caught `Overran` may go on before the process stops at once


class _Watch:
    def __init__(self):
        self.active, self.expired, self.signum = True, False, None


@contextlib.contextmanager
def bounded(timeout_s: float, late: str, late_exit: int, interrupt: bool = False) -> Iterator[None]:
    """Run the block, code of the user's in this process, for at most `timeout_s`: past it `Overran` is raised
    into the block (by SIGALRM, which also ends a `time.sleep` or a blocking read) and out of the `with`,
    whatever the block made of it. A block that catches it and goes on is stopped GRACE_S later: `late` is
    printed and the process ends with `late_exit` (os._exit: nothing else ends code that will not end).

    SIGINT and SIGTERM that come meanwhile go to the handler in place (`parity train`'s notes them and the
    block goes on); with `interrupt`, or where that handler is Python's default (which raises
    KeyboardInterrupt, or ends the process), the block is ended with `Interrupted`. So a KeyboardInterrupt
    that leaves the block is the block's own. A fork of the block that returns here exits at once: it
    would run a second copy of the program (a reward calling `os.fork()` in each call multiplied the run
    exponentially). Signals run in the main thread only: elsewhere the block is unbounded."""
    pid, watch = os.getpid(), _Watch()
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in (signal.SIGALRM, signal.SIGINT, signal.SIGTERM)} if main else {}

    def expire(_signum: int, _frame) -> None:
        if not watch.active:  # the block is over; the timer is being stopped
            return
        if watch.expired:  # the block caught Overran and went on
            print(f"\n{late}", file=sys.stderr, flush=True)  # on a line of its own, after any progress bar
            os._exit(late_exit)
        watch.expired = True
        raise Overran

    def note(signum: int, frame) -> None:
        handler = previous[signum]
        if handler == signal.SIG_IGN:
            return
        if callable(handler) and handler is not signal.default_int_handler:
            handler(signum, frame)
            if not interrupt:
                return
        watch.signum = watch.signum or signum
        if watch.active:
            raise Interrupted(signum)

    if main:
        signal.signal(signal.SIGALRM, expire)
        signal.signal(signal.SIGINT, note)
        signal.signal(signal.SIGTERM, note)
        signal.setitimer(signal.ITIMER_REAL, timeout_s, GRACE_S)
    raised: BaseException | None = None
    try:
        yield
    except BaseException as e:  # noqa: BLE001 - settled below, after the timer is stopped
        raised = e
    watch.active = False  # from here the handlers only note: nothing is raised into the lines below
    if os.getpid() != pid:
        os._exit(0)
    if main:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if watch.signum is not None:
        raise Interrupted(watch.signum) from None
    if watch.expired:
        raise Overran from None
    if raised is not None:
        raise raised


def overran_line(name: str, timeout_s: float) -> str:
    """What stops a run whose reward call in the training process ran past its bound."""
    return (
        f"reward function {name} did not return within reward.in_process_timeout_s={timeout_s:g} s in the training "
        "process; an interrupted call may have left its state half-changed, so the run stops (reward.isolate=always "
        "runs it in a worker process, where a call past reward.timeout_s scores 0)"
    )


def awaited(value: Any) -> Any:
    """`value`, or, if it is awaitable (an async reward's), what it comes to: run on an event loop of its own,
    in a thread of its own where this thread already runs one (a notebook's)."""
    if not inspect.isawaitable(value):
        return value

    async def result() -> Any:
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(result())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, result()).result()


def bounded_call(name: str, timeout_s: float | None, call: Any) -> Any:
    """`call()` (a reward in the training process) under `bounded`; no bound with `timeout_s` None (a
    worker process, which its parent bounds)."""
    if timeout_s is None:
        return call()
    late = f"parity: the run stopped: {overran_line(name, timeout_s)}; it went on after it was interrupted"
    with bounded(timeout_s, late, 1):
        return call()


@dataclass
class RewardResult:
    rewards: list[float]
    errors: int  # raised or returned a non-finite / non-number value; a dead worker counts here too
    timeouts: int
    first_error: str | None = None  # the first failure of these samples, one line
    functions: int = 1  # the reward functions each sample was scored by (errors and timeouts count their calls)
    responses: list[str] = field(default_factory=list)  # the decoded responses scored (`score_rollouts`)
    # Each reward function's own scores (NaN: it returned None, not scoring the sample) and weight.
    per_function: dict[str, list[float]] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # what reward functions gave `log_metric`, averaged
    extra: dict[str, list[Any]] = field(default_factory=dict)  # what they gave `log_extra`: a value per sample


class _Failure(NamedTuple):
    summary: str  # one line, e.g. "ZeroDivisionError: division by zero"
    trace: str = ""  # the formatted traceback, when there is an exception
    timed_out: bool = False


def exception_summary(e: BaseException) -> str:
    """`Type: message` on one line, even for multi-line messages; `Type` alone for an empty one."""
    message = " ".join(str(e).split())
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


def _exception_failure(e: BaseException) -> _Failure:
    return _Failure(exception_summary(e), "".join(traceback.format_exception(e)))


def report_first_failure(header: str, trace: str) -> None:
    """A reward's first failure on stderr, with its traceback: a broken reward is visible at once."""
    print(header + (f"\n{trace.rstrip()}" if trace else ""), file=sys.stderr)


def _death_failure(exit_code: int | None) -> _Failure:
    if exit_code is not None and exit_code < 0:  # multiprocessing's way of saying "killed by a signal"
        return _Failure(f"the worker process died ({signal.Signals(-exit_code).name})")
    return _Failure(f"the worker process died (exit code {exit_code})")


def _check(value: object) -> float:
    reward = float(value)  # type: ignore[arg-type]
    if not math.isfinite(reward):
        raise ValueError(f"reward is {reward}")
    return reward


def _unchecked(value: object) -> object:
    return value


def _worker(fn: RewardFn, conn, parent_pid: int, die_with_parent: bool, check=_check) -> None:
    stopping.worker_started(parent_pid, die_with_parent)
    pid = os.getpid()
    prepare = getattr(fn, "prepare", None)  # a reward's slow imports, within the start's budget
    if prepare is not None:
        prepare()
    conn.send(None)  # started, `fn` imported: the parent's timeouts count from here
    # The worker holds a copy of the parent's end of the pipe (fork), so a dead parent
    # never shows up as EOF: check who the parent is instead. Checking before the first
    # wait also covers a parent that died before the death signal was set.
    while os.getppid() == parent_pid:
        if not conn.poll(_PARENT_CHECK_S):
            continue
        item = conn.recv()
        if item is None:
            return
        try:
            reply = (check(fn(*item)), None)
        except BaseException as e:  # noqa: BLE001 - reported to the parent, never raised here
            reply = (0.0, _exception_failure(e))
        if os.getpid() != pid:  # a fork of the reward, returning here: it would answer the run a second time
            os._exit(0)
        conn.send(reply)


class RewardRunner:
    """`start`: how the worker process starts. `fork` (the built-in math reward: no torch in the child)
    is quick; `spawn` starts a fresh interpreter, the only safe start for code that runs torch, whose
    thread pools a forked child inherits locked (a judge model hangs in its forward)."""

    def __init__(
        self,
        fn: RewardFn,
        isolate: bool,
        timeout_s: float = 5.0,
        strict: bool = False,
        start: str = "fork",
        in_process_timeout_s: float = IN_PROCESS_TIMEOUT_S,
    ):
        self.fn, self.isolate, self.timeout_s, self.strict, self.start = fn, isolate, timeout_s, strict, start
        self.in_process_timeout_s = in_process_timeout_s
        self._proc: mp.process.BaseProcess | None = None
        self._conn = None
        self._shown_failure = False

    def _start(self, check=_check) -> None:
        ctx = mp.get_context(self.start)
        parent, child = ctx.Pipe()
        # The death signal fires when the forking *thread* exits, so it is only safe to ask
        # for from the main thread, which lives as long as the run.
        from_main_thread = threading.current_thread() is threading.main_thread()
        args = (self.fn, child, os.getpid(), from_main_thread, check)
        self._proc = ctx.Process(target=_worker, args=args, daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        # A spawned worker imports torch and the reward's module before it serves (seconds): that start is
        # not the reward's time, so it has a budget of its own.
        if not parent.poll(WORKER_START_S):
            self._kill()
            raise RewardError(f"the reward worker did not start within {WORKER_START_S:.0f}s")
        try:
            parent.recv()
        except (EOFError, OSError):  # died while importing: its exit code says how
            raise RewardError(
                f"the reward worker died while starting ({_death_failure(self._kill()).summary})"
            ) from None

    def _kill(self) -> int | None:
        """Stop the worker, if there is one; its exit code."""
        exit_code = None
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            exit_code = self._proc.exitcode
        self._proc, self._conn = None, None
        return exit_code

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        self._kill()

    def _score_in_process(self, item: tuple[Problem, str, int]) -> tuple[float, _Failure | None]:
        name = getattr(self.fn, "__qualname__", self.fn)
        try:
            return _check(bounded_call(name, self.in_process_timeout_s, lambda: self.fn(*item))), None
        except Overran:
            raise RewardError(overran_line(name, self.in_process_timeout_s)) from None
        except Interrupted:
            raise
        except BaseException as e:  # noqa: BLE001 - a failure of the reward's, as in a worker (`_worker`)
            return 0.0, _exception_failure(e)

    def call(self, *args) -> tuple[Any, _Failure | None]:
        """`fn(*args)` in the worker, its value unchecked (a batch's scores), or how the call failed."""
        return self._score_in_worker(args, check=_unchecked)

    def _score_in_worker(self, item: tuple, check=_check) -> tuple[Any, _Failure | None]:
        if self._proc is None:
            self._start(check)
        try:
            self._conn.send(item)
            reply = self._conn.recv() if self._conn.poll(self.timeout_s) else None
        except (EOFError, OSError):  # the worker died (os._exit, a crash)
            return 0.0, _death_failure(self._kill())
        if reply is None:
            self._kill()  # the next item starts a fresh worker
            return 0.0, _Failure(f"timed out after {self.timeout_s}s", timed_out=True)
        return reply  # (reward, _Failure or None), as `_worker` sends it

    def _report(self, index: int, failure: _Failure) -> None:
        """Show the runner's first failure in full (later ones are only counted); under strict, stop."""
        if not self._shown_failure:
            self._shown_failure = True
            report_first_failure(f"reward: first failure (sample {index}): {failure.summary}", failure.trace)
        if self.strict:
            self.close()
            name = getattr(self.fn, "__qualname__", self.fn)
            raise RewardError(
                f"reward function {name} failed on sample {index}: {failure.summary} (reward.strict=true)"
            )

    def __call__(self, items: list[tuple[Problem, str, int]]) -> RewardResult:
        result = RewardResult([0.0] * len(items), errors=0, timeouts=0)
        for i, item in enumerate(items):
            reward, failure = self._score_in_worker(item) if self.isolate else self._score_in_process(item)
            if failure is None:
                result.rewards[i] = reward
                continue
            if failure.timed_out:
                result.timeouts += 1
            else:
                result.errors += 1
            result.first_error = result.first_error or failure.summary
            self._report(i, failure)
        return result


class RewardHealth:
    """The training loop's step-by-step watch on reward failures (errors and timeouts together).

    `observe` returns a warning line when a step's failure rate reaches `warn_rate` after a
    step below it: a run that keeps failing warns once, and again each time it relapses.
    It raises `RewardError` once every reward failed in `max_failed_steps` consecutive steps,
    since such steps train on nothing but zero rewards; `max_failed_steps=0` never stops.
    """

    def __init__(self, warn_rate: float, max_failed_steps: int):
        self.warn_rate, self.max_failed_steps = warn_rate, max_failed_steps
        self._above_warn_rate = False  # the last step's rate was at or above warn_rate
        self._all_failed_steps = 0  # consecutive steps in which every reward failed

    def observe(self, step: int, result: RewardResult) -> str | None:
        """A step's rewards: a failure is one function's on one sample, so that one broken function of two
        fails half of the calls, not every reward."""
        failed, samples = result.errors + result.timeouts, len(result.rewards)
        calls = samples * result.functions
        rate = failed / calls if calls else 0.0
        self._all_failed_steps = self._all_failed_steps + 1 if calls and failed >= calls else 0
        if self.max_failed_steps and self._all_failed_steps >= self.max_failed_steps:
            raise RewardError(
                f"every reward failed in {self._all_failed_steps} consecutive steps (up to step {step}); "
                f"last error: {result.first_error}; reward.max_failed_steps={self.max_failed_steps} "
                "stops the run (0 never stops)"
            )
        crossed = rate >= self.warn_rate and not self._above_warn_rate
        self._above_warn_rate = rate >= self.warn_rate
        if not crossed:
            return None
        of = f"{samples} samples" if result.functions == 1 else f"{calls} calls, {samples} samples × {result.functions}"
        return (
            f"reward: step {step}: {rate:.0%} of rewards failed ({result.errors} errors, {result.timeouts} timeouts "
            f"of {of}; first: {result.first_error}); this warns at reward.warn_error_rate={self.warn_rate}"
        )


def training_rewards(rewards: torch.Tensor, truncated: torch.Tensor, mode: str) -> torch.Tensor:
    """The rewards the loss sees under `algorithm.truncated=mode`: with `zero_reward` a response cut off
    at the length limit scores 0 whatever it holds (a right number in an unfinished answer is not an
    answer); `keep` and `drop` leave the rewards as they are (`drop` takes such responses out of the loss). A
    response that no reward function scored (NaN) stays unscored: out of its group's baseline, advantage 0."""
    return rewards.masked_fill(truncated & ~rewards.isnan(), 0.0) if mode == "zero_reward" else rewards


def score_rollouts(
    batch: RolloutBatch, problems: list[Problem], tokenizer: Tokenizer, runner: RewardRunner
) -> RewardResult:
    """Decode each response and score it against its prompt's problem (`problems[group]`), its token ids
    given as the column `completion_ids` (TRL's: in an episode every id after the prompt, the fed ones too).
    An episode is scored on its last answer, with its messages (`rl/episodes.Episodes.reward_items`); the
    length a reward reads is the model's own tokens (the length task's), as `response/length_*` count them."""
    lengths = batch.response_lengths.tolist()
    groups, ids = batch.group_index.tolist(), batch.response_ids.tolist()
    problems = [
        Problem(problems[g].prompt, problems[g].answer, {**problems[g].columns, "completion_ids": row[:n]})
        for g, n, row in zip(groups, lengths, ids)
    ]
    if batch.episodes is not None:
        items = batch.episodes.reward_items(problems, batch.sampled_mask.sum(-1).tolist())
        result = runner(items)
        result.responses = batch.episodes.transcripts()
        return result
    items = [(p, tokenizer.decode(p.columns["completion_ids"]), n) for p, n in zip(problems, lengths)]
    result = runner(items)
    result.responses = [response for _, response, _ in items]
    return result
