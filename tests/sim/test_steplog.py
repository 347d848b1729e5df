"""Step logs: what a serving engine writes is what the profile fit reads back."""

from __future__ import annotations

import asyncio
import json

import pytest

from inflight.config import EngineConfig
from inflight.engine.async_engine import AsyncEngine
from inflight.engine.engine import Engine
from inflight.sampling_params import SamplingParams
from inflight.sim.step_shape import StepShape
from inflight.sim.steplog import StepLog, read_step_logs
from tests.conftest import FakeRunner


def test_a_served_engines_steps_round_trip(tmp_path):
    runner = FakeRunner()
    engine = AsyncEngine(Engine(EngineConfig(max_num_batched_tokens=32), runner=runner, num_blocks=64,
                                max_model_len=1024, eos_token_ids=[2]), log_interval_s=0)
    path = tmp_path / "steps.jsonl"
    log = StepLog(path, engine, None, header={"engine": {"block_size": 16}, "model": {}})
    engine.listeners.append(log)
    engine.start()

    async def serve() -> None:
        async def one(i: int) -> None:
            async for _ in engine.generate(f"r{i}", [5] * (20 + 10 * i), SamplingParams(max_tokens=4)):
                pass
        await asyncio.gather(*(one(i) for i in range(3)))
    asyncio.run(serve())
    engine.shutdown()
    log.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()[1:]]
    planned = [StepShape.of(out.scheduled) for out in runner.steps]
    assert [StepShape(*r[2:8]) for r in rows] == planned  # every step, in order, with its shape
    header, shapes, seconds = read_step_logs([path])
    assert header == {"engine": {"block_size": 16}, "model": {}}
    # Durations only between steps with no wait of the loop in between.
    kept = [StepShape(*b[2:8]) for a, b in zip(rows, rows[1:]) if a[1] == b[1]]
    assert shapes == kept and len(shapes) >= 1
    assert all(s > 0 for s in seconds)


def test_read_refuses_other_files(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"kind": "something"}\n')
    with pytest.raises(ValueError, match="not an inflight step log"):
        read_step_logs([tmp_path / "x.jsonl"])
