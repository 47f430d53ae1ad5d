"""Shared fixtures: tiny real Hugging Face checkpoints built and saved in the test session."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# Without a GPU, the batch-invariant Triton kernels of exact mode on CUDA run in Triton's CPU
# interpreter (tests/unit/test_invariant.py). It is read when a kernel is defined, so it is set first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpret_dot_by_position():
    """Triton's interpreter multiplies each pair of tiles by numpy's matmul, that is by the host's BLAS, whose
    bits can depend on where a row or column sits in the tile: OpenBLAS 0.3.31's Haswell kernel on an AMD EPYC
    with avx512_vp2intersect changed a row's sums (by 2.9e-6) when the row moved within a 64 x 32 tile, so the
    batch-invariance tests checked the BLAS, not the kernels. A GPU's `tl.dot` gives an element the same sums
    wherever it sits in its tile, and so does this: each FP32 product, summed over k in order."""
    import numpy as np
    from triton.runtime import interpreter

    blas_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not a.data.dtype == b.data.dtype == d.data.dtype == np.float32:
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        products = a.data[:, :, None] * b.data[None, :, :]  # [M, K, N]
        return interpreter.TensorHandle(products.sum(axis=1) + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    with contextlib.suppress(ImportError):  # no triton: the tests that need it skip
        _interpret_dot_by_position()


TIERS = {"unit", "e2e"}  # tests/unit and tests/e2e (docs/testing.md)

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def pytest_configure(config):
    """With `-n auto --dist loadgroup`, pytest-xdist runs the suite in one process per core. Each takes its share of
    the cores for torch, and so do the `parity` commands the tests start (PARITY_THREADS): more threads than cores
    would make every op wait for a descheduled thread. Fixed in a single process too: a thread count read from the
    load average (`runtime.use_free_cores`, at a test's first `main()`) could differ from the one the test's earlier
    runs computed on, and two runs a test compares bit for bit would sum in other orders. Not in xdist's controller,
    which runs no test: its workers would inherit its count (all the cores each, twice as slow on two)."""
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        return
    threads = str(max(1, len(os.sched_getaffinity(0)) // WORKERS))
    os.environ.setdefault("PARITY_THREADS", threads)  # `parity` commands (runtime.use_free_cores)
    os.environ.setdefault("OMP_NUM_THREADS", threads)  # the benchmark scripts and other child processes
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without the plugin, pytest would refuse to start
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a process per core this process may run on (xdist's own count is of physical cores: 1
    on a machine of two hyper-threads)."""
    return len(os.sched_getaffinity(0))


# The tests that start Ray or count this machine's Ray processes run one after another in one process
# (`--dist loadgroup`): a cluster another test started would be counted as left behind.
ONE_RAY_AT_A_TIME = pytest.mark.xdist_group("ray")


def pytest_collection_modifyitems(config, items):
    """Each test is marked with its tier (`-m unit`, `-m e2e`). Tests marked `cuda` need a GPU: skipped, and
    said so, where PyTorch sees none. In several processes, the Ray tests go first: they run one after
    another in one process, the longest stretch of the suite, while the other processes share the rest."""
    here = Path(__file__).parent
    for item in items:
        tier = item.path.relative_to(here).parts[0] if item.path.is_relative_to(here) else None
        if tier in TIERS:
            item.add_marker(tier)
    if WORKERS > 1:
        items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)  # stable: otherwise in order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


# The tiny run of the tests that train, written once: 4 prompts a step, 4 samples each, at most 32 new tokens,
# no TensorBoard. A test that needs another value appends its own override (the last one given wins).
TINY = ["prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=32", "tensorboard=false"]
# The same with 8 prompts a step, which distributed runs split between rollout workers and learners.
SMALL = ["prompts_per_step=8", *TINY[1:]]


TIMING = ("time/", "perf/")  # wall-clock metrics: two runs of the same steps differ only there


def metrics(run_dir: Path, drop: tuple[str, ...] = ()) -> list[dict]:
    """The steps a run logged, read as `parity report` reads them (`load_history`: each line a JSON object
    holding the reported metrics), and each line whole (no test's run is cut off mid-write); keys that
    start with one of `drop` are left out."""
    from parity.commands.report import load_history

    text = (Path(run_dir) / "metrics.jsonl").read_text()
    whole = text.endswith("\n") and all(line.strip() for line in text.splitlines())
    assert whole, f"{run_dir}/metrics.jsonl: a line cut short or empty"
    return [{k: v for k, v in row.items() if not k.startswith(drop)} for row in load_history(run_dir)]


VOCAB_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +=,.>?"


def write_char_tokenizer(out: Path) -> None:
    """A character-level tokenizer.json with <pad>=0, <bos>=1, <eos>=2; its post-processor puts <bos> first,
    as Llama checkpoints' do (transformers takes BOS from there, not from tokenizer_config.json)."""
    from tokenizers import processors

    from parity.builtin.build import char_tokenizer

    tok = char_tokenizer(VOCAB_CHARS, ("<pad>", "<bos>", "<eos>"))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<eos>", "pad_token": "<pad>", "bos_token": "<bos>"})
    )


# The shape of every tiny test checkpoint (tests/architectures.py adds each family's own keys).
TINY_CONFIG = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def randomize_weights(model: torch.nn.Module, gemma: bool = False) -> None:
    """Larger-than-default weights so the random model has a non-trivial distribution, and norm
    gains away from 1 (Gemma's (1 + w) gains: w away from 0), as in any trained model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5) if gemma else p.uniform_(0.5, 1.5)


def save_hf_model(out: Path, arch: str, seed: int = 0, vocab_size: int = 64, tie: bool = False) -> Path:
    """Build a tiny random Llama or Qwen2 with `transformers` and `save_pretrained` it."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    common = {**TINY_CONFIG, "vocab_size": vocab_size, "tie_word_embeddings": tie}
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    randomize_weights(model)
    model.save_pretrained(out)
    write_char_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return save_hf_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    return save_hf_model(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=1, tie=True)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """`trained_run(*overrides)`: the directory of a `parity train` run with these overrides, trained once in
    the session and shared by every test whose overrides give the same config. It is read-only: a test
    that changes a run (resumes it, damages it, locks it) works on its own `copy_run` of it."""
    from parity import config
    from parity.cli import main
    from parity.rl.train_config import TrainConfig

    runs: dict[str, Path] = {}

    def train(*overrides: str) -> Path:
        key = config.dump_yaml(config.load(TrainConfig, None, list(overrides)))
        if key not in runs:
            run_dir = tmp_path_factory.mktemp("trained") / "run"
            # Its output is no test's: kept out of the capsys of the test that first asks for it.
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
                code = main(["train", f"run_dir={run_dir}", *overrides])
            assert code == 0, err.getvalue()
            _set_writable(run_dir, False)
            runs[key] = run_dir
        return runs[key]

    return train


# The shared tiny run of the tests that read a trained run (report, eval, mismatch) or change a copy of
# one (checkpoint damage, resume): TINY, 2 steps, a checkpoint after each, no evaluation.
TINY_RUN = [*TINY, "steps=2", "checkpoint_every=1", "eval.every=-1"]


@pytest.fixture(scope="session")
def tiny_run(trained_run) -> Path:
    return trained_run(*TINY_RUN)


def copy_run(run_dir: Path, to: Path) -> Path:
    """A writable copy of a (shared, read-only) run directory at `to`; a resume continues the copy."""
    shutil.copytree(run_dir, to, symlinks=True)
    _set_writable(to, True)
    return to


def reseal(ckpt: Path) -> None:
    """Rewrite a checkpoint's manifest to match its files as they now are, as an attacker (or a careless tool)
    would."""
    from parity.rl.checkpoint import MANIFEST, _write_manifest, open_checkpoint

    (ckpt / MANIFEST).unlink()
    with open_checkpoint(ckpt) as folder:
        _write_manifest(folder)


def _set_writable(root: Path, writable: bool) -> None:
    write = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            mode = path.stat().st_mode
            path.chmod(mode | stat.S_IWUSR if writable else mode & ~write)


class _SharedRay:
    """The session's Ray cluster: started by the first test that asks for `ray_cluster`, ended before any
    test that does not (so that a run there starts, and cleans up, its own) and at the session's end."""

    cluster = None
    CPUS = max(os.cpu_count() or 1, 3)  # a rollout worker and two learners, the most a test asks for

    @classmethod
    def start(cls) -> None:
        if cls.cluster is None:
            from parity.distributed.cluster import LocalCluster  # what a run starts for itself (tries twice)

            cls.cluster = LocalCluster(num_cpus=cls.CPUS)

    @classmethod
    def stop(cls) -> None:
        if cls.cluster is not None:
            cls.cluster.stop()
            cls.cluster = None

    @classmethod
    def all_free(cls, wait_s: float = 10.0) -> bool:
        import ray

        deadline = time.monotonic() + wait_s
        while ray.available_resources().get("CPU", 0) < cls.CPUS:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True


@pytest.fixture
def ray_cluster():
    """A Ray cluster of this machine shared by the session: an in-process distributed run finds Ray
    initialized and runs on it instead of starting its own (a `ray.init` costs seconds). Tests of how a
    run starts, stops or cleans up its own cluster (signals, the driver killed, Ray processes counted) do
    not ask for it; a test that kills a rollout worker or a learner may: the run's `close()` kills its
    other actors, and a cluster left with a CPU taken is replaced before the next test."""
    _SharedRay.start()
    yield
    if not _SharedRay.all_free():  # actors left behind: the next test gets a fresh cluster
        _SharedRay.stop()


@pytest.fixture(autouse=True)
def _shared_ray_only_where_asked(request, monkeypatch):
    if "ray_cluster" not in request.fixturenames:
        _SharedRay.stop()
    grouped = request.node.get_closest_marker("xdist_group") is not None
    if grouped and getattr(request.config.option, "loadgroup", False) and "@" not in request.node.nodeid:
        # pytest-xdist marks a grouped test by its node id ("...@ray"), which pytest 9.2 no longer lets it
        # change (pytest-dev/pytest-xdist#1386): the Ray tests would run beside each other, and one's `ray stop`
        # would end another's cluster. Refuse rather than fail at random.
        pytest.fail(
            f"--dist loadgroup does not group with pytest {pytest.__version__} (pytest-dev/pytest-xdist#1386): "
            "pip install 'pytest<9.2', as the test extra pins it",
            pytrace=False,
        )
    if not grouped:
        # A test outside ONE_RAY_AT_A_TIME that starts Ray in this process would run beside the tests that
        # count Ray processes (in several processes) and fail them at random: fail it instead, by name.
        from parity.distributed import cluster, driver

        def refused(*_args, **_kwargs):
            raise AssertionError(f"{request.node.nodeid} starts Ray: mark it ONE_RAY_AT_A_TIME (tests/conftest.py)")

        monkeypatch.setattr(cluster.LocalCluster, "__init__", refused)
        monkeypatch.setattr(cluster, "join", refused)
        monkeypatch.setattr(driver, "join", refused)
    yield


def pytest_sessionfinish(session, exitstatus):
    _SharedRay.stop()


def processes_with(name: str, value: str) -> list:
    """The processes whose environment sets `name` to `value`: those a process started with it started, and
    what they started (a Ray worker renames itself, but keeps its environment), nobody else's."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(name) == value:
                found.append(proc)
    return found


def started_workers(pid: int) -> list:
    """The processes under `pid` that have started as Parity's workers (`parity.stopping.worker_started`): they
    catch SIGHUP, which a process does not by default (/proc/PID/status, SigCgt: a bit per signal)."""
    import psutil

    found = []
    for proc in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(OSError, AttributeError):
            caught = re.search(r"^SigCgt:\s*([0-9a-f]+)$", Path(f"/proc/{proc.pid}/status").read_text(), re.M)
            if int(caught.group(1), 16) >> (signal.SIGHUP - 1) & 1:
                found.append(proc)
    return found


@contextlib.contextmanager
def run_dir_held(run_dir: Path):
    """Another process holding `run_dir`'s lock, as a run going on does; yields that process."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from pathlib import Path; from parity.rundir import RunLock; "
            f"RunLock(Path({str(run_dir)!r})); print('locked', flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.kill()
        holder.wait()
