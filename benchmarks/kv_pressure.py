"""Serving under a small KV pool: the same requests through the offline engine with each
``--kv-cache-dtype`` at a pool size that holds the same bytes (issue 32).

Requests: the Mooncake conversation trace's first ``--num-requests`` rows, prompt and output
lengths scaled by ``--length-scale`` (prompts of vLLM's sonnet text, capped at
``--max-input-len``; ``ignore_eos`` so every request makes its output length), all submitted
at once (``LLM.generate``), as a saturated server sees them. Reports output tokens per
second, preemptions per request and the pool's tokens, per configuration, repeats
interleaved.

    .venv/bin/python benchmarks/kv_pressure.py --configs auto:64M int8:32M
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inflight.entrypoints.llm import LLM  # noqa: E402
from inflight.sampling_params import SamplingParams  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def requests(tokenizer, n, scale, max_in, max_out):
    text = tokenizer.encode((DATA / "vllm_sonnet.txt").read_text(), add_special_tokens=False)
    rows = [json.loads(line) for line in
            (DATA / "mooncake_conversation_0-30min.jsonl").read_text().splitlines()[:n]]
    out = []
    for i, row in enumerate(rows):
        length = max(8, min(max_in, round(row["input_length"] * scale)))
        start = (i * 97) % (len(text) - length)
        out.append((text[start:start + length],
                    max(1, min(max_out, round(row["output_length"] * scale)))))
    return out


def run(config, reqs):
    kv, budget = config.split(":")
    mib = int(budget.rstrip("M"))
    llm = LLM(kv_cache_dtype=kv, kv_cache_memory_bytes=mib * 2**20, enable_prefix_caching=False)
    engine = llm.engine
    prompts = [p for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    before = engine.scheduler.num_preemptions
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": tokens / seconds, "preemptions_per_request":
            (engine.scheduler.num_preemptions - before) / len(reqs),
            "pool_tokens": engine.kv_cache.num_blocks * engine.kv_cache.block_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["auto:64M", "int8:32M"],
                    help="kv_cache_dtype:MiB of kv_cache_memory_bytes, e.g. int8:32M")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--length-scale", type=float, default=0.03125)
    ap.add_argument("--max-input-len", type=int, default=512)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    first = LLM(num_kv_blocks=1, max_model_len=16)
    reqs = requests(first.get_tokenizer(), args.num_requests, args.length_scale,
                    args.max_input_len, args.max_output_len)
    del first
    print(f"{len(reqs)} requests: prompts {sum(len(p) for p, _ in reqs)} tokens "
          f"(max {max(len(p) for p, _ in reqs)}), outputs {sum(m for _, m in reqs)} tokens; "
          f"load average before {os.getloadavg()[0]:.2f}", flush=True)
    results = {c: [] for c in args.configs}
    for r in range(args.repeats):
        for c in (args.configs if r % 2 == 0 else args.configs[::-1]):
            results[c].append(run(c, reqs))
            print(f"  repeat {r} {c}: {results[c][-1]}", flush=True)
    base = statistics.median(x["tok_s"] for x in results[args.configs[0]])
    for c, xs in results.items():
        tok = [x["tok_s"] for x in xs]
        print(f"{c:12s} pool {xs[0]['pool_tokens']:6d} tokens  output {statistics.median(tok):6.1f} "
              f"tok/s [{min(tok):.1f}-{max(tok):.1f}] ({statistics.median(tok) / base:.2f}x)  "
              f"preemptions/request {statistics.median(x['preemptions_per_request'] for x in xs):.2f}")
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
