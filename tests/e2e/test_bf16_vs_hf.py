"""bfloat16 (the default dtype on CPUs with native bfloat16) against HF transformers.

bfloat16 keeps 8 mantissa bits, and we round activations at other points than HF does
(fused kernels, float32 accumulation in one place or another), so greedy texts may part
where two logits nearly tie. What must hold, and what these tests check, on the bundled
model and the first turn of MT-Bench's 8 categories:

- teacher forcing (fed HF float32's greedy tokens, so every position sees the same
  prefix), against HF float32's logits: our bfloat16 is no farther from them than HF's
  own bfloat16, position by position, beyond chance; every greedy flip sits at a margin
  the measured rounding noise reaches, and there are no more flips than that noise makes
  (``tests/e2e/agreement.py``: bounds taken from the run, not tuned on one host);
- greedy decoding equals HF float32's where HF's bfloat16 does too, up to the first
  position where HF float32's best two logits are within that noise's reach.
"""

from __future__ import annotations

import copy

import pytest
import torch

from inflight.config import EngineConfig
from inflight.core.output import SampleResult
from inflight.engine import Engine
from inflight.runner import ModelRunner
from inflight.sampler import Sampler
from inflight.sampling_params import SamplingParams
from tests.e2e.agreement import (assert_error_no_larger, assert_flip_count,
                                 assert_flips_at_near_ties, compare)
from tests.e2e.conftest import run

NUM_TOKENS = 32
# A logit of 16-32 moves in steps of 0.125 in bfloat16; a few steps decide nothing. (Used
# where two runs of one path differ by a step's shape; between two paths the noise's reach
# is measured: agreement.Agreement.tie_reach.)
NEAR_TIE = 0.5


class ForcedRunner(ModelRunner):
    """A real runner that records each sampled row's logits and feeds the given tokens
    instead of sampling (teacher forcing through the real decode path)."""

    def __init__(self, *args, forced, **kwargs):
        super().__init__(*args, **kwargs)
        self.forced, self.logits = forced, {}

    def execute(self, out):
        logits, requests, _ = self.compute_logits(out)
        results = []
        for row, req in enumerate(requests):
            pos = req.num_tokens - 1
            self.logits[(req.request_id, pos)] = logits[row].float().clone()
            results.append(SampleResult(req, self.forced[req.request_id][pos + 1], None))
        return results


@pytest.fixture(scope="module")
def references(bundled, hf_reference, chat_prompts):
    """Per prompt: its ids, HF float32's and HF bfloat16's greedy sequences, HF bfloat16's
    and HF float32's logits over the float32 sequence, and HF float32's top-2 margins."""
    tokenizer = bundled[2]
    hf16 = copy.deepcopy(hf_reference).to(torch.bfloat16)
    out = []
    for text in chat_prompts:
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                               add_special_tokens=False)
        kwargs = dict(attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False)
        with torch.no_grad():
            seq32 = hf_reference.generate(torch.tensor([ids]), **kwargs)[0].tolist()
            seq16 = hf16.generate(torch.tensor([ids]), **kwargs)[0].tolist()
            logits16 = hf16(torch.tensor([seq32])).logits[0].float()
            logits32 = hf_reference(torch.tensor([seq32])).logits[0]
            top2 = logits32.topk(2).values
        out.append(dict(ids=ids, seq32=seq32, seq16=seq16, logits16=logits16, logits32=logits32,
                        margin32=(top2[:, 0] - top2[:, 1]).tolist()))
    return out


@pytest.fixture(scope="module")
def forced_bf16(bundled, references):
    """Our bfloat16 model teacher-forced on HF float32's sequences, against HF float32 at
    the same positions: ``(ours, hf bfloat16, hf float32)`` logits by ``(request, pos)``."""
    config, models, tokenizer = bundled
    forced = {str(i): r["seq32"] for i, r in enumerate(references)}
    runner = ForcedRunner(models[torch.bfloat16], 512, 16, torch.bfloat16, Sampler(),
                          forced=forced)
    engine = Engine(EngineConfig(), runner=runner, tokenizer=tokenizer, num_blocks=512,
                    max_model_len=config.max_position_embeddings,
                    eos_token_ids=tokenizer.eos_token_ids)
    for i, r in enumerate(references):
        engine.add_request(str(i), r["ids"], SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                             ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    keys = [(str(i), pos) for i, r in enumerate(references)
            for pos in range(len(r["ids"]) - 1, len(r["seq32"]) - 1)]
    hf16 = {(i, pos): references[int(i)]["logits16"][pos] for i, pos in keys}
    hf32 = {(i, pos): references[int(i)]["logits32"][pos] for i, pos in keys}
    return {k: runner.logits[k] for k in keys}, hf16, hf32


def test_teacher_forced_logits_are_as_close_as_hf_bfloat16(forced_bf16, references):
    ours, hf16, hf32 = forced_bf16
    assert len(ours) == len(references) * NUM_TOKENS
    assert_error_no_larger(ours, hf16, hf32)
    agreement = compare(ours, hf32)
    assert_flips_at_near_ties(agreement)
    assert_flip_count(agreement)


def test_greedy_equals_hf_where_hf_float32_and_bfloat16_agree(make_engine, references,
                                                              forced_bf16):
    reach = compare(forced_bf16[0], forced_bf16[2]).tie_reach
    agreeing = [r for r in references if r["seq32"] == r["seq16"]]
    assert len(agreeing) >= 2  # measured: 4 of the 8 prompts at 32 tokens
    outs = run(make_engine(dtype=torch.bfloat16), [r["ids"] for r in agreeing],
               SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    for r, out in zip(agreeing, outs):
        ours, ref = out.outputs[0].token_ids, r["seq32"][len(r["ids"]):]
        first_diff = next((k for k in range(NUM_TOKENS) if ours[k] != ref[k]), None)
        if first_diff is not None:  # only where float32 itself nearly ties
            assert r["margin32"][len(r["ids"]) - 1 + first_diff] < reach, (first_diff, reach)
