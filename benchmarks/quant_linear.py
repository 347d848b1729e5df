"""The quantized linear kernel (quant_linear.c) against the bfloat16 paths, per layer shape
of the bundled model and row counts (issue 17): which path a decode step should take.

Per shape and row count, microseconds per call, best of ``--repeats`` interleaved runs:
oneDNN's prepacked GEMM and the skinny kernel (M <= 16) in ``--dtype`` (bfloat16; float32
where oneDNN has no bfloat16 path, as on AVX2-only CPUs, or to compare with the dense path
such a CPU serves), and the block
kernel in each block format (on CPUs with AMX-INT8, its VNNI and AMX paths apart; K-quants
on the shapes whose rows are whole 256-value super-blocks, random codes and scales). Each
weight is copied until the copies exceed L3, and calls cycle through them, so weights come
from DRAM as in a real step. Effective GB/s = the format's weight bytes / time.

    .venv/bin/python benchmarks/quant_linear.py --rows 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import os

import torch

import inflight.model.linear as linear
from inflight.bench.timing import seconds_per_call
from inflight.model.kernels import quant_linear, skinny_linear
from inflight.model.kernels.native_lib import native_library
from inflight.model.quant import QuantFormat, QuantizedWeight, sample_blocks

# (N, K): the bundled SmolLM2-135M's layers, and Gemma 3 270M's (g_*) where a Q4_K_M file
# has K-quants (its o and down projections; K = 640 rows are Q5_0 there)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576), "g_o": (640, 1024), "g_gate_up": (4096, 640),
          "g_down": (640, 2048)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--formats", nargs="+", default=[f.name for f in QuantFormat],
                   choices=[f.name for f in QuantFormat])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the dense paths' dtype (and the inputs')")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = native_library()
    if lib is None:
        raise SystemExit("the native kernels did not build: nothing to compare")
    amx_default = lib.quant_linear_amx(0)  # 0: no AMX tiles here
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}, "
          f"AMX {'from ' + str(amx_default) + ' rows' if amx_default else 'not available'}")
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    short = {"bfloat16": "bf16", "float32": "f32"}[args.dtype]
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = max(1, int(96e6 // (n * k * dtype.itemsize)))
        formats = [QuantFormat[f] for f in args.formats if k % QuantFormat[f].values_per_row == 0]
        dense, quant = [], {f: [] for f in formats}
        for c in range(copies):
            w = torch.randn(n, k) * 0.05
            lin = linear.Linear(k, n, bias=False)
            lin.weight = torch.nn.Parameter(w.to(dtype), requires_grad=False)
            lin.prepack()
            dense.append(lin)
            for f in formats:
                quant[f].append(QuantizedWeight.quantize(w, f) if f.quantizable else
                                QuantizedWeight.from_blocks(f, sample_blocks(f, n, k, c, 0.05)))
        for m in args.rows:
            x = torch.randn(m, k).to(dtype)
            turn = iter(range(1 << 62))

            def pick(xs):
                return xs[next(turn) % len(xs)]

            calls = {f"oneDNN {short}": lambda: torch.ops.mkldnn._linear_pointwise(
                         x, pick(dense).packed, None, "none", [], "")}
            if dense[0].packed is None:  # no prepacked path here (bfloat16 on AVX2)
                calls = {f"torch {short}": lambda: torch.nn.functional.linear(x, pick(dense).weight)}
            if m <= 16:  # the skinny kernel's limit
                calls[f"skinny {short}"] = lambda: skinny_linear(x, pick(dense).weight)
            # the block kernel per format; where AMX is there, its VNNI and AMX paths apart
            paths = {"": None} if amx_default == 0 else {" vnni": 1 << 40, " amx": 1}
            thresholds: dict[str, int | None] = {key: None for key in calls}
            for f in formats:
                for suffix, threshold in paths.items():
                    calls[f.name + suffix] = lambda f=f: quant_linear(x, pick(quant[f]))
                    thresholds[f.name + suffix] = threshold
            best = {key: float("inf") for key in calls}
            for _ in range(args.repeats):  # interleaved: a noisy second shifts all alike
                for key, fn in calls.items():
                    lib.quant_linear_amx(thresholds[key] or amx_default)
                    best[key] = min(best[key], seconds_per_call(fn))
            lib.quant_linear_amx(amx_default)
            nbytes = {**{key: n * k * dtype.itemsize for key in calls},
                      **{f.name + suffix: quant[f][0].nbytes for f in formats
                         for suffix in paths}}
            cells = "  ".join(f"{key} {1e6 * t:7.1f} us ({nbytes[key] / t / 1e9:4.1f} GB/s)"
                              for key, t in best.items())
            print(f"{name:8s} M={m:2d}: {cells}", flush=True)


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
