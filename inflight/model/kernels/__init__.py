"""Native CPU kernels, compiled on first use with the system C compiler and loaded with
ctypes (no torch headers, so a build takes about a second). Anything missing (no compiler,
a failed build, an unsupported shape) falls back to the PyTorch path, logged once.

``INFLIGHT_ATTENTION_BACKEND=torch`` forces the fallback; ``INFLIGHT_KERNEL_CACHE`` sets
where built libraries go (default ``~/.cache/inflight/kernels``); ``INFLIGHT_ATTENTION_THREADS``
(default 1) splits decode attention's rows over that many threads.

Why one thread by default: between its ops PyTorch's OpenMP workers spin on the other
cores, so a helper thread started right after a matmul finds no free core. Measured in the
engine (bfloat16, 2 cores), 2 threads saved nothing. With ``OMP_WAIT_POLICY=PASSIVE`` they
cut attention at 256 running from 96 to 60 ms a step, but every other op then pays a thread
wake-up and batch 1 went from 23-26 to 36 ms (docs/performance.md).
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.c")
# Vectorizable float reductions without -ffinite-math-only (the softmax uses -inf).
_CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math",
           "-fassociative-math", "-fno-signed-zeros", "-freciprocal-math", "-shared", "-fPIC"]
_lib: ctypes.CDLL | None = None
_tried = False


def _build() -> ctypes.CDLL | None:
    if os.environ.get("INFLIGHT_ATTENTION_BACKEND", "").lower() == "torch":
        return None
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        logger.warning("no C compiler found: paged attention uses the PyTorch fallback")
        return None
    src = _SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join(_CFLAGS).encode() + platform.machine().encode()
                         + platform.node().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("INFLIGHT_KERNEL_CACHE", Path.home() / ".cache/inflight/kernels"))
    lib_path = cache / f"paged_attention-{key}.so"
    if not lib_path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            tmp_lib = Path(tmp) / lib_path.name
            result = subprocess.run([cc, *_CFLAGS, str(_SOURCE), "-o", str(tmp_lib)],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                logger.warning("building the paged attention kernel failed; using the PyTorch "
                               "fallback:\n%s", result.stderr[-2000:])
                return None
            os.replace(tmp_lib, lib_path)  # atomic: concurrent builders never see half a file
    lib = ctypes.CDLL(str(lib_path))
    f = lib.paged_decode_attention
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                  ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 7 + [ctypes.c_float]
    return lib


def native_library() -> ctypes.CDLL | None:
    """The compiled kernel library, or None where it cannot be had (built once per process)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        try:
            _lib = _build()
        except Exception:  # a broken toolchain must not take the engine down
            logger.exception("loading the paged attention kernel failed; using PyTorch")
            _lib = None
    return _lib


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           row_splits: list[tuple[int, int]] | None = None) -> torch.Tensor | None:
    """Decode attention over the paged cache with the native kernel.

    Args:
        q: ``[B, num_heads, head_dim]``, float32 or bfloat16, CPU.
        kv_cache: ``[2, num_kv_heads, num_blocks, block_size, head_dim]``, q's dtype.
        block_tables: ``[B, max_blocks]`` int64; seq_lens: ``[B]`` int64 (>= 1 each).
        scale: softmax scale.
        row_splits: row ranges run on separate threads (``split_rows``; the runner
            computes them once a step); None: computed here from ``seq_lens``.

    Returns:
        ``[B, num_heads, head_dim]`` in q's dtype, or None when the kernel cannot run these
        inputs (then the caller uses the PyTorch path).
    """
    lib = native_library()
    if (lib is None or q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16)
            or kv_cache.dtype != q.dtype):
        return None
    q = q.contiguous()
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty_like(q)
    b, h, d = q.shape
    _, h_kv, num_blocks, block_size, _ = kv_cache.shape
    width, elem = tables.shape[1], q.element_size()
    is_bf16 = int(q.dtype == torch.bfloat16)

    def run(lo: int, hi: int) -> int:  # rows [lo, hi); ctypes drops the GIL for the call
        return lib.paged_decode_attention(
            is_bf16, q.data_ptr() + lo * h * d * elem, kv_cache.data_ptr(),
            tables.data_ptr() + lo * width * 8, lens.data_ptr() + lo * 8,
            out.data_ptr() + lo * h * d * elem, hi - lo, h, h_kv, d, num_blocks, block_size,
            width, scale)

    parts = row_splits
    if parts is None:
        threads = attention_threads()
        parts = [(0, b)] if threads == 1 else split_rows(lens.tolist(), threads)
    if len(parts) == 1:
        rc = run(0, b)
    else:
        # The rows are independent: the other threads take a share of the keys each, and
        # this thread the first. Python threads, not an OpenMP pool of the kernel's own:
        # that one spun against PyTorch's for the same cores.
        futures = [_executor().submit(run, lo, hi) for lo, hi in parts[1:]]
        rc = run(*parts[0])
        rc = min([rc] + [f.result() for f in futures])
    return out if rc == 0 else None


# Below this many keys a step's attention is too short to split: handing rows to another
# thread costs tens of microseconds per layer.
MIN_KEYS_PER_THREAD = 2048
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, 1),
                                   thread_name_prefix="inflight-attn")
    return _pool


def attention_threads() -> int:
    """Threads for decode attention: ``INFLIGHT_ATTENTION_THREADS``, else 1."""
    env = os.environ.get("INFLIGHT_ATTENTION_THREADS", "").strip()
    return max(int(env), 1) if env.isdigit() else 1


def split_rows(seq_lens: Sequence[int], num_threads: int) -> list[tuple[int, int]]:
    """Contiguous row ranges ``[lo, hi)`` with about equal keys each (the kernel's work is
    linear in them), at most ``num_threads``; one range when the work is too small to share
    (under ``MIN_KEYS_PER_THREAD`` keys a thread)."""
    b, total = len(seq_lens), sum(seq_lens)
    n = min(num_threads, b, total // MIN_KEYS_PER_THREAD)
    if n <= 1:
        return [(0, b)]
    cum = list(itertools.accumulate(seq_lens))
    # Each cut follows the row whose keys reach the next multiple of total / n.
    bounds = [0] + [min(bisect.bisect_left(cum, i * total / n) + 1, b) for i in range(1, n)] + [b]
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
