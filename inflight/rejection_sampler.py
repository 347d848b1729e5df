"""Verifying a request's draft tokens against the target model's distributions.

Speculative sampling (Leviathan et al., "Fast Inference from Transformers via Speculative
Decoding", ICML 2023, Algorithm 1; Chen et al., "Accelerating Large Language Model Decoding
with Speculative Sampling", 2023): draft ``x_i`` drawn from ``q_i`` is accepted with
probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection the token is drawn from
``norm(max(p_i - q_i, 0))`` and verification stops; when every draft is accepted one more
token is drawn from ``p_{k}``. Each emitted token is then distributed exactly as the target
model's ``p``. A deterministic proposer (n-gram lookup, a greedy draft model) has a one-hot
``q``: the draft is accepted with probability ``p_i(x_i)`` and the residual is ``p_i`` with
``x_i`` removed. Greedy requests accept a draft iff it is the target's argmax.
"""

from __future__ import annotations

import torch


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from the (possibly unnormalized) distribution ``probs`` ``[vocab]``:
    ``argmax(probs / E)`` with ``E ~ Exp(1)`` per token (the exponential race)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def verify_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """Tokens a greedy request keeps: ``targets`` (``len(drafts) + 1`` argmax ids, one per
    verification row) up to and including the first that differs from its draft."""
    kept = []
    for j, t in enumerate(targets):
        kept.append(t)
        if j == len(drafts) or t != drafts[j]:
            break
    return kept


def verify_random(probs: torch.Tensor, drafts: list[int], generator: torch.Generator,
                  draft_probs: torch.Tensor | None = None) -> list[int]:
    """Tokens a sampled request keeps, by speculative (rejection) sampling.

    Args:
        probs: ``[len(drafts) + 1, vocab]`` float32, the target's distribution at each
            verification row (after temperature, top-k/top-p/min-p and any masks).
        drafts: the proposed ids.
        generator: the request's random source (acceptance draws and residual samples).
        draft_probs: ``[len(drafts), vocab]`` the proposer's distributions ``q``; None: each
            draft was proposed deterministically (one-hot ``q``).

    Returns:
        The accepted drafts then one token from the residual (at a rejection) or from the
        last row (all accepted): 1 to ``len(drafts) + 1`` ids.
    """
    kept: list[int] = []
    for j, x in enumerate(drafts):
        p = probs[j]
        q_x = 1.0 if draft_probs is None else float(draft_probs[j, x])
        u = float(torch.rand((), generator=generator, device=probs.device))
        if q_x > 0 and u * q_x < float(p[x]):  # u < p(x) / q(x)
            kept.append(x)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q: the rejection had probability 0
            residual = p
        kept.append(draw(residual, generator))
        return kept
    kept.append(draw(probs[len(drafts)], generator))
    return kept
