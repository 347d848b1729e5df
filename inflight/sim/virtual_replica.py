"""A simulated replica: a real engine on a virtual clock whose runner computes nothing. Torch-free.

The runner (:class:`SimRunner`) advances the replica's clock by the profile's time for each
step's shape (:mod:`inflight.sim.profile`) and returns a token per sampling row, the
end-of-sequence token once a request reaches its dataset length; everything else (the
``Scheduler``, ``KVCacheManager``, ``OutputProcessor``) is the real engine's.

With ``speculative_config`` the scheduler's ``Speculation`` decides as it would serving
(who drafts, how many, whether a step's batch should verify at all, from the step costs it
observes on the virtual clock); the engine's proposer is a :class:`VirtualProposer` (filler
drafts), and the runner keeps ``1 + A`` tokens of each verification, ``A`` drawn from the
acceptance profile (:mod:`inflight.sim.acceptance`). A verification's rows are priced as
decode rows (``StepShape.of``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from inflight.config import EngineConfig
from inflight.core.output import SampleResult, SchedulerOutput
from inflight.engine.admission import has_room
from inflight.engine.engine import Engine
from inflight.request import Request
from inflight.routing import ReplicaLoad
from inflight.sim.acceptance import AcceptanceProfile
from inflight.sim.profile import StepProfile
from inflight.sim.step_shape import StepShape


NO_ACCEPTANCE = ("speculative_config is set but the profile does not say how often drafts are accepted: add "
                 "'\"speculation\": {\"acceptance_per_position\": [0.7, 0.6, ...]}' to it (a profile fitted to a "
                 "speculating server's step log has it; format: inflight/sim/acceptance.py)")


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
        acceptance: how many drafts a verification keeps (needed when a plan has drafts).
        spec_rng: draws the accepted drafts (its own stream: noise on or off, a seed
            accepts the same drafts).
    """

    def __init__(self, profile: StepProfile, clock: VirtualClock, eos_token_id: int,
                 filler_token_id: int, rng: np.random.Generator | None = None,
                 acceptance: AcceptanceProfile | None = None,
                 spec_rng: np.random.Generator | None = None) -> None:
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
        self.acceptance = acceptance
        self.spec_rng = spec_rng or np.random.default_rng(0)

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
        results: list[SampleResult] = []
        for s in out.scheduled:
            if s.samples:
                results += self._sample_row(s.request, s.num_draft_tokens)
        return results

    def _sample_row(self, req: Request, num_drafts: int) -> list[SampleResult]:
        """The tokens one request keeps: one, or ``1 + A`` of a verification (``A`` drawn);
        the EOS token at its target length ends them (a draft there is rejected: the
        target model's token is the EOS)."""
        kept = 1
        if num_drafts:
            if self.acceptance is None:
                raise ValueError("a plan verifies drafts but the simulation has no acceptance profile")
            kept += self.acceptance.draw(num_drafts, self.spec_rng)
        target = self.targets.get(req.request_id)
        out = []
        for j in range(kept):
            eos = target is not None and req.num_output_tokens + j + 1 >= target
            out.append(SampleResult(req, self.eos_token_id if eos else self.filler_token_id, None))
            if eos:
                break
        return out

    def release(self, request_id: str) -> None:
        """Forget a request that ended (the engine calls a runner's ``release`` when it can)."""
        self.targets.pop(request_id, None)


class VirtualProposer:
    """The engine's proposer in a simulated replica (``core.speculation.Proposer``): each
    request asked for gets as many filler drafts as it may have; a proposing step advances
    the clock by ``draft_s`` per draft position (a draft model's sequential passes)."""

    def __init__(self, draft_token_id: int, clock: VirtualClock, draft_s: float = 0.0) -> None:
        self.draft_token_id, self.clock, self.draft_s = draft_token_id, clock, draft_s

    def propose(self, requests: list[tuple[Request, int]]) -> None:
        for req, k in requests:
            req.spec_token_ids = [self.draft_token_id] * k
        if requests:
            self.clock.now += self.draft_s * max(k for _, k in requests)


class SimReplica:
    """One engine on its own virtual clock.

    Args:
        acceptance: the acceptance profile (None: the profile's); one is required when
            ``config`` speculates.
        spec_rng: draws the accepted drafts.

    Raises:
        ValueError: ``config.speculative_config`` without ``acceptance``.
    """

    def __init__(self, index: int, config: EngineConfig, profile: StepProfile, num_blocks: int,
                 max_model_len: int, eos_token_ids: Sequence[int], max_num_waiting: int | None,
                 rng: np.random.Generator | None = None, acceptance: AcceptanceProfile | None = None,
                 spec_rng: np.random.Generator | None = None) -> None:
        self.index = index
        self.clock = VirtualClock()
        eos = sorted(eos_token_ids) or [0]
        filler = next(t for t in itertools.count() if t not in eos)
        spec = config.speculative_config
        acceptance = acceptance or profile.acceptance
        if spec is not None:
            if acceptance is None:
                raise ValueError(NO_ACCEPTANCE)
            # The proposer the config names is replaced below: build the engine with the
            # one that needs no model (the scheduler reads k and the policy knobs only).
            config = dataclasses.replace(config, speculative_config=dataclasses.replace(
                spec, method="ngram", model=None))
        self.runner = SimRunner(profile, self.clock, eos[0], filler, rng, acceptance, spec_rng)
        self.engine = Engine(config, runner=self.runner, tokenizer=None, num_blocks=num_blocks,
                             max_model_len=max_model_len, eos_token_ids=eos, clock=self.clock)
        if spec is not None:
            assert acceptance is not None
            self.engine.proposer = VirtualProposer(filler, self.clock, acceptance.draft_s)
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
