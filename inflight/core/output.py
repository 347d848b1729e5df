"""The step's contracts: ``SchedulerOutput`` from the scheduler to the model runner (as vLLM
v1's vllm/v1/core/sched/output.py), ``SampleResult`` from the runner back to the scheduler.
Plain data, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from inflight.request import Request


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request (read-only for the runner and sampler).
        token_ids: ids of the tokens to compute this step (a prompt chunk, or the last
            sampled token for a decode).
        num_computed_tokens: tokens already in the KV cache before this step; the first
            new token sits at this position.
        block_table: block ids covering ``num_computed_tokens + len(token_ids)`` tokens.
        samples: the step completes the request's known tokens, so a token is sampled;
            False for a partial prefill chunk.
        num_draft_tokens: the last this many of ``token_ids`` are drafts to verify
            (speculative decoding, ``core.speculation``): the step samples at each of
            the ``1 + num_draft_tokens`` rows and keeps the tokens up to the first draft
            the target model disagrees with.
    """

    request: Request
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    samples: bool
    num_draft_tokens: int = 0

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One known token after cached context, drafts to verify or not: every row is
        a single-query decode row (a draft row attends to the rows before it, whose keys
        the step writes first)."""
        return (len(self.token_ids) - self.num_draft_tokens == 1
                and self.num_computed_tokens > 0)


@dataclass
class SchedulerOutput:
    """What runs in one step.

    Attributes:
        scheduled: requests given tokens this step, in scheduling order.
        preempted: requests preempted (blocks freed, back to waiting) during scheduling.
        shed: waiting requests rejected this step (load shedding; already finished, aborted,
            with ``shed_reason`` set).
        num_batched_tokens: total tokens scheduled (<= ``max_num_batched_tokens``).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    shed: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        """Nothing to run (shed requests still need their outputs)."""
        return not self.scheduled

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens this step computes (a recomputed output token is not one)."""
        return sum(max(0, min(s.num_computed_tokens + s.num_scheduled_tokens,
                              s.request.num_prompt_tokens) - s.num_computed_tokens)
                   for s in self.scheduled)


def split_rows(scheduled: list[ScheduledRequest]) -> tuple[list[ScheduledRequest],
                                                           list[ScheduledRequest]]:
    """The step's requests as the runner lays out rows: (generated, prompt chunks).

    Generated: decodes of output tokens (drafts included) and, of a chunk that recomputes a
    preempted request, its output tokens, as decode rows: each attends to the keys up to its
    own position, as when it was first decoded, and so gets the same bits. Prompt chunks:
    every prompt position, the chunk's prompt part stays a chunk that does not sample. A
    prompt's last token alone (after a cut or a prefix hit) is a one-token chunk, not a
    decode, so it attends as it would have inside the whole prompt (batch invariance).
    """
    generated: list[ScheduledRequest] = []
    prefills: list[ScheduledRequest] = []
    for s in scheduled:
        num_prompt, start = s.request.num_prompt_tokens, s.num_computed_tokens
        if s.is_decode and start >= num_prompt:
            generated.append(s)
        elif start + s.num_scheduled_tokens <= num_prompt:
            prefills.append(s)
        else:
            cut = max(num_prompt, start)
            if cut > start:
                prefills.append(replace(s, token_ids=s.token_ids[:cut - start], samples=False))
            generated.append(replace(s, token_ids=s.token_ids[cut - start:],
                                     num_computed_tokens=cut))
    return generated, prefills


@dataclass
class SampleResult:
    """One sampled token, as the runner returns it for each row that samples; a request
    verifying drafts gets one per token it keeps (1 to ``1 + num_draft_tokens``), in order.

    Attributes:
        request: whose token it is.
        token_id: the sampled id.
        logprobs: ``{token_id: logprob}`` of the sampled token and the top-``logprobs``
            tokens, or None when the request did not ask for logprobs.
    """

    request: Request
    token_id: int
    logprobs: dict[int, float] | None


class Runner(Protocol):
    """What the engine needs of a model runner (``inflight.runner.ModelRunner``; tests
    pass fakes): one ``SampleResult`` per row of the plan that samples, in row order."""

    def execute(self, out: SchedulerOutput) -> list[SampleResult]: ...
