"""A simulated replica: a real engine on a virtual clock whose runner computes nothing. Torch-free.

The runner (:class:`SimRunner`) advances the replica's clock by the profile's time for each
step's shape (:mod:`inflight.sim.profile`) and returns a token per sampling row, the
end-of-sequence token once a request reaches its dataset length; everything else (the
``Scheduler``, ``KVCacheManager``, ``OutputProcessor``) is the real engine's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from inflight.config import EngineConfig
from inflight.core.output import SampleResult, SchedulerOutput
from inflight.engine.admission import has_room
from inflight.engine.engine import Engine
from inflight.routing import ReplicaLoad
from inflight.sim.profile import StepProfile
from inflight.sim.step_shape import StepShape


class VirtualClock:
    """A clock the simulation sets; ``clock()`` reads it (seconds)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class SimRunner:
    """The ``Runner`` of a simulated replica: each ``execute`` advances ``clock`` by the
    profile's time for the step's shape and samples placeholder tokens.

    Args:
        profile: the step-time profile.
        clock: the replica's clock.
        eos_token_id: returned when a request reaches its target length.
        filler_token_id: every other sampled token (not an EOS or stop id).
        rng: draws the measured steps' variation (``FittedCostModel.sample``); None: every
            step takes the predicted time.
    """

    def __init__(self, profile: StepProfile, clock: VirtualClock, eos_token_id: int,
                 filler_token_id: int, rng: np.random.Generator | None = None) -> None:
        self.profile, self.clock, self.rng = profile, clock, rng
        sample = getattr(profile.cost, "sample", None)
        self._sample = sample if rng is not None and sample is not None else None
        self.eos_token_id, self.filler_token_id = eos_token_id, filler_token_id
        self.targets: dict[str, int] = {}  # request id -> output length ended by EOS
        self.error: Exception | None = None
        self.num_steps = 0
        self.busy_s = 0.0
        self.num_extrapolated = 0  # steps larger than any the profile measured
        self._in_range = getattr(profile.cost, "in_range", None)

    def execute(self, out: SchedulerOutput) -> list[SampleResult]:
        shape = StepShape.of(out.scheduled)
        try:
            seconds = self._sample(shape, self.rng) if self._sample else self.profile.predict(shape)
        except Exception as e:  # the engine would fail the step's requests: a bad profile is ours
            self.error = e
            raise
        self.clock.now += seconds
        self.num_steps += 1
        if self._in_range is not None and not self._in_range(shape):
            self.num_extrapolated += 1
        self.busy_s += seconds
        results = []
        for s in out.scheduled:
            if not s.samples:
                continue
            req = s.request
            target = self.targets.get(req.request_id)
            eos = target is not None and req.num_output_tokens + 1 >= target
            results.append(SampleResult(req, self.eos_token_id if eos else self.filler_token_id, None))
        return results

    def release(self, request_id: str) -> None:
        """Forget a request that ended (the engine calls a runner's ``release`` when it can)."""
        self.targets.pop(request_id, None)


class SimReplica:
    """One engine on its own virtual clock."""

    def __init__(self, index: int, config: EngineConfig, profile: StepProfile, num_blocks: int,
                 max_model_len: int, eos_token_ids: Sequence[int], max_num_waiting: int | None,
                 rng: np.random.Generator | None = None) -> None:
        self.index = index
        self.clock = VirtualClock()
        eos = sorted(eos_token_ids) or [0]
        filler = next(t for t in itertools.count() if t not in eos)
        self.runner = SimRunner(profile, self.clock, eos[0], filler, rng)
        self.engine = Engine(config, runner=self.runner, tokenizer=None, num_blocks=num_blocks,
                             max_model_len=max_model_len, eos_token_ids=eos, clock=self.clock)
        self.max_num_waiting = max_num_waiting
        self.busy = False
        self.pending = 0  # arrived and admitted, not yet in the engine's queue
        self.load = ReplicaLoad()

    def publish(self) -> None:
        """Report the load the router and the admission bound read until the next report
        (the server's engine thread publishes after each step)."""
        s = self.engine.get_stats()
        self.load = ReplicaLoad(s.num_running, s.num_waiting + self.pending, s.kv_cache_usage)

    def admits(self, n: int = 1) -> bool:
        """The server's admission bound (``admission.has_room``) on the last report."""
        return has_room(n, self.load.num_waiting, self.load.num_running, self.engine.config.max_num_seqs,
                        self.max_num_waiting)
