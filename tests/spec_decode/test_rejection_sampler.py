"""Draft verification (``inflight.rejection_sampler``): exact greedy cases, and for sampled
requests the property speculative sampling exists for (Leviathan et al. 2023, Theorem 1):
every emitted token is distributed as the target's ``p``, whatever the drafts were.

The distribution tests are chi-square goodness-of-fit tests at the 0.999 level over 20k
seeded draws: deterministic, and a verifier off by a few percent in one category fails."""

from __future__ import annotations

import pytest
import torch

from inflight.rejection_sampler import draw, verify_greedy, verify_random

N_DRAWS = 20_000
# Upper 0.999 quantiles of the chi-square distribution by degrees of freedom
# (scipy.stats.chi2.ppf(0.999, df)); scipy is not a dependency.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}

P0 = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.0, 0.30])  # has a zero-probability token
P1 = torch.tensor([0.40, 0.05, 0.05, 0.20, 0.20, 0.10])
P2 = torch.tensor([0.10, 0.10, 0.50, 0.10, 0.10, 0.10])


def assert_follows(tokens: list[int], p: torch.Tensor) -> None:
    """Chi-square test that ``tokens`` were drawn from ``p``; categories with p = 0 must
    never occur."""
    counts = torch.bincount(torch.tensor(tokens), minlength=len(p)).double()
    n = counts.sum()
    zero = p == 0
    assert counts[zero].sum() == 0, f"drew a zero-probability token: {counts.tolist()}"
    expected = p[~zero].double() * n
    stat = float(((counts[~zero] - expected) ** 2 / expected).sum())
    df = int((~zero).sum()) - 1
    assert stat < CHI2_999[df], (f"chi2 {stat:.1f} >= {CHI2_999[df]} (df {df}): counts "
                                 f"{counts.tolist()} vs expected {(p.double() * n).tolist()}")


def test_assert_follows_rejects_a_slightly_wrong_distribution():
    """The test has power: draws from P0 with 3% of its mass moved fail against P0."""
    g = torch.Generator().manual_seed(0)
    wrong = P0.clone()
    wrong[1] -= 0.03
    wrong[3] += 0.03
    tokens = torch.multinomial(wrong, N_DRAWS, replacement=True, generator=g).tolist()
    with pytest.raises(AssertionError, match="chi2"):
        assert_follows(tokens, P0)
    assert_follows(torch.multinomial(P0, N_DRAWS, replacement=True, generator=g).tolist(), P0)


@pytest.mark.parametrize("targets,drafts,kept", [
    ([5], [], [5]),                          # no drafts: the target's token
    ([1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4]),  # all accepted + the bonus token
    ([1, 9, 3, 4], [1, 2, 3], [1, 9]),       # second rejected: its correction ends it
    ([9, 2, 3, 4], [1, 2, 3], [9]),          # first rejected
    ([1, 2, 7, 4], [1, 2, 3], [1, 2, 7]),    # last rejected
    ([1, 1], [1], [1, 1]),
])
def test_verify_greedy_exact(targets, drafts, kept):
    assert verify_greedy(targets, drafts) == kept


def test_draw_follows_p():
    g = torch.Generator().manual_seed(1)
    assert_follows([draw(P0, g) for _ in range(N_DRAWS)], P0)


def test_draw_accepts_unnormalized_weights():
    g = torch.Generator().manual_seed(2)
    assert_follows([draw(P1 * 7.0, g) for _ in range(N_DRAWS)], P1)


@pytest.mark.parametrize("draft", [1, 4, 0])  # likely, impossible (p = 0), unlikely
def test_first_token_follows_p_with_a_one_hot_draft(draft):
    g = torch.Generator().manual_seed(10 + draft)
    probs = torch.stack([P0, P1])
    firsts, accepted = [], 0
    for _ in range(N_DRAWS):
        kept = verify_random(probs, [draft], g)
        assert 1 <= len(kept) <= 2
        assert (len(kept) == 2) == (kept[0] == draft)  # a second token only after acceptance
        accepted += kept[0] == draft
        firsts.append(kept[0])
    assert_follows(firsts, P0)
    if P0[draft] == 0:
        assert accepted == 0


def test_first_token_follows_p_with_drafts_sampled_from_q():
    """Chen et al.'s general case: ``x ~ q`` accepted with min(1, p(x)/q(x)), the residual
    norm(max(p - q, 0)) at a rejection."""
    q = torch.tensor([0.30, 0.10, 0.10, 0.10, 0.30, 0.10])  # q puts mass where p has none
    probs = torch.stack([P0, P1])
    g_draft = torch.Generator().manual_seed(20)
    g = torch.Generator().manual_seed(21)
    firsts = []
    for _ in range(N_DRAWS):
        x = int(torch.multinomial(q, 1, generator=g_draft))
        kept = verify_random(probs, [x], g, draft_probs=q[None, :])
        firsts.append(kept[0])
    assert_follows(firsts, P0)


def test_first_token_follows_p_when_q_equals_p():
    """p == q: every draft is accepted (the residual is empty and never used)."""
    probs = torch.stack([P1, P2])
    g_draft, g = torch.Generator().manual_seed(30), torch.Generator().manual_seed(31)
    firsts = []
    for _ in range(4000):
        x = int(torch.multinomial(P1, 1, generator=g_draft))
        kept = verify_random(probs, [x], g, draft_probs=P1[None, :])
        assert kept[0] == x and len(kept) == 2
        firsts.append(kept[0])
    assert_follows(firsts, P1)


def test_later_tokens_follow_their_rows_after_accepted_drafts():
    """The token at position 1 (emitted after an accepted first draft) follows row 1's p,
    and the bonus token after every draft was accepted follows the last row's."""
    probs = torch.stack([P0, P1, P2])
    drafts = [1, 0]  # P0[1] = 0.3, P1[0] = 0.4: both rows accept often
    g = torch.Generator().manual_seed(40)
    seconds, thirds = [], []
    for _ in range(N_DRAWS):
        kept = verify_random(probs, drafts, g)
        assert kept[:-1] == drafts[:len(kept) - 1]
        if len(kept) >= 2:
            seconds.append(kept[1])
        if len(kept) == 3:
            thirds.append(kept[2])
    # acceptance of the first draft has probability p0(1) = 0.3
    assert abs(len(seconds) / N_DRAWS - 0.3) < 0.02
    assert_follows(seconds, P1)
    assert len(thirds) > 1000
    assert_follows(thirds, P2)


def test_later_tokens_follow_their_rows_with_q():
    probs = torch.stack([P0, P1, P2])
    q = torch.stack([torch.tensor([0.1, 0.5, 0.1, 0.1, 0.1, 0.1]),
                     torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])])
    g_draft, g = torch.Generator().manual_seed(50), torch.Generator().manual_seed(51)
    firsts, seconds = [], []
    for _ in range(N_DRAWS):
        d = [int(torch.multinomial(q[j], 1, generator=g_draft)) for j in range(2)]
        kept = verify_random(probs, d, g, draft_probs=q)
        firsts.append(kept[0])
        if len(kept) >= 2:
            seconds.append(kept[1])
    assert_follows(firsts, P0)
    assert_follows(seconds, P1)


def test_a_seeded_generator_reproduces_the_output():
    probs = torch.stack([P0, P1, P2])
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(1234)
        runs.append([verify_random(probs, [1, 0], g) for _ in range(200)])
    assert runs[0] == runs[1]
    g = torch.Generator().manual_seed(4321)
    assert [verify_random(probs, [1, 0], g) for _ in range(200)] != runs[0]


def test_a_one_hot_target_always_accepts_its_token_and_rejects_others():
    onehot = torch.zeros(2, 6)
    onehot[0, 3] = onehot[1, 5] = 1.0
    g = torch.Generator().manual_seed(5)
    for _ in range(200):
        assert verify_random(onehot, [3], g) == [3, 5]
        assert verify_random(onehot, [2], g) == [3]


# --- through the Sampler: rows of a request verifying drafts ------------------------------

def _req(rid, **params):
    from inflight.request import Request
    from inflight.sampling_params import SamplingParams

    return Request(rid, [1, 2, 3], SamplingParams(**params))


def test_sampler_greedy_verification_keeps_tokens_with_their_rows_logprobs():
    from inflight.sampler import Sampler

    logits = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    a, b = _req("a", temperature=0, logprobs=2), _req("b", temperature=0, logprobs=2)
    argmax = logits.argmax(-1).tolist()
    # a: rows 0-3 verify 3 drafts; its first two are the targets, the third is not
    wrong = (argmax[2 + 1] + 1) % 10
    # b: rows 4-5 verify 1 right draft, so it keeps 2 tokens
    out = Sampler().sample(logits, [a, b], [[argmax[0], argmax[1], wrong], [argmax[4]]])
    assert [(r.request.request_id, r.token_id) for r in out] == [
        ("a", argmax[0]), ("a", argmax[1]), ("a", argmax[2]), ("b", argmax[4]), ("b", argmax[5])]
    logp = logits.log_softmax(-1)
    for res, row in zip(out, [0, 1, 2, 4, 5]):
        assert res.logprobs[res.token_id] == pytest.approx(float(logp[row, res.token_id]), abs=1e-5)
        top2 = logp[row].topk(2).indices.tolist()
        assert set(top2) <= set(res.logprobs)


def test_sampler_penalty_counts_the_drafts_before_each_row():
    """Row j sees the j drafts before it as output (``DraftedRow``): with a huge presence
    penalty, row 1 cannot pick row 0's draft again, as a plain next step could not."""
    from inflight.sampler import Sampler

    logits = torch.zeros(2, 8)
    logits[:, 5] = 10.0   # both rows' argmax is 5
    logits[:, 6] = 9.0
    req = _req("p", temperature=0, presence_penalty=2.0, repetition_penalty=1.0)
    out = Sampler().sample(logits, [req], [[5]])
    assert [r.token_id for r in out] == [5, 6]
