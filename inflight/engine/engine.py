"""The synchronous engine: ``step()`` = schedule, execute, update.

Used directly by offline ``LLM.generate`` and tests, and driven by a background loop in the
server. One ``step()`` is one iteration of Orca's iteration-level scheduling.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from inflight.config import EngineConfig
from inflight.core.kv_cache import KVCacheManager
from inflight.core.scheduler import Scheduler
from inflight.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inflight.profiling import StepTimer
from inflight.request import Request, RequestStatus
from inflight.sampler import SampleResult
from inflight.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters and gauges for metrics and the periodic log line.

    Attributes:
        num_running, num_waiting: requests (sequences) now running / waiting.
        kv_cache_usage: fraction of KV blocks in use, 0..1.
        num_preemptions: preemptions since start.
        prompt_tokens, generation_tokens: tokens computed for prompts / sampled, since start.
        num_steps: engine steps since start.
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up in / found in the
            prefix cache at admission, since start.
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_steps: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class _Sequence:
    """Engine-side companions of one ``Request``: its detokenizer and output cursor."""

    def __init__(self, request: Request, index: int, detokenizer, group_id: str) -> None:
        self.request = request
        self.index = index
        self.detokenizer = detokenizer
        self.group_id = group_id
        self.num_sent_tokens = 0  # tokens already returned in stream deltas
        self.sent_finish = False


class _RequestGroup:
    """The ``n`` sequences of one user request."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 stream: bool) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.stream = stream
        self.seqs: list[_Sequence] = []
        self.error: str | None = None
        self.shed_reason: str | None = None
        self.abort_reason: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.seqs)


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
    """

    def __init__(self, config: EngineConfig | None = None, *, runner=None, tokenizer=None,
                 num_blocks: int | None = None, max_model_len: int | None = None,
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.config = config = config or EngineConfig()
        if runner is None:
            runner, tokenizer, num_blocks, max_model_len, eos_token_ids = self._build(config)
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size,
                                       config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv_cache)
        self.max_model_len = config.max_model_len or max_model_len
        # A sequence can never outgrow the whole pool, so a lone request always fits.
        self.max_sequence_len = min(self.max_model_len, num_blocks * config.block_size)
        self._groups: dict[str, _RequestGroup] = {}
        self._seqs: dict[str, _Sequence] = {}
        self._dirty: dict[str, _RequestGroup] = {}
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_steps = 0
        self.step_timer = StepTimer(config.step_breakdown, getattr(runner, "device", None))
        if hasattr(runner, "step_timer"):
            runner.step_timer = self.step_timer

    @classmethod
    def from_engine_args(cls, **kwargs) -> "Engine":
        """``Engine(EngineConfig(**kwargs))``; raises ``ValueError`` naming a bad field."""
        return cls(EngineConfig(**kwargs))

    @staticmethod
    def _build(config: EngineConfig):
        from inflight.engine import loading
        from inflight.runner import ModelRunner
        from inflight.sampler import Sampler

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = loading.resolve_device(config.device)
        dtype = loading.resolve_dtype(config.dtype, device)
        kv_dtype = dtype if config.kv_cache_dtype == "auto" else loading.resolve_dtype(
            config.kv_cache_dtype, device)
        path = loading.resolve_model_path(config.model)
        t0 = time.monotonic()
        model_config, model, tokenizer = loading.load_model_and_tokenizer(path, dtype, device)
        max_len = config.max_model_len or model_config.max_position_embeddings
        if max_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len: {max_len} exceeds the model's context length "
                             f"{model_config.max_position_embeddings}")
        blocks = loading.num_kv_blocks(config, model_config, kv_dtype, device)
        runner = ModelRunner(model, blocks, config.block_size, kv_dtype,
                             Sampler(config.seed, device))
        eos = set(model_config.eos_token_ids) | set(tokenizer.eos_token_ids)
        logger.info("loaded %s (%s, %s on %s) in %.1f s; KV cache: %d blocks x %d tokens = "
                    "%d tokens (%.1f MiB); max_model_len %d", path.name,
                    model_config.architecture, str(dtype).removeprefix("torch."), device,
                    time.monotonic() - t0, blocks, config.block_size, blocks * config.block_size,
                    sum(t.numel() * t.element_size() for t in runner.kv_caches) / 2**20, max_len)
        if blocks * config.block_size < max_len:
            logger.warning("the KV cache holds %d tokens, fewer than max_model_len %d: "
                           "sequences stop at %d tokens", blocks * config.block_size, max_len,
                           blocks * config.block_size)
        return runner, tokenizer, blocks, max_len, eos

    # --- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int],
                    sampling_params: SamplingParams | None = None, *, stream: bool = False,
                    arrival_time: float | None = None, priority: int = 0,
                    ttft_slo: float | None = None, itl_slo: float | None = None) -> None:
        """Queue a request.

        Args:
            request_id: unique among unfinished requests.
            prompt: text (tokenized here) or token ids.
            sampling_params: defaults to ``SamplingParams()``.
            stream: emit an output every step with only the new text/tokens (deltas);
                otherwise one cumulative output when the request finishes.
            arrival_time: ``time.monotonic()`` seconds; now when None.
            priority: lower is served first under the ``priority`` scheduling policy.
            ttft_slo, itl_slo: this request's latency targets (seconds) under ``slo``.

        Raises:
            ValueError: duplicate id, empty prompt, token ids out of the vocabulary, or a
                prompt that can never fit (``max_model_len``, the KV pool, or the step
                budget with chunked prefill off).
        """
        params = sampling_params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_text, prompt_ids = self._tokenize(prompt)
        self._check_prompt_fits(len(prompt_ids))
        group = _RequestGroup(request_id, prompt_text, prompt_ids, stream)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        for i in range(params.n):
            seq_params = params
            if params.n > 1:
                seq_params = params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            seq_id = request_id if params.n == 1 else f"{i}_{request_id}"
            req = Request(seq_id, prompt_ids, seq_params, arrival, self.eos_token_ids,
                          priority=priority, ttft_slo=ttft_slo, itl_slo=itl_slo)
            seq = _Sequence(req, i, self._make_detokenizer(req), request_id)
            group.seqs.append(seq)
            self._seqs[seq_id] = seq
        self._groups[request_id] = group
        for seq in group.seqs:
            self.scheduler.add_request(seq.request)

    def _tokenize(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text needs a tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids = list(prompt)
            text = None
            vocab = getattr(self.tokenizer, "vocab_size", None)
            for t in ids:
                if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab and t >= vocab):
                    raise ValueError(f"prompt: token id {t!r} is not in the vocabulary")
        if not ids:
            raise ValueError("prompt: must not be empty")
        return text, ids

    def _check_prompt_fits(self, n: int) -> None:
        if n >= self.max_model_len:
            raise ValueError(f"prompt: {n} tokens leave no room to generate within "
                             f"max_model_len {self.max_model_len}")
        if n >= self.max_sequence_len:
            raise ValueError(f"prompt: {n} tokens do not fit in the KV cache "
                             f"({self.max_sequence_len} tokens)")
        if not self.config.enable_chunked_prefill and n > self.config.max_num_batched_tokens:
            raise ValueError(f"prompt: {n} tokens exceed max_num_batched_tokens "
                             f"{self.config.max_num_batched_tokens} with chunked prefill off")

    def _make_detokenizer(self, req: Request):
        if self.tokenizer is None:
            return None
        from inflight.tokenizer.detokenizer import IncrementalDetokenizer

        p = req.sampling_params
        return IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, skip_special_tokens=p.skip_special_tokens,
            stop=p.stop_strings, include_stop_str_in_output=p.include_stop_str_in_output)

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
        group = self._groups.get(request_id)
        if group is None or group.finished:
            return False
        for seq in group.seqs:
            self._finish(seq.request, RequestStatus.FINISHED_ABORTED)
        group.abort_reason = reason
        self._dirty[request_id] = group
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def reset_prefix_cache(self) -> int:
        """Drop every cached KV block no request holds; returns how many were dropped."""
        return self.kv_cache.reset_prefix_cache()

    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_cache.usage(), num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self._num_prompt_tokens, generation_tokens=self._num_generation_tokens,
            num_steps=self._num_steps, prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits)

    # --- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration: schedule, execute the model, update requests.

        Returns:
            Outputs of requests that progressed (streamed ones) or finished this step.
        """
        timer = self.step_timer
        timer.begin_step()
        with timer.section("schedule"):
            out = self.scheduler.schedule()
        for req in out.shed:
            self._on_shed(req)
        if not out.is_empty:
            self._num_steps += 1
            self._num_prompt_tokens += sum(
                max(0, min(s.num_computed_tokens + s.num_scheduled_tokens,
                           s.request.num_prompt_tokens) - s.num_computed_tokens)
                for s in out.scheduled)
            t0 = time.perf_counter()
            try:
                results = self.runner.execute(out)
            except Exception as e:  # one bad step must not kill the loop: fail its requests
                logger.exception("model step failed; failing its %d requests", len(out.scheduled))
                self.kv_cache.discard_step()
                self._fail([s.request for s in out.scheduled], f"{type(e).__name__}: {e}")
            else:
                self.scheduler.step_model.observe(out.num_batched_tokens, time.perf_counter() - t0)
                now = time.monotonic()
                with timer.section("output"):
                    for res in results:
                        try:
                            self._process_sample(res, now)
                        except Exception as e:  # fail only the request whose output broke
                            logger.exception("output of %s failed", res.request.request_id)
                            self._fail([res.request], f"{type(e).__name__}: {e}")
        with timer.section("output"):
            outputs = self._collect_outputs()
        timer.end_step(len(out.scheduled), out.num_batched_tokens)
        return outputs

    def _process_sample(self, res: SampleResult, now: float) -> None:
        req = res.request
        if req.is_finished:
            return
        req.append_output_token(res.token_id, res.logprobs, now)
        self._num_generation_tokens += 1
        seq = self._seqs[req.request_id]
        status, reason = self._check_stop(req, seq)
        if status is not None:
            req.stop_reason = reason
            self._finish(req, status)
        self._dirty[self._group_id(req)] = self._groups[self._group_id(req)]

    def _check_stop(self, req: Request, seq: _Sequence):
        p = req.sampling_params
        token = req.output_token_ids[-1]
        past_min = req.num_output_tokens >= p.min_tokens
        stop_str = seq.detokenizer.add_tokens([token]) if seq.detokenizer else None
        if past_min and not p.ignore_eos and token in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if past_min and token in p.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
        if stop_str is not None and past_min:
            return RequestStatus.FINISHED_STOPPED, stop_str
        if p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        if req.num_tokens >= self.max_sequence_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish_request(req, status)
        sampler = getattr(self.runner, "sampler", None)
        if sampler is not None:
            sampler.release(req.request_id)

    def _on_shed(self, req: Request) -> None:
        """A sequence shed by the scheduler: the whole request is rejected with its reason."""
        group = self._groups[self._group_id(req)]
        group.shed_reason = req.shed_reason
        for seq in group.seqs:
            self._finish(seq.request, RequestStatus.FINISHED_ABORTED)
        self._dirty[group.request_id] = group

    def _fail(self, requests: list[Request], message: str) -> None:
        for req in requests:
            group = self._groups[self._group_id(req)]
            group.error = message
            for seq in group.seqs:
                self._finish(seq.request, RequestStatus.FINISHED_ABORTED)
            self._dirty[group.request_id] = group

    def _group_id(self, req: Request) -> str:
        return self._seqs[req.request_id].group_id

    # --- outputs ------------------------------------------------------------------------
    def _collect_outputs(self) -> list[RequestOutput]:
        outputs = []
        for rid, group in self._dirty.items():
            finished = group.finished
            if group.stream or finished:
                outputs.append(self._make_output(group, finished))
            if finished:
                del self._groups[rid]
                for seq in group.seqs:
                    del self._seqs[seq.request.request_id]
        self._dirty.clear()
        return outputs

    def _make_output(self, group: _RequestGroup, finished: bool) -> RequestOutput:
        completions = []
        for seq in group.seqs:
            req = seq.request
            if group.stream:
                start = seq.num_sent_tokens
                if start == req.num_output_tokens and (seq.sent_finish or not req.is_finished):
                    continue  # nothing new for this sequence
                seq.num_sent_tokens = req.num_output_tokens
                seq.sent_finish = req.is_finished
                text = seq.detokenizer.get_delta(req.is_finished) if seq.detokenizer else ""
            else:
                start = 0
                text = seq.detokenizer.output_text if seq.detokenizer else ""
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=req.output_token_ids[start:],
                logprobs=req.output_logprobs[start:] if req.sampling_params.logprobs is not None else None,
                finish_reason=req.finish_reason, stop_reason=req.stop_reason))
        first = group.seqs[0].request
        metrics = RequestMetrics(
            arrival_time=first.arrival_time, first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time, last_token_time=first.last_token_time,
            finished_time=first.finished_time,
            num_preemptions=sum(s.request.num_preemptions for s in group.seqs))
        return RequestOutput(request_id=group.request_id, prompt=group.prompt,
                             prompt_token_ids=group.prompt_token_ids, outputs=completions,
                             finished=finished, metrics=metrics, error=group.error,
                             shed_reason=group.shed_reason, abort_reason=group.abort_reason,
                             num_cached_tokens=first.num_cached_tokens)
