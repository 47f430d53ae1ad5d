"""Fault injection: kill, corrupt, race and feed bad input to `parity train`, then count.

    python benchmarks/faults.py [--trials 16] [--out faults.json]

Every trial runs real `parity train` processes on the built-in model (~5 minutes
on 2 cores at the defaults):

- kills: SIGKILL at a random moment of a run (some timed to land inside a
  checkpoint write), up to three times per trial, then `--resume` to the end; the
  metrics must equal an uninterrupted run's exactly (timings aside);
- damaged checkpoints: flip a byte, cut a file, delete one, garble the manifest
  of the newest checkpoint; `--resume` must fall back and reproduce the metrics;
- concurrency: two runs started at once on one directory, and a resume while a
  run is going; exactly one may write;
- bad input: values, files and directories that used to stall, fake or crash a
  run; each must end with one line on stderr, no traceback, exit code 1 or 2, and
  no file of the user's touched;
- hostile model directories: every case of tests/test_model_dirs.py, a chat
  template linked to /etc/passwd, and templates that loop or grow without end,
  applied to a copy of the built-in model; each must end in one line and exit 2
  with no run directory written;
- distributed runs (one Ray rollout worker, one learner): a rollout worker
  SIGKILLed (restarted, run completes), a learner SIGKILLed (clean stop, exact
  resume), the driver SIGKILLed, sent SIGINT as a terminal's Ctrl-C does (to its
  whole process group), SIGTERM, and SIGTERM twice; each resumed and compared with
  an uninterrupted Ray run, and Ray processes still running 15 s after the driver
  ended counted as orphans; and a run that joins a cluster started with
  `ray start --head`, which must be left running with every CPU free.

"Data lost" counts a completed step missing or duplicated after the final resume,
a user's file changed, or a refused run that wrote anything.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUN = [
    "steps=8",
    "prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=32",
    "algorithm.name=grpo",
    "algorithm.ppo_epochs=2",
    "checkpoint_every=1",
    "keep_checkpoints=2",
    "tensorboard=false",
]


def parity(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parity", *args], capture_output=True, text=True, timeout=600, cwd=cwd)


def start(run_dir: Path, resume: bool) -> subprocess.Popen:
    args = ["train", "--resume", str(run_dir)] if resume else ["train", f"run_dir={run_dir}", *RUN]
    return subprocess.Popen(
        [sys.executable, "-m", "parity", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    return [{k: v for k, v in m.items() if not k.startswith(("time/", "perf/"))} for m in rows]


def lost_or_duplicated(got: list[dict], reference: list[dict]) -> int:
    steps = [m["step"] for m in got]
    return len(set(range(1, len(reference) + 1)) - set(steps)) + (len(steps) - len(set(steps)))


def kill_during(proc: subprocess.Popen, run_dir: Path, in_checkpoint: bool, at_s: float) -> bool:
    """SIGKILL `proc`: inside a checkpoint write (a `.step_*.tmp` folder exists) or after `at_s`
    seconds. False when the run ended first."""
    t0 = time.perf_counter()
    ckpts = run_dir / "checkpoints"
    while proc.poll() is None:
        if in_checkpoint:
            if ckpts.is_dir() and any(ckpts.glob(".step_*.tmp")):
                break
            time.sleep(0.0005)
        elif time.perf_counter() - t0 >= at_s:
            break
        else:
            time.sleep(0.005)
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


def kill_trials(root: Path, reference: list[dict], wall_s: float, trials: int, rng: random.Random) -> dict:
    out = {"trials": trials, "kills": 0, "kills_in_checkpoint_write": 0, "resumes_exact": 0, "steps_lost": 0}
    for t in range(trials):
        run_dir = root / f"kill-{t}"
        for _ in range(rng.randint(1, 3)):
            in_checkpoint = rng.random() < 0.4
            # As a user would: a run killed before it wrote config.yaml never started, so start it again.
            proc = start(run_dir, resume=(run_dir / "config.yaml").is_file())
            if kill_during(proc, run_dir, in_checkpoint, rng.uniform(0.3, 1.0) * wall_s):
                out["kills"] += 1
                out["kills_in_checkpoint_write"] += in_checkpoint
                out["kills_before_config"] = out.get("kills_before_config", 0) + (
                    not (run_dir / "config.yaml").is_file()
                )
        if (run_dir / "config.yaml").is_file():
            final = parity("train", "--resume", str(run_dir))
        else:
            final = parity("train", f"run_dir={run_dir}", *RUN)
        got = metrics(run_dir)
        exact = final.returncode == 0 and got == reference
        out["resumes_exact"] += exact
        out["steps_lost"] += lost_or_duplicated(got, reference)
        if not exact:
            kept = Path(tempfile.gettempdir()) / f"parity-faults-kill-{t}"
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(run_dir, kept)
            out.setdefault("different", []).append({"trial": t, "exit": final.returncode, "kept": str(kept)})
        print(f"  kill trial {t}: {'exact' if exact else f'DIFFERENT (kept in {kept})'}", flush=True)
    return out


def damage(ckpt: Path, how: str) -> None:
    if how == "flip":
        f = ckpt / "model" / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    elif how == "truncate":
        f = ckpt / "optimizer.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif how == "delete":
        (ckpt / "state.json").unlink()
    else:
        (ckpt / "manifest.json").write_text("{}")


def corruption_trials(root: Path, reference: list[dict]) -> dict:
    out = {"trials": 0, "fell_back_and_exact": 0, "steps_lost": 0}
    for how in ("flip", "truncate", "delete", "manifest"):
        run_dir = root / f"damaged-{how}"
        assert parity("train", f"run_dir={run_dir}", *RUN).returncode == 0
        damage(run_dir / "checkpoints" / "step_000008", how)
        final = parity("train", "--resume", str(run_dir))
        got = metrics(run_dir)
        ok = final.returncode == 0 and got == reference and "moved it to" in final.stderr
        out["trials"] += 1
        out["fell_back_and_exact"] += ok
        out["steps_lost"] += lost_or_duplicated(got, reference)
        print(f"  damaged checkpoint ({how}): {'fell back, exact' if ok else 'FAILED'}", flush=True)
    return out


def disk_full_trial(root: Path, reference: list[dict]) -> dict:
    """A checkpoint write that fails for space (a file-size limit stands in for a full disk: 4 MiB
    holds the model file but not the optimizer state), then a resume with room again."""
    import resource

    run_dir = root / "disk-full"
    limit = 4 * 2**20
    first = subprocess.run(
        [sys.executable, "-m", "parity", "train", f"run_dir={run_dir}", *RUN],
        capture_output=True,
        text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    failed_cleanly = (
        first.returncode == 2 and "could not be written" in first.stderr and "Traceback" not in first.stderr
    )
    final = parity("train", "--resume", str(run_dir))
    got = metrics(run_dir)
    ok = failed_cleanly and final.returncode == 0 and got == reference
    print(f"  disk full: {'clean stop, exact resume' if ok else 'FAILED'}", flush=True)
    return {"trials": 1, "stopped_cleanly_and_resumed_exact": int(ok), "steps_lost": lost_or_duplicated(got, reference)}


def concurrency_trials(root: Path, reference: list[dict]) -> dict:
    out = {"trials": 2, "refused_with_pid": 0, "steps_lost": 0}
    run_dir = root / "race"
    procs = [start(run_dir, resume=False) for _ in range(2)]
    codes = sorted(p.wait() for p in procs)
    errs = [p.stderr.read() for p in procs]
    out["refused_with_pid"] += codes == [0, 2] and any("in use by another Parity process" in e for e in errs)
    out["steps_lost"] += lost_or_duplicated(metrics(run_dir), reference) + (metrics(run_dir) != reference)
    run_dir = root / "resume-race"
    first = start(run_dir, resume=False)
    while not (run_dir / "metrics.jsonl").is_file():
        time.sleep(0.01)
    second = parity("train", "--resume", str(run_dir))
    first.wait()
    out["refused_with_pid"] += second.returncode == 2 and f"pid {first.pid}" in second.stderr
    out["steps_lost"] += lost_or_duplicated(metrics(run_dir), reference) + (metrics(run_dir) != reference)
    print(f"  concurrency: {out['refused_with_pid']}/2 refused with the holder's pid", flush=True)
    return out


def tree_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def bad_input_cases(root: Path) -> list[tuple[str, list[str], Path | None]]:
    """(name, argv, working directory) of each bad input; the files they need are written here.
    A `parity train` case names its run directory RUN, replaced by a fresh one."""
    fast = ["steps=2", "prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "tensorboard=false"]
    (root / "user").mkdir()
    (root / "user" / "thesis.tex").write_text("years of work\n")
    (root / "user" / "config.yaml").write_text("steps: 2\n")  # looks like a run at a glance
    (root / "long.jsonl").write_text(json.dumps({"prompt": "1+1=" * 1000, "answer": "2"}) + "\n")
    (root / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')
    (root / "broken_reward_mod.py").write_text("def score(p, r, a)\n    return 1\n")
    (root / "failing_reward_mod.py").write_text("def score(p, r, a):\n    raise RuntimeError('no grader')\n")
    from parity.engines.models import BUILTIN_DIR

    (root / "model-cut").mkdir()
    for f in BUILTIN_DIR.iterdir():
        (root / "model-cut" / f.name).write_bytes(f.read_bytes())
    weights = root / "model-cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    (root / "corrupt-run").mkdir()
    (root / "corrupt-run" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n')

    def train(*overrides: str) -> list[str]:
        return ["train", "run_dir=RUN", *fast, *overrides]

    return [
        *hostile_model_dir_cases(root, train),
        ("trainer.lr=inf", train("trainer.lr=inf"), None),
        ("trainer.lr=nan", train("trainer.lr=nan"), None),
        ("trainer.lr=-1e-4", train("trainer.lr=-1e-4"), None),
        ("trainer.loss_scale_init=inf", train("trainer.loss_scale_init=inf"), None),
        ("trainer.loss_scale_init=nan", train("trainer.loss_scale_init=nan"), None),
        ("reward.timeout_s=0", train("reward.timeout_s=0"), None),
        ("algorithm.clip_high=nan", train("algorithm.clip_high=nan"), None),
        ("algorithm.cap=-1", train("algorithm.name=grpo_seq_tis", "algorithm.cap=-1"), None),
        ("over-long prompt", train(f"task.data={root / 'long.jsonl'}"), None),
        ("non-UTF-8 data", train(f"task.data={root / 'latin1.jsonl'}"), None),
        ("unimportable reward module", train("task.reward_fn=broken_reward_mod:score"), root),
        ("run_dir=.", ["train", "run_dir=.", *fast], root / "user"),
        ("run_dir holding a user's files", ["train", f"run_dir={root / 'user'}", *fast], None),
        ("--resume a user's folder", ["train", "--resume", str(root / "user")], None),
        ("a reward that always fails", train("task.reward_fn=failing_reward_mod:score", "steps=5"), root),
        ("weights blow up (trainer.lr=1e38)", train("trainer.lr=1e38"), None),
        ("cut model file", ["mismatch", "--model", str(root / "model-cut"), "--out", str(root / "mm")], None),
        ("unwritable output", ["mismatch", "--out", "/sys/parity-fault", "num_prompts=2"], None),
        ("report on a corrupt run", ["report", str(root / "corrupt-run"), "--out", str(root / "rep")], None),
    ]


def hostile_model_dir_cases(root: Path, train) -> list[tuple[str, list[str], Path | None]]:
    """The cases of tests/test_model_dirs.py on the tests' tiny Llama, plus links out of the
    directory and chat templates that never end, each tried by `parity train`."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import save_hf_model
    from test_model_dirs import CASES

    base = save_hf_model(root / "llama", "llama")
    (root / "secret.txt").write_text("root:x:0:0:root:/root:/bin/bash\n")
    extra = [
        (
            "chat template linked to a file outside",
            lambda d: (d / "chat_template.jinja").symlink_to(root / "secret.txt"),
        ),
        ("chat template looping 10^9 times", _template("{% for i in range(10**9) %}{% endfor %}")),
        ("chat template building 1 GB", _template("{{ 'x' * 10**9 }}")),
        (
            "chat template doubling a string",
            _template(
                "{% set ns = namespace(s='xx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
            ),
        ),
    ]
    cases = []
    for i, (name, change, *_) in enumerate([*CASES, *extra]):
        model = root / f"hostile-{i}"
        shutil.copytree(base, model)
        change(model)
        cases.append((f"model dir: {name}", train(f"model={model}", "task.name=number"), None))
    return cases


def _template(text: str):
    return lambda d: (d / "chat_template.jinja").write_text(text)


# Cases that fail at run time, after the run directory legitimately exists.
RUNTIME_FAILURES = {"a reward that always fails", "weights blow up (trainer.lr=1e38)"}


def bad_input_trials(root: Path) -> dict:
    cases = bad_input_cases(root)
    user_before = tree_digest(root / "user")
    out = {"tried": len(cases), "clean": 0, "tracebacks": 0, "refused_runs_that_wrote": 0, "failures": []}
    for i, (name, argv, cwd) in enumerate(cases):
        run_dir = root / f"bad-{i}"
        result = parity(*[a.replace("run_dir=RUN", f"run_dir={run_dir}") for a in argv], cwd=cwd)
        lines = [x for x in result.stderr.splitlines() if x.startswith("parity ")]
        clean = result.returncode in (1, 2) and "Traceback" not in result.stderr and len(lines) == 1
        if name == "a reward that always fails":  # the first failure's traceback is shown on purpose
            clean = result.returncode == 1 and len(lines) == 1
        out["clean"] += clean
        out["tracebacks"] += (
            "Traceback (most recent call last)" in result.stderr and "first failure" not in result.stderr
        )
        if name not in RUNTIME_FAILURES and run_dir.exists():
            out["refused_runs_that_wrote"] += 1
        if not clean:
            out["failures"].append({"case": name, "code": result.returncode, "stderr": result.stderr[-400:]})
        print(f"  bad input {name!r}: exit {result.returncode}: {lines[-1] if lines else '(no error line)'}"[:220])
    out["user_files_changed"] = int(tree_digest(root / "user") != user_before)
    return out


# ----------------------------------------------------------------------------- distributed runs

RAY_RUN = [
    "steps=8",
    "prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=32",
    "precision=fp32",  # every step reproducible, so a resumed run can be compared number for number
    "checkpoint_every=1",
    "tensorboard=false",
    "distributed.rollout_workers=1",
    "distributed.learners=1",
]
RAY_PROCESSES = "ray::|raylet|gcs_server|dashboard/agent|runtime_env/agent|default_worker"
UNTIMED = ("async/", "sync/", "faults/")  # scheduling, not training: differs from run to run


def ray_processes() -> dict[int, str]:
    out = subprocess.run(["pgrep", "-af", RAY_PROCESSES], capture_output=True, text=True).stdout
    return {int(line.split()[0]): line.split(None, 1)[1][:60] for line in out.splitlines()}


def trained(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(UNTIMED)} for m in rows]


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> bool:
    log = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        if log.is_file() and log.read_text().count("\n") >= step:  # whole lines: the run may be mid-write
            return True
        time.sleep(0.05)
    return False


def distributed_trials(root: Path, rng: random.Random) -> dict:
    """Faults of a Ray run, each compared with an uninterrupted Ray run of the same config."""
    before = ray_processes()
    assert parity("train", f"run_dir={root / 'ray-reference'}", *RAY_RUN).returncode == 0
    reference = trained(metrics(root / "ray-reference"))
    out: dict = {"trials": 0, "exact_expected": 0, "resumes_exact": 0, "completed": 0, "steps_lost": 0}
    out.update({"tracebacks": 0, "orphans": 0, "unexpected_exits": 0, "cases": []})

    def spawn(run_dir: Path, *extra: str) -> subprocess.Popen:
        args = [sys.executable, "-m", "parity", "train", f"run_dir={run_dir}", *RAY_RUN, *extra]
        return subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
        )

    def settle(name: str, run_dir: Path, proc: subprocess.Popen, expect_exit: set[int], resume: bool) -> None:
        # A run sampling ahead (async) resumes from the checkpoint's weights: complete, not bit for bit.
        exact_expected = "async" not in name
        code = proc.wait(timeout=300)
        err = proc.stderr.read()
        time.sleep(15)  # what the run left behind after this is an orphan
        orphans = {pid: what for pid, what in ray_processes().items() if pid not in before}
        for pid in orphans:
            os.kill(pid, signal.SIGKILL)
        final_code = parity("train", "--resume", str(run_dir)).returncode if resume else 0
        got = trained(metrics(run_dir))
        exact = final_code == 0 and got == reference
        traceback = "Traceback (most recent call last)" in err
        lost = lost_or_duplicated(got, reference)
        out["trials"] += 1
        out["exact_expected"] += exact_expected
        out["resumes_exact"] += exact_expected and exact
        out["completed"] += final_code == 0 and lost == 0
        out["steps_lost"] += lost
        out["unexpected_exits"] += code not in expect_exit
        out["tracebacks"] += traceback
        out["orphans"] += len(orphans)
        last = err.strip().splitlines()[-1] if err.strip() else ""
        row = {"case": name, "exit": code, "exit_expected": code in expect_exit, "exact": exact, "orphans": orphans}
        row["completed_without_loss"] = final_code == 0 and lost == 0
        out["cases"].append({**row, "last_line": last[:200]})
        print(f"  ray {name}: exit {code}, {'exact' if exact else 'DIFFERENT'}, orphans {len(orphans)}: {last[:120]}")

    for t in range(2):  # a rollout worker: Ray restarts it and the run goes on
        run_dir = root / f"ray-worker-{t}"
        proc = spawn(run_dir)
        if wait_for_step(proc, run_dir, rng.randint(1, 5)):
            workers = [pid for pid, what in ray_processes().items() if "RolloutWorker" in what and pid not in before]
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
        settle("rollout worker SIGKILLed", run_dir, proc, {0}, resume=False)

    run_dir = root / "ray-learner"  # a learner: the run stops (exit 1) and resumes
    proc = spawn(run_dir)
    if wait_for_step(proc, run_dir, rng.randint(2, 5)):
        for pid, what in ray_processes().items():
            if "Learner" in what and pid not in before:
                os.kill(pid, signal.SIGKILL)
    settle("learner SIGKILLed", run_dir, proc, {1}, resume=True)

    driver_cases = [
        ("driver SIGKILLed", [signal.SIGKILL], False, {-signal.SIGKILL}),
        ("driver SIGKILLed (async)", [signal.SIGKILL], False, {-signal.SIGKILL}),
        ("Ctrl-C (SIGINT to the process group)", [signal.SIGINT], True, {130}),
        ("SIGTERM", [signal.SIGTERM], False, {143}),
        ("SIGTERM twice", [signal.SIGTERM, signal.SIGTERM], False, {143}),
    ]
    for i, (name, signals, group, expect) in enumerate(driver_cases):
        run_dir = root / f"ray-driver-{i}"
        proc = spawn(run_dir, *(["async.max_staleness=1"] if "async" in name else []))
        if wait_for_step(proc, run_dir, rng.randint(1, 5)):
            for sig in signals:
                os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
                time.sleep(0.3)
        settle(name, run_dir, proc, expect, resume=True)

    out["joined_cluster"] = joined_cluster_trial(root, reference)
    return out


def joined_cluster_trial(root: Path, reference: list[dict]) -> dict:
    """`ray start --head` as a user runs it, a run joining it by address, and the cluster after."""
    ray_cli = str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    port = 6390 + random.Random().randint(0, 99)
    address = f"127.0.0.1:{port}"
    start = [ray_cli, "start", "--head", f"--port={port}", "--num-cpus=3", "--include-dashboard=false"]
    subprocess.run([*start, "--disable-usage-stats"], env=env, capture_output=True, check=True)
    try:
        run_dir = root / "ray-joined"
        args = [
            sys.executable,
            "-m",
            "parity",
            "train",
            f"run_dir={run_dir}",
            *RAY_RUN,
            f"distributed.address={address}",
        ]
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
        time.sleep(5)
        status = subprocess.run([ray_cli, "status", f"--address={address}"], env=env, capture_output=True, text=True)
        result = {
            "exit": done.returncode,
            "exact": trained(metrics(run_dir)) == reference,
            "cluster_running": status.returncode == 0,
            "cpus_free": bool(re.search(r"\b0\.0/3\.0 CPU", status.stdout)),
        }
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True)
    print(f"  ray joined cluster: {result}")
    return result


SECTIONS = ("kills", "damaged_checkpoints", "disk_full", "concurrency", "bad_inputs", "distributed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=16, help="kill trials")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the summary here (JSON)")
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="which groups of faults to try"
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="parity-faults-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        assert parity("train", f"run_dir={root / 'reference'}", *RUN).returncode == 0
        wall_s = time.perf_counter() - t0
        reference = metrics(root / "reference")
        print(f"reference run: {len(reference)} steps in {wall_s:.1f} s", flush=True)
        trials = {
            "kills": lambda: kill_trials(root, reference, wall_s, args.trials, rng),
            "damaged_checkpoints": lambda: corruption_trials(root, reference),
            "disk_full": lambda: disk_full_trial(root, reference),
            "concurrency": lambda: concurrency_trials(root, reference),
            "bad_inputs": lambda: bad_input_trials(root),
            "distributed": lambda: distributed_trials(root, rng),
        }
        summary = {name: trials[name]() for name in args.sections}
    parts = list(summary.values())
    summary["data_lost"] = sum(
        p.get("steps_lost", 0) + p.get("user_files_changed", 0) + p.get("refused_runs_that_wrote", 0) for p in parts
    )
    summary["tracebacks"] = sum(p.get("tracebacks", 0) for p in parts)
    summary["orphan_processes"] = sum(p.get("orphans", 0) for p in parts)
    summary["wall_seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
