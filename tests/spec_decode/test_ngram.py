"""Prompt-lookup (n-gram) drafts: exact proposals of ``propose_ngram`` and of
``NgramProposer`` over requests (prompt and output together)."""

from __future__ import annotations

import numpy as np
import pytest

from inflight.core.spec_config import SpeculativeConfig
from inflight.request import Request
from inflight.sampling_params import SamplingParams
from inflight.spec_decode import make_proposer
from inflight.spec_decode.ngram import NgramProposer, propose_ngram


def ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


def test_docstring_example():
    assert propose_ngram(ids(1, 2, 3, 9, 1, 2), 3, 2, 3) == [3, 9, 1]


def test_longest_n_wins_over_a_later_shorter_match():
    # suffix (7, 8, 9): the 3-gram occurs at 0 (followed by 10, 11); the 1-gram 9 also
    # occurs later at 6 (followed by 20): the longest n is tried first.
    seq = ids(7, 8, 9, 10, 11, 5, 9, 20, 7, 8, 9)
    assert propose_ngram(seq, 2, 1, 3) == [10, 11]
    # capped at n = 1, the latest 9 (at 6) wins
    assert propose_ngram(seq, 2, 1, 1) == [20, 7]


def test_latest_occurrence_wins():
    # "1 2" occurs at 0 (-> 3) and at 3 (-> 4); the latest is nearer context.
    seq = ids(1, 2, 3, 1, 2, 4, 5, 1, 2)
    assert propose_ngram(seq, 2, 2, 2) == [4, 5]


def test_k_truncated_at_the_end_of_the_sequence():
    # the match's continuation runs into the suffix itself and stops at the end
    seq = ids(5, 6, 7, 5, 6)
    assert propose_ngram(seq, 10, 2, 2) == [7, 5, 6]
    assert propose_ngram(seq, 1, 2, 2) == [7]


def test_a_repeated_token_run_proposes_its_continuation():
    # suffix (4, 4): latest earlier window at 2 (positions 2..3), followed by one token 4
    seq = ids(4, 4, 4, 4)
    assert propose_ngram(seq, 5, 2, 2) == [4]
    assert propose_ngram(seq, 5, 1, 1) == [4]


def test_no_match_is_empty():
    assert propose_ngram(ids(1, 2, 3, 4, 5), 4, 1, 3) == []
    # a match of the n-gram exists only below n_min
    assert propose_ngram(ids(1, 2, 3, 9, 2, 3), 4, 3, 4) == []
    assert propose_ngram(ids(1, 2, 3, 9, 2, 3), 4, 2, 4) == [9, 2, 3]


def test_n_max_bounds_the_lookup():
    # only a 3-gram match exists at 0 -> (1, 2, 3) followed by 42; a 4-gram suffix
    # (8, 1, 2, 3) does not occur; n_max=2 still finds (2, 3) -> 42
    seq = ids(1, 2, 3, 42, 43, 8, 1, 2, 3)
    assert propose_ngram(seq, 2, 3, 4) == [42, 43]
    assert propose_ngram(seq, 2, 2, 2) == [42, 43]
    assert propose_ngram(seq, 2, 4, 5) == []


def test_sequences_too_short_to_match():
    assert propose_ngram(ids(3), 4, 1, 4) == []
    assert propose_ngram(ids(3, 3), 4, 1, 4) == [3]
    assert propose_ngram(ids(3, 3), 4, 2, 4) == []


def test_the_suffix_itself_is_not_a_match():
    # the only occurrence of (1, 2, 3) is the suffix: nothing follows it
    assert propose_ngram(ids(9, 1, 2, 3), 3, 3, 3) == []


@pytest.mark.parametrize("seed", range(20))
def test_matches_a_brute_force_reference(seed):
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, 4, size=int(rng.integers(1, 30))).astype(np.int64)
    n_min = int(rng.integers(1, 3))
    n_max = n_min + int(rng.integers(0, 3))
    k = int(rng.integers(1, 6))
    expected: list[int] = []
    size = len(seq)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = list(seq[size - n:])
        starts = [i for i in range(size - n) if list(seq[i:i + n]) == suffix]
        if starts:
            expected = [int(t) for t in seq[starts[-1] + n:starts[-1] + n + k]]
            break
    assert propose_ngram(seq, k, n_min, n_max) == expected


def _request(rid: str, prompt: list[int], output: list[int]) -> Request:
    req = Request(rid, prompt, SamplingParams(max_tokens=100))
    for t in output:
        req.append_output_token(t, None, 0.0)
    return req


def test_proposer_reads_prompt_and_output_and_respects_each_k():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                            prompt_lookup_max=3)
    proposer = make_proposer(cfg)
    assert isinstance(proposer, NgramProposer)
    # a: the suffix (10, 11) spans prompt and output; it occurred in the prompt at 0
    a = _request("a", [10, 11, 12, 13, 14, 15, 10], [11])
    # b: no repeat anywhere
    b = _request("b", [1, 2, 3], [4])
    # c: the match is in the output only; k = 2 truncates
    c = _request("c", [50], [60, 61, 62, 63, 60, 61])
    # d: stale drafts from an earlier step are replaced by an empty proposal
    d = _request("d", [7, 8], [9])
    d.spec_token_ids = [1, 2]
    proposer.propose([(a, 4), (b, 4), (c, 2), (d, 3)])
    assert a.spec_token_ids == [12, 13, 14, 15]
    assert b.spec_token_ids == []
    assert c.spec_token_ids == [62, 63]
    assert d.spec_token_ids == []


def test_proposer_leaves_requests_not_asked_alone():
    proposer = NgramProposer(SpeculativeConfig(method="ngram", prompt_lookup_min=1))
    asked = _request("a", [1, 2, 1], [])
    other = _request("o", [1, 2, 1], [])
    other.spec_token_ids = [99]
    proposer.propose([(asked, 3)])
    assert asked.spec_token_ids == [2, 1]
    assert other.spec_token_ids == [99]
