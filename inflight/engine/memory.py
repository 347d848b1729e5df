"""Keeping the engine's memory bounded by its work, not its history.

Two sources of growth, each bounded here:

- oneDNN's primitive caches (``bound_primitive_caches``). Every new GEMM shape (a step's
  token count: prefill chunks and decode batches come in hundreds of sizes) leaves a
  primitive of ~300 KiB in oneDNN's cache and another in ideep's, up to 1,024 entries each
  by default: ~600 MiB, filled over hours of serving, which is what a soak measured as RSS
  growth after warm-up (docs/reliability.md).
- glibc's arenas (``HeapTrimmer``), below.

Giving freed heap memory back to the OS between steps (glibc's ``malloc_trim``):

A server's RSS grew 13.5 % over a 10-minute soak after warm-up (docs/reliability.md) with
no Python object growing: each step's tensors (activations, logits: megabytes, every shape
different) are freed into glibc's arenas, which keep the pages. ``malloc_trim(0)`` on that
process took RSS back from 2047 to 1653 MiB. The engine thread calls ``HeapTrimmer.maybe``
when it goes idle and, under load that never idles, between steps at a longer interval, so
memory stays bounded by what the work needs, not by its history.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Entries per cache (oneDNN's and ideep's): a step uses ~5 GEMM shapes (the fused qkv,
# o_proj, gate_up, down projections at its token count, lm_head at its sampled rows), so 32
# keeps the last ~6 steps' shapes. Measured (docs/reliability.md): RSS flat over 12 rounds
# of 24 random-length requests (still climbing, +2 % by then, with the defaults), the same
# throughput within the noise; a 10-minute soak +0.72 % where it had been +13.5 %.
PRIMITIVE_CACHE_CAPACITY = 32
_PRIMITIVE_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")

IDLE_INTERVAL_S = 5.0   # at most this often when the engine goes idle
BUSY_INTERVAL_S = 60.0  # at most this often between steps when it never idles


def bound_primitive_caches(capacity: int = PRIMITIVE_CACHE_CAPACITY) -> dict[str, str]:
    """Cap oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's
    (``LRU_CACHE_CAPACITY``, PyTorch's oneDNN wrapper) at ``capacity`` entries each.

    Both are read from the environment when the first oneDNN primitive is built, so this
    must run before the first CPU GEMM of the process (``engine.loading.load`` calls it
    before building the model); after that it changes nothing. A value the user already
    set wins. ``LRU_CACHE_CAPACITY=0`` crashes ideep (segmentation fault, torch 2.13), so
    ``capacity`` must be at least 1.

    Returns:
        The two variables as they are now set.

    Raises:
        ValueError: ``capacity`` < 1.
    """
    if capacity < 1:
        raise ValueError(f"capacity: must be at least 1 (got {capacity})")
    return {name: os.environ.setdefault(name, str(capacity)) for name in _PRIMITIVE_CACHE_VARS}


def _libc_trim() -> Callable[[], int] | None:
    """glibc's ``malloc_trim`` (returns 1 if memory was released), or None off glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # musl, macOS: no malloc_trim
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return lambda: int(fn(0))


def trim_heap() -> bool:
    """``malloc_trim(0)`` once, now (after a load's transient tensors are freed: without it
    the resident size stays at the load's peak); whether memory was released. False off
    glibc."""
    trim = _libc_trim()
    return trim is not None and bool(trim())


class HeapTrimmer:
    """Calls ``malloc_trim(0)`` at most every ``idle_interval_s`` seconds when idle and every
    ``busy_interval_s`` seconds when busy (times on ``clock``, seconds). A no-op where the C
    library has no ``malloc_trim``.

    Args:
        idle_interval_s, busy_interval_s: least seconds between two trims in each state.
        clock: monotonic seconds.
        trim: the trim function (tests pass a fake); default: glibc's.
    """

    def __init__(self, idle_interval_s: float = IDLE_INTERVAL_S,
                 busy_interval_s: float = BUSY_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[], int] | None = None) -> None:
        self.idle_interval_s = idle_interval_s
        self.busy_interval_s = busy_interval_s
        self.clock = clock
        self._trim = trim if trim is not None else _libc_trim()
        self._last = clock()
        self.num_trims = 0

    def maybe(self, idle: bool) -> bool:
        """Trim if the interval for this state has passed since the last trim; returns
        whether it trimmed."""
        if self._trim is None:
            return False
        now = self.clock()
        if now - self._last < (self.idle_interval_s if idle else self.busy_interval_s):
            return False
        self._trim()
        self._last = self.clock()
        self.num_trims += 1
        logger.debug("malloc_trim took %.1f ms", (self._last - now) * 1e3)
        return True
