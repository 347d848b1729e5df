"""The engine's seams: token-level stops in the scheduler, text-level ones in the output
processor, one prompt-fit rule, and a fake-runner engine that needs no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from inflight.config import EngineConfig
from inflight.core.kv_cache import KVCacheManager
from inflight.core.output import SampleResult
from inflight.core.scheduler import Scheduler
from inflight.errors import InvalidRequestError
from inflight.request import Request, RequestStatus
from inflight.sampling_params import SamplingParams
from tests.conftest import FakeRunner
from tests.core.test_scheduler import make_engine

ROOT = Path(__file__).resolve().parents[2]


def _step(sched: Scheduler, token: int) -> list[Request]:
    out = sched.schedule(now=0.0)
    sampled = [SampleResult(s.request, token, None) for s in out.scheduled if s.samples]
    return sched.update(out, sampled, now=1.0)


@pytest.mark.parametrize("params,token,steps,status,stop_reason", [
    (SamplingParams(max_tokens=10), 2, 1, RequestStatus.FINISHED_STOPPED, None),       # EOS
    (SamplingParams(max_tokens=10, min_tokens=3), 2, 3, RequestStatus.FINISHED_STOPPED, None),
    (SamplingParams(max_tokens=10, ignore_eos=True), 2, 10, RequestStatus.FINISHED_LENGTH, None),
    (SamplingParams(max_tokens=10, stop_token_ids=[9]), 9, 1, RequestStatus.FINISHED_STOPPED, 9),
    (SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[9]), 9, 2,
     RequestStatus.FINISHED_STOPPED, 9),
    (SamplingParams(max_tokens=100, ignore_eos=True), 2, 16 - 5, RequestStatus.FINISHED_LENGTH,
     None),  # the 16-token pool ends it: prompt 5 + 11 outputs
])
def test_update_applies_token_level_stops_and_frees_blocks(params, token, steps, status,
                                                           stop_reason):
    kv = KVCacheManager(4, 4, enable_prefix_caching=False)
    sched = Scheduler(EngineConfig(max_num_batched_tokens=64), kv, max_model_len=1000)
    req = Request("r", [3] * 5, params, eos_token_ids=frozenset({2}))
    sched.add_request(req)
    for i in range(steps):
        assert not req.is_finished, f"finished early, at step {i}"
        assert _step(sched, token) == [req]
    assert (req.status, req.stop_reason, req.num_output_tokens) == (status, stop_reason, steps)
    assert kv.num_free_blocks == 4 and not sched.has_unfinished_requests()
    assert (sched.num_prompt_tokens, sched.num_generation_tokens) == (5, steps)


def test_stop_request_relabels_a_length_finish():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    sched = Scheduler(EngineConfig(), kv, max_model_len=1000)
    req = Request("r", [3, 4], SamplingParams(max_tokens=1))
    sched.add_request(req)
    _step(sched, 5)
    assert req.status == RequestStatus.FINISHED_LENGTH
    sched.stop_request(req, "five")  # the same token also completed a stop string
    assert (req.finish_reason, req.stop_reason, kv.num_free_blocks) == ("stop", "five", 8)


def test_prompt_fit_rule_names_the_field_and_defaults_max_tokens():
    kv = KVCacheManager(8, 4)   # 32 tokens of pool
    sched = Scheduler(EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=20),
                      kv, max_model_len=100)
    assert sched.check_prompt_fits(10) == 90
    assert sched.check_prompt_fits(10, 30) == 30
    cases = [((10, 91), "max_tokens", "maximum context length is 100"),
             ((32,), "prompt", "KV cache (32 tokens)"),
             ((21,), "prompt", "max_num_batched_tokens (20)")]
    for args, param, text in cases:
        with pytest.raises(InvalidRequestError) as e:
            sched.check_prompt_fits(*args)
        assert (e.value.param, e.value.code) == (param, "context_length_exceeded")
        assert text in e.value.message


class _Chars:
    """A tokenizer whose token ``i`` is the character ``chr(i)``: stop strings are exact."""

    vocab_size = 256
    eos_token_ids: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class _Spell(FakeRunner):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def execute(self, out):
        self.steps.append(out)
        return [SampleResult(s.request, ord(self.text[s.request.num_output_tokens % len(self.text)]),
                             None) for s in out.scheduled if s.samples]


@pytest.mark.parametrize("min_tokens,text,reason", [
    (0, "ab", "ab"),         # the stop string at once
    (4, "ab ab", "ab"),      # seen before min_tokens: the text goes on, the next match ends it
    # "ab" ending at token 8 = min_tokens does not count (vLLM v1: the output must have
    # more than min_tokens tokens); the one ending at token 11 does.
    (8, "ab ab ab ab", "ab"),
])
def test_stop_strings_wait_for_min_tokens(min_tokens, text, reason):
    engine = _engine_with(_Spell("ab "))
    engine.add_request("s", [65], SamplingParams(max_tokens=20, stop=["ab"], min_tokens=min_tokens,
                                                 include_stop_str_in_output=True))
    outs = [o for _ in range(30) for o in engine.step()]
    final = outs[-1].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == (text, "stop", reason)
    assert len(final.token_ids) == len(text)
    assert engine.kv_cache.num_free_blocks == 64


def _engine_with(runner):
    from inflight.engine import Engine
    return Engine(EngineConfig(block_size=4), runner=runner, tokenizer=_Chars(), num_blocks=64,
                  max_model_len=4096)


def test_a_failing_detokenizer_fails_only_its_request():
    class Broken(_Chars):
        def decode(self, ids, skip_special_tokens=True):
            if 66 in ids:
                raise RuntimeError("cannot decode")
            return super().decode(ids)

    from inflight.engine import Engine
    engine = Engine(EngineConfig(block_size=4), runner=_Spell("B"), tokenizer=Broken(),
                    num_blocks=64, max_model_len=4096)
    engine.add_request("bad", [65], SamplingParams(max_tokens=5))
    outs = {o.request_id: o for _ in range(3) for o in engine.step()}
    assert "cannot decode" in outs["bad"].error and outs["bad"].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and engine.kv_cache.num_free_blocks == 64


def test_n_sequences_share_one_group_and_one_output():
    engine = make_engine(FakeRunner(token_id=7))
    engine.add_request("g", [3, 4], SamplingParams(n=3, max_tokens=2, ignore_eos=True))
    outs = [o for _ in range(5) for o in engine.step()]
    assert [o.request_id for o in outs] == ["g"]
    assert [(c.index, c.token_ids) for c in outs[0].outputs] == [(i, [7, 7]) for i in range(3)]
    engine.add_request("x", [3], SamplingParams())
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("x", [3], SamplingParams())


def test_fake_runner_engine_imports_no_torch():
    code = ("import sys\n"
            "from tests.core.test_scheduler import make_engine\n"
            "from tests.conftest import FakeRunner\n"
            "from inflight.engine.async_engine import AsyncEngine\n"
            "from inflight.sampling_params import SamplingParams\n"
            "e = make_engine(FakeRunner())\n"
            "e.add_request('a', [3, 4], SamplingParams(max_tokens=3, ignore_eos=True))\n"
            "while e.has_unfinished_requests(): e.step()\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_stop_request_keeps_an_earlier_stop_and_an_abort():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    sched = Scheduler(EngineConfig(), kv, max_model_len=1000)
    by_token = Request("t", [3, 4], SamplingParams(max_tokens=5, stop_token_ids=[9]))
    aborted = Request("a", [3, 4], SamplingParams(max_tokens=5))
    for r in (by_token, aborted):
        sched.add_request(r)
    _step(sched, 9)
    sched.finish_request(aborted, RequestStatus.FINISHED_ABORTED)
    for r in (by_token, aborted):
        sched.stop_request(r, "nine")  # the same token also completed a stop string
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", 9)
    assert (aborted.finish_reason, aborted.stop_reason) == ("abort", None)


def test_recompute_past_the_budget_is_chunked_even_with_chunked_prefill_off():
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    sched = Scheduler(EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=8), kv,
                      max_model_len=1000)
    req = Request("p", [3] * 6, SamplingParams(max_tokens=20, ignore_eos=True))
    for t in range(5):  # as after a preemption: 11 known tokens, none in the cache
        req.append_output_token(5, None, 0.0)
    sched.add_request(req)
    plans = [sched.schedule(now=0.0) for _ in range(2)]
    assert [[(s.num_computed_tokens, s.num_scheduled_tokens, s.samples) for s in p.scheduled]
            for p in plans] == [[(0, 8, False)], [(8, 3, True)]]


def test_sequence_ids_of_n_never_collide_with_request_ids():
    engine = make_engine(FakeRunner())
    engine.add_request("x", [3], SamplingParams(n=2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("0_x", [3], SamplingParams())
    engine.add_request("1_y", [3], SamplingParams())
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("y", [3], SamplingParams(n=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_cache.num_free_blocks == 64


class _Echo(FakeRunner):
    """Each request's tokens repeat its first prompt token."""

    def execute(self, out):
        return [SampleResult(s.request, s.request.prompt_token_ids[0], None)
                for s in out.scheduled if s.samples]


def test_an_output_that_fails_to_build_fails_only_its_request(monkeypatch):
    from inflight.tokenizer.detokenizer import IncrementalDetokenizer

    real = IncrementalDetokenizer.get_delta

    def get_delta(self, finished=False):
        if "B" in self.output_text:
            raise RuntimeError("delta exploded")
        return real(self, finished)

    monkeypatch.setattr(IncrementalDetokenizer, "get_delta", get_delta)
    engine = _engine_with(_Echo())
    for rid, tok in (("ok", 65), ("bad", 66)):
        engine.add_request(rid, [tok], SamplingParams(max_tokens=4, ignore_eos=True),
                           stream=True)
    outs = [o for _ in range(8) for o in engine.step()]
    bad = [o for o in outs if o.request_id == "bad"]
    ok = [o for o in outs if o.request_id == "ok"]
    assert len(bad) == 1 and bad[0].finished and "delta exploded" in bad[0].error
    assert bad[0].outputs[0].finish_reason == "abort"
    assert "".join(o.outputs[0].text for o in ok) == "AAAA" and ok[-1].finished
    assert not engine.has_unfinished_requests() and engine.kv_cache.num_free_blocks == 64
