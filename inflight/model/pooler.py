"""Pooling a prompt's final hidden states into one embedding (``SamplingParams.pooling``).

As vLLM's pooler for a decoder model (vllm/model_executor/layers/pooler.py): ``last`` takes
the last prompt token's final (normed) hidden state, ``mean`` averages every prompt
token's; either is then L2-normalized. A prompt may be computed over several steps
(chunked prefill) or again after a preemption: the running sum lives on the request and
counts each position once.
"""

from __future__ import annotations

import torch

from inflight.core.output import ScheduledRequest


def pool_rows(hidden: torch.Tensor, s: ScheduledRequest, first_row: int) -> None:
    """Fold this step's rows of ``s`` into its request's pooled state; sets
    ``request.embedding`` (``hidden_size`` floats, unit L2 norm) once the last prompt
    position is in.

    Args:
        hidden: the step's final hidden states ``[num_tokens, hidden_size]`` (model dtype).
        s: a request with ``sampling_params.pooling`` set.
        first_row: the row of ``hidden`` holding ``s``'s first scheduled token.
    """
    req = s.request
    n_prompt = req.num_prompt_tokens
    start = max(s.num_computed_tokens, req.num_pooled_tokens)
    end = min(s.num_computed_tokens + s.num_scheduled_tokens, n_prompt)
    if start >= end or req.embedding is not None:
        return
    r0 = first_row + start - s.num_computed_tokens
    rows = hidden[r0:r0 + end - start].double()
    if req.sampling_params.pooling == "last":
        if end == n_prompt:
            req.embedding = _normalized(rows[-1])
        req.num_pooled_tokens = end
        return
    if start != req.num_pooled_tokens:  # positions computed elsewhere (cache hits)
        raise RuntimeError(f"mean pooling of {req.request_id}: position "
                           f"{req.num_pooled_tokens} was not computed")
    total = rows.sum(dim=0)
    req.pooled_sum = total if req.pooled_sum is None else req.pooled_sum + total
    req.num_pooled_tokens = end
    if end == n_prompt:
        req.embedding = _normalized(req.pooled_sum / n_prompt)
        req.pooled_sum = None


def _normalized(v: torch.Tensor) -> list[float]:
    """``v / ||v||_2`` as float32 values (vLLM's ``normalize=True``; a zero vector stays)."""
    norm = v.norm()
    out = v / norm if norm > 0 else v
    return [float(x) for x in out.float().tolist()]
