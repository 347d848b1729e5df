"""The native paged prefill-attention kernels against PyTorch's SDPA, per layer (issue 6).

One sequence's chunk of ``T`` tokens after ``num_computed`` cached ones, 9 query / 3 KV heads
of 64 (the bundled model's, SmolLM2-135M), blocks of 16 scattered at random. SDPA gets what
the PyTorch path (``attention._prefill_attention``) hands it: ``is_causal`` for a fresh
prompt; keys gathered from the blocks and a mask after a cached prefix (the gather included).
Interleaved, best of ``--repeats``.

Paths, each over the same keys and values:

- ``SDPA``: PyTorch over a cache in q's dtype (``--kv-cache-dtype auto``).
- ``kernel``: ``prefill_attention.c`` over that cache (AVX-512 only; absent elsewhere).
- ``SDPA/8`` (``--kv-cache-dtype int8`` / ``fp8``): PyTorch over the 8-bit cache, as
  attention.py runs it for every 8-bit chunk: gather the rows, dequantize, masked SDPA.
- ``kernel/8``: ``prefill_attention_kv8.c`` reading the 8-bit rows in place; its largest
  difference from ``SDPA/8`` is printed too (a kernel that computed something else would
  show).

``(Nx)``: a path's time over ``kernel/8``'s (``kernel``'s, or ``SDPA``'s, without it).

    .venv/bin/python benchmarks/prefill_attention.py
    .venv/bin/python benchmarks/prefill_attention.py --kv-cache-dtype int8 --dtypes float32
    .venv/bin/python benchmarks/prefill_attention.py --kv-cache-dtype fp8 --lengths 128 512 2048
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

import torch
import torch.nn.functional as F

from inflight.bench.timing import seconds_per_call
from inflight.model import kv_quant
from inflight.model.kernels import paged_prefill_attention

H, HKV, D, BS, NUM_BLOCKS, SCALE = 9, 3, 64, 16, 4096, 0.125
CASES = ((128, 0), (400, 0), (512, 0), (2048, 0), (200, 300), (512, 1536))


def _gathered_sdpa(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor,
                   cached: int) -> torch.Tensor:
    """The PyTorch path after a cached prefix, or over any 8-bit cache: the sequence's rows
    gathered from the blocks (as bytes where 8-bit), dequantized, then a masked SDPA."""
    t, total = q.shape[0], cached + q.shape[0]
    rows = cache.view(torch.uint8) if kv_quant.is_8bit(cache.dtype) else cache
    kv = rows.index_select(2, table).view(cache.dtype).view(2, HKV, -1, cache.shape[-1])
    keys = kv_quant.as_values(kv[0, :, :total], q.dtype)
    values = kv_quant.as_values(kv[1, :, :total], q.dtype)
    mask = torch.arange(total)[None, :] <= torch.arange(cached, total)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0),
                                          values.unsqueeze(0), attn_mask=mask, scale=SCALE,
                                          enable_gqa=True)


def _paths(q: torch.Tensor, plain: torch.Tensor, table: torch.Tensor, cached: int,
           k_new: torch.Tensor, v_new: torch.Tensor,
           kv8: torch.Tensor | None) -> dict[str, Callable[[], torch.Tensor | None]]:
    """Name -> callable for each path that runs here."""
    qh = q.transpose(0, 1).unsqueeze(0)

    def fresh() -> torch.Tensor:
        return F.scaled_dot_product_attention(qh, k_new.unsqueeze(0), v_new.unsqueeze(0),
                                              is_causal=True, scale=SCALE, enable_gqa=True)
    paths: dict[str, Callable[[], torch.Tensor | None]] = {
        "SDPA": fresh if cached == 0 else (lambda: _gathered_sdpa(q, plain, table, cached))}
    if paged_prefill_attention(q, plain, table, cached, SCALE) is not None:
        paths["kernel"] = lambda: paged_prefill_attention(q, plain, table, cached, SCALE)
    if kv8 is not None:
        paths["SDPA/8"] = lambda: _gathered_sdpa(q, kv8, table, cached)
        if paged_prefill_attention(q, kv8, table, cached, SCALE) is None:
            raise SystemExit("the 8-bit prefill kernel did not run")
        paths["kernel/8"] = lambda: paged_prefill_attention(q, kv8, table, cached, SCALE)
    return paths


def _case(dtype: torch.dtype, kv8_dtype: torch.dtype | None, t: int, cached: int,
          repeats: int, g: torch.Generator) -> str:
    total = cached + t
    plain = torch.randn(2, HKV, NUM_BLOCKS, BS, D, generator=g).to(dtype)
    table = torch.randperm(NUM_BLOCKS, generator=g)[:-(-total // BS)]
    q = torch.randn(t, 15, D, generator=g).to(dtype)[:, :H]  # a view, as in the model
    k_new = plain[0][:, table].reshape(HKV, -1, D)[:, cached:total]
    v_new = plain[1][:, table].reshape(HKV, -1, D)[:, cached:total]
    kv8 = None
    if kv8_dtype is not None:  # the same values, quantized (only the sequence's blocks)
        kv8 = torch.zeros(2, HKV, NUM_BLOCKS, BS, D + 4, dtype=torch.uint8)
        kv8[:, :, table] = kv_quant.quantize_rows(plain[:, :, table], kv8_dtype).view(torch.uint8)
        kv8 = kv8.view(kv8_dtype)
    paths = _paths(q, plain, table, cached, k_new, v_new, kv8)
    best = {name: float("inf") for name in paths}
    for _ in range(repeats):  # interleaved: a burst of load hits every path alike
        for name, fn in paths.items():
            best[name] = min(best[name], seconds_per_call(fn))
    ref = best.get("kernel/8", best.get("kernel", best["SDPA"]))
    figures = ", ".join(f"{n} {1e3 * s:7.2f} ms ({s / ref:4.2f}x)" for n, s in best.items())
    if kv8 is not None:
        ours, theirs = paths["kernel/8"](), paths["SDPA/8"]()
        assert ours is not None and theirs is not None
        diff = (ours.float() - theirs[0].transpose(0, 1).float()).abs().max()
        figures += f"; max |kernel/8 - SDPA/8| {float(diff):.1e}"
    return f"{str(dtype)[6:]:8s} T={t:4d} after {cached:4d} cached: {figures}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"])
    ap.add_argument("--lengths", nargs="+", type=int, default=None,
                    help="prompt lengths (fresh prompts) in place of the default cases")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="PyTorch's (and so the kernels') threads; default PyTorch's own")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    kv8_dtype = kv_quant.KV_8BIT_DTYPES.get(args.kv_cache_dtype)
    cases = CASES if args.lengths is None else tuple((t, 0) for t in args.lengths)
    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}; "
          f"kv cache {args.kv_cache_dtype}")
    g = torch.Generator().manual_seed(0)
    for name in args.dtypes:
        for t, cached in cases:
            print(_case(getattr(torch, name), kv8_dtype, t, cached, args.repeats, g), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
