"""``POST /v1/embeddings`` (issue 33, item 4): shapes, unit norms, batch invariance, token-id
input, base64, usage, the 400s, admission, the ``openai`` client, on the bundled model;
``inflight serve --pooling mean`` end to end; then the vectors against HF transformers'
final hidden states on a tiny random Llama, with ``--pooling last`` and ``mean``."""

from __future__ import annotations

import base64
import struct
import subprocess
import sys
import types

import httpx
import numpy as np
import openai
import pytest
import torch

from inflight.cli import build_parser
from inflight.config import EngineConfig
from inflight.engine import Engine
from inflight.outputs import RequestOutput
from inflight.server.app import build_app
from inflight.server.embeddings_api import EmbeddingRequest
from inflight.server.embeddings_serving import Embedder
from inflight.server.error_responses import OpenAIError
from tests.server.conftest import (MODEL, free_port, process_healthy, serve, stop_process,
                                   wait_until)

pytestmark = pytest.mark.slow

TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "Paged attention keeps the KV cache in fixed-size blocks, so many requests share it.",
         "hi"]
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 4
MAX_NUM_WAITING = 4


@pytest.fixture(scope="module")
def engine(real_engine):
    # The shared weights with small limits: 4 running + 4 waiting sequences at most.
    return Engine(EngineConfig(num_kv_blocks=128, max_num_seqs=MAX_NUM_SEQS),
                  runner=real_engine.runner, tokenizer=real_engine.tokenizer, num_blocks=128,
                  max_model_len=MAX_MODEL_LEN, eos_token_ids=real_engine.eos_token_ids)


@pytest.fixture(scope="module")
def url(engine):
    srv, _ = serve(engine, max_num_waiting=MAX_NUM_WAITING)
    yield srv.base_url
    srv.stop()


@pytest.fixture(scope="module")
def hidden_size(engine):
    return engine.runner.model.config.hidden_size


def embed(url, status=200, **body):
    r = httpx.post(url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def vectors(body) -> list[np.ndarray]:
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return [np.asarray(d["embedding"], dtype=np.float64) for d in body["data"]]


def test_shapes_norms_and_usage(url, engine, hidden_size):
    body = embed(url, input=TEXTS)
    assert body["object"] == "list" and body["model"] == MODEL
    assert body["id"].startswith("embd-")
    assert all(d["object"] == "embedding" for d in body["data"])
    vs = vectors(body)
    assert len(vs) == 3 and all(v.shape == (hidden_size,) for v in vs)
    for v in vs:
        assert abs(np.linalg.norm(v) - 1) < 1e-5
    assert not np.allclose(vs[0], vs[1], atol=1e-3)  # different texts, different vectors
    n = sum(len(engine.tokenizer.encode(t)) for t in TEXTS)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}


def test_a_batch_equals_each_input_alone(url):
    # Prompt rows are batch-invariant (issue 34): the same bits alone, batched, or with the
    # prompt's blocks served from the prefix cache (the last token then computed alone).
    batch = vectors(embed(url, input=TEXTS))
    for text, v in zip(TEXTS, batch):
        assert np.array_equal(vectors(embed(url, input=text))[0], v), text
    again = vectors(embed(url, input=TEXTS[1]))[0]  # its blocks now in the prefix cache
    assert np.array_equal(again, batch[1])


def test_token_ids_equal_the_text(url, engine):
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    by_text = vectors(embed(url, input=TEXTS))
    one = vectors(embed(url, input=ids[0]))
    many = vectors(embed(url, input=ids))
    assert np.array_equal(one[0], by_text[0])
    for a, b in zip(many, by_text):
        assert np.array_equal(a, b)
    body = embed(url, input=ids)
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))


def test_truncate_prompt_tokens_keeps_the_last_tokens(url, engine):
    ids = engine.tokenizer.encode(TEXTS[1])
    cut = vectors(embed(url, input=TEXTS[1], truncate_prompt_tokens=5))[0]
    assert np.array_equal(cut, vectors(embed(url, input=ids[-5:]))[0])
    body = embed(url, input=[ids * 30], truncate_prompt_tokens=-1)  # longer than the context
    assert body["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1


def test_base64_is_little_endian_float32(url):
    floats = embed(url, input=TEXTS[:2])["data"]
    b64 = embed(url, input=TEXTS[:2], encoding_format="base64")["data"]
    for f, b in zip(floats, b64):
        raw = base64.b64decode(b["embedding"])
        decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
        assert list(decoded) == f["embedding"]  # the floats are float32 values: exact


def test_the_openai_client(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    want = vectors(embed(url, input=TEXTS))
    # Without encoding_format the client asks for base64 and decodes it itself.
    got = client.embeddings.create(model=MODEL, input=TEXTS)
    assert len(got.data) == len(want)
    for d, w in zip(got.data, want):
        assert np.array_equal(np.asarray(d.embedding), w)  # float32 both ways: exact
    assert got.usage.prompt_tokens == got.usage.total_tokens > 0
    floats = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert np.array_equal(np.asarray(floats.data[0].embedding), want[0])
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=8)


def _prompt_tokens_total(url) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("inflight:prompt_tokens_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no prompt_tokens_total")


def test_dimensions_only_the_hidden_size(url, hidden_size):
    body = embed(url, input="x", dimensions=hidden_size)
    assert len(body["data"][0]["embedding"]) == hidden_size
    before = _prompt_tokens_total(url)
    err = embed(url, 400, input="x", dimensions=hidden_size // 2)["error"]
    assert err["param"] == "dimensions" and str(hidden_size) in err["message"]
    assert _prompt_tokens_total(url) == before  # refused before it ran (size known)


def test_dimensions_checked_on_the_vectors_while_the_size_is_unknown():
    # A fresh server knows the size only from its first vector: the check runs on it.
    gen = types.SimpleNamespace(num_prompt_tokens=2, request_id="embd-1", created=0,
                                model_name="m")
    out = RequestOutput("embd-1-0", None, [1, 2], [], True, embedding=[0.6, 0.8])
    emb = Embedder()
    with pytest.raises(OpenAIError) as e:
        emb.response(gen, EmbeddingRequest(input="x", dimensions=3), [out])
    assert e.value.status == 400 and e.value.param == "dimensions" and emb.hidden_size == 2
    body = emb.response(gen, EmbeddingRequest(input="x", dimensions=2), [out])
    assert body["data"][0]["embedding"] == [0.6, 0.8]
    missing = RequestOutput("embd-1-0", None, [1, 2], [], True)
    with pytest.raises(OpenAIError) as e:
        emb.response(gen, EmbeddingRequest(input="x"), [missing])
    assert e.value.status == 500


@pytest.mark.parametrize("body,status,param", [
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [[]]}, 400, "input[0]"),
    ({"input": ["a", ""]}, 400, "input[1]"),
    ({"input": [1, "a"]}, 400, "input[0]"),
    ({"input": [10**9]}, 400, "input"),
    ({"input": [5] * (MAX_MODEL_LEN + 10)}, 400, "input"),
    ({"input": "a", "encoding_format": "hex"}, 400, "encoding_format"),
    ({"input": "a", "dimensions": 0}, 400, "dimensions"),
    ({"input": "a", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"input": "a", "model": "nope"}, 404, "model"),
    ({"input": ["a"] * (MAX_NUM_SEQS + MAX_NUM_WAITING + 1)}, 400, "input"),
])
def test_refusals_name_the_field(url, body, status, param):
    err = embed(url, status, **body)["error"]
    assert err["param"] == param, err


def test_every_input_is_admitted_at_once(url, engine):
    body = embed(url, input=[f"input number {i}" for i in range(MAX_NUM_SEQS + MAX_NUM_WAITING)])
    assert len(body["data"]) == MAX_NUM_SEQS + MAX_NUM_WAITING
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_admission_refuses_before_reading_the_body_when_full(url, engine):
    # Hold every place with a streamed completion; the admission middleware then answers
    # /v1/embeddings 503 before parsing, so even a malformed body gets 503, not 400.
    hog = {"model": MODEL, "prompt": "Tell a long story", "n": MAX_NUM_SEQS + MAX_NUM_WAITING,
           "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=hog, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a collected iterator closes the stream (an abort)
        first = next(lines)
        assert first.startswith("data: {") and '"error"' not in first, first
        refused = httpx.post(url + "/v1/embeddings", content=b"{not json", timeout=30,
                             headers={"content-type": "application/json"})
        assert refused.status_code == 503, refused.text
    wait_until(lambda: engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks,
               what="the hog to be aborted")


def test_the_document_lists_the_route(url):
    doc = httpx.get(url + "/openapi.json").json()
    op = doc["paths"]["/v1/embeddings"]["post"]
    assert op["operationId"] == "create_embedding" and "400" in op["responses"]
    model = doc["components"]["schemas"]["EmbeddingRequest"]["properties"]["model"]
    assert {"type": "string", "enum": [MODEL]} in model["anyOf"]


def test_pooling_flag_and_option():
    parser = build_parser()
    assert parser.parse_args(["serve"]).pooling == "last"
    assert parser.parse_args(["serve", "--pooling", "mean"]).pooling == "mean"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--pooling", "max"])
    with pytest.raises(ValueError, match="pooling"):
        build_app(types.SimpleNamespace(), model_names=[MODEL], pooling="max")


def test_serve_pooling_flag_reaches_the_engine(url):
    # `inflight serve --pooling mean` on the same weights: a one-token input's mean is its
    # last token (the same bits: prompt rows do not depend on the engine's knobs), a
    # longer input's is not.
    port = free_port()
    cmd = [sys.executable, "-m", "inflight.cli", "serve", "--port", str(port), "--pooling",
           "mean", "--served-model-name", MODEL, "--num-kv-blocks", "64", "--max-model-len",
           str(MAX_MODEL_LEN), "--max-num-seqs", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        mean_url = f"http://127.0.0.1:{port}"
        wait_until(lambda: process_healthy(mean_url, proc), timeout=90, interval=0.2,
                   what="the server")
        mean = vectors(embed(mean_url, input=["hi", TEXTS[0]]))
    finally:
        stop_process(proc)
    last = vectors(embed(url, input=["hi", TEXTS[0]]))
    assert np.array_equal(mean[0], last[0])
    assert np.abs(mean[1] - last[1]).max() > 1e-2 and abs(np.linalg.norm(mean[1]) - 1) < 1e-5


# --- against HF transformers, on a tiny random Llama ---------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bundled_model_path):
    from tests.e2e.tiny_hf import save_tiny_llama
    from inflight.tokenizer import Tokenizer
    path = tmp_path_factory.mktemp("tiny_llama")
    hf = save_tiny_llama(path, Tokenizer.from_gguf(bundled_model_path))
    engine = Engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64,
                                 max_num_batched_tokens=16))  # long inputs come in chunks
    return engine, hf


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_vectors_equal_hf_final_hidden_states(tiny, pooling):
    engine, hf = tiny
    srv, _ = serve(engine, pooling=pooling)
    try:
        body = embed(srv.base_url, input=TEXTS)
        again = embed(srv.base_url, input=TEXTS[1])  # a prefix-cache hit for its blocks
    finally:
        srv.stop()
    for text, got in zip(TEXTS, vectors(body)):
        ids = torch.tensor([engine.tokenizer.encode(text)])
        with torch.no_grad():
            h = hf.model(ids).last_hidden_state[0].double()
        ref = h[-1] if pooling == "last" else h.mean(dim=0)
        ref = (ref / ref.norm()).numpy()
        assert got.shape == (64,) and np.abs(got - ref).max() < 1e-5, (text, pooling)
    assert np.abs(vectors(again)[0] - vectors(body)[1]).max() < 1e-5
