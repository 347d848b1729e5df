"""The synchronous engine: ``step()`` = schedule, execute, update, process outputs.

Used directly by offline ``LLM.generate`` and tests, and driven by a background loop in the
server. One ``step()`` is one iteration of Orca's iteration-level scheduling. The parts:
``core.Scheduler`` (token state, stops, KV blocks), the model runner (tensors, sampling),
``OutputProcessor`` (groups of ``n``, text, stop strings, outputs); see docs/architecture.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from inflight.config import EngineConfig
from inflight.core.kv_cache import KVCacheManager
from inflight.core.output import Runner, SchedulerOutput
from inflight.core.scheduler import Scheduler
from inflight.engine.inputs import tokenize_prompt
from inflight.errors import InvalidRequestError
from inflight.engine.output_processor import OutputProcessor
from inflight.engine.request_rules import RequestRules
from inflight.engine.stats import EngineStats, spec_decode_fields
from inflight.outputs import RequestOutput
from inflight.profiling import StepTimer
from inflight.request import Request, RequestOptions, RequestStatus
from inflight.sampling_params import SamplingParams
from inflight.spec_decode import make_proposer
from inflight.structured_output import GrammarState, StructuredOutputsParams

if TYPE_CHECKING:
    from inflight.engine.lora_manager import EngineLoRA

logger = logging.getLogger(__name__)

_NO_OPTIONS = RequestOptions()


class Engine:
    """Continuous-batching engine over a paged KV cache.

    Args:
        config: validated settings.
        runner: the model runner; built from ``config`` when None. Tests pass a fake.
        tokenizer: the tokenizer; loaded with the model when None. May be None together
            with a fake runner, then outputs carry token ids only.
        num_blocks: KV pool size when ``runner`` is given.
        max_model_len: context length when ``runner`` is given.
        eos_token_ids: end-of-sequence ids when ``runner`` is given.
        clock: seconds; arrival times, token stamps and the step-time model read it
            (``time.monotonic``; the simulator's runner advances a virtual one).
    """

    def __init__(self, config: EngineConfig | None = None, *, runner: Runner | None = None,
                 tokenizer: Any = None, num_blocks: int | None = None,
                 max_model_len: int | None = None, eos_token_ids: Iterable[int] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config = config or EngineConfig()
        self.clock = clock
        if runner is None:
            from inflight.engine import loading

            loaded = loading.load(config)
            runner, tokenizer, num_blocks = loaded.runner, loaded.tokenizer, loaded.num_blocks
            max_model_len, eos_token_ids = loaded.max_model_len, loaded.eos_token_ids
        if num_blocks is None:
            raise ValueError("num_blocks: required with a runner")
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size,
                                       config.enable_prefix_caching)
        lora = config.lora_config
        self.scheduler = Scheduler(config, self.kv_cache, max_model_len, clock,
                                   max_loras=0 if lora is None else lora.max_loras)
        self.lora: EngineLoRA | None = None
        if lora is not None:  # imported here: the adapters need torch, the engine does not
            from inflight.engine.lora_manager import EngineLoRA

            self.lora = EngineLoRA(lora, runner)
        spec = config.speculative_config
        # Drafts for the next step (speculative decoding); the scheduler's ``speculation``
        # decides for whom and how many.
        self.proposer = None if spec is None else make_proposer(
            spec, engine_config=config, target_kv_tokens=num_blocks * config.block_size)
        self.output_processor = OutputProcessor(tokenizer)
        self.rules = RequestRules(self.scheduler.check_prompt_fits, tokenizer)
        self._num_steps = 0
        self.last_plan: SchedulerOutput | None = None  # the last non-empty step's plan (step logs)
        # Per-request runner state to forget when a request ends (the sampler's generators);
        # fakes may have none.
        self._runner_release = getattr(runner, "release", None)
        self.step_timer = StepTimer(config.step_breakdown, getattr(runner, "device", None))
        if hasattr(runner, "step_timer"):
            runner.step_timer = self.step_timer

    @classmethod
    def from_engine_args(cls, **kwargs: Any) -> "Engine":
        """``Engine(EngineConfig(**kwargs))``; raises ``ValueError`` naming a bad field."""
        return cls(EngineConfig(**kwargs))

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    # --- requests -----------------------------------------------------------------------
    def check_prompt_fits(self, num_prompt_tokens: int, max_tokens: int | None = None) -> int:
        """The engine's one prompt-fit rule (``Scheduler.check_prompt_fits``): returns
        ``max_tokens`` or its default; raises ``InvalidRequestError`` naming the field."""
        return self.rules.check_prompt_fits(num_prompt_tokens, max_tokens)

    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    sampling_params: SamplingParams | None = None, *, stream: bool = False,
                    arrival_time: float | None = None,
                    options: RequestOptions | None = None) -> None:
        """Queue a request.

        Args:
            request_id: unique among unfinished requests.
            prompt: text (tokenized here) or token ids.
            sampling_params: defaults to ``SamplingParams()``.
            stream: emit an output every step with only the new text/tokens (deltas);
                otherwise one cumulative output when the request finishes. (The server's
                ``AsyncEngine`` always streams; its ``final_only`` is about delivery.)
            arrival_time: seconds on ``clock``; now when None.
            options: priority and latency targets (``RequestOptions``).

        Raises:
            InvalidRequestError (a ``ValueError``): duplicate id, empty prompt, token ids
                out of the vocabulary, or a prompt that can never fit (``max_model_len``,
                the KV pool, or the step budget with chunked prefill off).
        """
        params = sampling_params or SamplingParams()
        text, ids = tokenize_prompt(self.tokenizer, prompt)
        self.check_prompt_fits(len(ids), 0 if params.max_tokens == 0 else None)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.compile_grammar(params.structured_outputs)
        arrival = self.clock() if arrival_time is None else arrival_time
        options = options or _NO_OPTIONS
        if options.lora_name is not None and self.lora is None:
            raise InvalidRequestError(f"model: {options.lora_name!r} is a LoRA adapter and "
                                      "this engine serves none (start it with --enable-lora)")
        lora_id = 0 if self.lora is None else self.lora.id_for(options.lora_name)
        for req in self.output_processor.add_request(
                request_id, text, ids, params, stream=stream, arrival_time=arrival,
                eos_token_ids=self.eos_token_ids, options=options):
            req.lora_id = lora_id
            if grammar is not None:
                req.grammar = GrammarState(grammar)  # one matcher per sequence of n
            self.scheduler.add_request(req)

    def compile_grammar(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar for ``params`` (cached; thread-safe, so the server compiles
        on a worker thread first and the engine thread then finds it in the cache).

        Raises:
            InvalidRequestError: the spec does not compile, or there is no tokenizer.
        """
        return self.rules.compile_grammar(params)

    def abort_request(self, request_id: str, reason: str | None = None) -> bool:
        """Abort a request and all its sequences; frees their KV blocks at once.

        Args:
            request_id: the id given to ``add_request``.
            reason: why, when the server (not its client) aborts it; reported as the
                output's ``abort_reason``.

        Returns:
            False when no unfinished request has that id. Otherwise the next ``step()``
            returns its final output with ``finish_reason="abort"``.
        """
        if self.output_processor.is_finished(request_id):
            return False
        self._abort(self.output_processor.end_group(request_id, abort_reason=reason))
        return True

    def has_unfinished_requests(self) -> bool:
        return len(self.output_processor) > 0

    def reset_prefix_cache(self) -> int:
        """Drop every cached KV block no request holds; returns how many were dropped."""
        return self.kv_cache.reset_prefix_cache()

    def add_lora(self, name: str, path: str, base_model_name: str | None = None) -> int:
        """Load the LoRA adapter at ``path`` (a PEFT directory) as ``name``; its id.

        Raises:
            InvalidRequestError: LoRA is off. LoRAError (a ``ValueError``): ``name`` is
                taken, or the adapter cannot be served (the message says why).
        """
        if self.lora is None:
            raise InvalidRequestError("LoRA adapters are off: start the engine with --enable-lora")
        return self.lora.add(name, path, base_model_name)

    def remove_lora(self, name: str) -> bool:
        """Unload adapter ``name`` (False: none by that name); new requests for it are
        refused, requests already using it finish with it."""
        return self.lora is not None and self.lora.remove(name, self._in_flight())

    def get_stats(self) -> EngineStats:
        """Counters since start and gauges now; prefix-cache counters leave readmissions
        after preemption out, recomputation has ``num_recomputed_tokens``; speculative
        decoding's counters are copied from ``scheduler.speculation`` when it is on."""
        s, kv = self.scheduler, self.kv_cache
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=kv.usage(),
            num_preemptions=s.num_preemptions, prompt_tokens=s.num_prompt_tokens,
            generation_tokens=s.num_generation_tokens, num_steps=self._num_steps,
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            num_recomputed_tokens=s.num_recomputed_tokens,
            **({} if self.lora is None else self.lora.stats_fields(s.running, s.waiting)),
            **spec_decode_fields(None if s.speculation is None else s.speculation.stats))

    # --- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration: schedule, execute the model, update requests, make outputs.

        A failing model step fails only its requests; a failing output only its request.

        Returns:
            Outputs of requests that progressed (streamed ones) or finished this step.
        """
        timer = self.step_timer
        timer.begin_step()
        with timer.section("schedule"):
            out = self.scheduler.schedule()
        for req in out.shed:
            self._abort(self.output_processor.end_group(
                req.request_id, shed_reason=req.shed_reason, retry_after=req.shed_retry_after))
        if not out.is_empty:
            self._num_steps += 1
            self.last_plan = out
            t0 = self.clock()
            try:
                sampled = self.runner.execute(out)
            except Exception as e:  # one bad step must not kill the loop: fail its requests
                logger.exception("model step failed; failing its %d requests", len(out.scheduled))
                self.kv_cache.discard_step()
                for s in out.scheduled:
                    self._abort(self.output_processor.end_group(
                        s.request.request_id, error=f"{type(e).__name__}: {e}"))
            else:
                seconds = self.clock() - t0
                self.scheduler.step_model.observe(out.num_batched_tokens, seconds)
                with timer.section("output"):
                    updated = self.scheduler.update(out, sampled)
                    processed = self.output_processor.process(updated)
                    self.scheduler.num_generation_tokens -= processed.num_dropped_tokens
                    self._abort(processed.failed)
                    for req, stop in processed.stopped:
                        self.scheduler.stop_request(req, stop)
                    self._release([r for r in updated if r.is_finished])
                if self.proposer is not None:
                    self._propose(out, seconds)
        with timer.section("output"):
            outputs = self.output_processor.make_outputs(self._abort)
        timer.end_step(len(out.scheduled), out.num_batched_tokens)
        return outputs

    def _propose(self, out: SchedulerOutput, seconds: float) -> None:
        """Feed the step's cost to the load-aware switch (decode-only steps: their cost
        is what drafts add to) and draft for the next step."""
        spec = self.scheduler.speculation
        assert spec is not None and self.proposer is not None
        if all(s.is_decode for s in out.scheduled):
            spec.observe_step(out.num_batched_tokens, seconds)
        with self.step_timer.section("propose"):
            t0 = self.clock()
            wanted = self.scheduler.requests_to_draft()
            self.proposer.propose(wanted)
            spec.observe_proposal(len(wanted), self.clock() - t0)

    def _abort(self, requests: Sequence[Request]) -> None:
        for req in requests:
            self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
        self._release(requests)

    def _release(self, requests: Iterable[Request]) -> None:
        releases = [f for f in (self._runner_release, getattr(self.proposer, "release", None))
                    if f is not None]
        for req in requests:
            for release in releases:
                release(req.request_id)
        if self.lora is not None and self.lora.holds_unloaded:  # rare: skip the scan
            self.lora.forget_unused(self._in_flight())

    def _in_flight(self) -> list[Request]:
        return self.scheduler.running + list(self.scheduler.waiting)
