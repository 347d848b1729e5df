"""Decode at long context over an 8-bit KV cache against the model's own dtype (issue 32).

Times, side by side and interleaved, for each ``--kv-cache-dtypes`` value:
- ``attention``: the native decode-attention kernel alone, one layer, ``--batch`` sequences
  of ``--context`` keys each (the bundled model's 9 query / 3 KV heads of 64);
- ``step``: the whole model's decode step of ``--batch`` rows at that context (the runner's
  path: per-module, or the one-call C stack where it takes the rows).
The caches are filled with random keys and values through the real write path (the rows'
content does not change the work); blocks are scattered as a pool's would be after churn.
Milliseconds: median over ``--calls`` calls per round, rounds interleaved over the dtypes,
the median and spread of the rounds reported.

    .venv/bin/python benchmarks/kv_cache_8bit.py --dtype float32 --kv-cache-dtypes auto,int8,fp8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inflight.config import EngineConfig  # noqa: E402
from inflight.engine.loading import load  # noqa: E402
from inflight.model import kv_quant  # noqa: E402
from inflight.model.attention import AttentionMetadata, write_kv  # noqa: E402
from inflight.model.kernels import paged_decode_attention  # noqa: E402
from inflight.model.placement import resolve_kv_cache_dtype  # noqa: E402

BS = 16


def filled_caches(config, kv_dtype, tables, context, gen):
    """One cache per layer holding ``context`` random keys/values for each table's sequence."""
    num_blocks = int(tables.max()) + 1
    shape = (2, config.num_key_value_heads, num_blocks, BS,
             kv_quant.row_width(config.head_dim, kv_dtype))
    slots = torch.cat([row[torch.arange(context) // BS] * BS + torch.arange(context) % BS
                       for row in tables])
    caches = []
    for _ in range(config.num_hidden_layers):
        cache = torch.zeros(shape, dtype=kv_dtype)
        k = torch.randn(len(slots), config.num_key_value_heads, config.head_dim, generator=gen)
        write_kv(cache, k, torch.randn(k.shape, generator=gen), slots)
        caches.append(cache)
    return caches


def timed(fn, calls):
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", help="the model's dtype (--dtype)")
    ap.add_argument("--kv-cache-dtypes", default="auto,int8,fp8")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    loaded = load(EngineConfig(dtype=args.dtype, num_kv_blocks=1, max_model_len=16))
    model = loaded.runner.model
    c, gen = model.config, torch.Generator().manual_seed(0)
    per = -(-(args.context + 1) // BS)
    tables = torch.randperm(args.batch * per, generator=gen).view(args.batch, per)
    names = args.kv_cache_dtypes.split(",")
    setups = {}
    for name in names:
        kv_dtype = resolve_kv_cache_dtype(name, model.dtype, model.device)
        caches = filled_caches(c, kv_dtype, tables, args.context, gen)
        q = torch.randn(args.batch, c.num_attention_heads, c.head_dim, generator=gen).to(model.dtype)
        lens = torch.full((args.batch,), args.context + 1)
        meta = AttentionMetadata(
            slot_mapping=tables[:, args.context // BS] * BS + args.context % BS,
            num_decodes=args.batch, num_generated=args.batch, decode_block_tables=tables,
            decode_seq_lens=lens)
        ids, pos = torch.randint(0, 1000, (args.batch,), generator=gen), lens - 1

        def attention(q=q, cache=caches[0], lens=lens):
            assert paged_decode_attention(q, cache, tables, lens, c.head_dim ** -0.5) is not None

        def step(ids=ids, pos=pos, caches=caches, meta=meta):
            with torch.inference_mode():
                model(ids, pos, caches, meta)
        setups[name] = (kv_quant.dtype_name(kv_dtype), attention, step,
                        sum(x.numel() * x.element_size() for x in caches))
    results = {name: {"attention": [], "step": []} for name in names}
    for _ in range(args.rounds):
        for name in names:
            _, attention, step, _ = setups[name]
            results[name]["attention"].append(timed(attention, args.calls))
            results[name]["step"].append(timed(step, args.calls))
    load_avg = os.getloadavg()
    print(f"model {model.dtype}, {args.batch} sequences x {args.context} keys, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds x {args.calls} calls "
          f"(median per round), load average {load_avg[0]:.2f} {load_avg[1]:.2f}")
    base = names[0]
    for name in names:
        label, _, _, nbytes = setups[name]
        cells = []
        for part in ("attention", "step"):
            xs = results[name][part]
            ratio = statistics.median(xs) / statistics.median(results[base][part])
            cells.append(f"{part} {statistics.median(xs):7.2f} ms [{min(xs):.2f}-{max(xs):.2f}] "
                         f"({ratio:.2f}x {base})")
        print(f"  KV {label:9s} {nbytes / 2**20:7.1f} MiB  " + "  ".join(cells))


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
