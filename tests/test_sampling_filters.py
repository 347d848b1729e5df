"""Top-k, top-p and min-p keep the same tokens in both forms (``sampling_filters``), the
candidates form reads no more of the vocabulary than the row asks where its set closes early,
draws follow the filtered distribution, a seeded row's draws do not depend on its batch, and
logprobs are computed for the rows that ask (issue 52: a 262,144-token vocabulary)."""

from __future__ import annotations

import math

import pytest
import torch

from inflight import sampling_filters
from inflight.request import Request
from inflight.sampler import Sampler
from inflight.sampling_filters import NUCLEUS_CANDIDATES, candidates, mask_filtered
from inflight.sampling_params import SamplingParams


def kept_by_definition(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """The kept ids of one row, from the definitions in float64, one token at a time."""
    order = sorted(range(row.numel()), key=lambda i: -float(row[i]))
    if p.top_k > 0:
        order = order[:p.top_k]
    z = math.fsum(math.exp(float(row[i])) for i in order)
    probs = [math.exp(float(row[i])) / z for i in order]
    kept, before = set(), 0.0
    for rank, (i, q) in enumerate(zip(order, probs)):
        if rank and (before >= p.top_p or q < p.min_p * probs[0]):
            break
        kept.add(i)
        before += q
    return kept


PARAMS = [SamplingParams(temperature=1.0, top_k=40), SamplingParams(temperature=1.0, top_p=0.9),
          SamplingParams(temperature=1.0, min_p=0.05),
          SamplingParams(temperature=1.0, top_k=300, top_p=0.8, min_p=0.01),
          SamplingParams(temperature=1.0, top_k=1)]


@pytest.mark.parametrize("scale", [8.0, 1.0])  # peaked rows close early; flat ones do not
def test_both_forms_keep_the_definitions_tokens(scale):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(PARAMS), 5000, generator=g) * scale
    masked = mask_filtered(logits, PARAMS)
    values, ids, counts = candidates(logits, PARAMS)
    for i, p in enumerate(PARAMS):
        want = kept_by_definition(logits[i], p)
        assert set(torch.nonzero(masked[i] > -math.inf).flatten().tolist()) == want
        assert set(ids[i][values[i] > -math.inf].tolist()) == want
        assert len(want) <= counts[i]
        # the kept logits are the row's own
        assert torch.equal(values[i][values[i] > -math.inf], logits[i][ids[i][values[i] > -math.inf]])


def test_a_set_that_closes_early_reads_no_more_than_its_candidates(monkeypatch):
    g = torch.Generator().manual_seed(1)
    peaked = torch.randn(2, 262144, generator=g) * 6  # a nucleus of a few hundred tokens
    sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda *a, **k: sorts.append(1) or real_sort(*a, **k))
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_k=40)]
    values, ids, counts = candidates(peaked, params)
    assert not sorts and values.shape == (2, NUCLEUS_CANDIDATES)
    assert counts == [NUCLEUS_CANDIDATES, 40]
    flat = torch.randn(2, 262144, generator=g) * 0.5  # its nucleus holds most of the vocabulary
    values, ids, counts = candidates(flat, params)
    assert sorts and values.shape == (2, 262144) and counts == [262144, 40]


def _req(i: int, **kw) -> Request:
    return Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8, **kw))


def test_draws_follow_the_filtered_distribution():
    # 4 rows x 5,000 draws: each kept token's frequency within 4.5 standard errors of its
    # probability renormalized over the kept set (top-k 5 of 50 tokens, and top-p 0.7)
    logits = torch.linspace(2.0, -3.0, 50)[torch.randperm(50, generator=torch.Generator().manual_seed(0))]
    for params in (dict(top_k=5), dict(top_p=0.7)):
        p = SamplingParams(temperature=0.7, **params)
        kept = sorted(kept_by_definition(logits / 0.7, p))
        z = torch.softmax(logits / 0.7, -1)[kept].sum()
        counts = torch.zeros(50)
        sampler = Sampler(seed=5)
        reqs = [_req(i, temperature=0.7, **params) for i in range(4)]
        for _ in range(5000):
            for t in sampler.sample(logits.repeat(4, 1), reqs):
                counts[t.token_id] += 1
        n = counts.sum()
        assert set(torch.nonzero(counts).flatten().tolist()) <= set(kept)
        for tok in kept:
            q = float(torch.softmax(logits / 0.7, -1)[tok] / z)
            assert abs(counts[tok] / n - q) <= 4.5 * math.sqrt(q * (1 - q) / n) + 1e-9, tok


def test_a_seeded_rows_draws_do_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 20000, generator=g) * 4
    seeded = dict(temperature=0.9, top_p=0.95, seed=11)
    alone, batched = Sampler(), Sampler()
    for step in range(5):
        a = alone.sample(logits[:1].clone(), [_req(0, **seeded)])[0].token_id
        b = batched.sample(logits.clone(), [_req(0, **seeded), _req(1, temperature=0.9, top_k=5000),
                                            _req(2, temperature=0.5)])[0].token_id
        assert a == b, step


def test_logprobs_only_for_the_rows_that_ask(monkeypatch):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 1000, generator=g)
    rows = []
    real = torch.Tensor.log_softmax
    monkeypatch.setattr(torch.Tensor, "log_softmax",
                        lambda self, *a, **k: rows.append(self.shape[0]) or real(self, *a, **k))
    reqs = [_req(0, temperature=0), _req(1, temperature=0, logprobs=3), _req(2, temperature=0)]
    out = Sampler().sample(logits, reqs)
    assert rows == [1] and out[0].logprobs is None and out[2].logprobs is None
    ref = torch.log_softmax(logits[1], -1)
    top = ref.topk(3)
    assert out[1].logprobs == pytest.approx(
        {int(i): float(v) for i, v in zip(top.indices, top.values)}, abs=1e-6)


def test_the_module_names_its_rule_once():
    # one owner: the sampler holds no copy of the filters
    import inflight.sampler as sampler

    assert not hasattr(sampler, "_top_k_top_p_min_p")
    assert sampler.candidates is sampling_filters.candidates
