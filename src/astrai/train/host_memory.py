"""The C allocator's policy for large host tensors during online RL (Linux with glibc).

glibc serves an allocation from its heap unless it is at least `M_MMAP_THRESHOLD` bytes, and that
threshold moves: each freed mmapped block raises it to the block's size, up to 32 MiB. After the
first few frees every activation of a small model (a few MiB to a few tens of MiB per tensor)
lives in the heap. A training step saves hundreds of such tensors between temporaries of other
sizes; freed, they leave holes the next step's tensors do not fit, so the heap grows well past
what is live. An online RL step, which alternates the engine's decode allocations with the
trainer's, fragments it most: SmolLM2-135M's GRPO step peaked at 6.3 GB resident against 4.5 GB
live.

A fixed threshold (`rl.host_mmap_threshold_mb`, e.g. 1 MiB) sends every tensor of at least
that size to its own mapping, returned to the kernel when freed: no holes. The price is zeroing
fresh pages on each such allocation. In the online loop that cost 12-15% of CPU time (10% of wall
time) for 1.8 GB less at SmolLM2's peak, and 18% with no memory gained on a 1M-parameter model;
a loop of forward and backward passes alone slowed by about 30% for 0.95 GB. So it is opt-in (0,
glibc's default, is the default), for CPU runs where host memory decides what fits; a GPU's
activations do not live in this heap. A `MALLOC_MMAP_THRESHOLD_` in the environment always wins:
glibc read it at start, and it is left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_MMAP_THRESHOLD = -3  # mallopt's parameter number, <malloc.h>
MAX_THRESHOLD_MB = 32  # glibc refuses thresholds above HEAP_MAX_SIZE / 2 on 64-bit hosts


def set_mmap_threshold(megabytes: int) -> bool:
    """Fix glibc's mmap threshold at `megabytes` MiB for this process; True when it was set.

    0, a non-glibc C library, or a threshold already given by the environment leave the
    allocator as it is (False)."""
    if megabytes <= 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)  # the process's own C library
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, min(megabytes, MAX_THRESHOLD_MB) * 2**20) == 1
