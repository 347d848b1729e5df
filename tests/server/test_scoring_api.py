"""Scoring and the rest of the completions API (issue 16, item 3): ``echo``, ``max_tokens: 0``,
``prompt_logprobs``, ``logit_bias``, ``best_of``, as lm-evaluation-harness's
``local-completions`` and vLLM's clients send them, on a real server over the bundled model
in float32 with dense weights (HF transformers' log-softmax is then the exact reference)."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from inflight.config import EngineConfig
from tests.server.conftest import SMALL_CONFIG, serve

pytestmark = pytest.mark.slow

PROMPT = ("The quick brown fox jumps over the lazy dog. Then it ran into the forest and hid "
          "behind an old oak tree until the night fell.")


@pytest.fixture(scope="module")
def engine():
    from inflight.engine import Engine
    # max_num_batched_tokens 16: longer prompts arrive in chunks, so prompt logprobs are
    # gathered over several steps.
    return Engine(EngineConfig(dtype="float32", quantization="none",
                               **{**SMALL_CONFIG, "max_num_batched_tokens": 16}))


@pytest.fixture(scope="module")
def url(engine):
    srv, _ = serve(engine)
    yield srv.base_url
    srv.stop()


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    from inflight.model.bundled import find_bundled_model
    path = find_bundled_model()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def _hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]``: row ``p`` is the log-softmax after tokens ``0..p``."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def post(url, path, body, status=200):
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def tokenize(url, text):
    return post(url, "/tokenize", {"prompt": text})["tokens"]


def test_echo_max_tokens_0_scores_the_prompt_as_hf(url, hf_model):
    ids = tokenize(url, PROMPT)
    assert len(ids) > 16  # chunked over several steps
    body = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True,
                                         "logprobs": 2, "temperature": 0})
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) == len(lp["token_logprobs"]) == len(lp["text_offset"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == PROMPT
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    ref = _hf_logprobs(hf_model, ids)
    for p in range(1, len(ids)):
        assert lp["token_logprobs"][p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        top = ref[p - 1].topk(2)
        got = lp["top_logprobs"][p]
        assert 2 <= len(got) <= 3  # the top 2 plus the prompt token when it is not one
        for v in top.values.tolist():
            assert any(abs(v - g) < 1e-4 for g in got.values())
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                             "total_tokens": len(ids)}  # nothing generated, nothing counted
    assert choice["finish_reason"] == "length"


def test_scoring_generates_nothing_streamed_or_not(url, engine):
    ids = tokenize(url, PROMPT)
    generated = engine.get_stats().generation_tokens
    req = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0,
           "stream_options": {"include_usage": True}}
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", json={**req, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines()
                  if line and line != "data: [DONE]"]
    assert chunks[-1]["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                                   "total_tokens": len(ids)}
    choices = [c for ch in chunks for c in ch["choices"]]
    assert "".join(c["text"] for c in choices) == PROMPT
    assert sum(len(c["logprobs"]["tokens"]) for c in choices) == len(ids)  # the prompt's only
    assert choices[-1]["finish_reason"] == "length"
    assert engine.get_stats().generation_tokens == generated  # the engine sampled none


def test_echo_with_generation_and_token_id_prompts(url):
    ids = tokenize(url, PROMPT)
    # lm-eval's request: token ids, echo, logprobs 1, max_tokens 1, greedy.
    body = post(url, "/v1/completions", {"prompt": [ids, ids[:5]], "max_tokens": 1,
                                         "echo": True, "logprobs": 1, "temperature": 0})
    scored = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True,
                                           "logprobs": 1, "temperature": 0})
    plain = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 1, "logprobs": 1,
                                          "temperature": 0})
    first = body["choices"][0]
    lp = first["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][:-1] == scored["choices"][0]["logprobs"]["token_logprobs"]
    assert lp["token_logprobs"][-1] == plain["choices"][0]["logprobs"]["token_logprobs"][0]
    assert first["text"] == scored["choices"][0]["text"] + plain["choices"][0]["text"]
    assert lp["text_offset"][-1] == sum(len(t) for t in lp["tokens"][:-1])
    assert len(body["choices"][1]["logprobs"]["tokens"]) == 6
    # Echo without logprobs: the text alone.
    body = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "echo": True,
                                         "temperature": 0})
    assert body["choices"][0]["text"].startswith(PROMPT)
    assert body["choices"][0]["logprobs"] is None


def test_echo_stream_equals_non_stream(url):
    req = {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0}
    whole = post(url, "/v1/completions", req)["choices"][0]
    text, tokens, lps, offsets = "", [], [], []
    with httpx.stream("POST", url + "/v1/completions", json={**req, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line or line == "data: [DONE]":
                continue
            for c in json.loads(line.removeprefix("data: "))["choices"]:
                text += c["text"]
                tokens += c["logprobs"]["tokens"]
                lps += c["logprobs"]["token_logprobs"]
                offsets += c["logprobs"]["text_offset"]
    assert text == whole["text"]
    assert tokens == whole["logprobs"]["tokens"]
    assert lps == whole["logprobs"]["token_logprobs"]
    assert offsets == whole["logprobs"]["text_offset"]


def test_prompt_logprobs_shape_and_values(url, hf_model):
    ids = tokenize(url, PROMPT)
    ref = _hf_logprobs(hf_model, ids)
    body = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 2,
                                         "prompt_logprobs": 3, "temperature": 0})
    for choice in body["choices"]:
        pl = choice["prompt_logprobs"]
        assert len(pl) == len(ids) and pl[0] is None
        for p in range(1, len(ids)):
            entry = pl[p]
            assert str(ids[p]) in entry
            assert 3 <= len(entry) <= 4
            ranked = sorted(entry.values(), key=lambda e: e["rank"])
            assert [e["rank"] for e in ranked[:3]] == [1, 2, 3]
            row = ref[p - 1]
            actual = entry[str(ids[p])]
            assert actual["logprob"] == pytest.approx(row[ids[p]].item(), abs=1e-4)
            v = row[ids[p]]  # rank: 1 + tokens more likely (ties within rounding either way)
            assert int((row > v + 1e-4).sum()) + 1 <= actual["rank"] <= int((row >= v - 1e-4).sum())
            for tid, e in entry.items():
                assert e["logprob"] == pytest.approx(row[int(tid)].item(), abs=1e-4)
                assert isinstance(e["decoded_token"], str)
    # Without prompt_logprobs the field is null; chat carries it on the response.
    plain = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert plain["choices"][0]["prompt_logprobs"] is None
    chat = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 1, "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_prompt_logprobs_skip_the_prefix_cache(url, engine):
    ids = tokenize(url, PROMPT * 3)  # several full blocks, cached by the first request
    first = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0})
    scored = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True,
                                           "logprobs": 0})
    assert len(scored["choices"][0]["logprobs"]["token_logprobs"]) == len(ids)
    assert None not in scored["choices"][0]["logprobs"]["token_logprobs"][1:]
    again = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True,
                                          "logprobs": 0})
    assert again["choices"][0]["logprobs"] == scored["choices"][0]["logprobs"]
    assert first["choices"][0]["text"]


def test_logit_bias_forces_and_bans(url):
    greedy = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                           "temperature": 0, "logprobs": 0})
    lp = greedy["choices"][0]["logprobs"]
    top_text, top_lp = lp["tokens"][0], lp["token_logprobs"][0]
    base = tokenize(url, PROMPT)
    with_top = tokenize(url, PROMPT + top_text)
    assert with_top[:len(base)] == base and len(with_top) == len(base) + 1
    top_id = with_top[-1]
    forced_id = 3000
    forced_text = post(url, "/detokenize", {"tokens": [forced_id]})["prompt"]
    forced = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                           "logit_bias": {str(forced_id): 100}, "logprobs": 0})
    assert forced["choices"][0]["logprobs"]["tokens"] == [forced_text] * 3
    # Returned logprobs are the raw model's: the forced token stays unlikely.
    assert forced["choices"][0]["logprobs"]["token_logprobs"][0] < math.log(0.5)
    banned = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0,
                                           "logit_bias": {str(top_id): -100}, "logprobs": 0})
    assert banned["choices"][0]["logprobs"]["tokens"][0] != top_text
    assert banned["choices"][0]["logprobs"]["token_logprobs"][0] < top_lp
    # Sampled too (not only greedy): +100 wins every draw.
    sampled = post(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 1,
        "seed": 3, "logit_bias": {str(forced_id): 100}})
    text = sampled["choices"][0]["message"]["content"]
    assert text == post(url, "/detokenize", {"tokens": [forced_id] * 4})["prompt"]


def test_best_of_returns_the_highest_cumulative_logprob(url):
    req = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 11,
           "logprobs": 0, "ignore_eos": True}
    cands = post(url, "/v1/completions", {**req, "n": 4})["choices"]
    totals = [sum(c["logprobs"]["token_logprobs"]) for c in cands]
    best = post(url, "/v1/completions", {**req, "n": 1, "best_of": 4})
    assert len(best["choices"]) == 1
    assert best["choices"][0]["text"] == cands[totals.index(max(totals))]["text"]
    assert best["usage"]["completion_tokens"] == 4 * 6  # every candidate generated
    two = post(url, "/v1/completions", {**req, "n": 2, "best_of": 4})["choices"]
    order = sorted(range(4), key=lambda i: -totals[i])[:2]
    assert [c["text"] for c in two] == [cands[i]["text"] for i in order]
    assert [c["index"] for c in two] == [0, 1]
    # Without logprobs asked, none are returned.
    quiet = post(url, "/v1/completions", {**req, "logprobs": None, "best_of": 4})
    assert quiet["choices"][0]["logprobs"] is None
    assert quiet["choices"][0]["text"] == best["choices"][0]["text"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": -1}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "best_of": 0}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": "1"}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "logit_bias": {"-3": 5}}, "logit_bias"),
])
def test_invalid_values_get_400(url, path, body, param):
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err


def test_prompt_logprobs_leave_batched_neighbours_unchanged(engine):
    """The same batch (chunked prefills beside decodes) with and without one request asking
    for prompt logprobs: every other request's tokens and logprobs are identical."""
    from inflight.engine import Engine
    from inflight.runner import ModelRunner
    from inflight.sampler import Sampler
    from inflight.sampling_params import SamplingParams

    tok = engine.tokenizer
    prompts = [tok.encode(PROMPT), tok.encode("Name three planets of the solar system."),
               tok.encode("1, 2, 3, 4,")]
    plain = SamplingParams(temperature=0, max_tokens=8, logprobs=2)

    def run(prompt_logprobs):
        # Its own engine over the server's weights (the server's engine thread owns that one).
        cfg = EngineConfig(max_num_batched_tokens=16, enable_prefix_caching=False)
        e = Engine(cfg, runner=ModelRunner(engine.runner.model, 64, cfg.block_size,
                                           torch.float32, Sampler()),
                   tokenizer=tok, num_blocks=64, max_model_len=2048,
                   eos_token_ids=engine.eos_token_ids)
        e.add_request("scorer", tok.encode(PROMPT * 2), SamplingParams(
            temperature=0, max_tokens=2, prompt_logprobs=prompt_logprobs))
        for i, ids in enumerate(prompts):
            e.add_request(str(i), ids, plain)
        outs = {}
        while e.has_unfinished_requests():
            outs.update({o.request_id: o for o in e.step()})
        return outs

    without, with_ = run(None), run(5)
    for rid in ("0", "1", "2", "scorer"):
        a, b = without[rid].outputs[0], with_[rid].outputs[0]
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
    assert without["scorer"].prompt_logprobs is None
    assert len(with_["scorer"].prompt_logprobs) == len(tok.encode(PROMPT * 2))


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0, "echo": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "max_completion_tokens": 0}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_is_one_policy(url, engine, route, body, stream):
    """Issue 55: ``max_tokens: 0`` on completions and chat, echo or not, streamed or not, as
    vLLM: the prompt is prefilled, nothing generated, ``finish_reason`` ``length``,
    ``usage.completion_tokens`` 0, and no KV block kept."""
    generated = engine.get_stats().generation_tokens
    req = {**body, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    if stream:
        with httpx.stream("POST", url + route, json=req, timeout=60) as r:
            assert r.status_code == 200
            chunks = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines()
                      if line and line != "data: [DONE]"]
        choices = [c for ch in chunks for c in ch["choices"]]
        usage = chunks[-1]["usage"]
        finish = [c["finish_reason"] for c in choices if c.get("finish_reason")]
        text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)
    else:
        out = post(url, route, req)
        (choice,) = out["choices"]
        usage, finish = out["usage"], [choice["finish_reason"]]
        text = choice.get("text", (choice.get("message") or {}).get("content")) or ""
    assert finish == ["length"] and usage["completion_tokens"] == 0
    assert text == ("Hi" if body.get("echo") else "")
    assert engine.get_stats().generation_tokens == generated
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
