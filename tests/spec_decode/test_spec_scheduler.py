"""The scheduler with drafts (``core.speculation``), torch-free: exact schedules, KV
lookahead and its release, prefix-cache registration of accepted tokens only, gating,
pausing and counters; then the engine loop over a fake runner that verifies drafts
greedily against a simulated KV cache, token for token against a run without drafts."""

from __future__ import annotations

import pytest

from inflight.config import EngineConfig
from inflight.core.kv_cache import KVCacheManager, hash_block
from inflight.core.output import SampleResult
from inflight.core.scheduler import Scheduler
from inflight.core.spec_config import SpeculativeConfig
from inflight.core.speculation import PAUSE_STEPS, Speculation
from inflight.engine import Engine
from inflight.rejection_sampler import verify_greedy
from inflight.request import Request, RequestStatus
from inflight.sampling_params import SamplingParams

BS = 4  # block size of every test here


def spec(**kw) -> SpeculativeConfig:
    kw.setdefault("num_speculative_tokens", 3)
    kw.setdefault("disable_by_batch_size", 100)  # deterministic: no measured-cost switch
    return SpeculativeConfig(method="ngram", **kw)


def make_scheduler(num_blocks=32, speculative=None, **cfg) -> Scheduler:
    config = EngineConfig(block_size=BS, speculative_config=speculative or spec(), **cfg)
    kv = KVCacheManager(num_blocks, BS, config.enable_prefix_caching)
    return Scheduler(config, kv, max_model_len=cfg.pop("max_model_len", 4096))


def add(sched: Scheduler, rid: str, prompt: list[int], **params) -> Request:
    params.setdefault("ignore_eos", True)
    params.setdefault("max_tokens", 500)
    req = Request(rid, prompt, SamplingParams(**params), eos_token_ids=frozenset([2]))
    sched.add_request(req)
    return req


def step(sched: Scheduler, tokens: dict[str, list[int]]):
    """Schedule one step and feed back ``tokens`` per request id (its kept tokens)."""
    out = sched.schedule()
    sampled = [SampleResult(s.request, t, None)
               for s in out.scheduled if s.samples for t in tokens[s.request.request_id]]
    sched.update(out, sampled)
    sched.kv_cache.check_integrity()
    return out


def prefilled(prompt_len=5, **kw):
    """A scheduler with request ``a`` decoding: ``prompt_len`` prompt tokens computed and
    one sampled token (100) left to compute."""
    sched = make_scheduler(**kw)
    a = add(sched, "a", list(range(10, 10 + prompt_len)))
    step(sched, {"a": [100]})
    assert (a.num_tokens, a.num_computed_tokens) == (prompt_len + 1, prompt_len)
    return sched, a


def test_drafts_ride_with_the_decode_token_and_reserve_lookahead_blocks():
    sched, a = prefilled(5, num_blocks=32)
    kv = sched.kv_cache
    assert len(kv.get_block_table("a")) == 2 and kv.num_free_blocks == 30
    a.spec_token_ids = [101, 102, 103]
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.token_ids == [100, 101, 102, 103]
    assert (s.num_draft_tokens, s.draft_token_ids, s.num_computed_tokens) == (3, [101, 102, 103], 5)
    assert s.is_decode and s.samples
    assert out.num_batched_tokens == 4
    # positions 5..8 need blocks up to position 8: cdiv(9, 4) = 3 blocks
    assert len(s.block_table) == 3 and kv.num_free_blocks == 29
    assert a.spec_token_ids == []  # consumed
    # 1 draft accepted (101) + the correction (7)
    sched.update(out, [SampleResult(a, 101, None), SampleResult(a, 7, None)])
    assert a.output_token_ids == [100, 101, 7]
    assert a.num_computed_tokens == 5 + 2
    # 8 tokens need 2 blocks: the lookahead block is back in the pool
    assert len(kv.get_block_table("a")) == 2 and kv.num_free_blocks == 30
    kv.check_integrity()
    # next step computes exactly the one uncomputed token
    out = sched.schedule()
    assert [(s.token_ids, s.num_computed_tokens) for s in out.scheduled] == [([7], 7)]


def test_all_drafts_accepted_keeps_every_position_and_block():
    sched, a = prefilled(5)
    a.spec_token_ids = [101, 102, 103]
    step(sched, {"a": [101, 102, 103, 104]})
    assert a.output_token_ids == [100, 101, 102, 103, 104]
    assert a.num_computed_tokens == 9 and a.num_tokens == 10
    assert len(sched.kv_cache.get_block_table("a")) == 3


def test_all_drafts_rejected_rolls_back_to_the_decode_position():
    sched, a = prefilled(5)
    a.spec_token_ids = [101, 102, 103]
    step(sched, {"a": [55]})
    assert a.output_token_ids == [100, 55]
    assert a.num_computed_tokens == 6
    assert len(sched.kv_cache.get_block_table("a")) == 2
    s = sched.speculation.stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (1, 3, 0)


def test_prefix_cache_registers_only_blocks_full_of_accepted_tokens():
    sched, a = prefilled(5)
    kv, pool = sched.kv_cache, sched.kv_cache.pool
    table = kv.get_block_table("a")
    h0 = hash_block(b"", [10, 11, 12, 13])
    assert pool.cached == {h0: table[0]}
    # block 1 would hold positions 4..7 = 14, 100, 101, 102 if every draft were right
    a.spec_token_ids = [101, 102, 103]
    out = sched.schedule()
    assert pool.cached == {h0: table[0]}  # drafts are not known tokens
    sched.update(out, [SampleResult(a, 101, None), SampleResult(a, 7, None)])
    # position 7 held the rejected draft 102 and its real token 7 is not computed yet
    assert pool.cached == {h0: table[0]}
    assert pool.block_hashes[table[1]] is None
    step(sched, {"a": [8]})  # computes position 7 = 7
    h1 = hash_block(h0, [14, 100, 101, 7])
    assert pool.cached == {h0: table[0], h1: table[1]}
    assert hash_block(h0, [14, 100, 101, 102]) not in pool.cached


def test_prefix_cache_registers_accepted_blocks_at_update():
    sched, a = prefilled(5)
    pool = sched.kv_cache.pool
    table = list(sched.kv_cache.get_block_table("a"))
    a.spec_token_ids = [101, 102, 103]
    step(sched, {"a": [101, 102, 103, 104]})  # positions 5..8 computed: 100 101 102 103
    h0 = hash_block(b"", [10, 11, 12, 13])
    h1 = hash_block(h0, [14, 100, 101, 102])
    assert pool.cached == {h0: table[0], h1: table[1]}


def test_a_later_request_shares_only_real_blocks():
    """A request with a rejected draft in a block; a second request whose prompt is the
    first one's draft continuation must not hit that block."""
    sched, a = prefilled(5)
    a.spec_token_ids = [101, 102, 103]
    step(sched, {"a": [101, 7]})
    b = add(sched, "b", [10, 11, 12, 13, 14, 100, 101, 102, 103])
    hits = sched.kv_cache.get_computed_blocks(b)
    assert hits == sched.kv_cache.get_block_table("a")[:1]


def test_the_step_budget_truncates_drafts():
    sched = make_scheduler(max_num_batched_tokens=6)
    a = add(sched, "a", [10, 11, 12])
    c = add(sched, "c", [20, 21])
    step(sched, {"a": [100], "c": [200]})
    a.spec_token_ids = [1, 2, 3]
    c.spec_token_ids = [4, 5, 6]
    out = sched.schedule()
    assert [(s.request.request_id, s.token_ids, s.num_draft_tokens) for s in out.scheduled] == [
        ("a", [100, 1, 2, 3], 3), ("c", [200, 4], 1)]
    assert out.num_batched_tokens == 6
    # c's truncated drafts are gone, not carried to the next step
    assert c.spec_token_ids == []


def test_lookahead_blocks_are_dropped_before_anyone_is_preempted():
    # 3 blocks: a holds 2 (5 prompt tokens, 1 generated), b holds 1; a's drafts would need
    # a third block for positions 8..: the drafts go, nobody is preempted
    sched = make_scheduler(num_blocks=3)
    a = add(sched, "a", [10, 11, 12, 13, 14, 15])
    b = add(sched, "b", [20, 21])
    step(sched, {"a": [100], "b": [200]})
    assert sched.kv_cache.num_free_blocks == 0
    a.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    assert out.preempted == []
    assert [(s.request.request_id, s.token_ids) for s in out.scheduled] == [
        ("a", [100]), ("b", [200])]


def test_preemption_clears_drafts():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    a = add(sched, "a", list(range(10, 18)))
    b = add(sched, "b", list(range(20, 28)))
    step(sched, {"a": [100], "b": [200]})
    a.spec_token_ids = [1, 2]
    b.spec_token_ids = [3, 4]
    out = sched.schedule()
    assert out.preempted == [b]
    assert b.spec_token_ids == [] and b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert [(s.request.request_id, s.token_ids) for s in out.scheduled] == [("a", [100])]
    sched.kv_cache.check_integrity()


def test_disable_by_batch_size_gates_drafts():
    sched = make_scheduler(speculative=spec(disable_by_batch_size=2))
    a = add(sched, "a", [10, 11, 12])
    b = add(sched, "b", [20, 21, 22])
    step(sched, {"a": [100], "b": [200]})
    assert sched.requests_to_draft() == []  # 2 running: not below the limit
    a.spec_token_ids = [1, 2]
    out = sched.schedule()
    assert [s.num_draft_tokens for s in out.scheduled] == [0, 0]
    assert a.spec_token_ids == []
    sched.update(out, [SampleResult(a, 101, None)])
    sched.finish_request(b, RequestStatus.FINISHED_ABORTED)
    assert sched.requests_to_draft() == [(a, 3)]
    a.spec_token_ids = [1, 2]
    out = sched.schedule()
    assert [s.num_draft_tokens for s in out.scheduled] == [2]


def test_num_to_draft_stops_short_of_max_tokens_and_the_sequence_limit():
    sp = Speculation(spec(num_speculative_tokens=4))
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=5))
    req.status = RequestStatus.RUNNING
    assert sp.num_to_draft(req, 1000) == 0  # still prefilling
    for n_out, expected in [(1, 3), (2, 2), (3, 1), (4, 0)]:
        while req.num_output_tokens < n_out:
            req.append_output_token(9, None, 0.0)
        req.num_computed_tokens = req.num_tokens - 1
        # max_tokens 5: drafts + the step's own token never pass it
        assert sp.num_to_draft(req, 1000) == expected, n_out
    req = Request("s", [1, 2, 3], SamplingParams(max_tokens=None))
    req.status = RequestStatus.RUNNING
    req.append_output_token(9, None, 0.0)
    req.num_computed_tokens = 3
    assert sp.num_to_draft(req, 1000) == 4
    assert sp.num_to_draft(req, 7) == 2   # 4 tokens + 2 drafts + 1 = 7
    assert sp.num_to_draft(req, 5) == 0
    req.spec_pause = 1
    assert sp.num_to_draft(req, 1000) == 0


def test_requests_to_draft_in_the_scheduler():
    sched = make_scheduler(speculative=spec(num_speculative_tokens=4))
    a = add(sched, "a", [10, 11, 12], max_tokens=3)
    b = add(sched, "b", list(range(20, 40)), max_tokens=50)
    c = add(sched, "c", [30, 31], max_tokens=50)
    step(sched, {"a": [100], "b": [200], "c": [300]})
    assert sched.requests_to_draft() == [(a, 1), (b, 4), (c, 4)]
    step(sched, {"a": [101], "b": [201], "c": [301]})
    assert sched.requests_to_draft() == [(b, 4), (c, 4)]  # a is at max_tokens - 1


def test_low_acceptance_pauses_a_request():
    cfg = spec(num_speculative_tokens=2, min_acceptance_rate=0.3, acceptance_window=4)
    sched, a = prefilled(5, speculative=cfg)
    a.spec_token_ids = [1, 2]
    step(sched, {"a": [1, 50]})  # 1 of 2 accepted
    assert a.spec_pause == 0 and (a.spec_drafted, a.spec_accepted) == (2, 1)
    a.spec_token_ids = [1, 2]
    step(sched, {"a": [60]})  # 1 of 4 accepted in the window: 0.25 < 0.3
    assert a.spec_pause == PAUSE_STEPS
    assert (a.spec_drafted, a.spec_accepted) == (0, 0)
    assert sched.requests_to_draft() == []
    a.spec_token_ids = [1, 2]  # stale drafts still verify: the pause stops proposing
    out = sched.schedule()     # and each step counts it down
    assert a.spec_pause == PAUSE_STEPS - 1
    sched.update(out, [SampleResult(a, 80, None)])
    for _ in range(PAUSE_STEPS - 1):
        assert sched.requests_to_draft() == []
        step(sched, {"a": [70]})
    assert a.spec_pause == 0
    assert sched.requests_to_draft() == [(a, 2)]


def test_acceptance_at_the_rate_does_not_pause():
    cfg = spec(num_speculative_tokens=2, min_acceptance_rate=0.5, acceptance_window=4)
    sched, a = prefilled(5, speculative=cfg)
    a.spec_token_ids = [1, 2]
    step(sched, {"a": [1, 2, 3]})  # 2 of 2
    a.spec_token_ids = [9, 9]
    step(sched, {"a": [4]})        # 0 of 2: the window's 2 of 4 = 0.5 is not below it
    assert a.spec_pause == 0 and (a.spec_drafted, a.spec_accepted) == (0, 0)
    assert sched.requests_to_draft() == [(a, 2)]


def test_stats_count_drafts_and_accepted_positions():
    sched, a = prefilled(5, speculative=spec(num_speculative_tokens=3, min_acceptance_rate=0.0))
    for drafts, kept in [([1, 2, 3], [1, 2, 3, 4]),   # 3 accepted
                         ([5, 6, 7], [5, 9]),          # 1 accepted
                         ([8, 9], [8, 9, 1]),          # 2 of 2
                         ([3, 3, 3], [4])]:            # 0
        a.spec_token_ids = drafts
        step(sched, {"a": kept})
    step(sched, {"a": [5]})  # a plain decode is no verification
    s = sched.speculation.stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (4, 11, 6)
    assert s.accepted_per_position == [3, 2, 1]
    assert s.acceptance_rate == pytest.approx(6 / 11)
    assert s.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert a.num_computed_tokens == a.num_tokens - 1


def test_a_stop_token_among_the_kept_ends_the_request_and_frees_its_blocks():
    sched = make_scheduler()
    a = add(sched, "a", [10, 11, 12, 13, 14], ignore_eos=False)
    step(sched, {"a": [100]})
    a.spec_token_ids = [101, 2, 103]
    step(sched, {"a": [101, 2, 103, 104]})  # EOS (2) is the second kept token
    assert a.output_token_ids == [100, 101, 2]
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    assert sched.speculation.stats.num_accepted_tokens == 3  # verified, even if not all used


def test_max_tokens_cuts_the_kept_tokens():
    sched = make_scheduler()
    a = add(sched, "a", [10, 11, 12], max_tokens=3)
    step(sched, {"a": [100]})
    a.spec_token_ids = [1, 2, 3]  # more than num_to_draft would give
    step(sched, {"a": [1, 2, 3, 4]})
    assert a.output_token_ids == [100, 1, 2]
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks


def decoding_request() -> Request:
    """A running request with one output token left to compute, holding 4 drafts."""
    req = Request("r", [1, 2], SamplingParams())
    req.status = RequestStatus.RUNNING
    req.append_output_token(3, None, 0.0)
    req.num_computed_tokens = 2
    req.spec_token_ids = [5, 5, 5, 5]
    return req


def test_load_aware_switch_uses_the_measured_step_cost():
    sp = Speculation(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    req = decoding_request()
    # one request, 4 drafts, 1 expected accepted (the prior): 2 tokens in t(5) against 1 in t(1)
    sp.observe_step(1, 1.0)
    sp.observe_step(5, 1.9)
    assert sp.step_allows([req], proposed=True)
    sp2 = Speculation(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    sp2.observe_step(1, 1.0)
    sp2.observe_step(5, 2.1)
    assert not sp2.step_allows([req], proposed=True)
    sp2.gate([req], 0)
    assert req.spec_token_ids == []


def test_an_unmeasured_verification_size_is_measured_before_it_is_judged():
    # Only plain 1-row steps measured: extrapolating t(5) from t(1) would keep drafts off
    # for good (they were, in a fresh server); the switch speculates to measure it.
    sp = Speculation(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    sp.observe_step(1, 1.0)
    req = decoding_request()
    assert sp.step_allows([req], proposed=True)
    sp.observe_step(5, 3.0)  # now measured, and too dear for 1 expected accepted draft
    assert not sp.step_allows([req], proposed=True)


def test_prompt_work_takes_the_step_from_drafts():
    # Drafts would take budget and time from a waiting prompt or a chunked prefill: with
    # either pending, a step that would otherwise verify them drops them.
    sp = Speculation(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    sp.observe_step(1, 1.0)
    sp.observe_step(5, 1.1)
    req = decoding_request()
    assert sp.step_allows([req], proposed=True)
    sp.gate([req], 1)  # one request waiting
    assert req.spec_token_ids == []
    assert sp.requests_to_draft([req], 100, num_waiting=1) == []
    prefilling = Request("p", list(range(40)), SamplingParams())
    prefilling.status = RequestStatus.RUNNING
    prefilling.num_computed_tokens = 16  # a chunk done, 24 prompt tokens to go
    req.spec_token_ids = [5, 5, 5, 5]
    sp.gate([req, prefilling], 0)
    assert req.spec_token_ids == []
    req.spec_token_ids = [5, 5, 5, 5]
    sp.gate([req], 0)
    assert req.spec_token_ids == [5, 5, 5, 5]
    assert sp.requests_to_draft([req], 100) == [(req, 4)]


# --- the engine loop: a fake model that reads a simulated KV cache ----------------------

V = 40


def next_token(context: list[int]) -> int:
    """The fake model: mostly periodic (prompt lookup hits), with a break every 7
    positions (drafts rejected)."""
    if len(context) % 7 == 0:
        return (context[-1] * 3 + len(context)) % V + 3
    return (context[-1] + 1) % 8 + 3


class KVFakeRunner:
    """Greedy fake model over a simulated paged KV cache: each step writes its tokens to
    their slots, each sampling row reads its context back from the slots its block table
    names (so a wrong table, a block shared by mistake or a stale slot changes its token),
    and drafts are verified greedily as the real sampler does."""

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}
        self.steps = []

    def execute(self, out):
        self.steps.append(out)
        results = []
        for s in out.scheduled:
            table, start = s.block_table, s.num_computed_tokens
            for i, t in enumerate(s.token_ids):
                p = start + i
                self.slots[table[p // BS] * BS + p % BS] = t
        for s in out.scheduled:
            if not s.samples:
                continue
            table, start = s.block_table, s.num_computed_tokens
            n = len(s.token_ids) - s.num_draft_tokens
            targets = []
            for j in range(s.num_draft_tokens + 1):
                seq_len = start + n + j
                context = [self.slots[table[p // BS] * BS + p % BS] for p in range(seq_len)]
                truth = s.request.token_ids_slice(0, start + n) + s.draft_token_ids[:j]
                assert context == truth, f"{s.request.request_id}: row {j} reads a wrong KV"
                targets.append(next_token(context))
            kept = verify_greedy(targets, s.draft_token_ids)
            results += [SampleResult(s.request, t, None) for t in kept]
        return results


def run_engine(speculative, prompts, num_blocks=64, **cfg):
    runner = KVFakeRunner()
    config = EngineConfig(block_size=BS, speculative_config=speculative, **cfg)
    engine = Engine(config, runner=runner, num_blocks=num_blocks, max_model_len=4096,
                    eos_token_ids=[2])
    for rid, (prompt, max_tokens) in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    outs = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        engine.kv_cache.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == num_blocks
    return outs, engine, runner


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt):]


PROMPTS = {
    "a": ([3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5], 30),
    "b": ([5, 6, 7, 8, 9, 10, 3, 4, 5, 6, 7, 8, 9], 25),
    "c": ([3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5, 6, 11, 12], 17),  # shares a's first block
}


@pytest.mark.parametrize("cfg", [
    dict(),
    dict(max_num_batched_tokens=8),             # chunked prefill, drafts cut by the budget
    dict(num_blocks=12, max_num_seqs=3),        # preemption
    dict(enable_prefix_caching=False),
])
def test_engine_with_drafts_matches_the_model_token_for_token(cfg):
    cfg = dict(cfg)
    num_blocks = cfg.pop("num_blocks", 64)
    sp = spec(num_speculative_tokens=4, prompt_lookup_min=1, min_acceptance_rate=0.0)
    outs, engine, runner = run_engine(sp, PROMPTS, num_blocks=num_blocks, **cfg)
    for rid, (prompt, max_tokens) in PROMPTS.items():
        assert outs[rid] == reference(prompt, max_tokens), rid
    stats = engine.scheduler.speculation.stats
    assert stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # some were rejected
    assert any(s.num_draft_tokens for out in runner.steps for s in out.scheduled)
    if num_blocks == 12:
        assert engine.scheduler.num_preemptions > 0
    # fewer steps than tokens: drafts were worth something
    if cfg == {}:
        assert len(runner.steps) < max(m for _, m in PROMPTS.values())


def test_engine_without_drafts_matches_too():
    outs, engine, _ = run_engine(None, PROMPTS)
    assert engine.proposer is None and engine.scheduler.speculation is None
    for rid, (prompt, max_tokens) in PROMPTS.items():
        assert outs[rid] == reference(prompt, max_tokens), rid


def test_engine_observes_decode_step_costs_for_the_switch():
    sp = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1)
    outs, engine, _ = run_engine(sp, {"a": PROMPTS["a"]})
    assert outs["a"] == reference(*PROMPTS["a"])
    assert engine.scheduler.speculation.cost.predict(1) is not None


class _EndedGrammar:
    """A grammar the sampler advanced through every kept token of the step, the last of
    which ended it (``sampler._advance_grammar``)."""

    is_terminated = True


def test_a_grammar_ended_by_the_last_kept_token_keeps_every_kept_token():
    """Verification keeps [x, '}', EOS] and the grammar ends at EOS: all three are output
    (the grammar's end is known only after the step's last token, not after the first)."""
    sched = make_scheduler()
    a = add(sched, "a", [10, 11, 12, 13, 14])
    step(sched, {"a": [100]})
    a.grammar = _EndedGrammar()
    a.spec_token_ids = [101, 102, 103]
    step(sched, {"a": [101, 102, 2]})
    assert a.output_token_ids == [100, 101, 102, 2]
    assert a.status == RequestStatus.FINISHED_STOPPED
