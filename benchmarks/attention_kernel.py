"""The native paged decode-attention kernel alone: ms per layer call (issue 6).

Times ``inflight.model.kernels.paged_decode_attention`` on ``--batch`` sequences of
``--context`` keys (9 query / 3 KV heads of 64, the bundled model's), with the KV blocks
laid out in order or scattered at random, on 1 and 2 threads of PyTorch's OpenMP pool,
alone and right after a PyTorch matmul (as in a model step). Interleaved, best of
``--repeats``.

To compare against an older kernel, build it next to this one with
``git show REV:inflight/model/kernels/paged_attention.c``.

    .venv/bin/python benchmarks/attention_kernel.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os

import torch

from inflight.bench.timing import seconds_per_call
from inflight.model.kernels import paged_decode_attention
from inflight.model.kernels.native_lib import native_library


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=144)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if native_library() is None:
        raise SystemExit("the native kernel could not be built here")
    dtype = getattr(torch, args.dtype)
    b, h, h_kv, d, bs, n = args.batch, 9, 3, 64, 16, args.context
    width = -(-n // bs)
    num_blocks = b * width + 8
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, h_kv, num_blocks, bs, d, generator=g).to(dtype)
    q = torch.randn(b, h, d, generator=g).to(dtype)
    lens = torch.full((b,), n, dtype=torch.long)
    x, w = torch.randn(256, 576).to(dtype), torch.randn(576, 3072).to(dtype)
    layouts = {"in order": torch.arange(b * width).view(b, width),
               "scattered": torch.randperm(num_blocks, generator=g)[:b * width].view(b, width)}
    print(f"{args.dtype}, {b} sequences x {n} keys, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    for layout, tables in layouts.items():
        for after_matmul in (False, True):
            best = {}
            for _ in range(args.repeats):
                for threads in (1, 2):
                    def call():
                        if after_matmul:
                            x @ w
                        paged_decode_attention(q, cache, tables, lens, d ** -0.5, threads)
                    t = seconds_per_call(call)
                    best[threads] = min(best.get(threads, t), t)
            extra = " after a matmul (matmul time included)" if after_matmul else ""
            print(f"blocks {layout:9s}{extra}: 1 thread {1e3 * best[1]:.2f} ms, "
                  f"2 threads {1e3 * best[2]:.2f} ms")


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
