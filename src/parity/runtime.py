"""Process-wide settings that a CPU run needs to be fast.

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
import sys

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
