"""Reward functions and their containment: a raising or hanging reward never kills the run."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from decimal import Decimal
from pathlib import Path

import pytest
import torch

from parity.cli import main
from parity.config import ConfigError
from parity.rl.builtin_rewards import extract_boxed, extract_number, length_reward, math_reward, number_reward
from parity.rl.data import DataError, DataOrder, load_problems
from parity.rl.problems import Problem
from parity.rl.reward_fns import import_reward_fn
from parity.rl.rewards import RewardError, RewardHealth, RewardResult, RewardRunner, overran_line, training_rewards

P = Problem("1+1=", "2")


def _raises(problem, response, length):
    if response == "boom":
        raise RuntimeError("boom")
    return 1.0


def _hangs(problem, response, length):
    if response == "hang":
        time.sleep(60)
    return 0.5


def _dies(problem, response, length):
    if response == "die":
        os._exit(3)
    return 0.25


@pytest.mark.parametrize("isolate", [False, True])
def test_raising_reward_is_contained(isolate):
    runner = RewardRunner(_raises, isolate=isolate)
    try:
        out = runner([(P, "ok", 1), (P, "boom", 1), (P, "ok", 1)])
    finally:
        runner.close()
    assert out.rewards == [1.0, 0.0, 1.0] and out.errors == 1 and out.timeouts == 0
    assert out.first_error == "RuntimeError: boom"


@pytest.mark.parametrize("isolate", [False, True])
def test_first_failure_is_shown_once_with_its_traceback(isolate, capfd):
    runner = RewardRunner(_raises, isolate=isolate)
    try:
        runner([(P, "ok", 1), (P, "boom", 1), (P, "boom", 1)])
        runner([(P, "boom", 1)])
    finally:
        runner.close()
    err = capfd.readouterr().err
    assert err.count("reward: first failure (sample 1): RuntimeError: boom\n") == 1
    assert err.count("Traceback (most recent call last)") == 1
    assert 'raise RuntimeError("boom")' in err  # the reward function's own line
    assert "reward:" not in err.split("Traceback", 1)[1]  # later failures are only counted


def test_hanging_reward_times_out_and_the_rest_still_score():
    runner = RewardRunner(_hangs, isolate=True, timeout_s=0.5)
    try:
        out = runner([(P, "a", 1), (P, "hang", 1), (P, "b", 1)])
    finally:
        runner.close()
    assert out.rewards == [0.5, 0.0, 0.5] and out.timeouts == 1 and out.errors == 0


def test_dying_worker_is_replaced(capfd):
    runner = RewardRunner(_dies, isolate=True)
    try:
        out = runner([(P, "die", 1), (P, "x", 1)])
    finally:
        runner.close()
    assert out.rewards == [0.0, 0.25] and out.errors == 1
    assert out.first_error == "the worker process died (exit code 3)"
    assert capfd.readouterr().err == "reward: first failure (sample 0): the worker process died (exit code 3)\n"


def test_strict_stops_the_run():
    runner = RewardRunner(_raises, isolate=False, strict=True)
    with pytest.raises(RewardError, match="failed on sample 0: RuntimeError: boom.*strict=true"):
        runner([(P, "boom", 1)])


def test_non_finite_reward_counts_as_error():
    runner = RewardRunner(lambda p, r, n: float("nan"), isolate=False)
    assert runner([(P, "x", 1)]).errors == 1


def _step(errors: int, timeouts: int = 0) -> RewardResult:
    return RewardResult([0.0] * 4, errors, timeouts, "ZeroDivisionError: division by zero" if errors else None)


def test_health_warns_when_the_failure_rate_reaches_the_threshold():
    health = RewardHealth(warn_rate=0.5, max_failed_steps=0)
    assert health.observe(1, _step(1)) is None
    line = health.observe(2, _step(1, timeouts=1))
    assert line is not None and "step 2: 50%" in line and "1 errors, 1 timeouts of 4" in line
    assert "ZeroDivisionError" in line and "reward.warn_error_rate=0.5" in line
    assert health.observe(3, _step(3)) is None  # still above: warned already
    assert health.observe(4, _step(0)) is None
    assert "step 5: 75%" in health.observe(5, _step(3))  # crossed again


def test_health_stops_after_consecutive_all_failed_steps():
    health = RewardHealth(warn_rate=1.0, max_failed_steps=2)
    health.observe(1, _step(4))
    health.observe(2, _step(3))  # one reward scored: the count starts over
    health.observe(3, _step(2, timeouts=2))
    with pytest.raises(RewardError, match=r"in 2 consecutive steps.*ZeroDivisionError.*reward\.max_failed_steps=2"):
        health.observe(4, _step(4))


def test_health_counts_each_functions_calls():
    """One of two functions failing on every sample fails half of the calls: the other still scores them."""
    health = RewardHealth(warn_rate=0.5, max_failed_steps=1)
    half = RewardResult([1.0] * 4, errors=4, timeouts=0, first_error="f: ValueError", functions=2)
    assert "50% of rewards failed (4 errors, 0 timeouts of 8 calls, 4 samples × 2" in health.observe(1, half)
    with pytest.raises(RewardError, match="every reward failed in 1 consecutive"):
        health.observe(2, dataclasses.replace(half, errors=8))


def test_health_max_failed_steps_zero_never_stops():
    health = RewardHealth(warn_rate=0.1, max_failed_steps=0)
    for step in range(10):
        health.observe(step, _step(4))


def _gone(pid: int) -> bool:
    """The process no longer runs; a zombie (exited, not yet reaped by its new parent) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
@pytest.mark.parametrize(
    "only",
    [
        "rewards._PARENT_CHECK_S = 3600",  # the worker waits an hour between parent checks: the death signal
        "stopping._die_with = lambda parent_pid: None",  # no death signal: the worker's parent check
    ],
    ids=["death-signal", "parent-check"],
)
def test_worker_exits_when_the_run_is_killed(only):
    # The reward returns the worker's pid, so the run can tell it without reaching into the runner.
    script = textwrap.dedent(f"""
        import os, time
        from parity import stopping
        from parity.rl import rewards
        from parity.rl.problems import Problem
        {only}
        runner = rewards.RewardRunner(lambda p, r, n: os.getpid(), isolate=True)
        print(int(runner([(Problem("q", "a"), "r", 1)]).rewards[0]), flush=True)
        time.sleep(60)
    """)
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        worker = int(run.stdout.readline())
        assert not _gone(worker)
        run.send_signal(signal.SIGKILL)
        run.wait()
        deadline = time.monotonic() + 4
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(worker)
    finally:
        run.kill()
        run.wait()
        if worker is not None and not _gone(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_cut_off_response_scores_as_algorithm_truncated_says():
    checked = torch.tensor([1.0, 1.0, 0.0, 0.5])
    cut_off = torch.tensor([True, False, True, True])
    assert training_rewards(checked, cut_off, "zero_reward").tolist() == [0.0, 1.0, 0.0, 0.0]
    for mode in ("keep", "drop"):  # drop takes them out of the loss instead
        assert training_rewards(checked, cut_off, mode).tolist() == checked.tolist()
    # A response no function scored stays unscored, cut off or not: out of its group's baseline.
    unscored = torch.tensor([math.nan, math.nan, 1.0])
    assert training_rewards(unscored, torch.tensor([True, False, True]), "zero_reward").isnan().tolist() == [
        True,
        True,
        False,
    ]


def test_accuracy_and_the_perfectible_search_score_cut_off_answers_as_training_does(tmp_path, monkeypatch):
    """The built-in model writes its working, then `>ANSWER` and EOS: at a limit of exactly the right
    response's length every right answer is cut off before its EOS. Under zero_reward the loss scores them
    0, and so must `reward/accuracy`, `groups/zero_variance_frac` and the perfectible search."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"prompt": "954+4302=", "answer": "5256"}) + "\n")  # "4+2=6,5+0=5,9+3=12,0+4+1=5>5256"
    limit = ["rollout.max_new_tokens=31", f"task.data={data}", "prompts_per_step=2", "rollout.group_size=8"]
    metrics = {}
    for mode in ("zero_reward", "keep"):
        run_dir = tmp_path / mode
        args = ["train", f"run_dir={run_dir}", "steps=1", "tensorboard=false", f"algorithm.truncated={mode}", *limit]
        assert main(args) == 0
        metrics[mode] = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    zero, keep = metrics["zero_reward"], metrics["keep"]
    assert zero["response/truncated_frac"] == keep["response/truncated_frac"] == 1.0  # the same samples
    assert keep["reward/accuracy"] > 0 and keep["reward/correct_cut_off_frac"] == 0
    assert zero["reward/accuracy"] == zero["reward/mean"] == 0
    assert zero["reward/correct_cut_off_frac"] == keep["reward/accuracy"]
    assert zero["groups/zero_variance_frac"] == 1 and zero["grad/norm"] == 0
    accuracies = {}
    for mode in ("zero_reward", "keep"):
        out = tmp_path / f"{mode}.jsonl"
        args = ["perfectible", f"data={data}", "max_new_tokens=31", "samples=8", "lo=0", "hi=1", f"truncated={mode}"]
        assert main([*args, f"out={out}"]) == 0
        accuracies[mode] = json.loads(out.read_text())["base_accuracy"]
    assert accuracies["zero_reward"] == 0 < accuracies["keep"]
    assert main(["perfectible", f"data={data}", "truncated=cut"]) == 2


def test_math_reward_and_boxed_extraction():
    assert extract_boxed(r"a \boxed{x^{2}} b \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_boxed("no box") is None
    half = Problem("q", "0.5")
    assert math_reward(half, r"so \boxed{\frac{1}{2}}", 5) == 1.0
    assert math_reward(half, r"\boxed{1/3}", 5) == 0.0
    assert math_reward(half, "0.5 without a box", 5) == 0.0


MATH_IN_A_FRESH_PROCESS = """
import sys
from parity.rl.builtin_rewards import math_reward

assert "math_verify" not in sys.modules
math_reward.prepare()
print("math_verify" in sys.modules)
"""


def test_math_reward_prepares_by_importing_math_verify():
    """math-verify takes 0.6 s to import: the math reward's `prepare`, which its worker runs as it starts
    (below), imports it, so that the first sample's timeout does not include it."""
    done = subprocess.run([sys.executable, "-c", MATH_IN_A_FRESH_PROCESS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True", done.stdout + done.stderr


def _slow_to_prepare(problem, response, length):
    return 1.0


_slow_to_prepare.prepare = lambda: time.sleep(4.0)  # four times the timeout below


def test_a_rewards_prepare_runs_before_its_timeout_counts():
    """Every sample scores although preparing takes longer than a sample's timeout: the worker prepares
    before it reports itself started. Counted, not timed: had `prepare` run inside the first sample's timeout,
    that sample would have timed out."""
    runner = RewardRunner(_slow_to_prepare, isolate=True, timeout_s=1.0)
    try:
        out = runner([(P, "a", 1), (P, "b", 1)])
    finally:
        runner.close()
    assert out.rewards == [1.0, 1.0] and out.timeouts == 0 and out.errors == 0


@pytest.mark.parametrize(
    "response, number",
    [
        ("19", "19"),
        ("Sam has 12 + 7 = 19 apples.", "19"),
        ("The total is $1,234.", "1234"),
        ("It costs $25.00 in all", "25.00"),
        ("so -5 is left", "-5"),
        ("12-7 leaves 5", "5"),  # a minus after a digit is subtraction
        ("The train covers 360km.", "360"),  # units after the number
        ("First 3, then 4, then 12", "12"),  # a list is not a thousands group
        ("It is 1,2345", "2345"),
        (r"So the result is \boxed{48} (checked with 6 x 8)", "48"),  # \boxed{} wins over later numbers
        (r"\boxed{\$1,250}", "1250"),
        ("The answer is 19. Sam started with 12 and got 7.", "19"),  # "answer is" wins over later numbers
        ("Final answer: **42**, from 6 x 7", "42"),
        ("The answer is that all 3 remain, so 9", "9"),  # no number right after "answer is": the last one
        ("H2O and version v1.2", None),  # digits inside words are not numbers
        (r"\boxed{x}", None),
        ("no numbers here", None),
    ],
)
def test_number_extraction(response, number):
    assert extract_number(response) == (None if number is None else Decimal(number))


def test_number_reward():
    problem = Problem("Sam has 12 apples and buys 7 more. How many apples does Sam have now?", "19")
    assert number_reward(problem, "Sam has 12 + 7 = 19 apples.", 9) == 1.0
    assert number_reward(problem, "19.0", 2) == 1.0  # equal as numbers
    assert number_reward(problem, "He has 20 now.", 4) == 0.0
    assert number_reward(problem, "I do not know.", 4) == 0.0
    assert number_reward(Problem("q", "1,234"), "$1234", 2) == 1.0
    assert number_reward(Problem("q", "2.5"), "it is 2.50.", 2) == 1.0
    with pytest.raises(ValueError, match="task.name=number: the answer 'nineteen' is not a number"):
        number_reward(Problem("q", "nineteen"), "19", 1)


def test_length_reward():
    assert length_reward(P, "anything", 7) == -7.0


def test_user_reward_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def score(prompt, response, answer):\n    return float(answer in response)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = import_reward_fn("my_rewards:score")
    assert fn("1+1=", "it is 2", "2") == 1.0 and fn("1+1=", "it is 3", "2") == 0.0
    with pytest.raises(ConfigError, match="expected 'module:function'"):
        import_reward_fn("my_rewards.score")
    with pytest.raises(ConfigError, match="^task.reward_fn: module 'my_rewards' has no function 'nope'$"):
        import_reward_fn("my_rewards:nope")
    sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize(
    "source, problem",
    [
        ("def score(p, r, a)\n    return 1.0\n", r"SyntaxError: expected ':' \(broken_reward.py, line 1\)"),
        ("import no_such_module_here\n", "ModuleNotFoundError: No module named 'no_such_module_here'"),
        ("1 / 0\n", "ZeroDivisionError: division by zero"),
    ],
    ids=["syntax-error", "import-error", "raises-on-import"],
)
def test_unimportable_reward_module_is_a_config_error(tmp_path, monkeypatch, source, problem):
    (tmp_path / "broken_reward.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=f"^task.reward_fn: importing 'broken_reward' failed: {problem}$"):
        import_reward_fn("broken_reward:score")
    with pytest.raises(ConfigError, match="^task.reward_fn: importing 'not_a_module_anywhere' failed: ModuleNotFound"):
        import_reward_fn("not_a_module_anywhere:score")


def test_cli_reports_an_unimportable_reward_in_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_reward.py").write_text("def score(p, r, a)\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = [
        "train",
        f"run_dir={tmp_path / 'run'}",
        "task.reward_fn=broken_reward:score",
        "steps=1",
        "tensorboard=false",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "parity train: error: task.reward_fn: importing 'broken_reward' failed: "
        "SyntaxError: expected ':' (broken_reward.py, line 1)"
    ]


def test_dataset_files(tmp_path):
    jl = tmp_path / "d.jsonl"
    jl.write_text(
        json.dumps({"prompt": "1+1=", "answer": 2}) + "\n\n" + json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n"
    )
    assert load_problems(jl) == [Problem("1+1=", "2"), Problem("2+2=", "4")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": 1}\n{"prompt": 3}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: no answer column 'answer' \(the row has 'prompt'\)$"):
        load_problems(bad)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), tmp_path / "d.parquet")
    assert load_problems(tmp_path / "d.parquet")[1] == Problem("b", "2")
    with pytest.raises(DataError, match="does not exist"):
        load_problems(tmp_path / "missing.jsonl")


def test_data_order_is_resumable():
    full = DataOrder(7, seed=3).take(20)
    first = DataOrder(7, seed=3)
    head = first.take(9)
    assert head + DataOrder(7, seed=3, position=first.position).take(11) == full
    assert sorted(full[:7]) == list(range(7))  # each epoch is a permutation


# ----------------------------------------------------------------------------- your code in the training process


def _base_exceptions() -> dict[str, str]:
    """A `raise` of every built-in exception that `except Exception` lets through, and of one of the module's own."""
    import builtins

    names = [n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)]
    names = [n for n in names if not issubclass(getattr(builtins, n), Exception)]
    raises = {n: f"raise {n}('at import')" for n in names}
    raises["BaseExceptionGroup"] = "raise BaseExceptionGroup('at import', [KeyboardInterrupt()])"
    raises["its own"] = "class Own(BaseException):\n    pass\n\n\nraise Own('at import')"
    return raises


BASE_EXCEPTIONS = _base_exceptions()


def _train_with_reward(tmp_path: Path, module: str, *keys: str) -> int:
    return main(["train", f"run_dir={tmp_path / 'run'}", f"task.reward_fn={module}:score", *keys, "tensorboard=false"])


@pytest.mark.parametrize("raised", BASE_EXCEPTIONS)
def test_a_reward_module_raising_any_base_exception_at_import_is_one_line(tmp_path, monkeypatch, capsys, raised):
    """KeyboardInterrupt (or SystemExit, GeneratorExit...) raised by the module itself is its error, not a
    Ctrl-C of the user's: one line, exit 2, nothing written."""
    module = f"raising_at_import_{list(BASE_EXCEPTIONS).index(raised)}"
    (tmp_path / f"{module}.py").write_text(BASE_EXCEPTIONS[raised] + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _train_with_reward(tmp_path, module, "steps=1") == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"parity train: error: task.reward_fn: importing {module!r} failed: "
    )
    assert "at import" in lines[0] and not (tmp_path / "run").exists()


ENDLESS_IMPORTS = {
    "busy loop": "while True:\n    pass",
    "sleep": "import time\ntime.sleep(10**6)",
    "read of a pipe nobody writes": "import os\nr, w = os.pipe()\nos.read(r, 1)",
    "lock taken twice": "import threading\nlock = threading.Lock()\nlock.acquire()\nlock.acquire()",
}


@pytest.mark.parametrize("body", ENDLESS_IMPORTS)
def test_a_reward_module_that_never_finishes_importing_is_refused(tmp_path, monkeypatch, capsys, body):
    module = f"endless_import_{list(ENDLESS_IMPORTS).index(body)}"
    (tmp_path / f"{module}.py").write_text(ENDLESS_IMPORTS[body] + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _train_with_reward(tmp_path, module, "steps=1", "reward.import_timeout_s=0.5") == 2
    assert capsys.readouterr().err.splitlines() == [
        f"parity train: error: task.reward_fn: importing {module!r} did not end within reward.import_timeout_s=0.5 s; "
        "raise it if the import is slow on purpose"
    ]
    assert not (tmp_path / "run").exists()
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


def _parity_with_short_grace(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`parity ARGS` in its own process, run in `tmp_path`, with `rewards.GRACE_S` short (a test need not wait 10 s
    for code that catches the interruption)."""
    script = (
        "import sys\nfrom parity.rl import rewards\nrewards.GRACE_S = 0.5\nfrom parity.cli import main\n"
        f"sys.exit(main({list(args)!r}))"
    )
    return subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_a_reward_module_that_catches_the_interruption_is_stopped_at_once(tmp_path):
    (tmp_path / "swallows.py").write_text(
        "while True:\n    try:\n        while True:\n            pass\n    except BaseException:\n        pass\n"
    )
    run = _parity_with_short_grace(
        tmp_path, "train", "run_dir=run", "task.reward_fn=swallows:score", "reward.import_timeout_s=0.5"
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.splitlines()[-1] == (
        "parity: error: task.reward_fn: importing 'swallows' did not end within reward.import_timeout_s=0.5 s, "
        "nor when it was interrupted"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_a_reward_import_stops_the_program(tmp_path, signum):
    """The user's Ctrl-C (or SIGTERM) while a module imports for ever ends it at once: exit 130 (143), one line,
    nothing written."""
    (tmp_path / "endless.py").write_text("import pathlib\npathlib.Path('importing').touch()\nwhile True:\n    pass\n")
    argv = [sys.executable, "-m", "parity", "train", "run_dir=run", "task.reward_fn=endless:score"]
    run = subprocess.Popen(argv, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        while not (tmp_path / "importing").exists() and run.poll() is None:
            time.sleep(0.05)
        run.send_signal(signum)
        err = run.communicate(timeout=300)[1]
    finally:
        run.kill()
    name = signal.Signals(signum).name
    assert run.returncode == 128 + signum and "Traceback" not in err
    assert err.splitlines()[-1] == f"parity train: stopped by {name} before the run started"
    assert not (tmp_path / "run").exists()


def _loops(prompt, completion, **_):
    while True:
        pass


def _sleeps(prompts, completions, **_):
    time.sleep(10**6)


def _returns_once_interrupted(prompt, completion, **_):
    try:
        time.sleep(10**6)
    except BaseException:
        return 1.0


IN_PROCESS_HANGS = [_loops, _sleeps, _returns_once_interrupted]


@pytest.mark.parametrize("fn", IN_PROCESS_HANGS, ids=[f.__name__ for f in IN_PROCESS_HANGS])
def test_a_reward_that_never_returns_in_the_training_process_stops_the_run(fn):
    """`reward.timeout_s` bounds rewards in a worker; in the training process `reward.in_process_timeout_s` does,
    and the run stops naming the function (even one that caught the interruption and returned)."""
    from parity.rl.reward_fns import Reward, UserRewards, bind_all

    rewards = UserRewards(bind_all([Reward(fn)], ["answer"]), in_process_timeout_s=0.2)
    name = fn.__name__
    with pytest.raises(
        RewardError, match=f"^reward function {name} did not return within reward.in_process_timeout_s=0.2 s"
    ):
        rewards([(Problem("1+1=", "2"), "2", 1)])
    runner = RewardRunner(lambda p, r, n: fn(p, r), isolate=False, in_process_timeout_s=0.2)
    with pytest.raises(RewardError, match=r"^reward function .*<lambda> did not return within"):
        runner([(P, "x", 1)])
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


def test_a_reward_that_catches_every_interruption_is_stopped_at_once(tmp_path):
    (tmp_path / "stubborn.py").write_text(
        "import time\n\n\ndef score(prompt, completion, answer):\n    while True:\n        try:\n"
        "            time.sleep(100)\n        except BaseException:\n            pass\n"
    )
    keys = ("steps=1", "prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "eval.every=-1")
    run = _parity_with_short_grace(
        tmp_path, "train", "run_dir=run", "task.reward_fn=stubborn:score", "reward.in_process_timeout_s=0.5", *keys
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.splitlines()[-1].startswith(
        "parity: the run stopped: reward function score did not return within reward.in_process_timeout_s=0.5 s"
    )


def test_the_cli_stops_a_run_whose_reward_never_returns(tmp_path, monkeypatch, capsys):
    (tmp_path / "never_returns.py").write_text(
        "def score(prompt, completion, answer):\n    while True:\n        pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    keys = ("steps=2", "prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "eval.every=-1")
    assert _train_with_reward(tmp_path, "never_returns", *keys, "reward.in_process_timeout_s=0.5") == 1
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("parity ")]
    assert lines == [f"parity train: the run stopped: {overran_line('score', 0.5)}"]
    # Nothing was trained: the run leaves nothing, as a first batch that fails its check does (it was left
    # holding config.yaml, refused by the same call again as "already holds a run").
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit, GeneratorExit], ids=lambda e: e.__name__)
def test_a_reward_raising_a_base_exception_in_the_training_process_is_a_failure(raised):
    """As in a worker process: scored 0 and counted, where it used to end the run in a traceback."""
    from parity.rl.reward_fns import Reward, UserRewards, bind_all

    def score(prompt, completion, **_):
        if completion == "bad":
            raise raised("from the reward")
        return 1.0

    rewards = UserRewards(bind_all([Reward(score)], ["answer"]))
    out = rewards([(P, "ok", 1), (P, "bad", 1)])
    assert out.rewards == [1.0, 0.0] and out.errors == 1
    assert out.first_error == f"score: sample 1: {raised.__name__}: from the reward"
    runner = RewardRunner(lambda p, r, n: score(p, r), isolate=False)
    out = runner([(P, "bad", 1), (P, "ok", 1)])
    assert out.rewards == [0.0, 1.0] and out.errors == 1 and out.first_error == f"{raised.__name__}: from the reward"


def test_a_ctrl_c_during_a_reward_in_the_training_process_is_the_users():
    """Outside `parity train` (which notes a signal and finishes the step), SIGINT during a reward call ends it
    as Python's default does, but as `Interrupted`: a stop, not a failure of the reward's to count."""
    from parity.rl.reward_fns import Reward, UserRewards, bind_all
    from parity.rl.rewards import Interrupted

    def score(prompt, completion, **_):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10**6)

    # Python's default handler, whatever an earlier test in this process left (a library a test used once
    # left SIGINT ignored in CI, and the reward below would then sleep forever)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(Interrupted, match="SIGINT"):
            UserRewards(bind_all([Reward(score)], ["answer"]))([(P, "x", 1)])
        with pytest.raises(Interrupted, match="SIGINT"):
            RewardRunner(lambda p, r, n: score(p, r), isolate=False)([(P, "x", 1)])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


FORKED: list[int] = []


def _forks(prompt, completion, **_):
    """Forks, and both processes return: the child into whatever called the reward."""
    child = os.fork()
    if child:
        FORKED.append(child)
    return float(len(completion))


def _exit_codes_of_children(parent: int) -> list[int]:
    """The exit codes of the processes `_forks` started. A child that got back here instead of exiting when the
    reward returned (it would have run the rest of the run, and of this test) exits 99 first."""
    if os.getpid() != parent:
        os._exit(99)
    codes = [os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) for child in FORKED]
    FORKED.clear()
    return codes


def test_a_reward_that_forks_in_the_training_process_runs_the_run_once():
    """A reward calling os.fork(): the child returned into the training loop and trained too, forking again at
    each call (187 processes after one step of 4 samples). It now exits where the reward returns."""
    from parity.rl.reward_fns import Reward, UserRewards, bind_all

    parent, items = os.getpid(), [(P, "a", 1), (P, "bb", 1), (P, "ccc", 1)]
    assert UserRewards(bind_all([Reward(_forks)], ["answer"]))(items).rewards == [1.0, 2.0, 3.0]
    assert _exit_codes_of_children(parent) == [0, 0, 0]
    assert RewardRunner(lambda p, r, n: _forks(p, r), isolate=False)(items).rewards == [1.0, 2.0, 3.0]
    assert _exit_codes_of_children(parent) == [0, 0, 0]


def test_a_reward_that_forks_in_a_worker_answers_once():
    """In a worker process the fork's child answered the run too, so each later sample got the score of the
    one before it."""
    runner = RewardRunner(lambda p, r, n: _forks(p, r), isolate=True)
    try:
        assert runner([(P, "a", 1), (P, "bb", 1), (P, "ccc", 1)]).rewards == [1.0, 2.0, 3.0]
    finally:
        runner.close()


def test_a_reward_module_that_forks_at_import_is_imported_once(tmp_path, monkeypatch):
    (tmp_path / "forks_at_import.py").write_text(
        "import os\n\nCHILD = os.fork()\n\n\ndef score(prompt, completion, answer):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    parent = os.getpid()
    import_reward_fn("forks_at_import:score")
    FORKED.append(sys.modules.pop("forks_at_import").CHILD)
    assert _exit_codes_of_children(parent) == [0]
