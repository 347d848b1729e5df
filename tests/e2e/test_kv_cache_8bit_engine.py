"""An engine over an 8-bit KV cache (``--kv-cache-dtype int8`` / ``fp8``) on the bundled model:
the pool holds the 8-bit rows, and one prompt's greedy tokens are the same alone, in a batch,
cut into prefill chunks, after a prefix-cache hit and after preemption.

Why they can be equal: every attention reads the same stored rows, whichever step wrote them
(a fresh prompt reads its own rows back from the cache too, as a chunk after a cut or a
prefix hit must), so only the rows' order of computation differs between the runs. Float32
dense weights, as the other exactness tests.
"""

from __future__ import annotations

import pytest
import torch

from inflight.config import EngineConfig
from inflight.engine import Engine
from inflight.entrypoints.llm import LLM
from inflight.runner import ModelRunner
from inflight.sampler import Sampler
from inflight.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes "
          "Gutenberg combined movable metal type with an oil-based ink and a screw press. "
          "Within fifty years")
OTHERS = ["The capital of France is", "def fibonacci(n):\n    "]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module", params=["int8", "fp8"])
def llm(request):
    return LLM(kv_cache_dtype=request.param, dtype="float32", quantization="none",
               num_kv_blocks=64)


def engine_of(llm, num_blocks=64, **knobs):
    """A fresh engine over the LLM's weights with its KV dtype and ``knobs``."""
    loaded = llm.engine
    dtype = loaded.runner.kv_caches[0].dtype
    cfg = EngineConfig(dtype="float32", quantization="none", **knobs)
    runner = ModelRunner(loaded.runner.model, num_blocks, cfg.block_size, dtype, Sampler())
    return Engine(cfg, runner=runner, tokenizer=loaded.tokenizer, num_blocks=num_blocks,
                  max_model_len=loaded.max_model_len, eos_token_ids=loaded.eos_token_ids)


def run(engine, prompts):
    """Greedy token ids of each prompt, in order; every block back at the end."""
    base = engine.get_stats().num_steps
    for i, p in enumerate(prompts):
        engine.add_request(f"{base}-{i}", p, GREEDY)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return [outs[f"{base}-{i}"].outputs[0].token_ids for i in range(len(prompts))]


def test_the_pool_holds_8bit_rows(llm):
    caches = llm.engine.runner.kv_caches
    expected = torch.int8 if llm.engine.config.kv_cache_dtype == "int8" else torch.float8_e4m3fn
    assert {c.dtype for c in caches} == {expected}
    assert caches[0].shape == (2, 3, 64, 16, 64 + 4)  # SmolLM2-135M: 3 KV heads of 64


def test_greedy_tokens_are_the_same_however_the_prompt_is_served(llm):
    alone = run(engine_of(llm), [PROMPT])[0]
    assert len(alone) == 20
    assert run(engine_of(llm), [*OTHERS, PROMPT])[2] == alone  # batched
    assert run(engine_of(llm, max_num_batched_tokens=16), [PROMPT])[0] == alone  # chunked
    cached = engine_of(llm, enable_prefix_caching=True)
    run(cached, [PROMPT])
    assert run(cached, [PROMPT])[0] == alone  # a prefix-cache hit
    assert cached.kv_cache.prefix_cache_hits >= 32  # two whole blocks of the prompt


def test_preemption_recomputes_the_same_tokens(llm):
    # 3 prompts of ~40, 6 and 8 tokens and 20 new tokens each need 4 + 2 + 2 blocks of 16 at
    # the end; 6 blocks force the newest out and back.
    engine = engine_of(llm, num_blocks=6, enable_prefix_caching=False, max_num_seqs=3)
    together = run(engine, [PROMPT, *OTHERS])
    assert engine.scheduler.num_preemptions > 0
    assert together[0] == run(engine_of(llm), [PROMPT])[0]
    assert together[1:] == run(engine_of(llm), OTHERS)
