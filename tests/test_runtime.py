"""The process-wide allocator setting (parity.runtime)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

GLIBC = platform.libc_ver()[0] == "glibc"

# A step's worth of tensors of a few MiB each, all freed at the end; page faults are
# counted over the last steps, after the heap has grown to the step's high-water mark.
STEPS = """
import resource, sys, torch
from parity.runtime import reuse_freed_memory
if sys.argv[1] == "on":
    assert reuse_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def one_step():
    held = [torch.ones(n * 2**18) for n in (1, 8, 3, 16, 5, 2, 12)]
    del held
for _ in range(4):
    one_step()
before = faults()
for _ in range(4):
    one_step()
print(faults() - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_reuse_freed_memory_stops_per_step_page_faults():
    if not GLIBC:
        pytest.skip("the setting is glibc's")
    off, on = _faults("off"), _faults("on")
    # Default glibc maps and unmaps these tensors every step: ~9,000 faults per step.
    assert off > 4 * 1000, off
    assert on < 4 * 50, on


def test_reuse_freed_memory_is_idempotent():
    from parity.runtime import reuse_freed_memory

    first = reuse_freed_memory()
    assert reuse_freed_memory() == first
    assert first == GLIBC
