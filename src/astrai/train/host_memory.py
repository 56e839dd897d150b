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

Independently, glibc gives the top of its heap back to the kernel whenever more than
`M_TRIM_THRESHOLD` bytes lie free there (by default twice the moving mmap threshold: at most
64 MiB). Each decode step frees its (batch, vocab) blocks, and the next step faults the same
pages back in; a fresh page is expensive: in the VM this was measured on, a 6 MiB (32, 49152)
logits copy took 5.5 ms with the trim against 0.6 ms without, most of the sampler's time in a
SmolLM2 rollout. `rl.host_keep_heap` (on by default) raises the trim threshold to its maximum
while the engine decodes a rollout (`HeapTrim.rollout`), and puts it back for training. Keeping
the heap through training as well measured slower (the training part 1.0-2.2 s slower per
SmolLM2 step in two same-run pairs, for 0.4-0.6 s gained in the rollout). Setting a threshold
stops glibc moving them, so both are fixed when the loop starts, where the moving ones settle.
A `MALLOC_TRIM_THRESHOLD_` in the environment wins.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers, <malloc.h>
M_MMAP_THRESHOLD = -3
MAX_THRESHOLD_MB = 32  # glibc refuses thresholds above HEAP_MAX_SIZE / 2 on 64-bit hosts
MAX_TRIM_BYTES = 2**31 - 1  # mallopt takes an int


def _mallopt() -> Any | None:
    """glibc's `mallopt`, or None on another C library."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def set_mmap_threshold(megabytes: int) -> bool:
    """Fix glibc's mmap threshold at `megabytes` MiB for this process; True when it was set.

    0, a non-glibc C library, or a threshold already given by the environment leave the
    allocator as it is (False)."""
    if megabytes <= 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = _mallopt()
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, min(megabytes, MAX_THRESHOLD_MB) * 2**20) == 1


class HeapTrim:
    """`rl.host_keep_heap`: the heap's top is kept, not trimmed, while the engine decodes.

    glibc stops moving its thresholds once one is set, so `start` fixes them where the moving ones
    settle (mmap at 32 MiB unless `set_mmap_threshold` fixed it at `host_mmap_threshold_mb`; trim at
    twice the mmap threshold), the policy the trainer keeps; inside `rollout()` the trim threshold
    is at its maximum. Inert when not enabled, on another C library, or with a
    `MALLOC_TRIM_THRESHOLD_` in the environment."""

    def __init__(self) -> None:
        self.trim_bytes = 2 * MAX_THRESHOLD_MB * 2**20
        self._mallopt: Any = None  # set while the policy is on

    def start(self, enabled: bool, mmap_threshold_mb: int = 0) -> bool:
        """Fix the thresholds for this process; True when the policy is on."""
        mallopt = _mallopt() if enabled and "MALLOC_TRIM_THRESHOLD_" not in os.environ else None
        if mallopt is None:
            return False
        if mmap_threshold_mb <= 0 and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            mallopt(M_MMAP_THRESHOLD, MAX_THRESHOLD_MB * 2**20)  # else set_mmap_threshold's value stands
        mmap_mb = min(mmap_threshold_mb, MAX_THRESHOLD_MB) if mmap_threshold_mb > 0 else MAX_THRESHOLD_MB
        self.trim_bytes = 2 * mmap_mb * 2**20
        if mallopt(M_TRIM_THRESHOLD, self.trim_bytes) == 1:
            self._mallopt = mallopt
        return self._mallopt is not None

    @contextmanager
    def rollout(self) -> Iterator[None]:
        """Freed heap memory stays mapped inside: each decode step reuses the pages of the last."""
        if self._mallopt is None:
            yield
            return
        self._mallopt(M_TRIM_THRESHOLD, MAX_TRIM_BYTES)
        try:
            yield
        finally:
            self._mallopt(M_TRIM_THRESHOLD, self.trim_bytes)
