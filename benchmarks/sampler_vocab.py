"""What a sampling step costs at a large vocabulary (issue 52): Gemma 3's 262,144 tokens
against SmolLM2's 49,152, per thing a request may ask.

For each vocabulary and batch size, ``Sampler.sample`` over float32 logits for rows that all
ask the same thing. ``--logits model`` (default): the model's own next-token logits over real
text (MT-Bench questions from ``../shared/data``, greedy continuations; a language model's
distribution, whose nucleus is small); ``random``: N(0, 3^2) logits, a flat distribution
whose nucleus is most of the vocabulary (the worst case: the full sort). The cases: greedy; temperature; top-k 40; top-p
0.9; min-p 0.05; top-k 40 with top-p 0.9; 5 logprobs; greedy under a JSON-schema grammar
(xgrammar over the model's own tokenizer, so the bitmask covers the real vocabulary); and
one greedy row beside rows that ask for top-p (the greedy row must not pay for them). Best
and median of ``--repeats`` interleaved rounds, milliseconds a step; the LM head's own time
is ``benchmarks/quant_linear.py``'s ``lm_head`` shape.

    .venv/bin/python benchmarks/sampler_vocab.py --batch 1 8 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import torch

from inflight.model.bundled import find_bundled_model, find_gemma3_270m
from inflight.request import Request
from inflight.sampler import Sampler
from inflight.sampling_params import SamplingParams
from inflight.structured_output import GrammarCompiler, GrammarState, StructuredOutputsParams
from inflight.tokenizer import Tokenizer

CASES = {
    "greedy": dict(temperature=0),
    "temperature": dict(temperature=0.8),
    "top_k 40": dict(temperature=0.8, top_k=40),
    "top_p 0.9": dict(temperature=0.8, top_p=0.9),
    "min_p 0.05": dict(temperature=0.8, min_p=0.05),
    "top_k 40 + top_p 0.9": dict(temperature=0.8, top_k=40, top_p=0.9),
    "logprobs 5": dict(temperature=0, logprobs=5),
    "json grammar": dict(temperature=0),
    "1 greedy beside top_p": dict(temperature=0),
}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                            "age": {"type": "integer"}},
          "required": ["name", "age"]}


def requests_for(case: str, batch: int, tok: Tokenizer, compiler: GrammarCompiler | None,
                 ) -> list[Request]:
    out = []
    for i in range(batch):
        params = dict(CASES[case])
        if case == "1 greedy beside top_p" and i:
            params = dict(temperature=0.8, top_p=0.9)
        if case == "json grammar":
            spec = StructuredOutputsParams(json=SCHEMA)
            params["structured_outputs"] = spec
        r = Request(f"{case}-{i}", [1, 2, 3], SamplingParams(max_tokens=64, **params),
                    eos_token_ids=frozenset(tok.eos_token_ids))
        if case == "json grammar" and compiler is not None:
            r.grammar = GrammarState(compiler.compile(spec))
        out.append(r)
    return out


def model_logits(path: pathlib.Path, rows: int) -> torch.Tensor:
    """``[rows, vocab]`` next-token logits of the model at ``path`` along greedy continuations
    of MT-Bench questions (the logits its sampler saw)."""
    from inflight.config import EngineConfig
    from inflight.engine import Engine

    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=256, max_num_seqs=4))
    seen: list[torch.Tensor] = []
    real = engine.runner.sampler.sample

    def keep(logits: torch.Tensor, requests: list, *a: object) -> list:
        seen.extend(logits.clone())
        return real(logits, requests, *a)
    engine.runner.sampler.sample = keep  # type: ignore[method-assign]
    data = pathlib.Path(__file__).resolve().parents[2] / "shared/data/mt_bench_questions.jsonl"
    questions = [json.loads(line)["turns"][0] for line in data.read_text().splitlines()[:4]]
    for i, q in enumerate(questions):
        engine.add_request(str(i), engine.tokenizer.encode(q),
                           SamplingParams(temperature=0, max_tokens=-(-rows // len(questions))))
    while engine.has_unfinished_requests():
        engine.step()
    return torch.stack(seen[:rows])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--logits", choices=["model", "random"], default="model")
    args = p.parse_args()
    models = {"smollm2 (49,152)": find_bundled_model()}
    try:
        models["gemma3 (262,144)"] = find_gemma3_270m()
    except FileNotFoundError as e:
        print(f"skipping Gemma: {e}")
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}, "
          f"logits: {args.logits}")
    print("| vocabulary | batch | case | best ms | median ms |\n|---|---|---|---|---|")
    for name, path in models.items():
        tok = Tokenizer.from_gguf(path)
        compiler = GrammarCompiler(tok)
        vocab = tok.vocab_size
        g = torch.Generator().manual_seed(0)
        pool = (model_logits(path, max(args.batch)) if args.logits == "model"
                else torch.randn(max(args.batch), vocab, generator=g) * 3)
        for batch in args.batch:
            logits = pool[:batch, :vocab]
            times: dict[str, list[float]] = {c: [] for c in args.cases}
            for _ in range(args.repeats):  # rounds interleave the cases
                for case in args.cases:
                    reqs = requests_for(case, batch, tok, compiler)
                    sampler = Sampler()
                    t = time.perf_counter()
                    sampler.sample(logits.clone(), reqs)
                    times[case].append(time.perf_counter() - t)
            for case, ts in times.items():
                print(f"| {name} | {batch} | {case} | {1e3 * min(ts):.2f} | "
                      f"{1e3 * statistics.median(ts):.2f} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
