"""Structured output below the API: the spec type, the compiler, and the sampler's masks on
the bundled tokenizer's real vocabulary (no model weights needed)."""

from __future__ import annotations

import json

import pytest
import torch

from inflight.model.bundled import find_bundled_model
from inflight.request import Request
from inflight.sampler import Sampler
from inflight.sampling_params import SamplingParams
from inflight.structured_output import GrammarCompiler, GrammarState, StructuredOutputsParams
from inflight.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(find_bundled_model())


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok)


def _request(tok, compiler, spec: StructuredOutputsParams, **params) -> Request:
    req = Request("r", [1, 2, 3], SamplingParams(structured_outputs=spec, **params),
                  eos_token_ids=frozenset(tok.eos_token_ids))
    req.grammar = GrammarState(compiler.compile(spec))
    return req


@pytest.mark.parametrize("fields", [{}, {"regex": "a", "choice": ["a"]},
                                    {"choice": []}, {"regex": ""}, {"json": 3}])
def test_spec_needs_exactly_one_valid_field(fields):
    with pytest.raises(ValueError, match="^structured_outputs"):
        StructuredOutputsParams(**fields)


def test_key_keeps_property_order():
    # the schema's property order is the order the output is generated in
    a = StructuredOutputsParams(json={"properties": {"b": {}, "a": {}}})
    assert json.loads(a.key()[1])["properties"] == {"b": {}, "a": {}}
    assert list(json.loads(a.key()[1])["properties"]) == ["b", "a"]


@pytest.mark.parametrize("spec", [StructuredOutputsParams(regex="[a-"),
                                  StructuredOutputsParams(grammar="root ::= "),
                                  StructuredOutputsParams(json={"type": "objectx"}),
                                  StructuredOutputsParams(json="{not json")])
def test_bad_specs_raise_value_error_with_reason(compiler, spec):
    with pytest.raises(ValueError, match=f"^structured_outputs: invalid {spec.kind}: .+"):
        compiler.compile(spec)


def test_mask_allows_exactly_the_grammar_tokens(tok, compiler):
    """A choice grammar: every token the mask allows starts one of the choices, and each
    choice's first token is allowed; an unconstrained row in the same batch is untouched."""
    choices = ["yes", "no"]
    req = _request(tok, compiler, StructuredOutputsParams(choice=choices), temperature=0)
    free = Request("f", [1], SamplingParams(temperature=0))
    logits = torch.randn(2, tok.vocab_size, generator=torch.Generator().manual_seed(0))
    masked = Sampler._apply_grammars(logits.clone(), logits, [(0, req.grammar)], [req, free])
    allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    firsts = {tok.encode(c, add_special_tokens=False)[0] for c in choices}
    assert firsts <= set(allowed)
    for t in allowed:
        piece = tok.decode([t])
        assert any(c.startswith(piece) for c in choices), piece
    assert torch.equal(masked[1], logits[1])
    # greedy sampling through the sampler picks an allowed token and advances the grammar
    out = Sampler().sample(logits, [req, free])
    assert out[0].token_id in allowed
    assert out[1].token_id == int(logits[1].argmax())


def test_grammar_beats_min_tokens_and_ends_the_request(tok, compiler):
    """Once the grammar is complete only its stop token is allowed; ``min_tokens`` bans
    it, so the row falls back to the grammar's mask alone and samples EOS."""
    spec = StructuredOutputsParams(choice=["no"])
    req = _request(tok, compiler, spec, temperature=0, min_tokens=5)
    no = tok.encode("no", add_special_tokens=False)
    assert len(no) == 1 and req.grammar.accept(no[0])
    req.output_token_ids.append(no[0])
    logits = torch.zeros(1, tok.vocab_size)
    out = Sampler().sample(logits, [req])
    assert out[0].token_id in tok.eos_token_ids
    assert req.grammar.is_terminated


def test_sampled_tokens_follow_a_json_schema(tok, compiler):
    """Random logits, 60 sampled steps: the text is always a prefix the schema allows, and
    when the grammar ends it is valid JSON with the required key."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    spec = StructuredOutputsParams(json=schema)
    for seed in range(3):
        req = _request(tok, compiler, spec, temperature=1.0, seed=seed)
        sampler = Sampler()
        gen = torch.Generator().manual_seed(seed)
        for _ in range(60):
            out = sampler.sample(torch.randn(1, tok.vocab_size, generator=gen), [req])[0]
            req.output_token_ids.append(out.token_id)
            if req.grammar.is_terminated:
                break
        text = tok.decode(req.output_token_ids)
        assert text.startswith('{"n": ')
        if req.grammar.is_terminated:
            assert isinstance(json.loads(text)["n"], int)


def test_a_terminated_grammar_is_never_masked_by(tok, compiler):
    """Its request ends in this step's update; sampling it again (a caller that keeps it)
    must not raise inside xgrammar, which refuses masks after the stop token."""
    req = _request(tok, compiler, StructuredOutputsParams(choice=["no"]), temperature=0)
    assert req.grammar.accept(tok.encode("no", add_special_tokens=False)[0])
    assert req.grammar.accept(min(tok.eos_token_ids & {2} or tok.eos_token_ids))
    assert req.grammar.is_terminated
    logits = torch.randn(1, tok.vocab_size, generator=torch.Generator().manual_seed(1))
    assert Sampler().sample(logits, [req])[0].token_id == int(logits[0].argmax())
