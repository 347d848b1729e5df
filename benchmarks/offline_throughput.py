"""Offline throughput: inflight's ``LLM.generate`` vs HF transformers' static ``generate``.

The same requests go through both, in one run, interleaved per dtype:
- inflight: all requests at once, continuous batching (``--max-num-seqs``);
- HF: static batches of ``--hf-batch-size`` in arrival order; a batch runs until its longest
  member is done, and only each request's own target tokens count.

Workloads: ``uniform`` (``--input-len`` / ``--output-len`` for every request) or ``azure``
(prompt/output lengths from the Azure LLM 2023 conversation trace in ../shared/data,
capped at ``--max-input-len`` / ``--max-output-len``). EOS is ignored, so output lengths
are exactly the targets.

    .venv/bin/python benchmarks/offline_throughput.py --num-requests 64 --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import time
from pathlib import Path

import torch

from inflight.bench.datasets import default_data_dir

DATA = default_data_dir()  # $INFLIGHT_DATA_DIR, else ../shared/data


def make_workload(args, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    if args.dataset == "uniform":
        lengths = [(args.input_len, args.output_len)] * args.num_requests
    else:
        with open(DATA / "azure_llm_2023_conv_1815-1900.csv") as f:
            rows = list(csv.DictReader(f))[:args.num_requests]
        lengths = [(max(1, min(int(r["ContextTokens"]), args.max_input_len)),
                    max(1, min(int(r["GeneratedTokens"]), args.max_output_len))) for r in rows]
    # Random ids from the ordinary-token range (skip the first 100 special/control ids).
    return [([rng.randrange(100, vocab_size) for _ in range(n_in)], n_out) for n_in, n_out in lengths]


def run_inflight(workload, dtype: str, args) -> float:
    from inflight import LLM, SamplingParams

    llm = LLM(dtype=dtype, device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              step_breakdown=args.step_breakdown,
              **({"num_threads": args.num_threads} if args.num_threads else {}))
    prompts = [p for p, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    llm.engine.step_timer.records.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(n for _, n in workload), "inflight produced the wrong token count"
    if args.step_breakdown:
        print_breakdown(llm.engine.step_timer, elapsed)
    del llm
    return produced / elapsed


def print_breakdown(timer, elapsed: float) -> None:
    """Mean step phases of the measured run (``timer`` cleared after the warm-up), for all
    steps, steps with prefill work (mixed) and pure decode steps."""
    from inflight.profiling import StepTimer

    records = list(timer.records)
    groups = {"all": records, "mixed": [r for r in records if r.num_tokens > r.num_seqs],
              "pure decode": [r for r in records if r.num_tokens == r.num_seqs]}
    print(f"  inflight step breakdown, {elapsed:.1f} s measured:")
    for name, rs in groups.items():
        if rs:
            print(f"    {name:11s} {sum(r.total for r in rs):6.1f} s: "
                  + StepTimer.format(timer.summary(rs)))


def run_hf(workload, dtype: str, args, hf_model) -> float:
    dev = "cuda" if args.device == "cuda" else "cpu"
    model = hf_model.to(device=dev, dtype=getattr(torch, dtype))
    pad = 0
    t0 = time.perf_counter()
    useful = 0
    for i in range(0, len(workload), args.hf_batch_size):
        batch = workload[i:i + args.hf_batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=dev)
        longest = max(n for _, n in batch)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest,
                           min_new_tokens=longest, do_sample=False, pad_token_id=pad)
        useful += sum(n for _, n in batch)
    if dev == "cuda":
        torch.cuda.synchronize()
    return useful / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", choices=["uniform", "azure"], default="uniform")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-input-len", type=int, default=512)
    ap.add_argument("--max-output-len", type=int, default=256)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--num-threads", type=int, default=None, help="inflight's torch threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--step-breakdown", action="store_true",
                    help="time inflight's step phases and print them for mixed and pure decode "
                         "steps (adds a sync per phase; decode steps of 1-2 tokens then take "
                         "the module path)")
    args = ap.parse_args()

    import transformers
    from inflight.model.bundled import find_bundled_model

    path = find_bundled_model()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    workload = make_workload(args, hf_model.config.vocab_size)
    n_in = sum(len(p) for p, _ in workload)
    n_out = sum(n for _, n in workload)
    print(f"{args.dataset}: {len(workload)} requests, {n_in} prompt / {n_out} output tokens, "
          f"torch threads {torch.get_num_threads()}")
    results = []
    for rep in range(args.repeats):
        for dtype in args.dtypes:  # interleaved: each pair measured back to back
            ours = run_inflight(workload, dtype, args)
            hf = run_hf(workload, dtype, args, hf_model)
            results.append({"repeat": rep, "dtype": dtype, "inflight_tok_s": ours,
                            "hf_static_tok_s": hf, "ratio": ours / hf})
            print(f"[{rep}] {dtype:9s} inflight {ours:7.1f} out tok/s | HF static "
                  f"(batch {args.hf_batch_size}) {hf:7.1f} out tok/s | ratio {ours / hf:.2f}x",
                  flush=True)
    if args.save:
        args.save.write_text(json.dumps({"args": vars(args) | {"save": str(args.save)},
                                         "results": results}, indent=2))


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
