"""Process-wide settings that a CPU run needs to be fast, and where progress bars can be drawn.

glibc's malloc hands every block above its mmap threshold (128 KiB at start) to
the kernel as a fresh mapping and unmaps it on free. Most tensors of an RL step
are above that, so each step mapped, faulted in (the kernel zeroes every 4 KiB
page on first touch) and unmapped tens of megabytes again: 7,000-9,000 page
faults and 20-35 ms of kernel time per step on this project's benchmark models.
Serving blocks up to glibc's cap from the heap and keeping freed memory for
reuse removes nearly all of them; peak memory is unchanged, because the heap
holds no more than the step's high-water mark.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable

_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_CAP = 32 * 2**20  # glibc's largest allowed mmap threshold on 64-bit
_TRIM_THRESHOLD = 2**30  # free memory kept before the heap top is given back

_applied: bool | None = None


def reuse_freed_memory() -> bool:
    """Keep tensor memory in the process heap (glibc only; a no-op elsewhere).

    Returns True when the setting is in force. Idempotent.
    """
    global _applied
    if _applied is None:
        _applied = False
        path = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
        if path:
            libc = ctypes.CDLL(path)
            mallopt = getattr(libc, "mallopt", None)  # musl has none
            if mallopt is not None:
                _applied = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_CAP)) and bool(
                    mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
                )
    return _applied


# Torch's CPU ops split each op over every core, and a split op ends when its slowest thread does. On
# a machine where other processes keep cores busy, a thread waits for its share of a core at every op:
# on this project's 2-core machine with other jobs running (load average 3-4), a step of the built-in
# model took 9-19 s with 2 threads and 0.6-0.8 s with 1, and a `parity eval` at its defaults 73 s
# against 8 s (docs/benchmarks.md, "Threads on a busy machine").
_threads: int | None = None


def _cores() -> int:
    """The cores this process may run on (its affinity mask)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def free_cores() -> int:
    """The cores this process may run on that other processes are not already using: the cores of its
    affinity mask less the 1-minute load average (rounded), at least 1."""
    cores = _cores()
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, min(cores, cores - busy))


def use_free_cores() -> int:
    """Set torch's threads to `free_cores()`, counted once per process (later runs of the process would count
    its own load), unless OMP_NUM_THREADS or PARITY_THREADS names a number; returns the count in force. Set again
    at every call: a resume computes on its run's threads (`keep_threads`), and a new run after it in the same
    process (a notebook's next cell) must compute on the process's, as the same run before it did."""
    global _threads
    import torch

    if _threads is None:
        named = os.environ.get("PARITY_THREADS") or os.environ.get("OMP_NUM_THREADS")
        _threads = int(named) if named and named.isdigit() and int(named) > 0 else free_cores()
    torch.set_num_threads(_threads)
    return _threads


def keep_threads(threads: int, note: Callable[[str], None]) -> None:
    """A resumed run computes on the threads its run had (numerics.json): a CPU op split over other threads
    sums in another order, and the run would not go on bit for bit (measured: grad/norm apart in the 8th digit
    at the first resumed step, then every metric). Unless PARITY_THREADS or OMP_NUM_THREADS chooses, or this
    machine has fewer cores than that (oversubscribed threads would wait on each other at every op). For this run
    only: the process's next `use_free_cores` sets its own count again."""
    import torch

    if os.environ.get("PARITY_THREADS") or os.environ.get("OMP_NUM_THREADS") or threads == torch.get_num_threads():
        return
    cores = _cores()
    if threads > cores:
        note(
            f"the run computed on {threads} threads and this machine has {cores} cores: it goes on with "
            f"{torch.get_num_threads()}, not bit for bit as it would on {threads}"
        )
        return
    note(f"threads: {threads}, as the run had (on others it would not go on bit for bit; PARITY_THREADS=N chooses)")
    torch.set_num_threads(threads)


def draws_bars(progress: bool = True) -> bool:
    """Whether progress bars are drawn: asked for, and stderr a terminal or a notebook's output (which redraws a
    line); in a log file (nohup, a batch job) each redraw would be appended to one long line."""
    return progress and (sys.stderr.isatty() or "ipykernel" in sys.modules)


def progress_line(progress: bool, text: str) -> None:
    """`text` on stderr where progress is asked for and no bar is drawn (a log file): a long command's stages
    are said there, one line each, as its bar would show them."""
    if progress and not draws_bars(progress):
        print(text, file=sys.stderr, flush=True)
