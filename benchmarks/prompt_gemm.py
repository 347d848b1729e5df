"""The prompt GEMM (kernels/gemm.c, batch invariant) against oneDNN's prepacked GEMM, which
prompt rows took before issue 50, per layer shape of the bundled model and row count.

Per shape, dtype and M: microseconds per call and GFLOP/s, best of ``--repeats`` runs, the
two interleaved (ABAB...), and the ratio oneDNN time / ours (above 1: ours faster). The
weights stay in cache (a prompt step reuses each weight over hundreds of rows). The path
each side takes is printed: run under ``INFLIGHT_CPU_ISA=avx512 ONEDNN_MAX_CPU_ISA=
AVX512_CORE_BF16`` (or ``avx2`` / ``AVX2``) to measure another host kind's path on an AMX
host.

    .venv/bin/python benchmarks/prompt_gemm.py --dtype bfloat16 --rows 16 64 128 256 512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from inflight.bench.machine import describe_machine
from inflight.bench.timing import seconds_per_call
from inflight.model.kernels.gemm import gemm_linear, gemm_pack, gemm_path
from inflight.model.kernels.native_lib import isa_path, onednn_has_amx
from inflight.model.linear import onednn_pack

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256, 512])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    host = describe_machine()
    print(f"{host['cpu']}; path {isa_path()}: gemm.c {gemm_path(dtype)}, oneDNN "
          f"{'with' if onednn_has_amx() else 'without'} AMX (ONEDNN_MAX_CPU_ISA="
          f"{os.environ.get('ONEDNN_MAX_CPU_ISA', 'ALL')}); threads {torch.get_num_threads()}; "
          f"load average {host['loadavg']}")
    g = torch.Generator().manual_seed(0)
    results = []
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
        ours_w, onednn_w = gemm_pack(w), onednn_pack(w)
        if ours_w is None or onednn_w is None:
            raise SystemExit(f"no {'gemm.c' if ours_w is None else 'oneDNN'} path for {dtype} here")
        for m in args.rows:
            x = torch.randn(m, k, generator=g).to(dtype)
            calls = {"ours": lambda: gemm_linear(x, ours_w, n),
                     "onednn": lambda: torch.ops.mkldnn._linear_pointwise(
                         x, onednn_w, None, "none", [], "")}
            times: dict[str, list[float]] = {key: [] for key in calls}
            for r in range(args.repeats):
                for key in (calls if r % 2 == 0 else reversed(list(calls))):
                    times[key].append(seconds_per_call(calls[key], 0.15))
            best = {key: min(v) for key, v in times.items()}
            spread = {key: (max(v) - min(v)) / statistics.median(v) for key, v in times.items()}
            flop = 2 * m * n * k
            print(f"{name:8s} {n:5d}x{k:<5d} M={m:4d}  ours {best['ours'] * 1e6:8.1f} us "
                  f"{flop / best['ours'] / 1e9:7.0f} GF/s  oneDNN {best['onednn'] * 1e6:8.1f} us "
                  f"{flop / best['onednn'] / 1e9:7.0f} GF/s  oneDNN/ours {best['onednn'] / best['ours']:.2f}"
                  f"  (spread {spread['ours']:.0%} / {spread['onednn']:.0%})", flush=True)
            results.append({"shape": name, "n": n, "k": k, "m": m, "ours_s": best["ours"],
                            "onednn_s": best["onednn"]})
    ratios = [r["onednn_s"] / r["ours_s"] for r in results]
    print(f"oneDNN/ours over {len(ratios)} cases: median {statistics.median(ratios):.2f}, "
          f"min {min(ratios):.2f}, max {max(ratios):.2f}; geometric mean "
          f"{statistics.geometric_mean(ratios):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"host": host, "isa_path": isa_path(), "dtype": args.dtype,
                       "gemm_path": gemm_path(dtype), "results": results}, f, indent=1)


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
