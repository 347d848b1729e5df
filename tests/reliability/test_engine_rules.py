"""Engine rules from the reliability issue, each pinned to exact values.

1. Stop strings and ``min_tokens`` (vLLM v1's rule, ``inflight.engine.output_processor``).
2. Prefix-cache counters leave a preempted request's readmission out; recomputation after
   preemption has its own counter (``inflight:num_recomputed_tokens_total``).
3. Aborted requests: which metric series they change (``inflight.server.metrics``).
4. Priority aging: the admission bound of ``inflight.core.queue_policy``.
5. A KV pool smaller than ``max_model_len`` (``inflight.engine.loading``).

All run on fake runners, scripted tokens and a virtual clock: milliseconds each.
"""

from __future__ import annotations

import logging
import math
import time

import pytest

from inflight.config import EngineConfig
from inflight.core.output import SampleResult
from inflight.core.queue_policy import PriorityPolicy
from inflight.engine import Engine, loading
from inflight.model.hparams import ModelConfig
from inflight.sampling_params import SamplingParams
from inflight.server.metrics import ServerMetrics
from tests.conftest import FakeRunner
from tests.core.test_scheduler import make_engine, run_to_completion


class VirtualClock:
    """Seconds; only the runner moves it (one ``dt`` per step), as the simulator does."""

    def __init__(self, start: float = 0.0, dt: float = 0.1) -> None:
        self.start, self.dt, self.steps = start, dt, 0

    def __call__(self) -> float:
        return self.start + self.steps * self.dt  # no drift from summing floats


class ScriptedRunner:
    """Each sampling row of request ``rid`` gets ``script[rid][its output length]``
    (``default`` past the script); advances ``clock`` by one step per call."""

    def __init__(self, script: dict[str, list[int]] | None = None, default: int = 0,
                 clock: VirtualClock | None = None) -> None:
        self.script, self.default, self.clock = script or {}, default, clock
        self.steps: list = []

    def execute(self, out):
        self.steps.append(out)
        if self.clock is not None:
            self.clock.steps += 1
        rows = []
        for s in out.scheduled:
            if s.samples:
                seq = self.script.get(s.request.request_id, [])
                i = s.request.num_output_tokens
                rows.append(SampleResult(s.request, seq[i] if i < len(seq) else self.default,
                                         None))
        return rows


class CharTokenizer:
    """Token id -> a fixed string; decoding concatenates (no merges, no special tokens)."""

    VOCAB = {0: "x", 1: "h", 2: "i", 3: "hi", 4: "y"}
    vocab_size = 100
    eos_token_ids: tuple[int, ...] = ()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.VOCAB[i] for i in ids)


X, H, I, HI, Y = 0, 1, 2, 3, 4
PROMPT = [Y, Y, Y]


# --- 1. stop strings and min_tokens --------------------------------------------------------
def _run_stop(tokens: list[int], *, min_tokens: int, stream: bool = False,
              include_stop: bool = False):
    """One request scripted to sample ``tokens``; returns (text, token ids, finish, stop)."""
    engine = Engine(EngineConfig(block_size=4), runner=ScriptedRunner({"r": tokens}),
                    tokenizer=CharTokenizer(), num_blocks=16, max_model_len=64)
    engine.add_request("r", PROMPT, SamplingParams(
        max_tokens=len(tokens), min_tokens=min_tokens, stop=["hi"], ignore_eos=True,
        include_stop_str_in_output=include_stop), stream=stream)
    text, ids, last = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            text = text + c.text if stream else c.text
            ids = ids + c.token_ids if stream else c.token_ids
            last = c
    return text, ids, last.finish_reason, last.stop_reason


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tokens, min_tokens, expected", [
    # "hi" in tokens 1-2, inside the first min_tokens=3: never matched, later tokens or not.
    ([H, I, X, X, X, X], 3, ("hixxxx", 6, "length", None)),
    # "hi" ending exactly at token 3 = min_tokens: not matched (vLLM: output must have
    # more than min_tokens tokens).
    ([X, H, I, X, X, X], 3, ("xhixxx", 6, "length", None)),
    # "h" is token 3, "i" token 4: the match ends past the boundary, so it counts even
    # though it starts inside the first min_tokens tokens.
    ([X, X, H, I, X, X], 3, ("xx", 4, "stop", "hi")),
    # One token "hi" as token 4.
    ([X, X, X, HI, X, X], 3, ("xxx", 4, "stop", "hi")),
    # The "hi" inside the first three is skipped, the later one (tokens 4-5) stops.
    ([H, I, X, H, I, X], 3, ("hix", 5, "stop", "hi")),
    # min_tokens=0: the first match stops at once.
    ([X, H, I, X, X, X], 0, ("x", 3, "stop", "hi")),
    # min_tokens == max_tokens: stop strings can never end the request.
    ([X, X, H, I, X, X], 6, ("xxhixx", 6, "length", None)),
])
def test_stop_strings_only_end_past_min_tokens(tokens, min_tokens, expected, stream):
    text, ids, finish, stop = _run_stop(tokens, min_tokens=min_tokens, stream=stream)
    want_text, want_len, want_finish, want_stop = expected
    assert (text, ids, finish, stop) == (want_text, tokens[:want_len], want_finish, want_stop)


def test_stop_string_across_the_min_tokens_boundary_kept_with_include_stop_str():
    text, ids, finish, stop = _run_stop([X, X, H, I, X, X], min_tokens=3, include_stop=True)
    assert (text, ids, finish, stop) == ("xxhi", [X, X, H, I], "stop", "hi")


# --- 2. prefix-cache hits and recomputation after preemption -------------------------------
class EngineState:
    """What ``ServerMetrics`` reads of an ``AsyncEngine``, straight from an ``Engine``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def get_stats(self):
        return self.engine.get_stats()

    @property
    def num_waiting(self) -> int:
        return self.engine.get_stats().num_waiting

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len


def _drive(engine: Engine, metrics: ServerMetrics, clock=None, max_steps: int = 1000):
    """Step until idle, feeding every step to ``metrics`` as the async loop does."""
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        outputs = engine.step()
        metrics.on_step(engine.get_stats(), outputs, clock() if clock else 0.0)
    raise AssertionError("engine did not drain")


def _two_requests(num_blocks: int, caching: bool):
    # 4-token blocks; two distinct 6-token prompts, 6 tokens each. With 4 blocks, b's
    # third token needs a fifth block after step 3 and b (the newest) is preempted.
    runner = FakeRunner()
    engine = make_engine(runner, num_blocks=num_blocks, max_num_seqs=2,
                         enable_prefix_caching=caching)
    metrics = ServerMetrics(EngineState(engine))
    engine.add_request("a", [3] * 6, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("b", [4] * 6, SamplingParams(max_tokens=6, ignore_eos=True))
    _drive(engine, metrics)
    return engine, runner, metrics


@pytest.mark.parametrize("caching, queries, recomputed", [
    # b had computed 8 tokens (6 prompt + 2 sampled) when preempted; readmitted, its first
    # full block (tokens 0-3) is still cached, so it recomputes tokens 4-7 (4 tokens) and
    # computes token 8 for the first time.
    (True, 12, 4),
    # Without the cache all 8 are recomputed; nothing is ever looked up.
    (False, 0, 8),
])
def test_preemption_recompute_is_not_a_prefix_cache_hit(caching, queries, recomputed):
    plain, _, plain_metrics = _two_requests(64, caching)
    assert plain.get_stats().num_preemptions == 0
    engine, runner, metrics = _two_requests(4, caching)
    stats = engine.get_stats()
    assert stats.num_preemptions == 1
    # Hits and queries are exactly those of the run without preemption: 0 hits, the two
    # 6-token prompts queried once each.
    assert (plain.get_stats().prefix_cache_queries, plain.get_stats().prefix_cache_hits) \
        == (queries, 0)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (queries, 0)
    # The readmission's lookup is kept apart: b's 9 tokens, 4 found (its own block).
    kv = engine.kv_cache
    assert (kv.preempted_prefix_cache_queries, kv.preempted_prefix_cache_hits) \
        == ((9, 4) if caching else (0, 0))
    # The counter equals what the runner was asked to compute again: b's tokens below its
    # pre-preemption mark, in the steps after the preemption.
    at = next(i for i, out in enumerate(runner.steps) if out.preempted)
    before = [s for out in runner.steps[:at] for s in out.scheduled if s.request.request_id == "b"]
    mark = before[-1].num_computed_tokens + before[-1].num_scheduled_tokens
    again = sum(max(0, min(s.num_computed_tokens + s.num_scheduled_tokens, mark)
                    - s.num_computed_tokens)
                for out in runner.steps[at:] for s in out.scheduled if s.request.request_id == "b")
    assert (mark, again) == (8, recomputed)
    assert stats.num_recomputed_tokens == recomputed
    assert plain.get_stats().num_recomputed_tokens == 0
    # And on /metrics.
    reg = metrics.registry
    assert reg.get_sample_value("inflight:num_recomputed_tokens_total") == recomputed
    assert reg.get_sample_value("inflight:prefix_cache_hits_total") == 0
    assert reg.get_sample_value("inflight:prefix_cache_queries_total") == queries
    assert plain_metrics.registry.get_sample_value("inflight:num_recomputed_tokens_total") == 0
    assert metrics.stats()["num_recomputed_tokens_total"] == recomputed


# --- 3. aborted requests in the metrics ---------------------------------------------------
def _samples(metrics: ServerMetrics) -> dict[str, float]:
    """Every sample but ``_created`` stamps and the window gauges (which read the real
    clock at scrape time), keyed ``name{labels}``."""
    out = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name.endswith("_created") or s.name.endswith("_window"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def _abort_scenario(with_aborts: bool) -> tuple[ServerMetrics, dict[str, float]]:
    """``done`` (4-token prompt, 6 tokens, length) always; with ``with_aborts`` also
    ``gone`` (5-token prompt, streamed, aborted after 3 tokens) and ``queued`` (aborted
    before it was ever scheduled). 0.1 s steps on a virtual clock that starts at the real
    ``time.monotonic()``: a scrape reads the windows against the real clock."""
    clock = VirtualClock(start=time.monotonic())
    runner = ScriptedRunner(default=7, clock=clock)
    engine = Engine(EngineConfig(block_size=4, max_num_seqs=2), runner=runner,
                    num_blocks=64, max_model_len=4096, clock=clock)
    metrics = ServerMetrics(EngineState(engine))
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    engine.add_request("done", [5] * 4, SamplingParams(max_tokens=6, ignore_eos=True))
    if with_aborts:
        engine.add_request("gone", [6] * 5, params, stream=True)
        engine.add_request("queued", [8] * 3, params)  # max_num_seqs=2: waits for done
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if with_aborts and steps == 4:  # gone has sampled 3 tokens
            assert engine.abort_request("gone") and engine.abort_request("queued")
        outputs = engine.step()
        metrics.on_step(engine.get_stats(), outputs, clock())
    return metrics, _samples(metrics)


def test_an_aborted_request_is_observed_for_what_it_reached():
    _, base = _abort_scenario(False)
    metrics, after = _abort_scenario(True)
    now = time.monotonic()
    v = after.get
    assert v("inflight:request_success_total{finished_reason=abort}") == 2     # gone, queued
    assert v("inflight:request_success_total{finished_reason=length}") == 1    # done
    assert base.get("inflight:request_success_total{finished_reason=abort}") is None
    # gone was admitted and looked up (5 tokens); queued never was.
    assert v("inflight:prefix_cache_queries_total{}") == 4 + 5
    # Tokens: gone's prompt counted at its first token, queued's never; the per-request
    # histograms observe all three requests with exactly what the counters counted.
    assert v("inflight:prompt_tokens_total{}") == v("inflight:request_prompt_tokens_sum{}") == 4 + 5
    assert v("inflight:generation_tokens_total{}") == v("inflight:request_generation_tokens_sum{}") == 6 + 3
    assert v("inflight:request_prompt_tokens_count{}") == 3
    assert v("inflight:request_generation_tokens_count{}") == 3
    assert v("inflight:request_prompt_tokens_bucket{le=1.0}") == 1               # queued's 0
    assert v("inflight:request_params_n_count{}") == 3
    assert v("inflight:request_params_max_tokens_sum{}") == 6 + 50 + 50
    # Latencies end at the abort (before step 4: 0.3 s after arrival); a stage never
    # reached is not observed: queued was never scheduled and never got a token.
    assert v("inflight:e2e_request_latency_seconds_count{}") == 3
    assert v("inflight:e2e_request_latency_seconds_sum{}") == pytest.approx(0.6 + 0.3 + 0.3)
    assert sorted(metrics.windows["e2e_request_latency_seconds"].values(now)) == [
        pytest.approx(0.3), pytest.approx(0.3), pytest.approx(0.6)]
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_inference_time_seconds", "request_decode_time_seconds",
                 "time_to_first_token_seconds"):
        assert v(f"inflight:{name}_count{{}}") == 2, name                       # done, gone
    # decode: done 0.5 s (6 tokens), gone 0.2 s (3 tokens); per output token 0.1 s each.
    assert v("inflight:request_decode_time_seconds_sum{}") == pytest.approx(0.5 + 0.2)
    assert v("inflight:request_time_per_output_token_seconds_sum{}") == pytest.approx(0.1 + 0.1)
    assert v("inflight:inter_token_latency_seconds_count{}") == 2              # gone's 3 tokens
    assert len(metrics.windows["time_to_first_token_seconds"].values(now)) == 2
    # Nothing of the aborted requests stays in the listener.
    assert metrics._num_output_tokens == {} and metrics._first_token_seen == set()


# --- 4. priority aging --------------------------------------------------------------------
def test_default_priority_aging_admits_priority_10_within_20_s_of_saturation():
    config = EngineConfig(scheduling_policy="priority", max_num_seqs=1)
    assert config.priority_aging_s == 2.0
    bound = PriorityPolicy(config.priority_aging_s).outranks_after(10, 0)
    assert bound == 20.0 < 30.0
    clock = VirtualClock(dt=0.5)
    runner = ScriptedRunner(default=7, clock=clock)
    engine = Engine(config, runner=runner, num_blocks=64, max_model_len=4096, clock=clock)
    from inflight.request import RequestOptions
    engine.add_request("low", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True),
                       options=RequestOptions(priority=10))
    admitted_at = finished_at = None
    # Saturation: every step a fresh priority-0 request arrives, and each takes the only
    # slot for one step (1 token), so one always waits beside "low".
    for i in range(200):
        engine.add_request(f"p0-{i}", [4, 5, 6], SamplingParams(max_tokens=1, ignore_eos=True))
        now = clock()
        for out in engine.step():
            if out.request_id == "low" and out.finished:
                finished_at = out.metrics.finished_time
        scheduled = [s.request.request_id for s in runner.steps[-1].scheduled]
        if admitted_at is None and "low" in scheduled:
            admitted_at = (i, now)
        if finished_at is not None:
            break
    # Admitted at the first step at or after arrival + (10 - 0) x 2 s: step 40 at 20.0 s
    # (at 19.5 s its effective priority is 10 - 9 = 1, behind the fresh 0).
    assert admitted_at == (40, 20.0)
    assert runner.steps[39].scheduled[0].request.request_id == "p0-39"
    # Then 4 steps of its own: finished when step 43 ends, 22.0 s after arrival.
    assert finished_at == 22.0


@pytest.mark.parametrize("dt", [0.3, 0.7])
def test_priority_admission_is_the_first_step_at_or_after_the_bound(dt):
    config = EngineConfig(scheduling_policy="priority", max_num_seqs=1, priority_aging_s=1.0)
    clock = VirtualClock(dt=dt)
    runner = ScriptedRunner(default=7, clock=clock)
    engine = Engine(config, runner=runner, num_blocks=64, max_model_len=4096, clock=clock)
    from inflight.request import RequestOptions
    engine.add_request("low", [1, 2], SamplingParams(max_tokens=1, ignore_eos=True),
                       options=RequestOptions(priority=3))
    for i in range(100):
        engine.add_request(f"p0-{i}", [4, 5], SamplingParams(max_tokens=1, ignore_eos=True))
        engine.step()
        if any(s.request.request_id == "low" for s in runner.steps[-1].scheduled):
            break
    # The step starts at i * dt; the bound is (3 - 0) x 1 s.
    first = math.ceil(3.0 / dt - 1e-9)
    assert i == first


# --- 5. a KV pool smaller than max_model_len ----------------------------------------------
def _model_config(max_len: int = 8192) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576,
                       intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                       rope_theta=100000.0, max_position_embeddings=max_len,
                       tie_word_embeddings=True)


def test_explicit_max_model_len_past_the_pool_is_refused_naming_both_numbers():
    with pytest.raises(ValueError) as e:
        loading.resolve_max_model_len(2048, 8192, num_blocks=64, block_size=16)
    msg = str(e.value)
    assert msg.startswith("max_model_len: 2048 is larger than the KV cache can hold: "
                          "1024 tokens (64 blocks x 16)")
    assert "--max-model-len to 1024 or less" in msg and "--num-kv-blocks" in msg
    # Lowered to fit, or exactly the pool: served as asked.
    assert loading.resolve_max_model_len(1024, 8192, num_blocks=64, block_size=16) == 1024
    assert loading.resolve_max_model_len(1000, 8192, num_blocks=64, block_size=16) == 1000
    with pytest.raises(ValueError, match="exceeds the model's context length 8192"):
        loading.resolve_max_model_len(9000, 8192, num_blocks=1024, block_size=16)


def test_default_max_model_len_is_fitted_to_the_pool_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="inflight.engine.loading"):
        assert loading.resolve_max_model_len(None, 8192, num_blocks=64, block_size=16) == 1024
    assert "context length 8192 is larger than the KV cache can hold (1024 tokens" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="inflight.engine.loading"):
        assert loading.resolve_max_model_len(None, 8192, num_blocks=1024, block_size=16) == 8192
        # Even a one-block pool starts (the default must always start).
        assert loading.resolve_max_model_len(None, 8192, num_blocks=1, block_size=16) == 16
    assert caplog.text.count("larger than the KV cache") == 1


def test_load_refuses_before_allocating_the_kv_cache(monkeypatch):
    """``load`` with a too-small pool fails before any KV tensor exists (the model load is
    faked: the refusal must not need the weights)."""
    def fake_load(path, dtype, device, quantization="none", repack=True):
        return _model_config(), object(), object()

    def no_runner(*args, **kwargs):
        raise AssertionError("the KV cache was allocated before the refusal")

    monkeypatch.setattr(loading, "load_model_and_tokenizer", fake_load)
    monkeypatch.setattr(loading, "ModelRunner", no_runner)
    with pytest.raises(ValueError, match="max_model_len: 2048 is larger than the KV cache "
                                         "can hold: 256 tokens"):
        loading.load(EngineConfig(num_kv_blocks=16, max_model_len=2048, device="cpu"))


def test_default_kv_pool_holds_a_context_on_this_host():
    """``inflight serve`` with no flags: the CPU default budget gives a pool, and the model's
    context is served or fitted to it, never refused."""
    import torch

    c = _model_config()
    blocks = loading.num_kv_blocks(EngineConfig(), c, torch.float32, torch.device("cpu"))
    assert blocks >= 1
    served = loading.resolve_max_model_len(None, c.max_position_embeddings, blocks, 16)
    assert served == min(8192, blocks * 16)


def test_server_test_config_pool_holds_its_max_model_len():
    from tests.server.conftest import SMALL_CONFIG

    cfg = EngineConfig(**SMALL_CONFIG)
    assert cfg.num_kv_blocks * cfg.block_size >= cfg.max_model_len
