"""Prefix caching on vs off, on two workloads that share prefixes, through the engine.

- ``mtbench``: the 80 MT-Bench questions as two-turn chats (../shared/data). Turn 1 for all,
  then turn 2 = turn 1 + its greedy answer + the second question, so turn 2 can reuse turn
  1's blocks. Requests arrive as a Poisson stream (``--rate`` per second).
- ``mooncake``: the Mooncake conversation trace (../shared/data). Each 512-token
  ``hash_id`` block becomes a fixed random block of ``512 / --scale`` tokens (the same id,
  the same tokens, so the trace's prefix sharing survives the scaling); lengths scaled by
  the same factor; arrivals replayed from the trace's timestamps, ``--time-scale`` times
  slower.

Requests are added to the engine when their arrival time comes while it steps, so TTFT
includes queueing. Each configuration runs in the same process on the same weights,
interleaved (on, off, on, off ...) with ``--repeats``.

    .venv/bin/python benchmarks/prefix_cache.py --workload mtbench --num-requests 40
    .venv/bin/python benchmarks/prefix_cache.py --workload mooncake --num-requests 120
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from inflight.bench.datasets import default_data_dir
from inflight.quantiles import percentile

DATA = default_data_dir()  # $INFLIGHT_DATA_DIR, else ../shared/data


def replay(engine, requests: list[tuple[float, list[int], object]]) -> dict:
    """Feed ``(arrival offset s, prompt ids, params)`` in real time; returns metrics."""
    t0 = time.monotonic()
    pending = sorted(requests, key=lambda r: r[0])
    outs, i = {}, 0
    stats0 = engine.get_stats()
    while i < len(pending) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while i < len(pending) and pending[i][0] <= now:
            engine.add_request(str(i), pending[i][1], pending[i][2], arrival_time=t0 + pending[i][0])
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, pending[i][0] - now)))
            continue
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    elapsed = time.monotonic() - t0
    stats = engine.get_stats()
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs.values()]
    gen = sum(len(o.outputs[0].token_ids) for o in outs.values())
    queries = stats.prefix_cache_queries - stats0.prefix_cache_queries
    hits = stats.prefix_cache_hits - stats0.prefix_cache_hits
    return {"requests": len(outs), "elapsed_s": elapsed, "output_tok_s": gen / elapsed,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "hit_rate": hits / queries if queries else 0.0,
            "prompt_tokens_computed": stats.prompt_tokens - stats0.prompt_tokens,
            "outputs": {k: o.outputs[0].token_ids for k, o in outs.items()}}


def mtbench_requests(tok, llm_engine_factory, args):
    from inflight.sampling_params import SamplingParams

    with open(DATA / "mt_bench_questions.jsonl") as f:
        questions = [json.loads(line) for line in f][:args.num_requests]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    # Turn-1 answers come from one unmeasured greedy pass, so both configurations replay
    # exactly the same turn-2 prompts.
    engine = llm_engine_factory(True)
    first = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}]),
                        add_special_tokens=False) for q in questions]
    for i, ids in enumerate(first):
        engine.add_request(str(i), ids, params)
    answers = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                answers[int(o.request_id)] = o.outputs[0].text
    rng = random.Random(args.seed)
    t, reqs = 0.0, []
    for i, q in enumerate(questions):
        conv = [{"role": "user", "content": q["turns"][0]}]
        t += rng.expovariate(args.rate)
        reqs.append((t, first[i], params))
        conv2 = conv + [{"role": "assistant", "content": answers[i]},
                        {"role": "user", "content": q["turns"][1]}]
        ids2 = tok.encode(tok.apply_chat_template(conv2), add_special_tokens=False)
        reqs.append((t + args.think_time, ids2, params))
    return reqs


def mooncake_requests(args, vocab: int):
    from inflight.sampling_params import SamplingParams

    rng = random.Random(args.seed)
    block = 512 // args.scale
    blocks: dict[int, list[int]] = {}
    reqs = []
    with open(DATA / "mooncake_conversation_0-30min.jsonl") as f:
        rows = [json.loads(line) for line in f][:args.num_requests]
    t_first = rows[0]["timestamp"]
    for r in rows:
        n_in = max(1, r["input_length"] // args.scale)
        ids: list[int] = []
        for h in r["hash_ids"]:
            if h not in blocks:
                blocks[h] = [rng.randrange(100, vocab) for _ in range(block)]
            ids += blocks[h]
        ids = ids[:min(n_in, args.max_input_len)]
        n_out = max(1, min(r["output_length"] // args.scale, args.max_tokens))
        reqs.append(((r["timestamp"] - t_first) / 1000 * args.time_scale, ids,
                     SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)))
    return reqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["mtbench", "mooncake"], default="mtbench")
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rate", type=float, default=2.0, help="mtbench: conversations per second")
    ap.add_argument("--think-time", type=float, default=2.0,
                    help="mtbench: seconds between a conversation's two turns")
    ap.add_argument("--scale", type=int, default=32, help="mooncake: length divisor")
    ap.add_argument("--time-scale", type=float, default=2.0, help="mooncake: time multiplier")
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", type=Path, default=None)
    args = ap.parse_args()

    from inflight.config import EngineConfig
    from inflight.engine import Engine
    from inflight.model.bundled import find_bundled_model
    from inflight.model.llama import LlamaForCausalLM
    from inflight.model.loader import load_model
    from inflight.runner import ModelRunner
    from inflight.sampler import Sampler
    from inflight.tokenizer import Tokenizer

    path = find_bundled_model()
    config, state = load_model(path)
    dtype = getattr(torch, args.dtype)
    model = LlamaForCausalLM(config, dtype=dtype)
    model.load_weights(state)
    tok = Tokenizer.from_gguf(path)
    num_blocks = 4096

    def make_engine(caching: bool):
        runner = ModelRunner(model, num_blocks, 16, dtype, Sampler())
        return Engine(EngineConfig(enable_prefix_caching=caching, max_num_seqs=64), runner=runner,
                      tokenizer=tok, num_blocks=num_blocks, max_model_len=8192,
                      eos_token_ids=tok.eos_token_ids)

    reqs = (mtbench_requests(tok, make_engine, args) if args.workload == "mtbench"
            else mooncake_requests(args, config.vocab_size))
    print(f"{args.workload}: {len(reqs)} requests, {sum(len(r[1]) for r in reqs)} prompt tokens, "
          f"threads {torch.get_num_threads()}, load average {__import__('os').getloadavg()[0]:.2f}")
    results = []
    for rep in range(args.repeats):
        for caching in (True, False):
            r = replay(make_engine(caching), reqs)
            outputs = r.pop("outputs")
            results.append({"repeat": rep, "prefix_caching": caching, **r})
            print(f"[{rep}] caching {'on ' if caching else 'off'}: hit rate {r['hit_rate']:.1%}, "
                  f"prompt tokens computed {r['prompt_tokens_computed']}, TTFT p50 "
                  f"{r['ttft_p50_s']:.2f} s p95 {r['ttft_p95_s']:.2f} s, "
                  f"{r['output_tok_s']:.1f} out tok/s, {r['elapsed_s']:.1f} s", flush=True)
            if caching:
                on_outputs = outputs
            else:
                same = sum(on_outputs[k] == v for k, v in outputs.items())
                print(f"    greedy outputs identical with and without caching: {same}/{len(outputs)}")
    if args.save:
        args.save.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "results": results}, indent=2))
    print(f"load average after: {__import__('os').getloadavg()[0]:.2f}")


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
