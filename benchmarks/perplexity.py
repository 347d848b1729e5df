"""Perplexity of a text under inflight's model, scored as llama.cpp's ``llama-perplexity``
scores it, optionally beside ``llama-perplexity`` itself on the same GGUF (issue 17:
quantized weights within 1 % of llama.cpp's perplexity).

llama.cpp's method (tools/perplexity/perplexity.cpp): tokenize the whole text, cut it into
chunks of ``--ctx`` tokens (the first set to BOS where the vocabulary adds one), and score
in each chunk the predictions of tokens ``ctx/2 + 1 .. ctx - 1``, each given everything
before it in the chunk; perplexity = exp(mean negative log-likelihood).

Two ways through inflight, both over the real engine:
- ``prompt``: each chunk's first ``ctx/2`` tokens as a prompt, then teacher-forced decode
  steps over the rest (every chunk at once, so decode steps carry as many rows as chunks):
  the scored tokens go through the path that serves generated tokens, with
  ``--quantization`` the block-quantized one;
- ``prefill``: the whole chunk as a prompt, scored from its prefill logits (the path every
  prompt takes: the dense weights where oneDNN has AMX, else the blocks; llama.py).

    .venv/bin/python benchmarks/perplexity.py --model smollm2-q4_0.gguf --quantization gguf \\
        --llama-perplexity ~/llama.cpp/build/bin/llama-perplexity
"""

from __future__ import annotations

import argparse
import math
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from inflight.config import EngineConfig  # noqa: E402
from inflight.core.output import SampleResult  # noqa: E402
from inflight.engine import Engine  # noqa: E402
from inflight.model.placement import resolve_kv_cache_dtype  # noqa: E402
from inflight.runner import ModelRunner  # noqa: E402
from inflight.sampling_params import SamplingParams  # noqa: E402


class ScoringRunner(ModelRunner):
    """Feeds each request its chunk's next token (teacher forcing) and keeps the log
    probability the model gave it."""

    def __init__(self, model, *args, chunks: dict[str, list[int]], **kwargs) -> None:
        super().__init__(model, *args, **kwargs)
        self.chunks = chunks
        self.nll: dict[tuple[str, int], float] = {}
        self.top1: dict[tuple[str, int], int] = {}

    def execute(self, out):
        logits, requests, _ = self.compute_logits(out)
        results = []
        for row, req in enumerate(requests):
            pos = req.num_tokens - 1
            chunk = self.chunks[req.request_id]
            logp = torch.log_softmax(logits[row].float(), dim=-1)
            self.nll[(req.request_id, pos)] = -float(logp[chunk[pos + 1]])
            self.top1[(req.request_id, pos)] = int(logp.argmax())
            results.append(SampleResult(req, chunk[pos + 1], None))
        return results


def chunks_of(tokens: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    out = []
    for i in range(len(tokens) // ctx):
        c = tokens[i * ctx:(i + 1) * ctx]
        if bos is not None:
            c[0] = bos
        out.append(c)
    return out


def score_prompt(engine: Engine, runner: ScoringRunner, chunks: list[list[int]]) -> float:
    """Mean NLL of tokens ctx/2 + 1 .. ctx - 1, decoded teacher-forced."""
    ctx = len(chunks[0])
    first = ctx // 2
    for i, c in enumerate(chunks):
        engine.add_request(str(i), c[:first + 1], SamplingParams(
            temperature=0, max_tokens=ctx - first - 1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    scored = [runner.nll[(str(i), p)] for i in range(len(chunks)) for p in range(first, ctx - 1)]
    return sum(scored) / len(scored)


def score_prefill(model, chunks: list[list[int]]) -> float:
    """Mean NLL of the same tokens from each whole chunk's prefill logits (the prompt path;
    one chunk at a time, through the model's own paged forward)."""
    from inflight.model.attention import AttentionMetadata, PrefillChunk

    ctx, first = len(chunks[0]), len(chunks[0]) // 2
    bs = 16
    blocks = -(-ctx // bs)
    c = model.config
    caches = [torch.zeros(2, c.num_key_value_heads, blocks, bs, c.head_dim, dtype=model.dtype)
              for _ in range(c.num_hidden_layers)]
    table = torch.arange(blocks)
    total, n = 0.0, 0
    for chunk in chunks:
        meta = AttentionMetadata(slot_mapping=torch.arange(ctx),
                                 prefills=[PrefillChunk(q_start=0, q_end=ctx, num_computed=0,
                                                        block_table=table)])
        with torch.inference_mode():
            hidden = model(torch.tensor(chunk), torch.arange(ctx), caches, meta)
            logp = torch.log_softmax(model.compute_logits(hidden[first:ctx - 1]), dim=-1)
        target = torch.tensor(chunk[first + 1:])
        total += -float(logp.gather(1, target[:, None]).sum())
        n += len(target)
    return total / n


def llama_cpp(binary: str, model: str, text: str, ctx: int, threads: int,
              logits_file: str, cache_type: str = "f16") -> float:
    """llama-perplexity's final estimate; its tokens and log-probabilities are saved to
    ``logits_file`` (``--kl-divergence-base``). ``cache_type`` is its ``-ctk`` / ``-ctv``
    (``f16``, ``q8_0``, ...); flash attention is on for every type, since llama.cpp needs it
    for a quantized V cache and the types are compared on one attention path."""
    out = subprocess.run([binary, "-m", model, "-f", text, "-c", str(ctx), "-b", str(ctx),
                          "-t", str(threads), "--kl-divergence-base", logits_file,
                          "-ctk", cache_type, "-ctv", cache_type, "-fa", "on"],
                         capture_output=True, text=True, timeout=3600)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if m is None:
        raise RuntimeError(f"llama-perplexity gave no estimate:\n{(out.stdout + out.stderr)[-3000:]}")
    return float(m.group(1))


def read_llama_logits(path: str) -> tuple[list[list[int]], list[list[int]]]:
    """(chunks of tokens, per chunk the top-1 token at each scored position) from a
    ``--kl-divergence-base`` file: ``_logits_``, int32 n_ctx, n_vocab, n_chunk, the tokens,
    then per chunk and scored position two floats and n_vocab uint16 scaled log-probs
    (tools/perplexity/perplexity.cpp)."""
    import numpy as np

    raw = pathlib.Path(path).read_bytes()
    if raw[:8] != b"_logits_":
        raise ValueError(f"{path}: not a llama-perplexity logits file")
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw, np.int32, 3, 8)
    tokens = np.frombuffer(raw, np.int32, n_chunk * n_ctx, 20).reshape(n_chunk, n_ctx)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    n_token = n_ctx - 1 - n_ctx // 2
    probs = np.frombuffer(raw, np.uint16, n_chunk * n_token * nv, 20 + 4 * n_chunk * n_ctx)
    top = probs.reshape(n_chunk, n_token, nv)[:, :, 4:4 + n_vocab].argmax(axis=2)
    return tokens.tolist(), top.tolist()


def llama_cache_types(args: argparse.Namespace, path: str):
    """Runs llama-perplexity once per ``--llama-cache-types`` entry and prints each; returns
    the first run's (PPL, seconds, chunks of tokens, top-1 per scored position)."""
    first = None
    for cache_type in args.llama_cache_types.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            ppl = llama_cpp(args.llama_perplexity, path, args.text, args.ctx, args.threads,
                            f"{tmp}/logits.bin", cache_type)
            seconds = time.perf_counter() - t
            chunks, top = read_llama_logits(f"{tmp}/logits.bin")
        line = f"llama.cpp llama-perplexity, KV cache {cache_type}: PPL = {ppl:.4f} ({seconds:.1f} s)"
        if first is None:
            first = (cache_type, ppl, seconds, chunks, top)
        else:
            same = sum(a == b for r0, r1 in zip(first[4], top) for a, b in zip(r0, r1))
            total = sum(len(r) for r in top)
            line += (f"; PPL / {first[0]} = {ppl / first[1]:.4f}, top-1 agreement with "
                     f"{first[0]} {same}/{total} = {100 * same / total:.2f} %")
        print(line, flush=True)
    assert first is not None
    return first[1], first[2], first[3], first[4]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF (default: the bundled model)")
    p.add_argument("--text", default=str(REPO.parent / "shared/data/vllm_sonnet.txt"))
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-dtypes", default="auto",
                   help="comma-separated --kv-cache-dtype values, each scored by the decoded "
                        "path; top-1 agreement is reported against the first")
    p.add_argument("--llama-perplexity", default=None, help="also run llama.cpp's on the same "
                   "GGUF and text")
    p.add_argument("--llama-cache-types", default="f16",
                   help="comma-separated llama.cpp -ctk/-ctv types (e.g. f16,q8_0); the first "
                        "run's tokens are scored by inflight, the others compared with it")
    args = p.parse_args()
    from inflight.engine.loading import load
    from inflight.model.gguf_file import read_gguf_metadata

    torch.set_num_threads(args.threads)
    config = EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                          num_kv_blocks=1, max_model_len=16)
    loaded = load(config)
    model, tokenizer = loaded.runner.model, loaded.tokenizer
    path = args.model or str(__import__("inflight.model.bundled", fromlist=["x"]).find_bundled_model())
    meta = read_gguf_metadata(path, lambda k: k.startswith("tokenizer.ggml.add_bos")
                              or k == "tokenizer.ggml.bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    bos = meta.get("tokenizer.ggml.bos_token_id") if add_bos else None
    llama_ppl = llama_top = None
    if args.llama_perplexity:  # llama.cpp first: its own tokens are then scored by both
        llama_ppl, seconds, llama_chunks, llama_top = llama_cache_types(args, path)
        tokens = [t for c in llama_chunks for t in c]
    else:
        tokens = tokenizer.encode(pathlib.Path(args.text).read_text(), add_special_tokens=False)
        tokens = ([bos] if add_bos else []) + tokens
    chunks = chunks_of(tokens, args.ctx, bos)
    if not chunks:
        raise SystemExit(f"{args.text}: {len(tokens)} tokens, fewer than one chunk of {args.ctx}")
    blocks = len(chunks) * (-(-args.ctx // 16) + 1)
    quant = sorted({m.quant.fmt.name for m in model.modules() if getattr(m, "quant", None)})
    print(f"{path}: {len(tokens)} tokens, {len(chunks)} chunks of {args.ctx}, scoring "
          f"{len(chunks) * (args.ctx - args.ctx // 2 - 1)} tokens; {model.dtype}, "
          f"quantized rows: {quant or 'none'}")
    first_run = None
    for kv_name in args.kv_cache_dtypes.split(","):
        kv_dtype = resolve_kv_cache_dtype(kv_name, model.dtype, model.device)
        runner = ScoringRunner(model, blocks, 16, kv_dtype, loaded.runner.sampler,
                               chunks={str(i): c for i, c in enumerate(chunks)})
        engine = Engine(EngineConfig(max_num_seqs=len(chunks)), runner=runner,
                        tokenizer=tokenizer, num_blocks=blocks, max_model_len=args.ctx + 16,
                        eos_token_ids=loaded.eos_token_ids)
        t = time.perf_counter()
        nll = score_prompt(engine, runner, chunks)
        line = (f"inflight, decoded (the generated-token path), KV cache {kv_name}: "
                f"PPL = {math.exp(nll):.4f} ({time.perf_counter() - t:.1f} s)")
        if first_run is None:
            first_run = (kv_name, nll, runner.top1)
        else:
            same = sum(runner.top1[k] == v for k, v in first_run[2].items())
            line += (f"; PPL / {first_run[0]} = {math.exp(nll - first_run[1]):.4f}, top-1 "
                     f"agreement with {first_run[0]} {same}/{len(first_run[2])} = "
                     f"{100 * same / len(first_run[2]):.2f} %")
        print(line, flush=True)
    if llama_top is not None:  # against the first KV cache dtype's run
        first, nll = args.ctx // 2, first_run[1]
        same = sum(first_run[2][(str(i), first + j)] == top
                   for i, row in enumerate(llama_top) for j, top in enumerate(row))
        total = sum(len(row) for row in llama_top)
        print(f"llama.cpp llama-perplexity: PPL = {llama_ppl:.4f} ({seconds:.1f} s); decoded "
              f"PPL / llama.cpp = {math.exp(nll) / llama_ppl:.4f}; top-1 agreement with "
              f"llama.cpp {same}/{total} = {100 * same / total:.1f} %", flush=True)
    t = time.perf_counter()
    nll = score_prefill(model, chunks)
    print(f"inflight, prefill (the prompt path, {'blocks' if model.quantized_prompts else 'dense'}): PPL = {math.exp(nll):.4f} "
          f"({time.perf_counter() - t:.1f} s)", flush=True)


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    main()
