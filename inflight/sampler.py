"""Batched sampling from per-request parameters.

Order of logits processing follows vLLM's sampler and HF's ``LogitsProcessor`` conventions:
min-tokens suppression, ``logit_bias`` (OpenAI's, added to the logits), repetition penalty
(CTRL, Keskar et al. 2019: divide positive logits, multiply negative ones),
presence/frequency penalties (OpenAI API reference), temperature, then top-k, top-p
(Holtzman et al. 2020), min-p (Nguyen et al. 2024). Returned logprobs are those of the
model's raw distribution (vLLM's default ``raw_logprobs``): a ``logit_bias`` changes which
token is drawn, not the logprobs reported for it.

Seeded requests draw from their own ``torch.Generator``, so their tokens do not depend on
what they are batched with; unseeded ones share the engine's generator. The work follows what
each row asks (issue 52: at a 262,144-token vocabulary a full sort costs 30 ms a row): top-k,
top-p and min-p draw among their candidates alone (``sampling_filters``), logprobs are
computed for the rows that ask for them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from inflight.core.output import SampleResult
from inflight.faults import FAULTS
from inflight.rejection_sampler import verify_greedy, verify_random
from inflight.request import Request
from inflight.sampling_filters import candidates, filters_off, mask_filtered
from inflight.sampling_params import SamplingParams
from inflight.structured_output import GrammarState, apply_grammar_masks

logger = logging.getLogger(__name__)


class SamplingRow(Protocol):
    """What the logits processors read of a row's request: a ``Request``, or a verification
    row's view of it (``DraftedRow``)."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]

    @property
    def num_output_tokens(self) -> int: ...


class DraftedRow:
    """A request as its verification row ``j`` sees it: its output so far plus the ``j``
    drafts before the row, as if they had been sampled (penalties and ``min_tokens``
    count them, as they would in the steps speculation saves)."""

    def __init__(self, request: Request, drafts: list[int]) -> None:
        self.request_id = request.request_id
        self.sampling_params = request.sampling_params
        self.prompt_token_ids = request.prompt_token_ids
        self.output_token_ids = request.output_token_ids + drafts
        self.eos_token_ids = request.eos_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


class Sampler:
    """Turns the logits of the sampling rows into tokens.

    Args:
        seed: seed of the shared generator used by unseeded requests.
        device: where logits live (generators are made there).
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self._request_generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[Request],
               draft_token_ids: list[list[int]] | None = None) -> list[SampleResult]:
        """Sample one token per row, or verify drafts.

        Args:
            logits: ``[num_rows, vocab_size]`` float32, row ``i`` for ``requests[i]``; with
                drafts, ``1 + len(draft_token_ids[i])`` consecutive rows per request.
            requests: the rows' requests (their params and token history).
            draft_token_ids: per request, the drafts its rows verify (``rejection_sampler``).

        Returns:
            One ``SampleResult`` per row, in row order; with drafts, per request the tokens
            it keeps (1 to ``1 + len(drafts)``), in order.
        """
        if draft_token_ids is not None:
            return self._sample_drafted(logits, requests, draft_token_ids)
        with torch.inference_mode():
            FAULTS.check("sampler")
            raw = logits
            if any(_needs_penalties(r) for r in requests):
                # Penalties edit logits in place; the raw ones stay intact for logprobs.
                logits = self._apply_penalties(logits.clone(), requests)
            # a terminated grammar's request ends in this step's update; never mask by it
            constrained = [(i, r.grammar) for i, r in enumerate(requests)
                           if r.grammar is not None and not r.grammar.is_terminated]
            if constrained:
                logits = self._apply_grammars(logits if logits is not raw else logits.clone(), raw,
                                              constrained, requests)
            greedy = [r.sampling_params.is_greedy for r in requests]
            tokens = logits.argmax(dim=-1)
            if not all(greedy):
                rows = [i for i, g in enumerate(greedy) if not g]
                sampled = self._sample_random(logits[rows], [requests[i] for i in rows])
                tokens[rows] = sampled
            token_list = tokens.tolist()
            for i, state in constrained:
                if not state.accept(token_list[i]):  # cannot happen: the mask allowed it
                    logger.error("request %s: grammar rejected sampled token %d",
                                 requests[i].request_id, token_list[i])
            logprob_list = self._logprobs(raw, tokens, requests)
            return [SampleResult(r, t, lp) for r, t, lp in zip(requests, token_list, logprob_list)]

    @staticmethod
    def _apply_grammars(logits: torch.Tensor, raw: torch.Tensor,
                        constrained: list[tuple[int, GrammarState]],
                        requests: list[Request]) -> torch.Tensor:
        """Mask each constrained row to its grammar's next tokens, in place. Where the other
        processors left none of them (``min_tokens`` banning the stop token a finished
        grammar allows: the only processor that sets -inf), the row falls back to the raw
        logits under the mask alone."""
        bitmask = apply_grammar_masks(logits, constrained)
        banning = [i for i, _ in constrained
                   if requests[i].num_output_tokens < requests[i].sampling_params.min_tokens]
        if not banning:
            return logits
        rows = torch.tensor(banning, device=logits.device)
        dead = rows[torch.isinf(logits[rows].amax(dim=-1))].tolist()
        if dead:
            import xgrammar as xgr

            logits[dead] = raw[dead]
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=dead)
        return logits

    def _sample_drafted(self, logits: torch.Tensor, requests: list[Request],
                        drafts: list[list[int]]) -> list[SampleResult]:
        """Verify each request's drafts: its rows' logits processed as consecutive steps
        would process them (``DraftedRow``), grammar masks included, then the greedy
        match or speculative sampling of ``rejection_sampler``."""
        with torch.inference_mode():
            FAULTS.check("sampler")
            views: list[SamplingRow] = []
            first: list[int] = []
            for r, d in zip(requests, drafts):
                first.append(len(views))
                views += [r] + [DraftedRow(r, d[:j]) for j in range(1, len(d) + 1)]
            raw = logits
            if any(_needs_penalties(v) for v in views):
                logits = self._apply_penalties(logits.clone(), views)
            drafts = [list(d) for d in drafts]
            if any(r.grammar is not None and not r.grammar.is_terminated for r in requests):
                logits = _mask_drafted_rows(logits if logits is not raw else logits.clone(),
                                            requests, drafts, first)
            targets = logits.argmax(dim=-1).tolist()
            results: list[SampleResult] = []
            for i, (r, d) in enumerate(zip(requests, drafts)):
                rows = slice(first[i], first[i] + len(d) + 1)
                if r.sampling_params.is_greedy:
                    kept = verify_greedy(targets[rows], d)
                else:
                    probs = self._probs(logits[rows], views[rows])
                    kept = verify_random(probs, d, self._generator_for(r))
                kept = _advance_grammar(r, kept)
                lps: list[dict[int, float] | None] = [None] * len(kept)
                if r.sampling_params.logprobs is not None:  # else no copy of the rows
                    lps = self._logprobs(raw[first[i]:first[i] + len(kept)],
                                         torch.tensor(kept, device=raw.device), [r] * len(kept))
                results += [SampleResult(r, t, lp) for t, lp in zip(kept, lps)]
            return results

    def _apply_penalties(self, logits: torch.Tensor, requests: Sequence[SamplingRow]) -> torch.Tensor:
        for i, r in enumerate(requests):
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                banned = set(p.stop_ids)
                if not p.ignore_eos:
                    banned |= r.eos_token_ids
                if banned:
                    logits[i, list(banned)] = -float("inf")
            if p.logit_bias:  # after min_tokens, before the penalties: vLLM v1's order
                ids = torch.tensor(list(p.logit_bias), device=logits.device, dtype=torch.long)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()),
                                               device=logits.device, dtype=logits.dtype)
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)),
                                    device=logits.device, dtype=torch.long)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                              vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
                ids = torch.tensor(r.output_token_ids, device=logits.device, dtype=torch.long)
                counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        return logits

    @staticmethod
    def _probs(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> torch.Tensor:
        """Each row's sampling distribution over the whole vocabulary: temperature, then
        top-k/top-p/min-p."""
        return mask_filtered(_scaled(logits, requests),
                             [r.sampling_params for r in requests]).softmax(dim=-1)

    def _sample_random(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """One token per row, drawn from its temperature-scaled distribution: over the
        whole vocabulary where the row filters nothing, else over its candidates."""
        logits = _scaled(logits, requests)
        params = [r.sampling_params for r in requests]
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        plain = [i for i, p in enumerate(params) if filters_off(p)]
        if plain:
            tokens[plain] = self._race(logits[plain], [requests[i] for i in plain], None)
        rows = [i for i, p in enumerate(params) if not filters_off(p)]
        if rows:
            values, ids, counts = candidates(logits[rows], [params[i] for i in rows])
            pick = self._race(values, [requests[i] for i in rows], counts)
            tokens[rows] = ids.gather(1, pick[:, None])[:, 0]
        return tokens

    def _race(self, logits: torch.Tensor, requests: list[Request],
              counts: list[int] | None) -> torch.Tensor:
        """``argmax(p / E)``, ``E = -log U ~ Exp(1)`` a column, ``p = softmax(logits)``: a draw
        from ``p`` (the exponential race). Row ``i`` draws ``counts[i]`` uniforms (every
        column where None) from its own generator, so a seeded row's draws do not depend on
        its neighbours; columns past them cannot win (their noise is infinite and their
        logits -inf). ``-log U`` over ``torch.rand``: ``exponential_`` took 4.8 ms for 262,144
        values here, this 1 ms; ``U < 1`` keeps ``E > 0``, so no ``0 / 0``."""
        probs = logits.softmax(dim=-1)
        u = torch.zeros_like(probs)
        for i, r in enumerate(requests):
            n = probs.shape[1] if counts is None else counts[i]
            u[i, :n] = torch.rand(n, generator=self._generator_for(r), device=probs.device)
        return (probs / u.log_().neg_()).argmax(dim=-1)

    def _generator_for(self, r: Request) -> torch.Generator:
        seed = r.sampling_params.seed
        if seed is None:
            return self.generator
        g = self._request_generators.get(r.request_id)
        if g is None:
            g = torch.Generator(self.device).manual_seed(seed)
            self._request_generators[r.request_id] = g
        return g

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor,
                  requests: list[Request]) -> list[dict[int, float] | None]:
        wanted = [r.sampling_params.logprobs for r in requests]
        rows = [i for i, k in enumerate(wanted) if k is not None]
        result: list[dict[int, float] | None] = [None] * len(requests)
        if not rows:
            return result
        index = torch.tensor(rows, device=raw.device)  # only the rows that ask
        logp = raw.index_select(0, index).log_softmax(dim=-1)
        top_vals, top_ids = logp.topk(max(max(wanted[i] or 0 for i in rows), 1), dim=-1)
        chosen = logp.gather(1, tokens.index_select(0, index)[:, None])[:, 0].tolist()
        top_vals, top_ids, token_list = top_vals.tolist(), top_ids.tolist(), tokens.tolist()
        for j, i in enumerate(rows):
            entry = {token_list[i]: chosen[j]}
            for tid, val in zip(top_ids[j][:wanted[i]], top_vals[j][:wanted[i]]):
                entry.setdefault(tid, val)
            result[i] = entry
        return result


def _needs_penalties(r: SamplingRow) -> bool:
    p = r.sampling_params
    return (r.num_output_tokens < p.min_tokens or p.repetition_penalty != 1.0
            or bool(p.presence_penalty) or bool(p.frequency_penalty) or bool(p.logit_bias))


def _mask_drafted_rows(logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
                       first: list[int]) -> torch.Tensor:
    """Mask each constrained request's verification rows to what its grammar allows after
    the drafts before each row, in place; a request's drafts are cut at the first one its
    grammar refuses or after one that ends it (no row after it can be kept). The matcher
    is rolled back to where it was."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    rows = []
    for i, r in enumerate(requests):
        state = r.grammar
        if state is None or state.is_terminated:
            continue
        m, d, advanced = state.matcher, drafts[i], 0
        for j in range(len(d) + 1):
            m.fill_next_token_bitmask(bitmask, first[i] + j)
            rows.append(first[i] + j)
            if j == len(d) or not m.accept_token(d[j]):
                del d[j:]
                break
            advanced += 1
            if m.is_terminated():
                del d[j + 1:]
                break
        if advanced:
            m.rollback(advanced)
    if rows:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    return logits


def _advance_grammar(r: Request, kept: list[int]) -> list[int]:
    """Advance ``r``'s grammar by the kept tokens; those after one that ends the grammar
    are dropped (nothing may follow it)."""
    state: Any = r.grammar
    if state is None or state.is_terminated:
        return kept
    for j, t in enumerate(kept):
        if not state.accept(t):  # cannot happen: the mask allowed it
            logger.error("request %s: grammar rejected verified token %d", r.request_id, t)
            return kept[:j]
        if state.is_terminated:
            return kept[:j + 1]
    return kept


def _scaled(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> torch.Tensor:
    """The logits divided by each row's temperature (rows here sample: temperature > 0)."""
    temps = torch.tensor([r.sampling_params.temperature for r in requests],
                         device=logits.device, dtype=logits.dtype)
    return logits / temps[:, None]
