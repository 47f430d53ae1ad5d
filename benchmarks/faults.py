"""Fault injection: kill, corrupt, race and feed bad input to `parity train`, then count.

    python benchmarks/faults.py [--trials 16] [--out faults.json] [--sections received_folders api_misuse ...]

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
  no file of the user's touched; among them (issue 43) config files that nest or
  expand without end or hold a 3 GiB line, data nested 100,000 deep, a
  5000-digit answer, a FIFO and /dev/zero as data, values no machine honours
  (seed 2**64, group_size 10**9, ...), joins to addresses where no Ray cluster
  answers, a user's folders and files given as outputs, and bad flags; each runs
  with 8 GiB of address space and 300 s, so a memory bomb or a hang is counted,
  not suffered;
- hostile model directories: every case of tests/unit/test_model_dirs.py (config
  values, tokenizer files linked to a private key outside, a folder merely named
  snapshots/REV, weights whose forward leaves FP32's or FP16's range, chat
  templates that loop, grow through filters, render nothing or lengthen every
  prompt past the context), applied to a copy of the tests' tiny Llama; each must
  end in one line and exit 2 with no run directory or output written, and no byte
  of the secret outside its home folder ("bytes leaked");
- received run directories: the newest checkpoint of a finished run turned into
  the sharded form, then forged (an index and a shard that are pickles writing a
  marker: "code executed") or damaged as tests/e2e/test_checkpoint_files.py does;
  `parity eval` must refuse the forged ones in one line and `--resume` set the
  checkpoint aside and reproduce the run exactly; a user's folders under
  checkpoints/ must be neither read nor pruned;
- your code and your files (issue 54): LoRA adapter folders whose
  adapter_config.json has each bad field or nests 100,000 deep, config files
  and a run's config.yaml holding a YAML python tag (its command must never run),
  completion rows missing keys, reward modules that raise KeyboardInterrupt or
  loop at import, a reward that forks in the training process (the run must end
  once, exit 0) and one that never returns there (exit 1, one line);
- received folders (issue 54): the reference run with one of its entries
  (checkpoints/, .lock, completions/, config.yaml, a checkpoint's weights, ...)
  replaced by a link to the user's folder or private key, given to `--resume`,
  `eval` and `report`; a FIFO and a 3 GiB line where `report` reads; output
  folders holding a forged mark, a file the user edited, or a link planted under
  Parity's names: each must end in one line, exit 2, with the user's folder and
  the received one unchanged and no byte of the key anywhere else;
- the Python API misused (issue 54): wrong kinds of `rewards`, `config`,
  `callbacks`, `model`, `dataset`, `resume`, `Reward(...)` and more, each in a
  fresh interpreter: Parity's own exception in one line, nothing written; and
  callbacks that raise or answer an array: the run stops after a checkpoint,
  naming the callback;
- distributed runs (one Ray rollout worker, one learner): a rollout worker
  SIGKILLed (restarted, run completes), a learner SIGKILLed (clean stop, exact
  resume), the driver SIGKILLed, sent SIGINT as a terminal's Ctrl-C does (to its
  whole process group), SIGTERM, and SIGTERM twice; each resumed and compared with
  an uninterrupted Ray run, and Ray processes still running 15 s after the driver
  ended counted as orphans; and a run that joins a cluster started with
  `ray start --head`, which must be left running with every CPU free.

"Data lost" counts a completed step missing or duplicated after the final resume,
and a user's file or folder changed; "crashes after writing", a refused command
that wrote a run directory or an output.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pickle
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The tests' helpers (tests/, tests/unit, tests/e2e) build several faults: the hostile inputs the tests try.
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / d) for d in ("", "unit", "e2e")]

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
        ok = resumed_past_it(run_dir, reference, out)
        print(f"  damaged checkpoint ({how}): {'fell back, exact' if ok else 'FAILED'}", flush=True)
    return out


def resumed_past_it(run_dir: Path, reference: list[dict], out: dict) -> bool:
    """`--resume` of a run whose newest checkpoint is damaged: it must be set aside, and the run end as the
    reference did; counted into `out`."""
    final = parity("train", "--resume", str(run_dir))
    got = metrics(run_dir)
    ok = final.returncode == 0 and got == reference and "moved it to" in final.stderr
    out["trials"] += 1
    out["fell_back_and_exact"] += ok
    out["steps_lost"] += lost_or_duplicated(got, reference)
    out["tracebacks"] = out.get("tracebacks", 0) + ("Traceback" in final.stderr)
    return ok


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


@dataclass
class Case:
    """One bad input: `argv` for `parity`, where RUN (in `run_dir=RUN`) and OUT stand for a fresh run
    directory and output path that a refusal must leave unwritten."""

    name: str
    argv: list[str]
    cwd: Path | None = None
    env: dict[str, str] | None = None
    expect: tuple[int, ...] = (1, 2)  # the exit codes of a clean end: a refusal, or a run stopped on purpose


def bad_input_cases(root: Path) -> list[Case]:
    """The bad inputs; the files they need are written here."""
    fast = ["steps=2", "prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16", "tensorboard=false"]
    (root / "user").mkdir()
    (root / "user" / "thesis.tex").write_text("years of work\n")
    (root / "user" / "config.yaml").write_text("steps: 2\n")  # looks like a run at a glance
    (root / "long.jsonl").write_text(json.dumps({"prompt": "1+1=" * 1000, "answer": "2"}) + "\n")
    (root / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')
    (root / "broken_reward_mod.py").write_text("def score(p, r, a)\n    return 1\n")
    # It scores the first batch (4 completions), which the first-batch check would refuse, then always fails.
    failing = (
        "calls = 0\n"
        "def score(prompt, completion, answer):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls > 4:\n"
        "        raise RuntimeError('no grader')\n"
        "    return 0.0\n"
    )
    (root / "failing_reward_mod.py").write_text(failing)
    from parity.engines.models.io import BUILTIN_DIR

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
        *received_input_cases(root, train),
        *your_code_cases(root, train),
        Case("trainer.lr=inf", train("trainer.lr=inf")),
        Case("trainer.lr=nan", train("trainer.lr=nan")),
        Case("trainer.lr=-1e-4", train("trainer.lr=-1e-4")),
        Case("trainer.loss_scale_init=inf", train("trainer.loss_scale_init=inf")),
        Case("trainer.loss_scale_init=nan", train("trainer.loss_scale_init=nan")),
        Case("reward.timeout_s=0", train("reward.timeout_s=0")),
        Case("algorithm.clip_high=nan", train("algorithm.clip_high=nan")),
        Case("algorithm.cap=-1", train("algorithm.name=grpo_seq_tis", "algorithm.cap=-1")),
        Case("over-long prompt", train(f"task.data={root / 'long.jsonl'}")),
        Case("non-UTF-8 data", train(f"task.data={root / 'latin1.jsonl'}")),
        Case("unimportable reward module", train("task.reward_fn=broken_reward_mod:score"), root),
        Case("run_dir=.", ["train", "run_dir=.", *fast], root / "user"),
        Case("run_dir holding a user's files", ["train", f"run_dir={root / 'user'}", *fast]),
        Case("--resume a user's folder", ["train", "--resume", str(root / "user")]),
        Case(
            "a reward that always fails after its first batch",
            train("task.reward_fn=failing_reward_mod:score", "steps=5"),
            root,
        ),
        Case("weights blow up (trainer.lr=1e38)", train("trainer.lr=1e38")),
        Case("cut model file", ["mismatch", "--model", str(root / "model-cut"), "--out", "OUT"]),
        Case("unwritable output", ["mismatch", "--out", "/sys/parity-fault", "num_prompts=2"]),
        Case("report on a corrupt run", ["report", str(root / "corrupt-run"), "--out", "OUT"]),
    ]


def your_code_cases(root: Path, train) -> list[Case]:
    """Issue 54's: a LoRA adapter folder with each bad field, a config.yaml holding a YAML python tag, a run's
    completions missing keys, and reward modules that raise KeyboardInterrupt or never end at import, fork in the
    training process, or never return from a call there."""
    import yaml

    adapters = {
        "r 0": {"r": 0},
        "r -4": {"r": -4},
        "target_modules a string": {"target_modules": "q_proj"},
        "target_modules unknown": {"target_modules": ["attn.c_proj"]},
        "lora_alpha nan": {"lora_alpha": float("nan")},
    }
    base = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    base["base_model_name_or_path"] = "builtin"
    cases = []
    for i, (name, change) in enumerate({**adapters, "nested 100,000 deep": None}.items()):
        folder = root / f"adapter-{i}"
        folder.mkdir()
        text = json.dumps({**base, **change}) if change is not None else "[" * 100_000 + "]" * 100_000
        (folder / "adapter_config.json").write_text(text)
        (folder / "adapter_model.safetensors").write_bytes(b"")
        cases.append(Case(f"eval of an adapter folder: {name}", ["eval", str(folder), "num_prompts=2", "out=OUT"]))
    marker = root / "yaml-ran"
    tagged = f"steps: 2\nseed: !!python/object/apply:os.system [touch {marker}]\n"
    (root / "tagged.yaml").write_text(tagged)
    cases.append(Case("a config file with a YAML python tag", ["train", str(root / "tagged.yaml"), "run_dir=RUN"]))
    for name in ("tagged-run", "rows-run"):
        shutil.copytree(root / "reference", root / name)
    config = yaml.safe_load((root / "tagged-run" / "config.yaml").read_text())
    (root / "tagged-run" / "config.yaml").write_text(
        yaml.safe_dump(config) + f"x: !!python/object/apply:os.system [touch {marker}]\n"
    )
    cases.append(
        Case("--resume of a run whose config.yaml holds a python tag", ["train", "--resume", str(root / "tagged-run")])
    )
    cases.append(
        Case("eval of a run whose config.yaml holds a python tag", ["eval", str(root / "tagged-run"), "out=OUT"])
    )
    newest = sorted((root / "rows-run" / "completions").iterdir())[-1]
    newest.write_text(json.dumps({"step": 8, "prompt": "1+1=", "completion": "2"}) + "\n")
    cases.append(Case("report of completions rows missing keys", ["report", str(root / "rows-run"), "--out", "OUT"]))
    modules = {
        "interrupts_mod": "raise KeyboardInterrupt\n",
        "loops_mod": "while True:\n    pass\n",
        "forks_mod": "import os\ndef score(prompt, completion, answer):\n    os.fork()\n    return 1.0\n",
        "stalls_mod": "import time\ndef score(prompt, completion, answer):\n    time.sleep(10**6)\n",
    }
    for module, text in modules.items():
        (root / f"{module}.py").write_text(text)
    in_process = ("reward.isolate=never", "reward.in_process_timeout_s=5")
    return [
        *cases,
        Case("a reward module raising KeyboardInterrupt at import", train("task.reward_fn=interrupts_mod:score"), root),
        Case(
            "a reward module with an endless loop at import",
            train("task.reward_fn=loops_mod:score", "reward.import_timeout_s=5"),
            root,
        ),
        Case(
            "a reward that forks in the training process",
            train("task.reward_fn=forks_mod:score", *in_process),
            root,
            expect=(0,),
        ),
        Case("an in-process reward that never returns", train("task.reward_fn=stalls_mod:score", *in_process), root),
    ]


def hostile_model_dir_cases(root: Path, train) -> list[Case]:
    """The cases of tests/unit/test_model_dirs.py on the tests' tiny Llama (hostile config values, links out of
    the directory, chat templates that never end, grow without bound or render nothing, prompts longer than
    the context), each tried by the command its test names, `parity train` for most."""
    from conftest import save_hf_model
    from test_model_dirs import BOMBS, CASES, EMPTY_TEMPLATES, LINKED, SECRET

    base = save_hf_model(root / "llama", "llama")
    secrets_dir = root / "home" / ".ssh"
    secrets_dir.mkdir(parents=True)
    (secrets_dir / "id_rsa").write_bytes(SECRET)
    (secrets_dir / "default.jinja").write_bytes(SECRET)  # a named template, for the linked templates' folder
    (root / "home" / ".aws").mkdir()
    (root / "home" / ".aws" / "credentials").write_bytes(SECRET)
    linked = [
        (f"{name} linked outside ({kind})", _linked(name, secrets_dir, relative=kind == "relative"))
        for name in [*LINKED, "additional_chat_templates"]
        for kind in ("absolute", "relative")
    ]
    extra = [
        *linked,
        ("chat template looping 10^9 times", _template("{% for i in range(10**9) %}{% endfor %}")),
        ("chat template building 1 GB", _template("{{ 'x' * 10**9 }}")),
        *[(f"chat template bomb: {name}", _template(text)) for name, text in BOMBS.items()],
        *[(f"empty chat template: {name}", _template(text)) for name, text in EMPTY_TEMPLATES.items()],
        ("chat template lengthening every prompt past the context", _template("{{ 'x' * 300 }}{{ messages }}")),
    ]
    cases = []
    for i, (name, change, *_) in enumerate([*CASES, *extra]):
        model = root / f"hostile-{i}"
        shutil.copytree(base, model)
        change(model)
        cases.append(Case(f"model dir: {name}", train(f"model={model}", "task.name=number", "checkpoint_every=1")))
        if name.startswith(("empty chat template", "chat template lengthening")):
            for command in _commands_on(model, root / f"hostile-{i}-data.jsonl"):
                cases.append(Case(f"model dir: {name} ({command[0]})", command))
    fake = root / "home" / "snapshots" / "rev"  # not a cache: any folder named snapshots/REV
    shutil.copytree(base, fake)
    (fake / "chat_template.jinja").symlink_to(Path("../../.aws/credentials"))
    cases.append(
        Case("model dir: snapshots/rev linked to ~/.aws/credentials", train(f"model={fake}", "task.name=number"))
    )
    cases.append(Case("model weights overflowing FP16", train(f"model={_overflowing(base, root)}", "task.name=number")))
    return cases


def _linked(name: str, secrets_dir: Path, relative: bool):
    def apply(model: Path) -> None:
        at = model / name
        target = secrets_dir if name == "additional_chat_templates" else secrets_dir / "id_rsa"
        at.parent.mkdir(parents=True, exist_ok=True)
        at.symlink_to(Path(os.path.relpath(target, at.parent)) if relative else target)

    return apply


def _overflowing(base: Path, root: Path) -> Path:
    from test_model_dirs import scale_weights

    model = root / "hostile-fp16"
    shutil.copytree(base, model)
    scale_weights(model, 1e4)  # finite in FP32, past 65504 in FP16: the run's default precision
    return model


def _commands_on(model: Path, data: Path) -> list[list[str]]:
    """Every other command that encodes prompts, on `model`, writing into OUT."""
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    return [
        ["mismatch", "--model", str(model), "--out", "OUT", "num_prompts=2"],
        ["doctor", "--model", str(model), "--out", "OUT", "--prompts", "2"],
        ["perfectible", f"model={model}", "task=number", "out=OUT"],
        ["eval", str(model), f"data={data}", "num_prompts=1", "out=OUT"],
    ]


def _template(text: str):
    return lambda d: (d / "chat_template.jinja").write_text(text)


def received_input_cases(root: Path, train) -> list[Case]:
    """Config files, data files, values and addresses that used to crash, hang or exhaust memory
    (tests/unit/test_config.py, test_data.py, tests/e2e/test_distributed.py), and a user's folders given as outputs."""
    from test_config import HUGE, _alias_bomb

    (root / "bomb.yaml").write_text(_alias_bomb())
    (root / "nested.yaml").write_text("steps: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with open(root / "huge.yaml", "wb") as f:  # one 3 GiB line, sparse: no disk is used
        f.write(b"steps: ")
        f.truncate(3 * 2**30)
    good_row = json.dumps({"prompt": "2+2=", "answer": "4"})
    (root / "nested.jsonl").write_text(good_row + "\n" + good_row.replace('"4"', "[" * 100_000 + "]" * 100_000) + "\n")
    (root / "huge-int.jsonl").write_text(good_row.replace('"4"', "9" * 5000) + "\n")
    (root / "nested-run").mkdir()
    (root / "nested-run" / "metrics.jsonl").write_text('{"step": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    os.mkfifo(root / "pipe.jsonl")
    stale = root / "raytmp" / "ray"
    stale.mkdir(parents=True)
    (stale / "ray_current_cluster").write_text("127.0.0.1:9\n")  # a cluster that is gone
    ray_env = {**os.environ, "RAY_TMPDIR": str(stale.parent)}
    ray_env.pop("RAY_ADDRESS", None)
    join = ["distributed.rollout_workers=1", "distributed.connect_timeout_s=10"]
    user = root / "user"
    cases = [
        Case("config file: an alias bomb under a real key", ["train", str(root / "bomb.yaml"), "run_dir=RUN"]),
        Case("config file: nested 100,000 deep", ["train", str(root / "nested.yaml"), "run_dir=RUN"]),
        Case("config file: a 3 GiB line", ["train", str(root / "huge.yaml"), "run_dir=RUN"]),
        Case("task.data nested 100,000 deep", train(f"task.data={root / 'nested.jsonl'}")),
        Case("eval.data nested 100,000 deep", train(f"eval.data={root / 'nested.jsonl'}")),
        Case("parity eval data= nested 100,000 deep", ["eval", "builtin", f"data={root / 'nested.jsonl'}", "out=OUT"]),
        Case("metrics.jsonl nested 100,000 deep", ["report", str(root / "nested-run"), "--out", "OUT"]),
        Case("a 5000-digit answer", train(f"task.data={root / 'huge-int.jsonl'}")),
        Case("a FIFO as data", train(f"task.data={root / 'pipe.jsonl'}")),
        Case("/dev/zero as data", train("task.data=/dev/zero")),
        *[Case(f"value: {override}", train(override)) for override, _ in HUGE],
        *[
            Case(f"join {address}", train(*join, f"distributed.address={address}"), env=ray_env)
            for address in ("127.0.0.1:1", "not-a-host:6379", "auto")
        ],
        Case("doctor --prompts -5", ["doctor", "--prompts", "-5", "--out", "OUT"]),
        Case("phantom --eps nan", ["phantom", "--eps", "nan", "--out", "OUT"]),
        Case("phantom --steps -1", ["phantom", "--steps", "-1", "--out", "OUT"]),
        Case("sanity --jobs 0", ["sanity", "--quick", "--jobs", "0", "--out", "OUT"]),
        Case("report on a missing run", ["report", str(root / "no-such-run"), "--out", "OUT"]),
        Case("mismatch --out a user's folder", ["mismatch", "--out", str(user), "num_prompts=2"]),
        Case("eval out= a user's folder", ["eval", "builtin", f"out={user}", "num_prompts=2"]),
        Case("doctor --out a user's folder", ["doctor", "--out", str(user), "--prompts", "1"]),
        Case("report --out a user's folder", ["report", str(root / "nested-run"), "--out", str(user)]),
        Case("sanity --out a user's folder", ["sanity", "--quick", "--out", str(user)]),
        Case("phantom --out a user's folder", ["phantom", "--steps", "1", "--out", str(user)]),
        Case("perfectible out= a user's file", ["perfectible", f"out={user / 'thesis.tex'}"]),
        Case("build-model --out a user's folder", ["build-model", "--out", str(user), "--steps", "1"]),
    ]
    return cases


# Cases that fail at run time, after the run directory legitimately exists.
RUNTIME_FAILURES = {
    "a reward that always fails after its first batch",
    "weights blow up (trainer.lr=1e38)",
    "an in-process reward that never returns",
    "a reward that forks in the training process",
}
CASE_TIMEOUT_S = 300  # a case still running after this long has hung
MEMORY_LIMIT = 8 * 2**30  # address space per case: a memory bomb fails in the case, not on the machine


def bounded(argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """`argv`'s exit code and stderr, run with MEMORY_LIMIT of address space; a None code: it ran past
    CASE_TIMEOUT_S (a hang), and was killed."""
    import resource

    try:
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=CASE_TIMEOUT_S,
            cwd=cwd,
            env=env,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT)),
        )
        return result.returncode, result.stderr
    except subprocess.TimeoutExpired as e:
        return None, (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else ""


def bad_input_trials(root: Path) -> dict:
    cases = bad_input_cases(root)
    user_before = tree_digest(root / "user")
    out = {"tried": len(cases), "clean": 0, "tracebacks": 0, "hangs": 0, "refused_runs_that_wrote": 0}
    out["failures"] = []
    for i, case in enumerate(cases):
        run_dir, out_path = root / f"bad-{i}", root / f"out-{i}"
        argv = [a.replace("run_dir=RUN", f"run_dir={run_dir}").replace("OUT", str(out_path)) for a in case.argv]
        code, err = bounded([sys.executable, "-m", "parity", *argv], case.cwd, case.env)
        out["hangs"] += code is None
        lines = [x for x in err.splitlines() if x.startswith("parity ")]
        clean = code in case.expect and "Traceback" not in err and len(lines) == (1 if code else 0)
        if case.name == "a reward that always fails after its first batch":  # its first failure's traceback: on purpose
            clean = code == 1 and len(lines) == 1
        out["clean"] += clean
        out["tracebacks"] += "Traceback (most recent call last)" in err and "first failure" not in err
        if case.name not in RUNTIME_FAILURES and (run_dir.exists() or out_path.exists()):
            out["refused_runs_that_wrote"] += 1
        if not clean:
            out["failures"].append({"case": case.name, "code": code, "stderr": err[-400:]})
        print(f"  bad input {case.name!r}: exit {code}: {lines[-1] if lines else '(no error line)'}"[:220], flush=True)
    out["user_files_changed"] = int(tree_digest(root / "user") != user_before)
    out["bytes_leaked"] = leaked_files(root)
    out["code_executed"] = int((root / "yaml-ran").exists())  # a YAML python tag's command
    return out


def leaked_files(root: Path) -> int:
    """Files, outside the home folder that holds the test secrets, that hold a secret's marker: what reached
    a checkpoint or an output from outside a model directory. Links are not followed."""
    from test_model_dirs import SECRET

    marker, count = SECRET.split()[-1], 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if Path(folder, d) != root / "home"]
        for name in files:
            path = Path(folder, name)
            if not path.is_symlink() and path.is_file() and path.stat().st_size < 2**30:
                count += marker in path.read_bytes()
    return count


# ----------------------------------------------------------------------------- received run directories


def received_run_trials(root: Path, reference: list[dict]) -> dict:
    """A finished run directory received from someone, its newest checkpoint turned into the sharded form
    and then forged or damaged as tests/e2e/test_checkpoint_files.py does (a pickled index and a shard that write
    a marker when unpickled; state.json and manifest.json fields of the wrong kind; a cut RNG file; an index
    naming a missing shard): `parity eval` refuses the forged ones in one line, and `--resume` sets the
    checkpoint aside in one line and reproduces the reference exactly. No marker may ever appear. Last, the
    user's own folders under checkpoints/ (step_best, step_000007.bak): a resume neither reads nor prunes them."""
    from test_checkpoint_files import DAMAGE, _WritesMarker, damaged

    marker = root / "code-ran"
    forged = pickle.dumps(_WritesMarker(marker))

    def forge_index(ckpt: Path) -> None:
        (ckpt / "sharded" / "metadata.json").unlink()
        (ckpt / "sharded" / ".metadata").write_bytes(forged)

    def forge_shard(ckpt: Path) -> None:
        next((ckpt / "sharded").glob("__*.safetensors")).write_bytes(forged)

    cases = [(name, sharded, damage, reseal) for name, sharded, damage, reseal, _ in DAMAGE]
    cases += [
        ("forged pickled index", True, forge_index, True),
        ("shard replaced by a pickle", True, forge_shard, True),
    ]
    out = {"trials": 0, "fell_back_and_exact": 0, "eval_refused": 0, "steps_lost": 0, "tracebacks": 0}
    for i, (name, sharded, damage, reseal) in enumerate(cases):
        run_dir = root / f"received-{i}"
        shutil.copytree(root / "reference", run_dir)
        damaged(run_dir / "checkpoints" / "step_000008", sharded, damage, reseal)
        if name.startswith(("forged", "shard replaced")):
            evaluated = parity("eval", str(run_dir), "num_prompts=2", "samples=1", f"out={root / f'received-eval-{i}'}")
            lines = [x for x in evaluated.stderr.splitlines() if x.startswith("parity ")]
            out["eval_refused"] += evaluated.returncode == 2 and len(lines) == 1
            out["tracebacks"] += "Traceback" in evaluated.stderr
        ok = resumed_past_it(run_dir, reference, out)
        print(f"  received run ({name}): {'set aside, exact' if ok else 'FAILED'}", flush=True)
    out["code_executed"] = int(marker.exists())

    run_dir = root / "received-user-folders"
    shutil.copytree(root / "reference", run_dir)
    ckpts = run_dir / "checkpoints"
    shutil.copytree(ckpts / "step_000007", ckpts / "step_best")
    (ckpts / "step_000007.bak").mkdir()
    (ckpts / "step_000007.bak" / "notes.txt").write_text("mine\n")
    mine = {name: tree_digest(ckpts / name) for name in ("step_best", "step_000007.bak")}
    final = parity("train", "--resume", str(run_dir), "steps=9")
    kept = all((ckpts / n).is_dir() and tree_digest(ckpts / n) == d for n, d in mine.items())
    ok = final.returncode == 0 and metrics(run_dir)[:8] == reference and kept
    out["user_checkpoint_folders_changed"] = int(not kept)
    out["trials"] += 1
    out["fell_back_and_exact"] += ok
    print(f"  received run (user folders under checkpoints/): {'untouched, exact' if ok else 'FAILED'}", flush=True)
    return out


# ----------------------------------------------------------------------------- received folders (issue 54)

# A report's output folder, forged or planted: what it holds before `parity report RUN --out` it.
FORGED_OUTPUTS = {
    "a mark of names (the old form) listing the user's files": {"written_by": "parity", "names": ["report.md"]},
    "a mark recording other bytes for the user's file": {"written_by": "parity", "files": {"report.md": ["0" * 64]}},
    "a mark listing the user's file as Parity's folder": {
        "written_by": "parity",
        "files": {},
        "folders": ["report.md"],
    },
}
PLANTED_LINKS = (".accuracy.png.fig.tmp", ".report.md.0badc0de.tmp", "runs", "summary.json")


def _one_line(code: int | None, err: str) -> bool:
    return code == 2 and "Traceback" not in err and len([x for x in err.splitlines() if x.startswith("parity ")]) == 1


def received_folder_trials(root: Path) -> dict:
    """Run folders received with links inside (each given to `--resume`, `eval` and `report`), FIFOs and 3 GiB
    lines where report reads, and output folders with a forged mark, an edited file or a planted link: each
    must end in one line, exit 2, with 0 bytes written, deleted or read outside the folders named."""
    from test_model_dirs import SECRET
    from test_received_runs import LINKED, link_in

    home = root / "home"  # `leaked_files` looks everywhere but here for the secret's bytes
    (home / "results" / "step_000001").mkdir(parents=True, exist_ok=True)
    (home / "results" / "step_000001" / "table.csv").write_text("mine\n")
    (home / "id_rsa").write_bytes(SECRET + b"\n")
    out = {"tried": 0, "clean": 0, "tracebacks": 0, "hangs": 0, "refused_runs_that_wrote": 0, "failures": []}

    def tried(name: str, argv: list[str], wrote: Path | None = None, unchanged: Path | None = None) -> None:
        before = tree_digest(unchanged) if unchanged is not None else None
        home_before = tree_digest(home)
        code, err = bounded([sys.executable, "-m", "parity", *argv])
        clean = _one_line(code, err) and tree_digest(home) == home_before
        clean = clean and (unchanged is None or tree_digest(unchanged) == before)
        out["tried"] += 1
        out["clean"] += clean
        out["hangs"] += code is None
        out["tracebacks"] += "Traceback (most recent call last)" in err
        out["refused_runs_that_wrote"] += wrote is not None and wrote.exists()
        if not clean:
            out["failures"].append({"case": name, "code": code, "stderr": err[-400:]})
        line = next((x for x in err.splitlines() if x.startswith("parity ")), "(no error line)")
        print(f"  received folder {name!r}: exit {code}: {line}"[:220], flush=True)

    for i, (entry, target) in enumerate(LINKED.items()):
        run, entry = root / f"linked-{i}", entry.format(newest="step_000008")
        shutil.copytree(root / "reference", run)
        link_in(run, entry, home / target)
        report_out = root / f"linked-{i}-out"
        tried(f"{entry} a link: --resume", ["train", "--resume", str(run), "steps=9", "keep_checkpoints=1"], None, run)
        if entry != "config.yaml":  # without it the folder is no run eval and report take
            tried(
                f"{entry} a link: eval",
                ["eval", str(run), "num_prompts=2", "samples=1", f"out={report_out}"],
                report_out,
            )
            tried(f"{entry} a link: report", ["report", str(run), "--out", str(report_out)], report_out, run)

    for i, name in enumerate(("metrics.jsonl", "completions/step_000008.jsonl")):
        for how in ("a FIFO", "a 3 GiB line"):
            run = root / f"read-{i}-{how[2]}"
            shutil.copytree(root / "reference", run)
            if how == "a FIFO":
                (run / name).unlink()
                os.mkfifo(run / name)
            else:
                with open(run / name, "r+b") as f:  # sparse: 3 GiB of the line cost no disk
                    f.truncate((run / name).stat().st_size + 3 * 2**30)
            tried(f"{name} {how}: report", ["report", str(run), "--out", str(run) + "-out"], Path(str(run) + "-out"))

    shutil.copytree(root / "reference", root / "report-run")
    for i, (name, mark) in enumerate(FORGED_OUTPUTS.items()):
        folder = root / f"forged-{i}"
        folder.mkdir()
        (folder / "report.md").write_text("the user's report\n")
        (folder / ".parity-out").write_text(json.dumps(mark))
        tried(name, ["report", str(root / "report-run"), "--out", str(folder)], None, folder)
    for i, planted in enumerate(("report.md edited by the user", *PLANTED_LINKS)):
        folder = root / f"planted-{i}"
        assert parity("report", str(root / "report-run"), "--out", str(folder)).returncode == 0
        if i == 0:
            (folder / "report.md").write_text("my edits\n")
        else:
            (folder / planted).unlink(missing_ok=True)
            (folder / planted).symlink_to(home / "id_rsa")
        tried(
            planted if i == 0 else f"{planted} planted as a link",
            ["report", str(root / "report-run"), "--out", str(folder)],
            None,
            folder,
        )
    out["bytes_leaked"] = leaked_files(root)
    return out


# The Python API misused (issue 54): each snippet runs in a fresh interpreter with RUN a fresh run directory; a
# refusal is Parity's own exception (ConfigError, DataError), one line, before RUN is written.
API_SETTINGS = "steps=1, prompts_per_step=2, rollout__group_size=2, rollout__max_new_tokens=8, tensorboard=False"
API_MISUSE = {
    "rewards=5": "parity.train(rewards=5, run_dir=RUN)",
    "rewards=[5]": "parity.train(rewards=[5], run_dir=RUN)",
    "rewards='score'": "parity.train(rewards='score', run_dir=RUN)",
    "config=5": "parity.train(config=5, run_dir=RUN)",
    "config={1: 2}": "parity.train(config={1: 2}, run_dir=RUN)",
    "callbacks=object()": "parity.train(callbacks=object(), run_dir=RUN)",
    "callbacks=[a class]": "parity.train(callbacks=[parity.Callback], run_dir=RUN)",
    "callback without hooks": "parity.train(callbacks=[type('C', (), {})()], run_dir=RUN)",
    "callback hook of the wrong signature": (
        "parity.train(callbacks=[type('C', (), {'on_step_end': lambda self: None})()], run_dir=RUN)"
    ),
    "Reward(fn, weight='high')": "parity.Reward(lambda p, c, a: 1.0, weight='high')",
    "Reward(fn, weight=nan)": "parity.Reward(lambda p, c, a: 1.0, weight=float('nan'))",
    "Reward(5)": "parity.Reward(5)",
    "model=5": "parity.train(model=5, run_dir=RUN)",
    "dataset=5": "parity.train(dataset=5, run_dir=RUN)",
    "dataset=[strings]": "parity.train(dataset=['a', 'b'], run_dir=RUN)",
    "resume=5": "parity.train(resume=5)",
    "progress='yes'": "parity.train(progress='yes', run_dir=RUN)",
    "unknown key": "parity.train(num_generations=4, run_dir=RUN)",
    "trainer__lr=an array": "parity.train(trainer__lr=__import__('numpy').ones(3), run_dir=RUN)",
    "evaluate(out=5)": "parity.evaluate('builtin', out=5)",
    "push_to_hub(model_dir=5)": "parity.push_to_hub(5, 'me/model', token='x')",
}
# Callbacks that fail at run time: the run stops after the step's checkpoint, naming the callback.
API_CALLBACK_FAILURES = {
    "a callback that raises": "type('Boom', (parity.Callback,), {'on_step_end': lambda s, step, m: 1 / 0})()",
    "a callback returning an array": (
        "type('Arr', (parity.Callback,), {'on_step_end': lambda s, step, m: __import__('numpy').ones(2)})()"
    ),
    "a callback that mutates the metrics": (
        "type('Mut', (parity.Callback,), {'on_step_end': lambda s, step, m: m.clear()})()"
    ),
}
API_SNIPPET = """
import sys, parity
RUN = {run!r}
try:
    {call}
except (parity.ConfigError, parity.DataError, parity.CallbackError) as e:
    print(f"parity: {{type(e).__name__}}: {{e}}", file=sys.stderr)
    sys.exit(2 if not isinstance(e, parity.CallbackError) else 1)
"""


def api_misuse_trials(root: Path) -> dict:
    """Every API misuse of API_MISUSE must be Parity's exception in one line with nothing written; each
    callback of API_CALLBACK_FAILURES must stop its run after a checkpoint with one line naming it (or, for the
    one that only mutates its copy of the metrics, run to the end)."""
    out = {"tried": 0, "clean": 0, "tracebacks": 0, "hangs": 0, "refused_runs_that_wrote": 0, "failures": []}
    cases = [(name, call, False) for name, call in API_MISUSE.items()]
    cases += [
        (name, f"parity.train(callbacks=[{hook}], run_dir=RUN, {API_SETTINGS}, checkpoint_every=1)", True)
        for name, hook in API_CALLBACK_FAILURES.items()
    ]
    for i, (name, call, runs) in enumerate(cases):
        run = root / f"api-{i}"
        code, err = bounded([sys.executable, "-c", API_SNIPPET.format(run=str(run), call=call)])
        lines = [x for x in err.splitlines() if x.startswith("parity")]
        if not runs:
            clean = code == 2 and len(lines) == 1 and "Traceback" not in err and not run.exists()
            out["refused_runs_that_wrote"] += run.exists()
        elif "mutates" in name:
            clean = code == 0 and (run / "checkpoints" / "step_000001").is_dir()
        else:
            clean = code == 1 and len(lines) == 1 and (run / "checkpoints" / "step_000001").is_dir()
            clean = clean and any(n in lines[0] for n in ("Boom", "Arr"))
        out["tried"] += 1
        out["clean"] += clean
        out["hangs"] += code is None
        out["tracebacks"] += "Traceback (most recent call last)" in err and not runs
        if not clean:
            out["failures"].append({"case": name, "code": code, "stderr": err[-400:]})
        print(f"  API {name!r}: exit {code}: {lines[-1] if lines else '(no error line)'}"[:220], flush=True)
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
UNTIMED = ("async/", "sync/", "faults/")  # scheduling, not training: differs from run to run
RUN_MARK = "PARITY_FAULTS_RUN"  # set in a trial's environment: its processes, and theirs, inherit it


def run_processes(mark: str) -> dict[int, str]:
    """The processes of the trial marked `mark`, whatever they call themselves (a Ray worker renames
    itself); never another user's Ray processes, which a trial must neither count nor kill."""
    from conftest import processes_with

    found = {}
    for proc in processes_with(RUN_MARK, mark):
        with contextlib.suppress(Exception):
            found[proc.pid] = " ".join(proc.cmdline())[:60]
    return found


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
    assert parity("train", f"run_dir={root / 'ray-reference'}", *RAY_RUN).returncode == 0
    reference = trained(metrics(root / "ray-reference"))
    out: dict = {"trials": 0, "exact_expected": 0, "resumes_exact": 0, "completed": 0, "steps_lost": 0}
    out.update({"tracebacks": 0, "orphans": 0, "unexpected_exits": 0, "cases": []})

    def spawn(run_dir: Path, *extra: str) -> subprocess.Popen:
        args = [sys.executable, "-m", "parity", "train", f"run_dir={run_dir}", *RAY_RUN, *extra]
        env = {**os.environ, RUN_MARK: run_dir.name}
        return subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
        )

    def settle(name: str, run_dir: Path, proc: subprocess.Popen, expect_exit: set[int], resume: bool) -> None:
        # A run sampling ahead (async) resumes from the checkpoint's weights: complete, not bit for bit.
        exact_expected = "async" not in name
        code = proc.wait(timeout=300)
        err = proc.stderr.read()
        time.sleep(15)  # what the run left behind after this is an orphan
        orphans = run_processes(run_dir.name)
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError):
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
        said = [line for line in err.splitlines() if line.strip() and "%|" not in line]  # not progress bars
        last = said[-1] if said else ""
        row = {"case": name, "exit": code, "exit_expected": code in expect_exit, "exact": exact, "orphans": orphans}
        row["completed_without_loss"] = final_code == 0 and lost == 0
        out["cases"].append({**row, "last_line": last[:200]})
        print(f"  ray {name}: exit {code}, {'exact' if exact else 'DIFFERENT'}, orphans {len(orphans)}: {last[:120]}")

    for t in range(2):  # a rollout worker: Ray restarts it and the run goes on
        run_dir = root / f"ray-worker-{t}"
        proc = spawn(run_dir)
        if wait_for_step(proc, run_dir, rng.randint(1, 5)):
            workers = [pid for pid, what in run_processes(run_dir.name).items() if "RolloutWorker" in what]
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
        settle("rollout worker SIGKILLed", run_dir, proc, {0}, resume=False)

    run_dir = root / "ray-learner"  # a learner: the run stops (exit 1) and resumes
    proc = spawn(run_dir)
    if wait_for_step(proc, run_dir, rng.randint(2, 5)):
        for pid, what in run_processes(run_dir.name).items():
            if "Learner" in what:
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
    from test_distributed import stop_cluster

    ray_cli = str(Path(sys.executable).with_name("ray"))
    ray_tmp = Path(tempfile.mkdtemp(prefix="pf", dir="/tmp"))  # its own: stopped alone, and short for Ray's sockets
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), "RAY_TMPDIR": str(ray_tmp)}
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
        stop_cluster(ray_tmp)
    print(f"  ray joined cluster: {result}")
    return result


# ----------------------------------------------------------------------------- signals to commands with workers

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL)
SIGNAL_EXIT_S = 120  # a command still running this long after a signal has hung
ORPHAN_WAIT_S = 15  # what of a command still runs this long after it ended is an orphan


@dataclass
class WorkerCommand:
    """A command that starts worker processes: `argv` for `parity` (DIR stands for a fresh folder of its own),
    and `running(pid, mark)`, true once its workers run."""

    name: str
    argv: list[str]
    running: Callable[[int, str], bool]
    env: dict[str, str] | None = None


def worker_commands(root: Path) -> list[WorkerCommand]:
    """Every command that starts worker processes, at settings small enough to reach its workers in seconds."""
    from conftest import started_workers
    from parity.engines.models.io import BUILTIN_DIR

    def workers(count: int) -> Callable[[int, str], bool]:  # Parity's own (`parity.stopping.worker_started`)
        return lambda pid, mark: len(started_workers(pid)) >= count

    def on_ray(pid: int, mark: str) -> bool:  # Ray's worker processes name themselves ray::CLASS
        return any(what.startswith("ray::") for what in run_processes(mark).values())

    (root / "signal_reward.py").write_text("def score(prompt, completion, answer):\n    return len(completion) % 2\n")
    spawned_reward = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    train = ["train", "run_dir=DIR", "steps=500", "prompts_per_step=4", "rollout.group_size=4"]
    train += ["rollout.max_new_tokens=32", "checkpoint_every=0", "tensorboard=false"]
    small = ["prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=16"]
    return [
        WorkerCommand(
            "sanity: a process per training run",
            ["sanity", "--quick", "--out", "DIR", "--runs", "fp16/grpo,bf16/grpo", "--jobs", "2", "--candidates", "16"]
            + ["--lo", "0", "--max-new-tokens", "16"],
            workers(2),
        ),
        WorkerCommand("train: the math reward's worker (fork)", [*train, "task.name=math"], workers(1)),
        WorkerCommand(
            "train: a reward function's worker (spawn)",
            [*train, "task.reward_fn=signal_reward:score", "reward.isolate=always"],
            workers(1),
            spawned_reward,
        ),
        WorkerCommand(
            "train: Ray (a rollout worker, a learner)",
            [*train, "distributed.rollout_workers=1", "distributed.learners=1"],
            on_ray,
        ),
        WorkerCommand(
            "train: joining a cluster (the join's child)",
            [*train, "distributed.rollout_workers=1", "distributed.address=127.0.0.1:1"]
            + ["distributed.connect_timeout_s=600"],
            workers(1),
        ),
        WorkerCommand(
            "eval: the math reward's worker",
            ["eval", "builtin", "task=math", "precisions=fp32", "num_prompts=512", "out=DIR"],
            workers(1),
        ),
        WorkerCommand(
            "perfectible: the math reward's worker",
            ["perfectible", "task=math", "num_candidates=2048", "out=DIR/set.jsonl"],
            workers(1),
        ),
        WorkerCommand(
            "phantom --model: Ray (its asynchronous arms)",
            ["phantom", "--model", str(BUILTIN_DIR), "--steps", "2", "--seeds", "0", "--out", "DIR", *small],
            on_ray,
        ),
    ]


def signal_trials(root: Path) -> dict:
    """Each command with workers, sent each stop signal (SIGKILL too) once its workers run: it must end with
    128 + the signal and one line (a SIGKILLed one says nothing), and nothing of it may run 15 s later."""
    out: dict = {"cases": 0, "exits_expected": 0, "one_line_stops": 0, "tracebacks": 0, "hangs": 0, "orphans": 0}
    out["not_reached"], out["rows"] = 0, []
    for command in worker_commands(root):
        for sig in STOP_SIGNALS:
            row = signal_case(root / f"signals-{out['cases']}", command, sig)
            out["cases"] += 1
            out["not_reached"] += row["exit"] is None and not row["hang"]
            out["exits_expected"] += row["exit"] == (-sig if sig == signal.SIGKILL else 128 + sig)
            out["one_line_stops"] += row["one_line"]
            out["tracebacks"] += row["traceback"]
            out["hangs"] += row["hang"]
            out["orphans"] += len(row["orphans"])
            out["rows"].append(row)
            said = (
                f"  {command.name}, {sig.name}: exit {row['exit']}, orphans {len(row['orphans'])}: {row['last_line']}"
            )
            print(said[:220], flush=True)
    return out


def signal_case(folder: Path, command: WorkerCommand, sig: signal.Signals) -> dict:
    """`command` in its own session, marked with RUN_MARK; `sig` to it once its workers run; what it left."""
    folder.mkdir()
    mark = folder.name
    argv = [a.replace("DIR", str(folder / "out")) for a in command.argv]
    env = {**(command.env or os.environ), RUN_MARK: mark, "XDG_CACHE_HOME": str(folder / "cache")}
    row = {"command": command.name, "signal": sig.name, "exit": None, "hang": False, "last_line": ""}
    with (folder / "stderr").open("w") as err:  # a file: a pipe stays open as long as an orphan holds it
        proc = subprocess.Popen(
            [sys.executable, "-m", "parity", *argv],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            cwd=folder,
            start_new_session=True,
        )
    deadline = time.monotonic() + CASE_TIMEOUT_S
    while proc.poll() is None and not command.running(proc.pid, mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    row["exit_before_signal"] = proc.poll()  # the workers never ran: the case did not happen
    if proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(sig)
        try:
            row["exit"] = proc.wait(timeout=SIGNAL_EXIT_S)
        except subprocess.TimeoutExpired:
            row["hang"] = True
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + ORPHAN_WAIT_S
    while (left := run_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    text = (folder / "stderr").read_text(errors="replace")
    said = [line for line in text.splitlines() if line.strip() and "it/s]" not in line and "step/s" not in line]
    row["last_line"] = said[-1][:200] if said else ""
    row["orphans"] = left
    row["traceback"] = "Traceback (most recent call last)" in text
    verb = argv[0]
    row["one_line"] = row["exit"] == 128 + sig and row["last_line"].startswith(f"parity {verb}: stopped by {sig.name}")
    return row


SECTIONS = (
    "kills",
    "damaged_checkpoints",
    "disk_full",
    "concurrency",
    "bad_inputs",
    "received_runs",
    "received_folders",
    "api_misuse",
    "distributed",
    "signals",
)


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
            "received_runs": lambda: received_run_trials(root, reference),
            "received_folders": lambda: received_folder_trials(root),
            "api_misuse": lambda: api_misuse_trials(root),
            "distributed": lambda: distributed_trials(root, rng),
            "signals": lambda: signal_trials(root),
        }
        summary = {name: trials[name]() for name in args.sections}
    parts = list(summary.values())
    summary["data_lost"] = sum(
        p.get("steps_lost", 0) + p.get("user_files_changed", 0) + p.get("user_checkpoint_folders_changed", 0)
        for p in parts
    )
    summary["crashes_after_writing"] = sum(p.get("refused_runs_that_wrote", 0) for p in parts)
    summary["tracebacks"] = sum(p.get("tracebacks", 0) for p in parts)
    summary["hangs"] = sum(p.get("hangs", 0) for p in parts)
    summary["bytes_leaked"] = sum(p.get("bytes_leaked", 0) for p in parts)
    summary["code_executed"] = sum(p.get("code_executed", 0) for p in parts)
    summary["orphan_processes"] = sum(p.get("orphans", 0) for p in parts)
    summary["wall_seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
