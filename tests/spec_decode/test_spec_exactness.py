"""Speculative decoding on the bundled model changes no greedy token: with n-gram drafts
(``num_speculative_tokens=4``, ``prompt_lookup_min=1``) every output equals the run
without, token for token, across batching, ``n``, stop strings, ``max_tokens``, logprobs,
prefix-cache hits, structured output, chunked prefill and preemption.

Float32 dense weights (``quantization="none"``): a verification row is a decode row of the
same model, so its logits equal the plain decode step's up to summation order, far below
the gaps between these prompts' top logits. One model load for the module; the engines
for the other knobs share its weights. The drafts are forced on
(``disable_by_batch_size``): the load-aware switch would skip them on a slow CPU, and the
point here is that verification keeps the tokens exact.
"""

from __future__ import annotations

import json

import pytest
import torch

from inflight.config import EngineConfig
from inflight.core.spec_config import SpeculativeConfig
from inflight.engine import Engine
from inflight.entrypoints.llm import LLM
from inflight.runner import ModelRunner
from inflight.sampler import Sampler
from inflight.sampling_params import SamplingParams
from inflight.structured_output import StructuredOutputsParams

pytestmark = pytest.mark.slow

SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                         disable_by_batch_size=64, min_acceptance_rate=0.0)
NUM_BLOCKS = 128

# Copy-heavy: code that repeats, so prompt lookup proposes long runs.
COPY = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n")
PROMPTS = [COPY, "The capital of France is", "Once upon a time, there was a little"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=2)


@pytest.fixture(scope="module")
def spec_llm():
    """The public path: ``LLM(speculative_config=...)`` loads the model and the proposer."""
    return LLM(speculative_config=SPEC, dtype="float32", quantization="none",
               num_kv_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def make_engine(spec_llm):
    """An engine over the spec LLM's weights: ``make_engine(speculative, num_blocks, **knobs)``."""
    loaded = spec_llm.engine

    def build(speculative, num_blocks=NUM_BLOCKS, **knobs):
        cfg = EngineConfig(dtype="float32", quantization="none", speculative_config=speculative,
                           **knobs)
        runner = ModelRunner(loaded.runner.model, num_blocks, cfg.block_size, torch.float32,
                             Sampler())
        return Engine(cfg, runner=runner, tokenizer=loaded.tokenizer, num_blocks=num_blocks,
                      max_model_len=loaded.max_model_len, eos_token_ids=loaded.eos_token_ids)
    return build


@pytest.fixture(scope="module")
def plain(make_engine):
    return make_engine(None)


def run(engine, prompts, params):
    """Add every prompt, step until idle; outputs in prompt order. Checks the pool after
    every step and that every block is back at the end."""
    base = engine.get_stats().num_steps
    for i, p in enumerate(prompts):
        engine.add_request(f"{base}-{i}", p, params[i] if isinstance(params, list) else params)
    outs = {}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        engine.kv_cache.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return [outs[f"{base}-{i}"] for i in range(len(prompts))]


def tokens(out):
    return [c.token_ids for c in out.outputs]


@pytest.fixture(scope="module")
def reference(plain):
    """The three prompts' greedy outputs without speculation, batched."""
    return run(plain, PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def batched(spec_llm):
    """The same batch with drafts, through ``LLM.generate``; and the stats it added."""
    engine = spec_llm.engine
    before = engine.scheduler.speculation.stats.num_accepted_tokens
    outs = spec_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return outs, engine.scheduler.speculation.stats.num_accepted_tokens - before


def test_the_spec_llm_speculates_with_the_ngram_proposer(spec_llm):
    from inflight.spec_decode.ngram import NgramProposer

    assert isinstance(spec_llm.engine.proposer, NgramProposer)
    assert spec_llm.engine.scheduler.speculation.config == SPEC


def test_copy_heavy_prompt_speculates_and_keeps_every_token(batched, reference):
    outs, accepted = batched
    assert tokens(outs[0]) == tokens(reference[0])
    assert outs[0].outputs[0].text == reference[0].outputs[0].text
    assert accepted > 0


def test_a_batch_of_three_prompts_keeps_every_token(batched, reference):
    outs, _ = batched
    assert [tokens(o) for o in outs] == [tokens(o) for o in reference]
    assert [o.outputs[0].finish_reason for o in outs] == [
        o.outputs[0].finish_reason for o in reference]


def test_logprobs_of_each_token_match(batched, reference):
    outs, _ = batched
    for got, ref in zip(outs, reference):
        g, r = got.outputs[0].logprobs, ref.outputs[0].logprobs
        assert g is not None and len(g) == len(r) == len(ref.outputs[0].token_ids)
        for pos, (gd, rd) in enumerate(zip(g, r)):
            assert set(gd) == set(rd), pos
            for t in rd:
                assert _lp(gd[t]) == pytest.approx(_lp(rd[t]), abs=1e-4), (pos, t)


def _lp(value):
    return getattr(value, "logprob", value)


def test_n2_greedy_gives_the_reference_twice(make_engine, reference):
    engine = make_engine(SPEC)
    (out,) = run(engine, [COPY], SamplingParams(n=2, temperature=0, max_tokens=12))
    ref = reference[0].outputs[0].token_ids[:12]
    assert tokens(out) == [ref, ref]
    assert engine.scheduler.speculation.stats.num_accepted_tokens > 0


def test_max_tokens_is_exactly_respected(spec_llm, reference):
    for max_tokens in (1, 2, 7):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        (out,) = spec_llm.generate([COPY], params, use_tqdm=False)
        assert out.outputs[0].token_ids == reference[0].outputs[0].token_ids[:max_tokens]
        assert out.outputs[0].finish_reason == "length"


def test_stop_string_cuts_the_text_as_without_drafts(spec_llm, plain, reference):
    full = reference[0].outputs[0].text
    # A stop string in the middle of the output, after its first occurrence could be cut.
    cut = len(full) // 2
    stop = full[cut:cut + 4]
    first = full.index(stop)
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    (got,) = spec_llm.generate([COPY], params, use_tqdm=False)
    (ref,) = run(plain, [COPY], params)
    assert got.outputs[0].text == full[:first] == ref.outputs[0].text
    assert (got.outputs[0].finish_reason, got.outputs[0].stop_reason) == ("stop", stop)
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids


def test_a_prefix_cache_hit_gives_the_same_tokens(make_engine, reference):
    engine = make_engine(SPEC)
    params = SamplingParams(temperature=0, max_tokens=8)
    first = run(engine, [COPY], params)[0]
    hits = engine.kv_cache.prefix_cache_hits
    second = run(engine, [COPY], params)[0]
    assert engine.kv_cache.prefix_cache_hits > hits
    ref = reference[0].outputs[0].token_ids[:8]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == ref


SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
JSON_PROMPT = ('Reply in JSON. {"name": "Bob", "age": 31}\n{"name": "Ann", "age": 25}\n'
               '{"name": "Tom", "age": 40}\nNow another person:\n')


def test_structured_output_is_valid_json_and_unchanged(make_engine, plain):
    """Found a bug: kept tokens [x, '}', EOS] of one verification, the last of which ends
    the grammar, ended the request at x (``token_stop`` read the grammar as advanced past
    all three after the first): '{"name": "John", "age": 25' without its brace."""
    params = SamplingParams(temperature=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    engine = make_engine(SPEC)
    (got,) = run(engine, [JSON_PROMPT], params)
    (ref,) = run(plain, [JSON_PROMPT], params)
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    value = json.loads(got.outputs[0].text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert got.outputs[0].finish_reason == "stop"
    assert engine.scheduler.speculation.stats.num_drafts > 0


LONG = COPY * 2  # 110 tokens: 4 chunks of 32


def test_chunked_prefill_keeps_every_token(make_engine):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    knobs = dict(max_num_batched_tokens=32, enable_prefix_caching=False)
    spec_engine = make_engine(SPEC, **knobs)
    got = run(spec_engine, [LONG, PROMPTS[1]], params)
    ref = run(make_engine(None, **knobs), [LONG, PROMPTS[1]], params)
    assert 90 < len(spec_engine.tokenizer.encode(LONG)) < 130
    assert [tokens(o) for o in got] == [tokens(o) for o in ref]
    assert spec_engine.scheduler.speculation.stats.num_accepted_tokens > 0


def test_preemption_keeps_every_token(make_engine):
    # Prompts of 55, 12 and 13 tokens take 4 + 1 + 1 blocks of 16; with 16 output tokens
    # each they need 5 + 2 + 2 > 7: the newest is preempted and recomputed.
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [COPY, "The capital of France is Paris. The capital of Spain is",
               "Once upon a time, there was a little dog. The dog"]
    knobs = dict(enable_prefix_caching=False, max_num_seqs=3)
    spec_engine = make_engine(SPEC, num_blocks=7, **knobs)
    got = run(spec_engine, prompts, params)
    plain_engine = make_engine(None, num_blocks=7, **knobs)
    ref = run(plain_engine, prompts, params)
    assert spec_engine.scheduler.num_preemptions > 0
    assert [tokens(o) for o in got] == [tokens(o) for o in ref]
