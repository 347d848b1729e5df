"""What the engine hands back: ``RequestOutput`` with one ``CompletionOutput`` per sequence.

Shapes follow vLLM's ``vllm.outputs`` so offline client code ports unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inflight.errors import EngineDeadError, EngineError, EngineOverloadedError, RequestFailedError


@dataclass
class RequestMetrics:
    """Timestamps of one request, seconds on the ``time.monotonic()`` clock.

    ``first_token_time - arrival_time`` is the TTFT; ``finished_time - arrival_time`` the
    end-to-end latency; ``first_scheduled_time - arrival_time`` the queueing time.
    ``n`` and ``max_tokens`` are the request's sampling parameters as the engine took them
    (vLLM carries them on its finished request's stats too), for the per-request
    ``request_params_*`` histograms; None where unknown (an output built by hand).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    n: int | None = None
    max_tokens: int | None = None


@dataclass
class CompletionOutput:
    """One generated sequence.

    For a streamed request (``Engine.add_request(..., stream=True)``) ``text``, ``token_ids``
    and ``logprobs`` hold only what is new since the previous output (vLLM's DELTA kind);
    otherwise they are cumulative and the output comes once, when the request finishes.

    Attributes:
        index: which of the ``n`` completions this is.
        text: detokenized text (stop string removed unless asked to keep it).
        token_ids: generated token ids.
        logprobs: per token ``{token_id: logprob}`` (sampled token and top-k), or None.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or None while running.
        stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The output of one request (all ``n`` completions of one prompt).

    Attributes:
        request_id: id given to ``add_request``.
        prompt: prompt text, if the request was given text.
        prompt_token_ids: prompt ids.
        outputs: one ``CompletionOutput`` per completion, by ``index``.
        finished: every completion has finished.
        metrics: timestamps of the first completion (of the whole request when ``n == 1``).
        error: set when the request failed inside the engine (it is then finished).
        shed_reason: set when load shedding rejected the request before it started
            (``max_queue_time``, or a TTFT deadline it could not meet); finish reason abort.
        retry_after: with ``shed_reason``, the seconds a retry should wait (overload
            shedding's predicted lateness); None: 1 s.
        abort_reason: set when the server aborted the request (shutdown), not its client.
        num_cached_tokens: prompt tokens served from the prefix cache.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, per prompt token None
            (the first) or ``{token_id: (logprob, rank)}`` of the token and the top-k
            (vLLM's ``prompt_logprobs``, rank 1 = most likely). A streamed request gets them
            once, on the first delta after the whole prompt is computed.
        embedding: with ``SamplingParams.pooling``, the prompt's pooled final hidden state,
            L2-normalized, ``hidden_size`` floats (vLLM's ``PoolingOutput.embedding``);
            None otherwise and until the prompt is computed.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    shed_reason: str | None = None
    retry_after: float | None = None
    abort_reason: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None
    embedding: list[float] | None = None
    extra: dict[str, object] = field(default_factory=dict)

    def failure(self) -> EngineError | None:
        """Why the engine did not serve this request, as the one engine error type, or None.

        ``error`` is a ``RequestFailedError``, ``shed_reason`` an ``EngineOverloadedError``
        (retry later), and ``abort_reason`` (the server cut it: shutdown) an
        ``EngineDeadError`` (503 with ``Retry-After``, or an error event on a stream whose
        200 went out), before or after its first token: cut work is never reported as a
        success (issue 35). An abort by the client is an ordinary finish.
        """
        if self.error:
            return RequestFailedError(self.error)
        if self.shed_reason:
            return EngineOverloadedError(f"request shed: {self.shed_reason}",
                                         1.0 if self.retry_after is None else self.retry_after)
        if self.abort_reason:
            started = self.metrics is not None and self.metrics.first_token_time is not None
            when = "before it finished" if started else "before its first token"
            return EngineDeadError(f"the request was cut short {when}: {self.abort_reason}; retry it")
        return None
