"""From sampled tokens to ``RequestOutput``: the engine's text side.

Owns what a request needs beyond its tokens: the ``n`` sequences of one user request (a
group), each sequence's detokenizer, stop strings, stream deltas, logprobs assembly and the
reason a group ended early (an error, load shedding, an abort by the server). The scheduler
owns token-level state and stops; this owns text-level ones. vLLM v1 splits its engine the
same way (``EngineCore`` / ``OutputProcessor``, vllm/v1/engine/output_processor.py).

Stop strings and ``min_tokens`` follow vLLM v1 (``BaseIncrementalDetokenizer.update``,
vllm/v1/engine/detokenizer.py): a stop string is looked for only once a sequence has *more*
than ``min_tokens`` output tokens, and a match must end in text that the tokens past the
first ``min_tokens`` added; it may start earlier. So with ``min_tokens=3`` and
``stop=["hi"]``, "hi" spread over tokens 3 and 4 ends the request at token 4, while "hi"
within the first three tokens (even ending exactly at token 3) never does. EOS and stop
token ids are a different rule (the scheduler's): they may end a sequence at token
``min_tokens`` itself, as in vLLM. A match is handed back to the engine, which ends the
request in the scheduler. Structured output and tool-call parsing plug in here (and in the
sampler).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from inflight.errors import InvalidRequestError
from inflight.faults import FAULTS
from inflight.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inflight.request import Request, RequestOptions
from inflight.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class _Sequence:
    """One of a group's ``n`` sequences: its request, detokenizer and stream cursor."""

    def __init__(self, request: Request, index: int, detokenizer: Any,
                 group: "_Group") -> None:
        self.request = request
        self.index = index
        self.detokenizer = detokenizer  # IncrementalDetokenizer, or None without a tokenizer
        self.group = group
        self.num_sent_tokens = 0  # tokens already returned in stream deltas
        self.sent_finish = False


@dataclass
class _Group:
    """The ``n`` sequences of one user request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    stream: bool
    seqs: list[_Sequence] = field(default_factory=list)
    error: str | None = None
    shed_reason: str | None = None
    retry_after: float | None = None
    abort_reason: str | None = None
    sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.seqs)

    def take_prompt_logprobs(self) -> list[dict[int, tuple[float, int]] | None] | None:
        """The prompt logprobs once complete (those of the first sequence that has them
        all: the ``n`` share the prompt, so a sequence's first token never comes before
        them), given once per stream; None when not asked or not complete yet."""
        if self.seqs[0].request.sampling_params.prompt_logprobs is None \
                or self.sent_prompt_logprobs:
            return None
        for seq in self.seqs:
            if not seq.request.needs_prompt_logprobs:
                self.sent_prompt_logprobs = self.stream
                return seq.request.prompt_logprobs
        return None


@dataclass
class ProcessedStep:
    """What ``OutputProcessor.process`` asks of the engine.

    Attributes:
        stopped: ``(request, stop string)`` to end as stopped.
        failed: requests whose group failed in output processing; to abort.
        num_dropped_tokens: sampled tokens dropped because a stop string ended their
            sequence at an earlier token of the same step (drafts verified together); the
            generation-token count takes them back, as they are never returned.
    """

    stopped: list[tuple[Request, str]] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    num_dropped_tokens: int = 0


class OutputProcessor:
    """Groups, detokenizers and outputs of every unfinished request.

    Args:
        tokenizer: an ``inflight.tokenizer.Tokenizer``, or None (outputs then carry token
            ids and empty text).
    """

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._groups: dict[str, _Group] = {}  # by user request id
        self._seqs: dict[str, _Sequence] = {}  # by sequence (scheduler request) id
        self._dirty: dict[str, _Group] = {}  # groups with something to report this step

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, *, stream: bool, arrival_time: float,
                    eos_token_ids: frozenset[int], options: RequestOptions) -> list[Request]:
        """Fan a user request out into its ``n`` sequences; returns their requests
        for the scheduler (ids ``request_id``, or ``{i}_{request_id}`` when ``n > 1``;
        sequence ``i`` of a seeded request gets ``seed + i``).

        Raises:
            InvalidRequestError: ``request_id`` is already in use.
        """
        seq_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        for rid in {request_id, *seq_ids}:
            if rid in self._groups or rid in self._seqs:
                raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        group = _Group(request_id, prompt, prompt_token_ids, stream)
        for i, seq_id in enumerate(seq_ids):
            seq_params = params
            if params.n > 1:
                seq_params = params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            req = Request(seq_id, prompt_token_ids, seq_params, arrival_time, eos_token_ids,
                          priority=options.priority, ttft_slo=options.ttft_slo,
                          itl_slo=options.itl_slo, tenant=options.tenant,
                          cache_salt=options.cache_salt, lora_name=options.lora_name)
            seq = _Sequence(req, i, self._make_detokenizer(req), group)
            group.seqs.append(seq)
            self._seqs[seq_id] = seq
        self._groups[request_id] = group
        return [s.request for s in group.seqs]

    def _make_detokenizer(self, req: Request) -> Any:
        if self.tokenizer is None:
            return None
        from inflight.tokenizer.detokenizer import IncrementalDetokenizer

        p = req.sampling_params
        return IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, skip_special_tokens=p.skip_special_tokens,
            stop=p.stop_strings, include_stop_str_in_output=p.include_stop_str_in_output)

    # --- a step's tokens ----------------------------------------------------------------
    def process(self, requests: Iterable[Request]) -> ProcessedStep:
        """Detokenize each request's new tokens and check its stop strings.

        A sequence whose output processing raises fails its whole group (logged); the
        others go on.
        """
        result = ProcessedStep()
        for req in requests:
            seq = self._seqs[req.request_id]
            try:
                before = req.num_output_tokens
                stop = self._detokenize(seq)
                result.num_dropped_tokens += before - req.num_output_tokens
            except Exception as e:  # fail only the request whose output broke
                logger.exception("output of %s failed", req.request_id)
                result.failed += self.end_group(req.request_id, error=f"{type(e).__name__}: {e}")
                continue
            if stop is not None:
                result.stopped.append((req, stop))
            self._dirty[seq.group.request_id] = seq.group
        return result

    def _detokenize(self, seq: _Sequence) -> str | None:
        """Detokenize the sequence's new tokens (several after a verification of drafts),
        checking stop strings after each; tokens after the one that completes a stop
        string are dropped, as if generation had stopped there."""
        if seq.detokenizer is None:
            return None
        req = seq.request
        FAULTS.check("detokenizer", req.request_id)
        det = seq.detokenizer
        new = req.output_token_ids[det.num_output_tokens:]
        for j, token in enumerate(new):
            past_min = det.num_output_tokens + 1 > req.sampling_params.min_tokens  # vLLM's rule
            stop: str | None = det.add_tokens([token], check_stop=past_min)
            if stop is not None:
                keep = req.num_output_tokens - (len(new) - j - 1)
                del req.output_token_ids[keep:]
                del req.output_logprobs[keep:]
                return stop
        return None

    def end_group(self, request_id: str, *, error: str | None = None,
                  shed_reason: str | None = None, abort_reason: str | None = None,
                  retry_after: float | None = None) -> list[Request]:
        """Record why the group holding sequence (or user request) ``request_id`` ends
        early; returns all its sequences, for the engine to finish in the scheduler."""
        seq = self._seqs.get(request_id)
        group = seq.group if seq is not None else self._groups[request_id]
        group.error = group.error or error
        group.shed_reason = group.shed_reason or shed_reason
        group.retry_after = group.retry_after if group.retry_after is not None else retry_after
        group.abort_reason = group.abort_reason or abort_reason
        self._dirty[group.request_id] = group
        return [s.request for s in group.seqs]

    def is_finished(self, request_id: str) -> bool:
        """True when no unfinished user request has this id."""
        group = self._groups.get(request_id)
        return group is None or group.finished

    # --- outputs ------------------------------------------------------------------------
    def make_outputs(self, abort: Callable[[list[Request]], None]) -> list[RequestOutput]:
        """Outputs of the groups touched since the last call: a delta per step for streamed
        ones, one cumulative output at the end otherwise. Finished groups are forgotten.

        Args:
            abort: ends requests in the scheduler; called with a group's sequences when
                building its output raises (logged), whose output then carries the error
                and no text.
        """
        dirty = list(self._dirty.values())
        self._dirty.clear()
        outputs = []
        for group in dirty:
            try:
                if group.stream or group.finished:
                    outputs.append(self._make_output(group, group.finished))
            except Exception as e:  # fail only the request whose output broke
                logger.exception("output of %s failed", group.request_id)
                group.error = group.error or f"{type(e).__name__}: {e}"
                abort([s.request for s in group.seqs])
                outputs.append(self._make_output(group, True, with_text=False))
            if group.finished:
                del self._groups[group.request_id]
                for seq in group.seqs:
                    del self._seqs[seq.request.request_id]
        return outputs

    def _make_output(self, group: _Group, finished: bool, with_text: bool = True,
                     ) -> RequestOutput:
        completions = []
        for seq in group.seqs:
            req = seq.request
            if not with_text:
                start, text = seq.num_sent_tokens if group.stream else 0, ""
            elif group.stream:
                start = seq.num_sent_tokens
                if start == req.num_output_tokens and (seq.sent_finish or not req.is_finished):
                    continue  # nothing new for this sequence
                seq.num_sent_tokens = req.num_output_tokens
                seq.sent_finish = req.is_finished
                text = seq.detokenizer.get_delta(req.is_finished) if seq.detokenizer else ""
            else:
                start = 0
                text = seq.detokenizer.output_text if seq.detokenizer else ""
            wants_logprobs = req.sampling_params.logprobs is not None
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=req.output_token_ids[start:],
                logprobs=req.output_logprobs[start:] if wants_logprobs else None,
                finish_reason=req.finish_reason, stop_reason=req.stop_reason))
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids, outputs=completions, finished=finished,
            metrics=_metrics([s.request for s in group.seqs]), error=group.error,
            shed_reason=group.shed_reason, retry_after=group.retry_after,
            abort_reason=group.abort_reason,
            num_cached_tokens=group.seqs[0].request.num_cached_tokens,
            prompt_logprobs=group.take_prompt_logprobs(),
            embedding=group.seqs[0].request.embedding)


def _metrics(requests: Sequence[Request]) -> RequestMetrics:
    first = requests[0]
    return RequestMetrics(
        arrival_time=first.arrival_time, first_scheduled_time=first.first_scheduled_time,
        first_token_time=first.first_token_time, last_token_time=first.last_token_time,
        finished_time=first.finished_time,
        num_preemptions=sum(r.num_preemptions for r in requests),
        n=len(requests), max_tokens=first.sampling_params.max_tokens)
