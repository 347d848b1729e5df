"""The native paged prefill-attention kernel against PyTorch's SDPA, per layer (issue 6).

One sequence's chunk of ``T`` tokens after ``num_computed`` cached ones, 9 query / 3 KV heads
of 64 (the bundled model's), blocks scattered at random. SDPA gets what the PyTorch path
hands it: ``is_causal`` for a fresh prompt; keys gathered from the blocks and a mask after a
cached prefix (the gather included). Interleaved, best of ``--repeats``.

    .venv/bin/python benchmarks/prefill_attention.py
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from inflight.bench.timing import seconds_per_call
from inflight.model.kernels import paged_prefill_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    g = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for t, cached in ((128, 0), (400, 0), (512, 0), (2048, 0), (200, 300), (512, 1536)):
            bs, num_blocks = 16, 4096
            total = cached + t
            width = -(-total // bs)
            cache = torch.randn(2, 3, num_blocks, bs, 64, generator=g).to(dtype)
            table = torch.randperm(num_blocks, generator=g)[:width]
            q = torch.randn(t, 15, 64, generator=g).to(dtype)[:, :9]  # a view, as in the model
            k_new = cache[0][:, table].reshape(3, -1, 64)[:, cached:total]
            v_new = cache[1][:, table].reshape(3, -1, 64)[:, cached:total]
            qh = q.transpose(0, 1).unsqueeze(0)

            def sdpa():
                if cached == 0:
                    return F.scaled_dot_product_attention(qh, k_new.unsqueeze(0), v_new.unsqueeze(0),
                                                          is_causal=True, enable_gqa=True)
                kv = cache.index_select(2, table).view(2, 3, -1, 64)[:, :, :total]
                mask = torch.arange(total)[None, :] <= torch.arange(cached, total)[:, None]
                return F.scaled_dot_product_attention(qh, kv[0].unsqueeze(0), kv[1].unsqueeze(0),
                                                      attn_mask=mask, enable_gqa=True)

            def kernel():
                return paged_prefill_attention(q, cache, table, cached, 0.125)
            if kernel() is None:
                raise SystemExit("the prefill kernel does not apply here (needs AVX-512)")
            a = min(seconds_per_call(sdpa) for _ in range(args.repeats))
            b = min(seconds_per_call(kernel) for _ in range(args.repeats))
            print(f"{name:8s} T={t:4d} after {cached:4d} cached: SDPA {1e3 * a:6.2f} ms, "
                  f"kernel {1e3 * b:6.2f} ms ({a / b:.2f}x)", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
