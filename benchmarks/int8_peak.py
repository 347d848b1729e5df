"""How close the block kernel comes to this core's int8 peak (issue 32, part 5).

The peak is the rate of the instruction the kernel's integer part is made of, measured
with a loop of 8 independent ones (no loads, no dependences; inline assembly compiled here
with ``$CC``, default ``cc``): ``vpmaddubsw`` (AVX2: 32 multiply-adds of unsigned by signed
bytes into int16 pairs) and, where the CPU has AVX-512 VNNI, ``vpdpbusd`` (64 into int32).
The same loop with one ``vpmaddwd`` per 8 (the AVX2 path's widening of a block's int16 sums)
gives the peak of the AVX2 path's instruction mix. Then ``quant_linear`` (the kernel the
model calls) on the bundled model's layer shapes with Q4_1 blocks, best of ``--repeats``,
on one thread and on all of PyTorch's threads (where the CPU has AMX, its path is turned
off for the run: this measures the VNNI path against its instruction): multiply-adds per second per core and their
share of the peak. Nothing here is timed in a test; the host is shared, so read the load
average it prints, and run it twice.

    .venv/bin/python benchmarks/int8_peak.py --rows 32 128
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch

from inflight.bench.timing import seconds_per_call
from inflight.model.kernels import quant_linear
from inflight.model.kernels.native_lib import native_library
from inflight.model.quant import QuantFormat, QuantizedWeight

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from quant_linear import SHAPES  # noqa: E402  (sibling benchmark: the bundled model's layer shapes)

# Each loop: n iterations of 8 independent products (registers 0-7 from 14, 15), optionally
# one vpmaddwd more. Returns nothing; the caller times it.
PEAK_C = r"""
#include <stdint.h>
#define CLOBBER "ymm0","ymm1","ymm2","ymm3","ymm4","ymm5","ymm6","ymm7","ymm8","ymm14","ymm15"
#define EIGHT(I) I " %%ymm14,%%ymm15,%%ymm0\n" I " %%ymm14,%%ymm15,%%ymm1\n"          \
                 I " %%ymm14,%%ymm15,%%ymm2\n" I " %%ymm14,%%ymm15,%%ymm3\n"          \
                 I " %%ymm14,%%ymm15,%%ymm4\n" I " %%ymm14,%%ymm15,%%ymm5\n"          \
                 I " %%ymm14,%%ymm15,%%ymm6\n" I " %%ymm14,%%ymm15,%%ymm7\n"
void maddubs(int64_t n) { for (int64_t i = 0; i < n; i++) __asm__ volatile(EIGHT("vpmaddubsw") ::: CLOBBER); }
void maddubs_madd(int64_t n) {
    for (int64_t i = 0; i < n; i++)
        __asm__ volatile(EIGHT("vpmaddubsw") "vpmaddwd %%ymm14,%%ymm15,%%ymm8\n" ::: CLOBBER);
}
#ifdef __AVX512VNNI__
#define ZCLOBBER "zmm0","zmm1","zmm2","zmm3","zmm4","zmm5","zmm6","zmm7","zmm14","zmm15"
#define ZEIGHT "vpdpbusd %%zmm14,%%zmm15,%%zmm0\n vpdpbusd %%zmm14,%%zmm15,%%zmm1\n"        \
               "vpdpbusd %%zmm14,%%zmm15,%%zmm2\n vpdpbusd %%zmm14,%%zmm15,%%zmm3\n"        \
               "vpdpbusd %%zmm14,%%zmm15,%%zmm4\n vpdpbusd %%zmm14,%%zmm15,%%zmm5\n"        \
               "vpdpbusd %%zmm14,%%zmm15,%%zmm6\n vpdpbusd %%zmm14,%%zmm15,%%zmm7\n"
int has_vnni(void) { return 1; }
void dpbusd(int64_t n) { for (int64_t i = 0; i < n; i++) __asm__ volatile(ZEIGHT ::: ZCLOBBER); }
#else
int has_vnni(void) { return 0; }
void dpbusd(int64_t n) { (void)n; }
#endif
"""


def build_peak() -> ctypes.CDLL:
    """The peak loops, compiled for this CPU (``-march=native``) into a temporary library."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="int8_peak_"))
    (tmp / "peak.c").write_text(PEAK_C)
    subprocess.run([os.environ.get("CC", "cc"), "-O2", "-march=native", "-shared", "-fPIC",
                    str(tmp / "peak.c"), "-o", str(tmp / "peak.so")], check=True)
    return ctypes.CDLL(str(tmp / "peak.so"))


def rate(fn: Callable[[ctypes.c_int64], object], ops_per_iter: int, n: int = 20_000_000) -> float:
    """Instructions a second (best of 3) of a loop of ``ops_per_iter`` per iteration."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        fn(ctypes.c_int64(n))
        best = min(best, time.perf_counter() - t)
    return ops_per_iter * n / best


def kernel_gmacs(n: int, k: int, m: int, repeats: int) -> float:
    """GMAC/s of ``quant_linear`` on ``m`` rows of a ``[n, k]`` Q4_1 layer, weights out of
    cache (8 copies used in turn), best of ``repeats`` timings."""
    ws = [QuantizedWeight.quantize(torch.randn(n, k) * 0.05, QuantFormat.Q4_1) for _ in range(8)]
    x = torch.randn(m, k)
    if quant_linear(x, ws[0]) is None:
        raise SystemExit("quant_linear did not run (no native kernels here)")
    turn = itertools.count()
    best = min(seconds_per_call(lambda: quant_linear(x, ws[next(turn) % len(ws)]))
               for _ in range(repeats))
    return m * n * k / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[32, 128])
    p.add_argument("--shapes", nargs="+", default=["gate_up", "down"], choices=list(SHAPES))
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    lib = build_peak()
    kernels = native_library()
    if kernels is None:
        raise SystemExit("the native kernels did not build: nothing to measure")
    amx_from = kernels.quant_linear_amx(0)  # 0 where there are no AMX tiles
    if amx_from:
        kernels.quant_linear_amx(1 << 40)
    threads = torch.get_num_threads()
    print(f"threads {threads}, load average {os.getloadavg()[0]:.2f}")
    peak = rate(lib.maddubs, 8) * 32 / 1e9
    mix = rate(lib.maddubs_madd, 8) * 32 / 1e9
    print(f"vpmaddubsw alone: {peak:.1f} GMAC/s a core; with one vpmaddwd per 8 (the AVX2 "
          f"path's mix): {mix:.1f}")
    # The kernel's own path: VNNI where the CPU has it (its peak the reference), else AVX2.
    refs = {"vpmaddubsw": peak, "the AVX2 mix": mix}
    if lib.has_vnni():
        refs = {"vpdpbusd": rate(lib.dpbusd, 8) * 64 / 1e9}
        print(f"vpdpbusd (AVX-512 VNNI, the kernel's path here): {refs['vpdpbusd']:.1f} GMAC/s a core")
    for name in args.shapes:
        n, k = SHAPES[name]
        for m in args.rows:
            per_core = {}
            for t in sorted({1, threads}):
                torch.set_num_threads(t)
                per_core[t] = kernel_gmacs(n, k, m, args.repeats) / t
            torch.set_num_threads(threads)
            cells = ", ".join(f"{t} thread{'s' * (t > 1)} {g:.1f} GMAC/s a core ("
                              + ", ".join(f"{g / r:.0%} of {label}" for label, r in refs.items()) + ")"
                              for t, g in per_core.items())
            print(f"{name:8s} {n} x {k}, {m:4d} rows, Q4_1: {cells}")
    if amx_from:
        kernels.quant_linear_amx(amx_from)


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
