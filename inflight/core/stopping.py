"""The token-level stop rules, applied after each sampled token. Torch-free.

Stop strings are text: the output processor checks them (``Scheduler.stop_request``).
"""

from __future__ import annotations

from inflight.request import Request, RequestStatus


def token_stop(req: Request, max_sequence_len: int,
               last_of_step: bool = True) -> RequestStatus | None:
    """Whether ``req`` ends with the token it just got, and how.

    In order: its grammar terminated (stopped; judged at the step's last kept token only,
    since the sampler advanced the grammar through every token the step kept, drafts
    verified with it included); once it has ``min_tokens``, an EOS token
    (unless ``ignore_eos``) or a stop token id (stopped; a stop id becomes its
    ``stop_reason``); ``max_tokens`` output tokens or ``max_sequence_len`` tokens in all
    (length). None: it goes on.
    """
    p = req.sampling_params
    token = req.output_token_ids[-1]
    if last_of_step and req.grammar is not None and req.grammar.is_terminated:
        return RequestStatus.FINISHED_STOPPED  # the grammar ended: nothing may follow
    if req.num_output_tokens >= p.min_tokens:
        if not p.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if req.num_tokens >= max_sequence_len:
        return RequestStatus.FINISHED_LENGTH
    return None
