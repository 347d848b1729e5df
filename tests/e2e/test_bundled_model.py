"""The bundled GGUF through the whole engine against HF transformers' ``generate``, and
batch invariance: a greedy request's tokens do not depend on how it was scheduled.

Float32 throughout: HF's reference and ours then differ only in summation order, so
greedy tokens match exactly unless two logits tie within ~1e-5 (none do for these prompts).
"""

from __future__ import annotations

import pytest
import torch

from inflight.sampling_params import SamplingParams
from tests.e2e.conftest import run

GREEDY = SamplingParams(temperature=0, max_tokens=32)


def _chat_ids(tokenizer, text):
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                            add_special_tokens=False)


def test_greedy_tokens_equal_hf_generate(make_engine, hf_reference, bundled, chat_prompts):
    tokenizer = bundled[2]
    prompts = [_chat_ids(tokenizer, p) for p in chat_prompts[:5]]
    outs = run(make_engine(), prompts, GREEDY)
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        max_new_tokens=32, do_sample=False)
        ref_ids = ref[0, len(ids):].tolist()
        ours = out.outputs[0].token_ids
        # HF keeps the EOS token it stopped at, as we do.
        assert ours == ref_ids[:len(ours)], tokenizer.decode(ours)
        assert len(ours) == len(ref_ids)
        assert out.outputs[0].text == tokenizer.decode(ours)


@pytest.fixture(scope="module")
def mixed_batch(bundled, chat_prompts):
    tokenizer = bundled[2]
    from tests.conftest import require_data
    sonnet = require_data("vllm_sonnet.txt").read_text().splitlines()
    prompts = [_chat_ids(tokenizer, p) for p in chat_prompts]
    # Mixed lengths: sonnet excerpts of 1..24 lines beside the chat prompts.
    prompts += [tokenizer.encode("\n".join(sonnet[i * 7:i * 7 + 1 + 3 * i])) for i in range(16 - len(prompts))]
    return prompts


@pytest.fixture(scope="module")
def alone(make_engine, mixed_batch):
    target = mixed_batch[0]
    return run(make_engine(), [target], GREEDY)[0].outputs[0].token_ids


def test_same_tokens_in_a_batch_of_16(make_engine, mixed_batch, alone):
    outs = run(make_engine(), mixed_batch, GREEDY)
    assert outs[0].outputs[0].token_ids == alone


def test_same_tokens_chunked(make_engine, mixed_batch, alone):
    engine = make_engine(max_num_batched_tokens=32)
    outs = run(engine, mixed_batch[:6], GREEDY)
    assert outs[0].outputs[0].token_ids == alone


def test_same_tokens_after_preemption(make_engine, mixed_batch, alone):
    # 24 blocks of 16 tokens cannot hold 8 growing sequences: the newest are preempted and
    # recomputed, repeatedly.
    engine = make_engine(num_blocks=24, max_num_seqs=8)
    outs = run(engine, [mixed_batch[0]] + mixed_batch[1:8], GREEDY)
    assert engine.scheduler.num_preemptions > 0
    # Preempted requests find their own freed blocks still cached when they come back.
    assert engine.kv_cache.prefix_cache_hits > 0
    assert outs[0].outputs[0].token_ids == alone
    assert sum(o.metrics.num_preemptions for o in outs) == engine.scheduler.num_preemptions


def test_seeded_sampling_is_independent_of_the_batch(make_engine, mixed_batch):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=24)
    alone = run(make_engine(), [mixed_batch[1]], params)[0].outputs[0].token_ids
    noisy = [SamplingParams(temperature=1.0, max_tokens=24)] * 5
    outs = run(make_engine(), [mixed_batch[1]] + mixed_batch[2:7], [params] + noisy)
    assert outs[0].outputs[0].token_ids == alone
    other_seed = run(make_engine(), [mixed_batch[1]], params.clone(seed=99))[0]
    assert other_seed.outputs[0].token_ids != alone


def test_prefix_cache_hit_gives_the_same_tokens_as_a_miss(make_engine, mixed_batch):
    prompt = mixed_batch[-1][:37]                     # 2 full blocks of 16 + 5 tokens
    cold = run(make_engine(enable_prefix_caching=False), [prompt], GREEDY)[0]
    engine = make_engine()
    first = run(engine, [prompt], GREEDY)[0]
    again = run(engine, [prompt], GREEDY)[0]          # hits both full blocks
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == cold.outputs[0].token_ids
    # A different prompt sharing 2 full blocks, its partially filled last block differing.
    other = prompt[:35] + mixed_batch[2][:3]
    hit = run(engine, [other], GREEDY)[0]
    assert hit.num_cached_tokens == 32
    assert hit.outputs[0].token_ids == run(make_engine(enable_prefix_caching=False), [other],
                                           GREEDY)[0].outputs[0].token_ids
