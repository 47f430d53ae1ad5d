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
  no file of the user's touched.

"Data lost" counts a completed step missing or duplicated after the final resume,
a user's file changed, or a refused run that wrote anything.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=16, help="kill trials")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the summary here (JSON)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="parity-faults-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        assert parity("train", f"run_dir={root / 'reference'}", *RUN).returncode == 0
        wall_s = time.perf_counter() - t0
        reference = metrics(root / "reference")
        print(f"reference run: {len(reference)} steps in {wall_s:.1f} s", flush=True)
        summary = {
            "kills": kill_trials(root, reference, wall_s, args.trials, rng),
            "damaged_checkpoints": corruption_trials(root, reference),
            "disk_full": disk_full_trial(root, reference),
            "concurrency": concurrency_trials(root, reference),
            "bad_inputs": bad_input_trials(root),
        }
    summary["data_lost"] = (
        summary["kills"]["steps_lost"]
        + summary["damaged_checkpoints"]["steps_lost"]
        + summary["concurrency"]["steps_lost"]
        + summary["disk_full"]["steps_lost"]
        + summary["bad_inputs"]["user_files_changed"]
        + summary["bad_inputs"]["refused_runs_that_wrote"]
    )
    summary["wall_seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
