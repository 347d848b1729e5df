"""Which tokens a sampled row may draw: top-k, top-p (nucleus; Holtzman et al. 2020) and
min-p (Nguyen et al. 2024), over temperature-scaled logits, in vLLM's order. One rule, two
forms:

- ``mask_filtered``: the whole vocabulary, dropped tokens at -inf. Speculative verification
  needs whole distributions.
- ``candidates``: only the tokens a row may keep, sorted, and their ids, for drawing one
  token. At Gemma 3's 262,144-token vocabulary the whole-vocabulary form's sort cost 30 ms
  a row, twice a decode step (``benchmarks/sampler_vocab.py``). A partial selection of the
  first ``NUCLEUS_CANDIDATES`` (or top-k) tokens reads the row once; the draw then touches
  those alone. A row whose nucleus or min-p set reaches past them (a flat distribution)
  takes the full sort, and so does its group.

Each row keeps a prefix of its tokens sorted by logit: rank below top-k; probability mass
before the token below top-p (the mass normalized over the top-k set, or the whole
vocabulary without one); probability at least min-p times the top token's. The top token
always stays.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inflight.sampling_params import SamplingParams

# The first selection's size for a row without a top-k: a nucleus of top-p 0.9-0.95 over a
# language model's next-token distribution holds tens to hundreds of tokens.
NUCLEUS_CANDIDATES = 1024


def filters_off(p: SamplingParams) -> bool:
    """No top-k, top-p or min-p: the row draws from the whole vocabulary."""
    return p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0


def _top_k(params: Sequence[SamplingParams], c: int, device: torch.device) -> torch.Tensor:
    """``[R]`` each row's top-k within ``c`` sorted columns (``c`` where it has none)."""
    return torch.tensor([min(p.top_k, c) if p.top_k > 0 else c for p in params], device=device)


def _dropped(sorted_logits: torch.Tensor, params: Sequence[SamplingParams],
             log_norm: torch.Tensor) -> torch.Tensor:
    """``[R, C]`` bool: the sorted tokens each row drops.

    Args:
        sorted_logits: ``[R, C]`` float32, each row's first C logits in descending order.
        params: the rows' parameters.
        log_norm: ``[R]`` the log of each row's normalizer (over its top-k set, or its whole
            vocabulary), so that ``exp(logit - log_norm)`` is the row's probability.
    """
    dev, c = sorted_logits.device, sorted_logits.shape[-1]
    top_k = _top_k(params, c, dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=sorted_logits.dtype)
    min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=sorted_logits.dtype)
    drop = torch.arange(c, device=dev)[None, :] >= top_k[:, None]
    probs = (sorted_logits - log_norm[:, None]).exp().masked_fill(drop, 0.0)
    drop |= probs.cumsum(dim=-1) - probs >= top_p[:, None]  # the mass before each token
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    return drop


def _log_norm(sorted_logits: torch.Tensor, logits: torch.Tensor,
              params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row's log normalizer: over its top-k set (inside ``sorted_logits``) where it has
    one, else over its whole row of ``logits``."""
    c = sorted_logits.shape[-1]
    dev = logits.device
    top_k = _top_k(params, c, dev)
    in_k = sorted_logits.masked_fill(torch.arange(c, device=dev)[None, :] >= top_k[:, None],
                                     -float("inf")).logsumexp(dim=-1)
    if all(p.top_k > 0 for p in params):
        return in_k
    has_k = torch.tensor([p.top_k > 0 for p in params], device=dev)
    return torch.where(has_k, in_k, logits.logsumexp(dim=-1))


def mask_filtered(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` ``[R, V]`` with each row's dropped tokens at -inf (a new tensor, or
    ``logits`` itself where no row filters)."""
    if all(filters_off(p) for p in params):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = _dropped(sorted_logits, params, _log_norm(sorted_logits, logits, params))
    return torch.empty_like(logits).scatter_(
        1, order, sorted_logits.masked_fill(drop, -float("inf")))


def candidates(logits: torch.Tensor, params: Sequence[SamplingParams],
               ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The tokens each row may draw.

    Args:
        logits: ``[R, V]`` float32, temperature applied; every row filters (not
            ``filters_off``).
        params: the rows' parameters.

    Returns:
        ``(values, ids, counts)``: ``[R, C]`` logits in descending order with dropped
        tokens at -inf, their ``[R, C]`` int64 token ids, and per row how many leading
        columns can hold its kept tokens, a number that depends on the row alone (its
        top-k, else ``NUCLEUS_CANDIDATES`` where its set closes inside them, else V), so a
        seeded row's draws do not depend on its batch.
    """
    v = logits.shape[-1]
    first = min(v, max(p.top_k if p.top_k > 0 else NUCLEUS_CANDIDATES for p in params))
    values, ids = logits.topk(first, dim=-1)
    drop = _dropped(values, params, _log_norm(values, logits, params))
    nucleus = min(v, NUCLEUS_CANDIDATES)
    # a row without a top-k: its set ends inside the first `nucleus` tokens (first >= nucleus
    # whenever such a row is here)
    closed = (drop[:, nucleus - 1].tolist() if any(p.top_k <= 0 for p in params)
              else [True] * len(params))
    counts = [min(p.top_k, v) if p.top_k > 0 else nucleus if closed[i] or nucleus == v else v
              for i, p in enumerate(params)]
    if max(counts) > first:  # a set that reaches past the selection: the full sort
        values, ids = logits.sort(dim=-1, descending=True)
        drop = _dropped(values, params, _log_norm(values, logits, params))
    return values.masked_fill(drop, -float("inf")), ids, counts
