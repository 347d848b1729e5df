"""Chunked prefill cost: one long prompt in chunks vs in one forward (issue 6).

Runs a ``--prompt-len`` prompt (default 2,048 tokens) through the engine with
``max_num_batched_tokens`` = the whole prompt (one forward) and = ``--chunk`` (default 512:
four forwards, each attending to the blocks cached by the ones before), interleaved,
``--repeats`` times, and reports prefill tokens/s and the chunked / unchunked time ratio.
The issue's target: within 1.25x.

    .venv/bin/python benchmarks/prefill_chunking.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from inflight.config import EngineConfig
from inflight.engine import Engine
from inflight.sampling_params import SamplingParams


def prefill_seconds(engine: Engine, ids: list[int], tag: str) -> float:
    """Wall time from adding the request to its first token (the whole prefill)."""
    engine.reset_prefix_cache()  # a cold cache: nothing of the prompt is reused
    t0 = time.perf_counter()
    engine.add_request(tag, ids, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n = args.prompt_len
    blocks = 2 * (n // 16 + 2)
    whole = Engine(EngineConfig(dtype=args.dtype, num_kv_blocks=blocks, max_num_batched_tokens=n))
    chunked = Engine(EngineConfig(dtype=args.dtype, num_kv_blocks=blocks,
                                  max_num_batched_tokens=args.chunk), runner=whole.runner,
                     tokenizer=whole.tokenizer, num_blocks=blocks,
                     max_model_len=whole.max_model_len, eos_token_ids=whole.eos_token_ids)
    ids = [(7919 * j) % 40000 + 100 for j in range(n)]
    prefill_seconds(whole, ids[:256], "warm-0")
    prefill_seconds(chunked, ids[:256], "warm-1")
    print(f"dtype {args.dtype}, {n}-token prompt, chunks of {args.chunk}, threads "
          f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    t_whole, t_chunked = [], []
    for r in range(args.repeats):
        t_whole.append(prefill_seconds(whole, ids, f"w{r}"))
        t_chunked.append(prefill_seconds(chunked, ids, f"c{r}"))
        print(f"[{r}] one forward {t_whole[-1]:.3f} s ({n / t_whole[-1]:.0f} tok/s), "
              f"{-(-n // args.chunk)} chunks {t_chunked[-1]:.3f} s ({n / t_chunked[-1]:.0f} tok/s), "
              f"ratio {t_chunked[-1] / t_whole[-1]:.2f}x", flush=True)
    mw, mc = statistics.median(t_whole), statistics.median(t_chunked)
    print(f"median: one forward {n / mw:.0f} tok/s, chunked {n / mc:.0f} tok/s, "
          f"chunked / one = {mc / mw:.2f}x; load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
