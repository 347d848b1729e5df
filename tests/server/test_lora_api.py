"""Multi-LoRA on a real server (the bundled SmolLM2-135M): a request's ``model`` names an
adapter on every route, ``/v1/models`` lists the adapters, vLLM's runtime load / unload
routes, the ``lora_requests_info`` gauge.

Adapters are written as PEFT directories by hand (no HF model is built): rank-8 ``q_proj``
deltas in every layer, random with a fixed seed and large enough to change greedy tokens.
The served answers are checked against the engine's own greedy tokens for
``RequestOptions(lora_name=...)``, computed before the server takes the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from inflight.config import EngineConfig
from inflight.engine import Engine
from inflight.errors import InvalidRequestError
from inflight.lora.lora_config import LoRAConfig, LoRAModule
from inflight.request import RequestOptions
from inflight.sampling_params import SamplingParams
from inflight.server.lora_routes import install_lora
from tests.server.conftest import API_KEY, MODEL, SMALL_CONFIG, serve, wait_until

PROMPT = "The capital of France is"
MAX_TOKENS = 6
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def write_adapter(path: Path, seed: int, *, rank: int = 8, num_layers: int = 30,
                  hidden: int = 576, q_size: int = 576) -> str:
    """A PEFT LoRA directory adapting every layer's ``q_proj`` (A [r, hidden], B [q, r])."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_layers):
        key = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.2
        tensors[f"{key}.lora_B.weight"] = torch.randn(q_size, rank, generator=gen) * 0.2
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"]}))
    return str(path)


def greedy(engine: Engine, lora_name: str | None) -> str:
    """The engine's greedy text for ``PROMPT`` with adapter ``lora_name``, run directly."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request(f"ref-{lora_name}", PROMPT, params,
                       options=RequestOptions(lora_name=lora_name))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs[-1].outputs[0].text


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    c = SimpleNamespace(root=root, sql=write_adapter(root / "sql", 1),
                        chat=write_adapter(root / "chat", 2), extra=write_adapter(root / "extra", 3),
                        wide=write_adapter(root / "wide", 4, rank=16))
    engine = Engine(EngineConfig(**SMALL_CONFIG, lora_config=LoRAConfig(
        max_loras=2, max_lora_rank=8,
        lora_modules=(LoRAModule("sql", c.sql), LoRAModule("chat", c.chat, "smol-base")))))
    engine.add_lora("extra", c.extra)  # its reference; the server loads it again at runtime
    c.refs = {name: greedy(engine, name) for name in (None, "sql", "extra")}
    assert engine.remove_lora("extra")
    assert len(set(c.refs.values())) == 3, c.refs  # each adapter changes the answer
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        srv, c.async_engine = serve(engine, api_key=API_KEY)
    c.url, c.engine = srv.base_url, engine
    yield c
    srv.stop()


def post(setup, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(setup.url + path, json=body, headers=AUTH, timeout=60, **kw)


def complete(setup, model: str, **kw) -> httpx.Response:
    return post(setup, "/v1/completions", {"model": model, "prompt": PROMPT, "temperature": 0,
                                           "max_tokens": MAX_TOKENS, "ignore_eos": True, **kw})


def test_models_lists_adapters_after_the_base_with_root_and_parent(setup):
    data = httpx.get(setup.url + "/v1/models", headers=AUTH).json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in data] == [
        (MODEL, MODEL, None), ("sql", setup.sql, MODEL), ("chat", setup.chat, "smol-base")]
    card = httpx.get(setup.url + "/v1/models/chat", headers=AUTH).json()
    assert card == {**data[2], "created": card["created"]}
    assert httpx.get(setup.url + "/v1/models/nope", headers=AUTH).status_code == 404


def test_openapi_names_the_start_adapters_and_the_load_routes(setup):
    doc = httpx.get(setup.url + "/openapi.json", timeout=10).json()
    for schema in ("CompletionRequest", "ChatCompletionRequest", "EmbeddingRequest"):
        model = doc["components"]["schemas"][schema]["properties"]["model"]
        assert model["anyOf"][0]["enum"] == [MODEL, "sql", "chat"]
    load = doc["paths"]["/v1/load_lora_adapter"]["post"]
    assert set(load["responses"]) == {"200", "400", "401", "503"}
    assert "/v1/unload_lora_adapter" in doc["paths"]


def test_completion_with_an_adapter_is_the_engines_adapter_output(setup):
    base, sql = complete(setup, MODEL).json(), complete(setup, "sql").json()
    assert base["choices"][0]["text"] == setup.refs[None]
    assert sql["choices"][0]["text"] == setup.refs["sql"] != setup.refs[None]
    assert (base["model"], sql["model"]) == (MODEL, "sql")
    lines = [ln for ln in complete(setup, "sql", stream=True).text.splitlines()
             if ln.startswith("data: {")]
    chunks = [json.loads(ln[6:]) for ln in lines]
    assert {c["model"] for c in chunks} == {"sql"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == setup.refs["sql"]


def test_chat_and_responses_run_with_the_adapter(setup):
    def chat(model: str) -> dict:
        r = post(setup, "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Name a colour."}],
            "temperature": 0, "max_tokens": MAX_TOKENS})
        assert r.status_code == 200, r.text
        return r.json()
    base, sql = chat(MODEL), chat("sql")
    assert sql["model"] == "sql"
    assert sql["choices"][0]["message"]["content"] != base["choices"][0]["message"]["content"]
    r = post(setup, "/v1/responses", {"model": "sql", "input": "Name a colour.",
                                      "temperature": 0, "max_output_tokens": MAX_TOKENS})
    assert r.status_code == 200 and r.json()["model"] == "sql"
    assert r.json()["output"][0]["content"][0]["text"] == sql["choices"][0]["message"]["content"]


def test_embeddings_run_with_the_adapter(setup):
    def embed(model: str) -> dict:
        r = post(setup, "/v1/embeddings", {"model": model, "input": PROMPT})
        assert r.status_code == 200, r.text
        return r.json()
    base, sql = embed(MODEL), embed("sql")
    diff = max(abs(a - b) for a, b in zip(base["data"][0]["embedding"],
                                          sql["data"][0]["embedding"]))
    assert diff > 1e-3


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi"}),
    ("/v1/embeddings", {"input": "hi"}),
    ("/tokenize", {"prompt": "hi"}),
])
def test_an_unknown_model_is_404_model_not_found(setup, path, body):
    r = post(setup, path, {"model": "nope", **body})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found"


def test_runtime_load_serve_unload(setup):
    r = post(setup, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": setup.extra})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'extra' added successfully.")
    ids = [m["id"] for m in httpx.get(setup.url + "/v1/models", headers=AUTH).json()["data"]]
    assert ids == [MODEL, "sql", "chat", "extra"]
    out = complete(setup, "extra").json()
    assert (out["model"], out["choices"][0]["text"]) == ("extra", setup.refs["extra"])

    again = post(setup, "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": setup.extra})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    assert "extra" in again.json()["error"]["message"]

    r = post(setup, "/v1/unload_lora_adapter", {"lora_name": "extra"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'extra' removed successfully.")
    assert complete(setup, "extra").status_code == 404
    r = post(setup, "/v1/unload_lora_adapter", {"lora_name": "extra"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The lora adapter 'extra' cannot be found."
    assert complete(setup, "sql").json()["choices"][0]["text"] == setup.refs["sql"]


@pytest.mark.parametrize("name,path,param,says", [
    ("gone", "/nowhere/adapter", "lora_path", "/nowhere/adapter"),
    ("wide", None, "lora_path", "rank"),          # rank 16 > --max-lora-rank 8
    (MODEL, None, "lora_name", "served model name"),
])
def test_a_bad_load_is_400_naming_the_problem(setup, name, path, param, says):
    r = post(setup, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path or setup.wide})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"]
    ids = [m["id"] for m in httpx.get(setup.url + "/v1/models", headers=AUTH).json()["data"]]
    assert name not in ids[1:]


def test_load_routes_check_body_and_key(setup):
    r = post(setup, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = post(setup, "/v1/unload_lora_adapter", {"lora_name": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = httpx.post(setup.url + "/v1/load_lora_adapter",
                   json={"lora_name": "x", "lora_path": setup.extra})
    assert r.status_code == 401


def test_load_routes_exist_only_with_the_env_var_and_lora_on(setup, monkeypatch):
    def paths(lora_config, env: str | None) -> set[str]:
        for var in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "INFLIGHT_ALLOW_RUNTIME_LORA_UPDATING"):
            monkeypatch.delenv(var, raising=False)
        if env is not None:
            monkeypatch.setenv("INFLIGHT_ALLOW_RUNTIME_LORA_UPDATING", env)
        app = FastAPI()
        engine = SimpleNamespace(config=SimpleNamespace(lora_config=lora_config))
        install_lora(app, SimpleNamespace(engine=engine, metrics=SimpleNamespace(
            registry=SimpleNamespace(register=lambda c: None), model_name=MODEL),
            model_names=[MODEL], lora_modules=lambda: list(lora_config.lora_modules)))
        return set(app.openapi()["paths"])
    routes = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
    lora = setup.engine.config.lora_config
    assert paths(lora, "1") == routes and paths(lora, "TRUE") == routes
    assert paths(lora, None) == paths(lora, "0") == paths(lora, "yes") == set()
    assert paths(None, "1") == set()


def test_lora_requests_info_gauge(setup):
    def info() -> dict:
        text = httpx.get(setup.url + "/metrics", timeout=10).text
        samples = [s for f in text_string_to_metric_families(text)
                   if f.name == "inflight:lora_requests_info" for s in f.samples]
        assert len(samples) == 1
        assert abs(samples[0].value - time.time()) < 60
        return samples[0].labels

    # earlier tests' aborted streams may still be finishing on a loaded host
    wait_until(lambda: info()["running_lora_adapters"] == "", timeout=60, what="idle")
    assert info() == {"running_lora_adapters": "", "waiting_lora_adapters": "",
                      "max_lora": "2", "model_name": MODEL}
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", setup.url + "/v1/completions", json=body, headers=AUTH,
                      timeout=60) as r:
        lines = r.iter_lines()  # kept: a collected iterator closes the stream (an abort)
        next(lines)  # the request runs
        wait_until(lambda: info()["running_lora_adapters"] == "sql", timeout=30,
                   what="sql running")
    wait_until(lambda: info()["running_lora_adapters"] == "", timeout=30, what="the abort")


def test_cluster_serves_start_adapters_and_refuses_runtime_loads():
    from inflight.cluster.ray_engine import ClusterEngine

    mods = (LoRAModule("a", "/p/a"), LoRAModule("b", "/p/b", "base"))
    cluster = SimpleNamespace(_config=EngineConfig(lora_config=LoRAConfig(lora_modules=mods)))
    assert ClusterEngine.lora_modules(cluster) == list(mods)  # type: ignore[arg-type]
    assert ClusterEngine.lora_modules(SimpleNamespace(_config=EngineConfig())) == []  # type: ignore[arg-type]
    for call in (ClusterEngine.add_lora(cluster, "c", "/p/c"),  # type: ignore[arg-type]
                 ClusterEngine.remove_lora(cluster, "a")):  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError, match="--data-parallel-size > 1"):
            asyncio.run(call)


def test_an_adapter_named_like_a_served_model_fails_start_up(setup):
    lora = setup.engine.config.lora_config
    shadow = [*lora.lora_modules, type(lora.lora_modules[0])(MODEL, lora.lora_modules[0].path)]
    ctx = SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(lora_config=lora)),
                          model_names=[MODEL], lora_modules=lambda: shadow)
    with pytest.raises(ValueError, match=f"lora_modules: adapter name.s. {MODEL} "):
        install_lora(FastAPI(), ctx)
