"""Embedding requests (``SamplingParams.pooling``) through the engine: the pooled vector
equals HF transformers' final hidden states (last token or mean, L2-normalized) on a tiny
random Llama, whatever the batch, the chunking, a prefix-cache hit or a preemption."""

from __future__ import annotations

import pytest
import torch

from inflight import LLM, SamplingParams
from tests.e2e.tiny_hf import save_tiny_llama

PROMPTS = ["The quick brown fox jumps over the lazy dog and keeps running far away",
           "Paged attention keeps the KV cache in fixed-size blocks",
           "hi",
           "One shared model, many users at once: continuous batching admits new requests "
           "between generation steps, over a paged KV cache with recompute preemption"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bundled):
    path = tmp_path_factory.mktemp("tiny_llama")
    hf = save_tiny_llama(path, bundled[2])
    return str(path), hf, bundled[2]


def reference(hf, tokenizer, prompt: str, pooling: str) -> torch.Tensor:
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state[0].double()
    v = h[-1] if pooling == "last" else h.mean(dim=0)
    return v / v.norm()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embedding_equals_hf_alone_batched_and_chunked(tiny, pooling):
    path, hf, tok = tiny
    refs = [reference(hf, tok, p, pooling) for p in PROMPTS]
    alone = LLM(path, num_kv_blocks=64, dtype="float32")
    singles = [alone.embed(p, pooling=pooling, use_tqdm=False)[0] for p in PROMPTS]
    # a 16-token budget cuts every long prompt into chunks, mixed with the others
    chunked = LLM(path, num_kv_blocks=64, dtype="float32", max_num_batched_tokens=16)
    batch = chunked.embed(PROMPTS, pooling=pooling, use_tqdm=False)
    for ref, one, many, prompt in zip(refs, singles, batch, PROMPTS):
        assert len(one.embedding) == 64
        got = torch.tensor(one.embedding, dtype=torch.float64)
        assert abs(got.norm().item() - 1) < 1e-6
        assert torch.allclose(got, ref, atol=2e-6), (prompt, (got - ref).abs().max())
        assert torch.allclose(torch.tensor(many.embedding, dtype=torch.float64), ref, atol=2e-6)
        assert one.outputs[0].token_ids == [] and one.outputs[0].finish_reason == "length"
        assert one.prompt_token_ids == tok.encode(prompt)


def test_prefix_cache_hit_serves_last_pooling_and_mean_reads_no_cache(tiny):
    path, hf, tok = tiny
    llm = LLM(path, num_kv_blocks=64, dtype="float32", block_size=4)
    prompt = PROMPTS[3]
    first = llm.embed(prompt, use_tqdm=False)[0]
    again = llm.embed(prompt, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert again.embedding == first.embedding
    mean = llm.embed(prompt, pooling="mean", use_tqdm=False)[0]
    assert mean.num_cached_tokens == 0
    ref = reference(hf, tok, prompt, "mean")
    assert torch.allclose(torch.tensor(mean.embedding, dtype=torch.float64), ref, atol=2e-6)
    llm.engine.scheduler.kv_cache.check_integrity()
    assert not llm.engine.scheduler.kv_cache.block_tables  # nothing leaked


def test_pooling_needs_a_prefill_only_request():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(pooling="last", max_tokens=4)
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(pooling="cls", max_tokens=0)
    with pytest.raises(ValueError, match="^n"):
        SamplingParams(pooling="mean", max_tokens=0, n=2)


def test_a_prompt_of_the_whole_context_embeds_and_one_more_is_refused(tiny):
    """A prefill-only request needs no room for a token (vLLM's rule): exactly
    max_model_len prompt tokens fit; one more is refused, naming the input, not room to
    generate."""
    path, hf, tok = tiny
    llm = LLM(path, num_kv_blocks=64, dtype="float32")
    mml = llm.engine.max_model_len
    ids = [(7 * i) % 200 + 50 for i in range(mml)]
    out = llm.embed([ids], use_tqdm=False)[0]
    assert len(out.embedding) == 64 and out.prompt_token_ids == ids
    with pytest.raises(ValueError, match=f"your prompt has {mml + 1} tokens. Please"):
        llm.embed([ids + [60]], use_tqdm=False)
    with pytest.raises(ValueError, match="leaves no room to generate"):
        llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)
