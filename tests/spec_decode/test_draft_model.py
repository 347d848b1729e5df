"""The ``draft_model`` proposer: the bundled model drafting for itself (greedy float32,
so its drafts are the target's own tokens), its draft KV blocks, start-up refusals."""

from __future__ import annotations

import json

import pytest
import transformers

from inflight import LLM, SamplingParams
from inflight.config import EngineConfig
from inflight.core.spec_config import SpeculativeConfig
from inflight.request import Request
from inflight.spec_decode.draft_model import DraftModelProposer, _common_prefix

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
K = 3


@pytest.fixture(scope="module")
def spec_llm(bundled_model_path):
    # A fixed batch limit instead of the measured-cost switch: every decode step drafts.
    spec = SpeculativeConfig(method="draft_model", model=str(bundled_model_path),
                             num_speculative_tokens=K, disable_by_batch_size=64)
    return LLM(dtype="float32", quantization="none", num_kv_blocks=128,
               speculative_config=spec)


def test_self_drafting_keeps_greedy_tokens_and_accepts_its_drafts(spec_llm):
    plain = LLM(dtype="float32", quantization="none", num_kv_blocks=128)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    del plain
    got = [o.outputs[0].token_ids for o in spec_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want
    stats = spec_llm.engine.scheduler.speculation.stats
    assert stats.num_drafts > 0
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
    # The draft pool is empty again once every request finished.
    proposer = spec_llm.engine.proposer
    assert proposer.pool.num_free_blocks == proposer.pool.num_blocks == 128
    assert proposer._seqs == {}


def test_draft_blocks_held_while_running_and_freed_on_abort(spec_llm):
    engine, proposer = spec_llm.engine, spec_llm.engine.proposer
    prompt = list(range(100, 130))  # 30 tokens
    engine.add_request("held", prompt, SamplingParams(temperature=0, max_tokens=20,
                                                      ignore_eos=True))
    engine.step()  # prefill, first token sampled, then drafts for the next step
    req = engine.scheduler.running[0]
    assert req.num_tokens == 31 and len(req.spec_token_ids) == K
    # Positions 0 .. 31 + K - 2 hold draft K/V: ceil(33 / 16) = 3 blocks.
    assert proposer.pool.num_free_blocks == 128 - 3
    assert engine.abort_request("held")
    engine.step()
    assert proposer.pool.num_free_blocks == 128
    assert "held" not in proposer._seqs


def test_reused_draft_kv_gives_the_drafts_of_a_fresh_start(spec_llm):
    """After the target keeps some drafts (and after it keeps all), the drafts from the
    proposer's reused KV equal those of a request it has never seen with the same tokens."""
    proposer = spec_llm.engine.proposer
    params = SamplingParams(temperature=0, max_tokens=50)
    a = Request("reuse", list(range(200, 220)), params)
    a.output_token_ids = [7]
    proposer.propose([(a, K)])
    first = list(a.spec_token_ids)
    assert len(first) == K
    kept = [
        [first[0], (first[1] + 1) % 1000],  # the first draft kept, then another token
        None,  # every draft kept, and the bonus token
    ]
    for i, step in enumerate(kept):
        drafts = list(a.spec_token_ids)
        a.output_token_ids += step if step is not None else drafts + [drafts[-1]]
        proposer.propose([(a, K)])
        fresh = Request(f"fresh{i}", a.prompt_token_ids, params)
        fresh.output_token_ids = list(a.output_token_ids)
        proposer.propose([(fresh, K)])
        assert a.spec_token_ids == fresh.spec_token_ids and len(a.spec_token_ids) == K
        # Both fed the request's tokens and their first K - 1 drafts.
        fed = a.prompt_token_ids + a.output_token_ids + a.spec_token_ids[:K - 1]
        assert proposer._seqs["reuse"].fed == proposer._seqs[f"fresh{i}"].fed == fed
        proposer.release(f"fresh{i}")
    proposer.release("reuse")
    assert proposer.pool.num_free_blocks == proposer.pool.num_blocks


def test_out_of_draft_blocks_skips_drafting(spec_llm):
    proposer = spec_llm.engine.proposer
    taken = proposer.pool.allocate(proposer.pool.num_blocks - 2)  # 2 blocks left
    assert taken is not None
    small = Request("small", list(range(10, 40)), SamplingParams(temperature=0))
    big = Request("big", list(range(10, 40)), SamplingParams(temperature=0))
    small.output_token_ids = big.output_token_ids = [5]
    proposer.propose([(small, 1), (big, 3)])  # 31 and 33 positions: 2 and 3 blocks
    assert len(small.spec_token_ids) == 1 and big.spec_token_ids == []
    assert proposer.pool.num_free_blocks == 0
    proposer.release("big")  # held nothing
    assert proposer.pool.num_free_blocks == 0
    proposer.release("small")
    assert proposer.pool.num_free_blocks == 2
    proposer.pool.free(taken)


def test_missing_draft_model_is_refused(tmp_path):
    missing = tmp_path / "no-such-draft.gguf"
    spec = SpeculativeConfig(method="draft_model", model=str(missing))
    with pytest.raises(FileNotFoundError, match="no-such-draft.gguf"):
        DraftModelProposer(spec, engine_config=EngineConfig(quantization="none"))


def test_draft_with_another_vocabulary_is_refused(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    spec = SpeculativeConfig(method="draft_model", model=str(tmp_path))
    # Refused from the config alone, before any weight is read (the directory has none).
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens.* 49152"):
        DraftModelProposer(spec, engine_config=EngineConfig(quantization="none"))


def test_common_prefix():
    assert _common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert _common_prefix([1, 2, 3], [1, 9, 3]) == 1
    assert _common_prefix([], [1]) == 0
