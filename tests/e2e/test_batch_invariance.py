"""Batch invariance in the default mode (issue 34): a prompt's greedy tokens, and the logprobs
of every sampled token to the bit, are the same alone, in a batch of more decodes than the
skinny kernel's register block, in prefill chunks, in steps that mix its decodes with other
prompts' chunks, after a prefix-cache hit and after preemption.

Why they can be equal (``model/linear.py``, ``GENERATED_ROWS``): a generated token's rows take
the row kernels and a prompt's rows the GEMM, whatever the step holds; each reduces a row
alone; prompt attention reads keys in tiles from position 0 whatever the chunk; an output
token recomputed after a preemption is a decode row again (``core.output.split_rows``).
The engine is built as ``LLM()`` builds it by default on this host (``--dtype auto
--quantization auto``), so the test holds the mode users get.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inflight.config import EngineConfig
from inflight.engine import Engine
from inflight.entrypoints.llm import LLM
from inflight.runner import ModelRunner
from inflight.sampler import Sampler
from inflight.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "mt_bench_questions.jsonl"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=128)


@pytest.fixture(scope="module")
def prompts(llm):
    """12 held-out MT-Bench questions as token ids (18-100 tokens)."""
    tok = llm.get_tokenizer()
    turns = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()]
    ids = [tok.encode(t) for t in turns[40:]]
    return [p for p in ids if 18 <= len(p) <= 100][:12]


def engine_of(llm, num_blocks=128, **knobs):
    """A fresh engine over the LLM's weights, in its configuration, with ``knobs``."""
    loaded = llm.engine
    cfg = EngineConfig(dtype=loaded.config.dtype, quantization=loaded.config.quantization,
                       **knobs)
    runner = ModelRunner(loaded.runner.model, num_blocks, cfg.block_size,
                         loaded.runner.kv_caches[0].dtype, Sampler())
    return Engine(cfg, runner=runner, tokenizer=loaded.tokenizer, num_blocks=num_blocks,
                  max_model_len=loaded.max_model_len, eos_token_ids=loaded.eos_token_ids)


def run(engine, prompts, stagger=False):
    """(token ids, logprobs of the sampled tokens) per prompt, in order; with ``stagger`` one
    prompt arrives per step, so prompt chunks share steps with earlier prompts' decodes."""
    base = engine.get_stats().num_steps
    outs = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"{base}-{i}", p, GREEDY)
        if stagger:
            outs.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    result = []
    for i in range(len(prompts)):
        c = outs[f"{base}-{i}"].outputs[0]
        result.append((c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]))
    return result


@pytest.fixture(scope="module")
def alone(llm, prompts):
    return [run(engine_of(llm), [p])[0] for p in prompts]


def test_batched_with_more_decodes_than_a_register_block(llm, prompts, alone):
    assert len(prompts) == 12 and all(len(t) == 12 for t, _ in alone)
    assert run(engine_of(llm), prompts) == alone


def test_cut_into_chunks_and_mixed_with_decodes(llm, prompts, alone):
    assert [run(engine_of(llm, max_num_batched_tokens=16), [p])[0] for p in prompts] == alone
    assert run(engine_of(llm, max_num_batched_tokens=48), prompts, stagger=True) == alone


def test_after_a_prefix_cache_hit(llm, prompts, alone):
    cached = engine_of(llm, enable_prefix_caching=True)
    run(cached, prompts)
    hits = cached.kv_cache.prefix_cache_hits
    assert [run(cached, [p])[0] for p in prompts] == alone
    assert cached.kv_cache.prefix_cache_hits - hits >= 16 * len(prompts)  # a block or more each


def test_after_preemption(llm, prompts, alone):
    small = engine_of(llm, num_blocks=24)  # 12 prompts of 2-8 blocks: preempted and recomputed
    assert run(small, prompts) == alone
    assert small.get_stats().num_preemptions > 0
