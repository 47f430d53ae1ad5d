"""The process-wide allocator setting (parity.runtime)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

GLIBC = platform.libc_ver()[0] == "glibc"

# In a fresh process: where does a 30 MiB tensor come from, and is its memory kept
# after it is freed? (glibc's mallinfo2: hblkhd = bytes in mmap'd blocks, fordblks =
# free bytes kept in the heap.)
PROBE = """
import ctypes, ctypes.util, sys, torch
from parity.runtime import reuse_freed_memory
if sys.argv[1] == "on":
    assert reuse_freed_memory()
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                     "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
tensor = torch.ones(30 * 2**20 // 4)
mapped = libc.mallinfo2().hblkhd
del tensor
print(mapped, libc.mallinfo2().fordblks)
"""

MIB = 2**20


def _probe(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    mapped, kept = out.stdout.split()
    return int(mapped), int(kept)


@pytest.mark.skipif(not GLIBC, reason="the setting is glibc's")
def test_tensor_memory_comes_from_the_heap_and_is_kept():
    mapped, kept = _probe("off")
    # glibc's default: a fresh mapping per large tensor (faulted in page by page), unmapped on free.
    assert mapped >= 30 * MIB and kept < 30 * MIB
    mapped, kept = _probe("on")
    assert mapped < 30 * MIB and kept >= 30 * MIB


def test_reuse_freed_memory_is_idempotent():
    from parity.runtime import reuse_freed_memory

    first = reuse_freed_memory()
    assert reuse_freed_memory() == first
    assert first == GLIBC


def test_a_resume_computes_on_the_threads_its_run_had(tmp_path, monkeypatch):
    """A run resumed on other threads (the cores free at its start) did not go on bit for bit: grad/norm apart
    in the 8th digit at its first step, then every metric. numerics.json records the threads; a resume keeps
    them, unless PARITY_THREADS or OMP_NUM_THREADS chooses or the machine has fewer cores."""
    import json
    import os

    import torch

    from parity import runtime
    from parity.rl.run_setup import recorded_threads

    (tmp_path / "numerics.json").write_text(json.dumps({"device": "cpu", "threads": 1}))
    assert recorded_threads(tmp_path) == 1
    # A resume on fewer cores computed on its own, and the run's stay what a later resume keeps
    (tmp_path / "numerics.json").write_text(json.dumps({"threads": 1, "run_threads": 16}))
    assert recorded_threads(tmp_path) == 16
    for forged in (10**9, "2", True, None):
        (tmp_path / "numerics.json").write_text(json.dumps({"threads": forged}))
        assert recorded_threads(tmp_path) is None
    (tmp_path / "numerics.json").write_text("[1]")
    assert recorded_threads(tmp_path) is None

    before, notes = torch.get_num_threads(), []
    monkeypatch.setattr(runtime, "_threads", before)
    try:
        monkeypatch.setenv("PARITY_THREADS", str(before))  # the user's choice wins
        runtime.keep_threads(before + 1, notes.append)
        assert torch.get_num_threads() == before and notes == []
        monkeypatch.delenv("PARITY_THREADS", raising=False)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)  # as the free cores may have given
        runtime.keep_threads(1, notes.append)
        assert torch.get_num_threads() == 1 and notes[-1].startswith("threads: 1, as the run had")
        cores = len(os.sched_getaffinity(0))
        runtime.keep_threads(cores + 1, notes.append)  # more than this machine has: not oversubscribed
        assert torch.get_num_threads() == 1 and f"and this machine has {cores} cores" in notes[-1]
    finally:
        torch.set_num_threads(before)


def test_a_resume_s_threads_are_its_own(monkeypatch):
    """A resume computes on its run's threads, and the process's next run on the process's again: in one notebook,
    a new run after a resume of a run on 2 threads computed on 2, the same run before it on 1, and they saved other
    weights at step 3."""
    import torch

    from parity import runtime

    before = torch.get_num_threads()
    monkeypatch.delenv("PARITY_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime, "_threads", 2)  # the process's count (the free cores at its first run)
    try:
        torch.set_num_threads(2)
        runtime.keep_threads(1, lambda note: None)  # a resume of a run on 1 thread
        assert torch.get_num_threads() == 1
        assert runtime.use_free_cores() == 2 and torch.get_num_threads() == 2  # the next run's
    finally:
        torch.set_num_threads(before)
