"""A quantized model's memory against its file, and what the prompt GEMM's copy buys (issue 53).

For each mode (``--repack`` on and off: ``--no-repack`` keeps the blocks alone), a fresh
process loads the model with ``LLM``, then reports:

- the bytes its weights hold (``LlamaForCausalLM.weight_bytes``: blocks, dense, packed copy)
  against the GGUF file's size;
- the anonymous resident memory (``RssAnon``) that loading the model and its tokenizer
  adds to the process, after ``malloc_trim`` (no KV cache yet; the tokenizer included: a
  model is not served without);
- prefill throughput: ``--prompts`` prompts of ``--prompt-len`` tokens, one output token
  each (TTFT-bound work), and decode throughput at one stream (``--decode-tokens``).

Modes alternate within each repeat, so a noisy neighbour hits both alike. Prints the host
first (``_runs.record_host``) and one JSON line a run; the summary gives each figure's
median and range over the repeats.

    .venv/bin/python benchmarks/weight_memory.py --model gemma3-270m --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._runs import record_host  # noqa: E402


def _rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def one_run(model: str, repack: bool, prompt_len: int, prompts: int, decode_tokens: int) -> dict:
    """Load and time one mode in this process (the child's side)."""
    import time

    import torch

    from inflight import LLM, SamplingParams
    from inflight.engine.memory import trim_heap
    from inflight.model.placement import resolve_model_path

    from inflight.engine.loading import load_model_and_tokenizer

    torch.tensor([1.0]) @ torch.tensor([1.0])  # torch's own start-up is not the model's
    path = resolve_model_path(model)
    before = _rss_anon_mib()
    _, loaded, tokenizer = load_model_and_tokenizer(path, torch.bfloat16, torch.device("cpu"),
                                                    "gguf", repack)
    trim_heap()
    after = _rss_anon_mib()
    held = loaded.weight_bytes()
    del loaded, tokenizer
    llm = LLM(model=model, repack=repack, num_kv_blocks=320, max_model_len=2048,
              dtype="bfloat16", quantization="gguf", enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    batch = [[1000 + (7 * i + j) % 20000 for j in range(prompt_len)] for i in range(prompts)]
    llm.generate([[3] * prompt_len], greedy, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate(batch, greedy, use_tqdm=False)
    prefill = prompts * prompt_len / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=decode_tokens,
                                             ignore_eos=True), use_tqdm=False)
    decode = decode_tokens / (time.perf_counter() - t0)
    return {"repack": repack, "file_mib": path.stat().st_size / 2**20,
            **{f"{k}_mib": v / 2**20 for k, v in held.items()},
            "rss_anon_delta_mib": after - before,
            "prefill_tok_s": prefill,
            "decode_tok_s": decode}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--child", choices=["repack", "no-repack"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(one_run(a.model, a.child == "repack", a.prompt_len, a.prompts,
                                 a.decode_tokens)), flush=True)
        return
    record_host()
    runs: dict[str, list[dict]] = {"repack": [], "no-repack": []}
    for _ in range(a.repeats):
        for mode in runs:
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--model", a.model,
                                  "--prompt-len", str(a.prompt_len), "--prompts", str(a.prompts),
                                  "--decode-tokens", str(a.decode_tokens)],
                                 capture_output=True, text=True, check=True, timeout=900)
            run = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps(run), flush=True)
            runs[mode].append(run)
    for mode, rs in runs.items():
        summary = {k: (round(statistics.median(r[k] for r in rs), 1),
                       round(min(r[k] for r in rs), 1), round(max(r[k] for r in rs), 1))
                   for k in rs[0] if k != "repack"}
        print(f"{mode} (median, min, max over {len(rs)}): {json.dumps(summary)}", flush=True)


if __name__ == "__main__":
    main()
