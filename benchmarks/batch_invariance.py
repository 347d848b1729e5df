"""The cost of batch invariance (issue 34): the default mode's kernels against the rules before
it, side by side in one process, interleaved (ABAB...), at 1 / 8 / 32 streams and on a mix.

Batch-invariant (the default): a generated token's rows take the row kernels (skinny or
int8) at any count, a prompt's rows oneDNN's GEMM, prompt attention the kernels that read
keys in tiles from position 0. Before: a dense Linear sent a call's rows to the skinny
kernel up to ``kernels.skinny_max_rows`` rows and to oneDNN above, generated or not, and a
cache in the model's dtype without the AVX-512 prefill kernel went to PyTorch's SDPA
(``linear.BATCH_INVARIANT`` and ``kernels.PORTABLE_PREFILL_PLAIN`` off).

Workloads (``LLM.generate``, greedy, EOS ignored, random prompt ids, fresh per run so no
prefix-cache hit): ``N streams``: N requests of ``--input-len`` / ``--output-len`` at once,
at once; ``prefill``: 8 prompts of ``--prefill-len`` tokens, one output token each, rated
in prompt tokens a second (the prompt GEMM's share, issue 50); ``mix``: the first ``--mix-requests`` of the Azure conversation trace
(prompts capped at 512, outputs at 256), 32 running at most, so prompts keep joining
running decodes. Prints each run's output tok/s, the medians and the ratio, and the load
average before each run.

    .venv/bin/python benchmarks/batch_invariance.py --repeats 3
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import statistics
import time

import inflight.model.kernels as kernels
import inflight.model.linear as linear
from inflight.bench.datasets import default_data_dir
from inflight.entrypoints.llm import LLM
from inflight.sampling_params import SamplingParams


def set_mode(invariant: bool) -> None:
    linear.BATCH_INVARIANT = invariant
    kernels.PORTABLE_PREFILL_PLAIN = invariant


def workload(name: str, args: argparse.Namespace, rng: random.Random, vocab: int
             ) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths)."""
    if name == "prefill":
        lens = [(args.prefill_len, 1)] * 8
    elif name == "mix":
        with open(default_data_dir() / "azure_llm_2023_conv_1815-1900.csv") as f:
            rows = list(csv.DictReader(f))[:args.mix_requests]
        lens = [(min(int(r["ContextTokens"]), 512), min(int(r["GeneratedTokens"]), 256))
                for r in rows]
    else:
        lens = [(args.input_len, args.output_len)] * int(name)
    prompts = [[rng.randrange(100, vocab) for _ in range(max(1, i))] for i, _ in lens]
    return prompts, [max(1, o) for _, o in lens]


def run_once(llm: LLM, prompts: list[list[int]], outs: list[int], prefill: bool = False) -> float:
    """Output tokens per second of one ``generate`` over the workload (``--max-num-seqs``
    32: N streams are N requests at once); with ``prefill``, prompt tokens per second."""
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
    t = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    if prefill:
        return sum(len(p) for p in prompts) / dt
    return sum(len(r.outputs[0].token_ids) for r in results) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["prefill", "1", "8", "32", "mix"])
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--mix-requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    llm = LLM(max_num_seqs=32)
    vocab = llm.get_tokenizer().vocab_size
    cfg = llm.engine.config
    print(f"dtype {cfg.dtype}, quantization {cfg.quantization}, cores {os.cpu_count()}")
    rng = random.Random(args.seed)
    rates: dict[tuple[str, bool], list[float]] = {}
    run_once(llm, *workload("8", args, rng, vocab))  # warm-up: kernels built, pages touched
    for r in range(args.repeats):
        for name in args.workloads:
            order = [True, False] if r % 2 == 0 else [False, True]
            for invariant in order:
                set_mode(invariant)
                load = os.getloadavg()[0]
                rate = run_once(llm, *workload(name, args, rng, vocab), prefill=name == "prefill")
                rates.setdefault((name, invariant), []).append(rate)
                print(f"repeat {r + 1} {name:>4s} {'invariant' if invariant else 'before':9s} "
                      f"{rate:8.1f} tok/s  (load average {load:.2f})", flush=True)
    set_mode(True)
    print("\nworkload: invariant tok/s (runs) | before | invariant / before (median; range)")
    for name in args.workloads:
        a, b = rates[(name, True)], rates[(name, False)]
        ratios = [x / y for x, y in zip(a, b)]
        print(f"{name:>4s}: {' '.join(f'{x:.1f}' for x in a)} | {' '.join(f'{x:.1f}' for x in b)}"
              f" | {statistics.median(a) / statistics.median(b):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
