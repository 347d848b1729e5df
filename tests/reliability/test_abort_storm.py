"""Abort storm (CI variant): waves of concurrent streams, half of whose clients vanish.

Three waves of 16 concurrent streaming requests (chat and completions, 4..48 tokens, some
``ignore_eos``, some seeded sampling, some with a usage chunk) hit a real uvicorn around the
real model, on a small KV pool (near full at a wave's peak). Half of the clients
disconnect at a seeded random point: after k chunks, or before the first byte (the 200
headers wait for the first token, so that is while queued or prefilling). Everything is
seeded, so a failure reproduces with the same plan.

Promises checked: no request is lost (every client that stayed gets a ``stop``/``length``
finish and ``data: [DONE]`` last, and no error event); once the clients are gone the engine
is idle (running, waiting, KV usage 0) with every block back in the pool and no
per-request state left anywhere; ``inflight:request_success_total`` counts exactly one
finish per request that reached the engine; and the server still answers afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.reliability.conftest import (app_metrics, assert_engine_clean, engine_sharing_model,
                                        finished_by_reason, is_idle, scrape, stats)
from tests.server.conftest import MODEL, serve, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SEED = 20261202
WAVES, PER_WAVE = 3, 16
# 48 blocks x 16 tokens = 768 token slots, less than a wave's worst case (16 streams of up
# to ~40 prompt + 48 output tokens), so the pool runs near full and admission can wait on
# free blocks; prefix-cached chat-template blocks are shared (ref counts > 1) while aborted.
NUM_BLOCKS = 48
PROMPTS = ["Name three planets.", "What is 2+2?", "Write a haiku about rain.",
           "Explain photosynthesis briefly.", "List some colours.", "Tell me a joke.",
           "Why is the sky blue?", "Count to ten."]


@dataclass
class Plan:
    """What one client does; drawn from the seeded RNG."""

    index: int
    chat: bool
    max_tokens: int
    ignore_eos: bool
    seed: int | None
    include_usage: bool
    abort: str | None  # None (stay to the end), "chunks" or "before_first_byte"
    abort_after_chunks: int = 0
    abort_after_s: float = 0.0
    start_delay_s: float = 0.0

    def body(self) -> dict:
        prompt = PROMPTS[self.index % len(PROMPTS)]
        body: dict = {"model": MODEL, "max_tokens": self.max_tokens, "stream": True,
                      "ignore_eos": self.ignore_eos,
                      "temperature": 0.0 if self.seed is None else 0.8}
        if self.seed is not None:
            body["seed"] = self.seed
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body


@dataclass
class Outcome:
    plan: Plan
    status: int | None = None
    lines: list[str] = field(default_factory=list)  # the "data: ..." lines received
    finish_reason: str | None = None
    done: bool = False  # saw data: [DONE]
    left: bool = False  # the client closed the connection on purpose
    error: str | None = None  # an exception or an error event


def make_plans(rng: random.Random, wave: int) -> list[Plan]:
    plans = []
    for i in range(PER_WAVE):
        idx = wave * PER_WAVE + i
        max_tokens = rng.randint(4, 48)
        abort = None
        if i % 2 == 1:  # half of each wave leaves
            abort = rng.choice(("chunks", "chunks", "before_first_byte"))
        plans.append(Plan(index=idx, chat=rng.random() < 0.5, max_tokens=max_tokens,
                          ignore_eos=rng.random() < 0.5,
                          seed=rng.randint(0, 2**31) if rng.random() < 0.3 else None,
                          include_usage=rng.random() < 0.3, abort=abort,
                          abort_after_chunks=rng.randint(1, max(1, max_tokens // 2)),
                          abort_after_s=rng.uniform(0.0, 0.6),
                          start_delay_s=rng.uniform(0.0, 0.3)))
    return plans


async def run_client(client: httpx.AsyncClient, plan: Plan) -> Outcome:
    """Send one streaming request and follow its plan; never raises."""
    out = Outcome(plan)
    path = "/v1/chat/completions" if plan.chat else "/v1/completions"
    await asyncio.sleep(plan.start_delay_s)

    async def follow() -> None:
        async with client.stream("POST", path, json=plan.body()) as r:
            out.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                out.error = f"status {r.status_code}: {r.text[:200]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                out.lines.append(line)
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    out.done = True
                    continue
                event = json.loads(payload)
                if "error" in event:
                    out.error = f"error event: {event['error']}"
                for choice in event.get("choices", []):
                    if choice.get("finish_reason") is not None:
                        out.finish_reason = choice["finish_reason"]
                chunks = sum(1 for ln in out.lines if ln != "data: [DONE]")
                if plan.abort == "chunks" and chunks >= plan.abort_after_chunks and not out.done:
                    out.left = True
                    return  # leaving the block closes the connection mid-stream

    try:
        if plan.abort == "before_first_byte":
            # Cancel while waiting for the headers (or early in the body if the first token
            # came quicker): cancellation closes the connection.
            try:
                await asyncio.wait_for(follow(), timeout=plan.abort_after_s)
            except asyncio.TimeoutError:
                out.left = True
        else:
            await follow()
    except Exception as e:  # a reset, a timeout: lost unless the client meant to leave
        out.error = f"{type(e).__name__}: {e}"
    return out


def check_completed(o: Outcome) -> list[str]:
    """Why a client that did not leave did not get a whole response (empty: it did)."""
    problems = []
    if o.status != 200:
        problems.append(f"status {o.status}")
    if o.error:
        problems.append(o.error)
    if o.finish_reason not in ("stop", "length"):
        problems.append(f"finish_reason {o.finish_reason!r}")
    if not o.lines or o.lines[-1] != "data: [DONE]":
        problems.append(f"last line {o.lines[-1] if o.lines else None!r}, not [DONE]")
    if sum(1 for ln in o.lines if ln == "data: [DONE]") != 1:
        problems.append("[DONE] not exactly once")
    if o.plan.ignore_eos and o.finish_reason == "stop":
        problems.append("ignore_eos stream stopped before max_tokens")
    return problems


@pytest.fixture(scope="module")
def storm_server(base_engine):
    with engine_sharing_model(base_engine, num_blocks=NUM_BLOCKS) as engine:
        srv, async_engine = serve(engine)  # unbounded queue: no request may be refused
        added: list[str] = []
        real_add = async_engine.add_request

        def spy(request_id, *args, **kwargs):
            stream = real_add(request_id, *args, **kwargs)
            added.append(request_id)  # reached the engine (each request is one sequence)
            return stream

        async_engine.add_request = spy
        try:
            yield srv, async_engine, engine, added
        finally:
            srv.stop()
            async_engine.shutdown()


def test_abort_storm_loses_nothing_and_leaks_nothing(storm_server):
    srv, async_engine, engine, added = storm_server
    url = srv.base_url
    rng = random.Random(SEED)
    before = scrape(url)
    preemptions_before = engine.get_stats().num_preemptions
    t0 = time.monotonic()

    async def storm() -> list[Outcome]:
        outcomes: list[Outcome] = []
        limits = httpx.Limits(max_connections=PER_WAVE * 2, max_keepalive_connections=PER_WAVE)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits,
                                     trust_env=False) as client:
            for wave in range(WAVES):
                plans = make_plans(rng, wave)
                outcomes += await asyncio.wait_for(
                    asyncio.gather(*(run_client(client, p) for p in plans)), timeout=90)
        return outcomes

    outcomes = asyncio.run(storm())
    storm_s = time.monotonic() - t0
    sent = len(outcomes)
    assert sent == WAVES * PER_WAVE

    # 1. Nothing lost: every client that did not leave got a whole response.
    stayed = [o for o in outcomes if not o.left]
    lost = {o.plan.index: check_completed(o) for o in stayed if check_completed(o)}
    assert lost == {}, f"lost requests (index: problems): {lost}"
    # Clients that left did so on purpose, with no error before they left.
    errors = {o.plan.index: o.error for o in outcomes if o.left and o.error}
    assert errors == {}, errors
    left = [o for o in outcomes if o.left]
    assert len(left) >= WAVES * PER_WAVE // 4, "the plan must actually abort a good share"

    # 2. The engine drains: running, waiting and KV usage back to 0.
    wait_until(lambda: is_idle(url), timeout=15, interval=0.05,
               what=f"idle after the storm (last /stats: {stats(url)})")
    wait_until(lambda: not engine.has_unfinished_requests(), timeout=5,
               what="the output processor to empty")
    after = scrape(url)
    assert after["inflight:num_requests_running"] == 0
    assert after["inflight:num_requests_waiting"] == 0
    assert after["inflight:kv_cache_usage_perc"] == 0

    # 3. No block or per-request state leaked.
    assert_engine_clean(engine, async_engine, app_metrics(srv))

    # 4. The finish counters account for every request exactly once. A client that left
    # before its request reached the engine (while the server was still reading or
    # tokenizing it) leaves no trace there; only "before first byte" clients can do that.
    reached = set(added)
    assert len(added) == len(reached), "a request id was added twice"
    # Every stream that got a chunk was, of course, in the engine (ids are "<id>-<prompt>").
    unseen = [o.plan.index for o in outcomes
              if _response_id(o) is not None and f"{_response_id(o)}-0" not in reached]
    assert unseen == [], f"streams whose engine request was never added: {unseen}"
    deltas = finished_by_reason(before, after)
    assert deltas["error"] == 0, deltas
    assert sum(deltas.values()) == len(added), (
        f"success+abort counters {deltas} sum to {sum(deltas.values())}, but "
        f"{len(added)} of {sent} sent requests reached the engine")
    # Every client that stayed saw stop/length; a leaver's request may still have finished
    # first (its last chunk was already on the wire), so those bound the counters only.
    assert deltas["stop"] + deltas["length"] >= len(stayed)
    assert deltas["abort"] <= len(left)
    not_added = sent - len(added)
    assert 0 <= not_added <= sum(1 for o in left if o.plan.abort == "before_first_byte")

    # 5. The server still serves a normal request.
    r = httpx.post(url + "/v1/chat/completions", timeout=30, trust_env=False, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    wait_until(lambda: is_idle(url), timeout=5, what="idle after the last request")
    assert_engine_clean(engine, async_engine, app_metrics(srv))

    print(f"\nabort storm: {sent} sent in {storm_s:.1f} s, {len(stayed)} completed, "
          f"{len(left)} left ({sum(o.plan.abort == 'before_first_byte' for o in left)} before "
          f"the first byte, {sum(o.left and o.status is None for o in left)} of them before "
          f"the headers), {not_added} never reached the engine; counters {deltas}; "
          f"preemptions {engine.get_stats().num_preemptions - preemptions_before}; "
          f"load average {tuple(round(x, 2) for x in os.getloadavg())}")


def _response_id(o: Outcome) -> str | None:
    """The response ``id`` of a stream that got at least one chunk (engine ids extend it)."""
    for line in o.lines:
        if line != "data: [DONE]":
            return json.loads(line[len("data: "):]).get("id")
    return None
