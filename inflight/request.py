"""A request's state as the scheduler and engine see it: token ids, status, timestamps.

Mirrors vLLM v1's ``Request`` (vllm/v1/request.py): the prompt and output token ids, and
``num_computed_tokens``, how many of them already have keys and values in the KV cache.
Prefill and decode are not states: a step gives a request ``num_tokens -
num_computed_tokens`` new tokens (or a chunk of them). No tensors, no HTTP.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any, Sequence

from inflight.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle: WAITING -> RUNNING (-> PREEMPTED -> RUNNING ...) -> one FINISHED_* state."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(frozen=True)
class RequestOptions:
    """Per-request scheduling fields, carried unchanged from the API body to ``Request``.

    Attributes:
        priority: lower is served first under ``scheduling_policy="priority"`` (vLLM's).
        ttft_slo, itl_slo: this request's latency targets, seconds, for
            ``scheduling_policy="slo"``; None: the engine's defaults.
        tenant: who sent it (the name of its API key); ``scheduling_policy="fair"``
            shares the engine between tenants. None: the anonymous tenant.
        cache_salt: mixed into the first KV block's hash (vLLM's request field): requests
            share cached prefix blocks only when their salts are equal.
        lora_name: the LoRA adapter to run with (the request's ``model`` when it names
            one, ``--lora-modules``); None: the base model.
    """

    priority: int = 0
    ttft_slo: float | None = None
    itl_slo: float | None = None
    tenant: str | None = None
    cache_salt: str | None = None
    lora_name: str | None = None

    @staticmethod
    def fields_used(policy: str, overload_guard: bool) -> frozenset[str]:
        """The per-request fields a server acts on: ``priority`` under ``priority`` and
        ``fair``; ``ttft_slo`` under ``slo`` (its deadline order) and wherever the overload
        guard is on (``--overload-ttft``: the first-token deadline it judges the request
        by at arrival); ``itl_slo`` under ``slo``."""
        used = {"priority"} if policy in ("priority", "fair") else set()
        if policy == "slo":
            used |= {"ttft_slo", "itl_slo"}
        if overload_guard:
            used.add("ttft_slo")
        return frozenset(used)

    def check_policy(self, policy: str, overload_guard: bool = False) -> None:
        """Refuse a field the server would silently ignore (vLLM answers 400 for a non-zero
        ``priority`` without priority scheduling): a client that asks for a priority or a
        latency target must learn that this server does not act on it (``fields_used``).

        Raises:
            ValueError: ``"field: ..."`` naming the field and the policy that uses it.
        """
        used = self.fields_used(policy, overload_guard)
        if self.priority != 0 and "priority" not in used:
            raise ValueError(f"priority: is only used by --scheduling-policy priority or "
                             f"fair (this server runs {policy}); send 0 or leave it out")
        if self.ttft_slo is not None and "ttft_slo" not in used:
            raise ValueError(f"ttft_slo: is only used by --scheduling-policy slo or the "
                             f"overload guard (this server runs {policy}, --overload-ttft "
                             f"off); leave it out")
        if self.itl_slo is not None and "itl_slo" not in used:
            raise ValueError(f"itl_slo: is only used by --scheduling-policy slo "
                             f"(this server runs {policy}); leave it out")


class Request:
    """One sequence being generated (one of the ``n`` completions of a prompt).

    Args:
        request_id: unique id (sequence ``i`` of an ``n > 1`` request is ``{i}_{id}``).
        prompt_token_ids: prompt ids, at least one.
        sampling_params: validated parameters.
        arrival_time: seconds, ``time.monotonic()`` clock.
        eos_token_ids: ids that finish the request unless ``ignore_eos``.
        priority: lower is served first under ``scheduling_policy="priority"``.
        ttft_slo, itl_slo: latency targets in seconds for ``scheduling_policy="slo"``.
        tenant, cache_salt, lora_name: see ``RequestOptions``.
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling_params: SamplingParams, arrival_time: float | None = None,
                 eos_token_ids: frozenset[int] = frozenset(), *, priority: int = 0,
                 ttft_slo: float | None = None, itl_slo: float | None = None,
                 tenant: str | None = None, cache_salt: str | None = None,
                 lora_name: str | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority  # lower runs first under the priority policy
        self.ttft_slo = ttft_slo  # seconds; None: the engine's default target
        self.itl_slo = itl_slo
        self.tenant = tenant
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        # The adapter's id (``lora.LoRARegistry``; ids are never reused), set by the engine:
        # rows' slots, the scheduler's --max-loras cap, the prefix-cache hash. 0: base.
        self.lora_id = 0
        self.shed_reason: str | None = None  # why load shedding rejected it
        self.shed_retry_after: float | None = None  # seconds a retry should wait; None: 1 s
        # The overload guard judged it (or it arrived before overload): never refused by it
        # from then on (``core.overload``: refused at arrival or not at all).
        self.overload_judged = False
        self.output_token_ids: list[int] = []
        # Per output token: {token_id: logprob}, the sampled token plus the top-k.
        self.output_logprobs: list[dict[int, float]] = []
        # With ``sampling_params.prompt_logprobs``: per prompt position, None for the first
        # token, then ``{token_id: (logprob, rank)}`` of the prompt token and the top-k
        # (rank 1 = most likely). Filled by the model runner as the prompt is computed.
        self.prompt_logprobs: list[dict[int, tuple[float, int]] | None] = []
        # With ``sampling_params.pooling``: the runner's running sum of pooled hidden states
        # (an opaque float64 vector), the prompt positions it holds, and the final
        # normalized embedding once the whole prompt is computed.
        self.pooled_sum: Any = None
        self.num_pooled_tokens = 0
        self.embedding: list[float] | None = None
        # With ``sampling_params.structured_outputs``: this sequence's grammar matcher
        # (``structured_output.GrammarState``), set by the engine; the sampler masks by it.
        self.grammar: Any = None
        # Speculative decoding (``core.speculation``): drafts proposed for the next step,
        # drafted/accepted tokens in the current acceptance window, steps left paused.
        self.spec_token_ids: list[int] = []
        self.spec_drafted = 0
        self.spec_accepted = 0
        self.spec_pause = 0
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache on admission
        self.stop_reason: int | str | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens: what the KV cache must hold once all are computed."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and some are still missing: its prompt positions must
        reach the LM head, so none may come from the prefix cache."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids))

    @property
    def needs_every_prompt_position(self) -> bool:
        """Every prompt position must be computed here (none from the prefix cache):
        prompt logprobs still missing, or mean pooling."""
        return self.needs_prompt_logprobs or self.sampling_params.pooling == "mean"

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions ``[start, end)`` of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def append_output_token(self, token_id: int, logprobs: dict[int, float] | None,
                            now: float) -> None:
        """Record one sampled token (its KV is computed in the next step)."""
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")
