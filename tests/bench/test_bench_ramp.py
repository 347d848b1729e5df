"""The calibration ramp (``bench capacity --calibrate``) on the fake server."""

from __future__ import annotations

import asyncio

from bench_fake_openai import ServerState, queueing_plan
from test_bench_capacity import fake_session

from inflight.bench.client import make_client
from inflight.bench.ramp import run_ramp


def test_the_ramp_stops_once_the_server_saturates(fake_server, data_dir):
    """One slot of 25 ms (40 req/s at most), a ramp from 10 req/s doubling every 1.5 s:
    10 and 20 keep up, 40 or 80 saturates, one more segment there, then the drain."""
    srv = fake_server(ServerState(plan=queueing_plan(0.025)))

    async def main():
        async with make_client() as client:
            session = await fake_session(client, srv, data_dir, 40)
            return await run_ramp(session, 10.0, segment_s=1.5, max_segments=6, drain_s=5.0)
    ramp = asyncio.run(main())
    assert ramp.rates[:2] == [10.0, 20.0]
    assert ramp.saturated_at in (40.0, 80.0) and ramp.rates[-1] == ramp.rates[-2] == ramp.saturated_at
    assert ramp.growth[-1] > 0.2 * ramp.saturated_at * 1.5 * 0.5
    assert ramp.sent > 0 and ramp.completed == len(ramp.outputs) == ramp.sent  # the drain let them end
    assert all(n == 2 for _, n in ramp.outputs)  # the fake answers max_tokens=2 chunks
