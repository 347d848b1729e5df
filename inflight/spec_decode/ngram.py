"""N-gram (prompt lookup) proposer: drafts copied from the request's own context.

Prompt lookup decoding (Saxena, 2023; vLLM's ``method: ngram``): when the sequence's last
``n`` tokens occurred earlier in its prompt or output, the tokens that followed that
occurrence are likely to follow again (code edits, quoted passages, extraction). The
longest ``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` with a match wins; among its
matches, the latest (the nearest context). No model, no tensors: numpy over the ids.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from inflight.core.spec_config import SpeculativeConfig
from inflight.request import Request


def propose_ngram(token_ids: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` ids that followed the latest earlier occurrence of the longest suffix
    n-gram of ``token_ids`` (``[L]`` int64), ``n_min <= n <= n_max``; [] without one.

    Examples: ``[1 2 3 9 1 2]`` with n in 2..3 matches ``1 2`` at 0 and proposes ``3 9 1``
    for k = 3.
    """
    size = len(token_ids)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = token_ids[size - n:]
        # Windows starting at 0 .. size-n-1: each leaves at least one token after it.
        windows = sliding_window_view(token_ids[:size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in token_ids[start:start + k]]
    return []


class NgramProposer:
    """Proposes by prompt lookup (``propose_ngram``) for each request given.

    Args:
        config: ``method == "ngram"``; ``prompt_lookup_min``/``max`` bound the n-gram.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.n_min = config.prompt_lookup_min
        self.n_max = config.prompt_lookup_max

    def propose(self, requests: list[tuple[Request, int]]) -> None:
        """Set ``spec_token_ids`` of each ``(request, k)`` to at most ``k`` drafts."""
        for req, k in requests:
            ids = np.fromiter(req.prompt_token_ids, dtype=np.int64,
                              count=req.num_prompt_tokens)
            ids = np.concatenate([ids, np.asarray(req.output_token_ids, dtype=np.int64)])
            req.spec_token_ids = propose_ngram(ids, k, self.n_min, self.n_max)
