"""``--data-parallel-size 2``: the OpenAI server in this process, two engine replicas on Ray.

Ray starts once for the module (local, 127.0.0.1); two small replicas (1 torch thread,
128 KV blocks each) serve the bundled model. The checks: a completion and a streamed chat,
abort on disconnect reaching the replica, 503 on overload, metrics with ``replica``
labels and router counters, prefix affinity, a replica killed mid-stream (its request
fails at once, the other's finishes, Ray restarts it and it rejoins), and a shutdown that
leaves no Ray process. About 1.5-2 minutes on 2 cores, most of it the replicas' model
loads (start and restart).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'inflight-serve[cluster]'")

from inflight.cluster import replica_metrics as cluster_metrics  # noqa: E402
from inflight.cluster.ray_engine import ClusterEngine  # noqa: E402
from inflight.cluster.runtime import RayRuntime  # noqa: E402
from inflight.config import EngineConfig  # noqa: E402
from inflight.routing import make_router  # noqa: E402
from inflight.server.app import build_app  # noqa: E402
from tests.server.conftest import MODEL, ServerThread, wait_until  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONFIG = EngineConfig(num_kv_blocks=128, max_num_seqs=4, max_model_len=1024, num_threads=1)
MAX_NUM_WAITING = 4
# A prefix of several full KV blocks (16 tokens each).
PREFIX = ("You are a careful assistant. Answer in one short sentence, without lists, and "
          "never repeat the question. Context: the weather station on the hill records wind, "
          "rain and temperature every ten minutes and sends them to the valley. ")


class Cluster:
    def __init__(self) -> None:
        self.runtime = RayRuntime(None, num_cpus=2)
        self.session_dir = ray._private.worker._global_node.get_session_dir_path()
        self.engine = ClusterEngine(CONFIG, num_replicas=2, model_name=MODEL,
                                    router="prefix_affinity", max_num_waiting=MAX_NUM_WAITING,
                                    log_interval_s=0, log_level="WARNING")
        app = build_app(self.engine, model_names=[MODEL])
        cluster_metrics.install(app, self.engine)
        self.server = ServerThread(app).start()
        self.base_url = self.server.base_url
        self.stopped = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.server.stop()
            self.engine.shutdown()
            self.runtime.stop()


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _routed(cluster) -> list[int]:
    return [r.routed for r in cluster.engine.replicas]


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_completion_and_streamed_chat(cluster, client):
    done = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=8, temperature=0)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 8
    chat = [{"role": "user", "content": "Name three colors."}]
    whole = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=12,
                                           temperature=0)
    # The same prompt again would read its blocks from the prefix cache, and in bfloat16 a
    # cached prefix's logits differ in the last bits: this prompt's first token is a near
    # tie ("1" vs "The", 0.04 apart in float32), so the greedy answers could differ.
    assert httpx.post(cluster.base_url + "/reset_prefix_cache").status_code == 200
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=12, temperature=0, stream=True) if c.choices]
    assert "".join(parts) == whole.choices[0].message.content
    # A request the engines would refuse is refused by the ingress with the same 400.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5000)


def test_abort_on_disconnect_reaches_the_replica(cluster):
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", cluster.base_url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    # The replica stops the request: nothing runs there any more, and it counts an abort.
    wait_until(lambda: cluster.engine.num_in_flight == 0, timeout=10, what="ingress forgets it")

    def replicas_idle():
        stats = httpx.get(cluster.base_url + "/stats").json()
        return all(r["stats"]["num_requests_running"] == 0 for r in stats["replicas"])
    wait_until(replicas_idle, timeout=10, what="replicas idle")
    text = httpx.get(cluster.base_url + "/metrics").text
    assert _metric(text, "inflight:request_success_total", finished_reason="abort") >= 1


def test_non_stream_disconnect_aborts(cluster):
    body = {"model": MODEL, "prompt": "Write a very long essay.", "max_tokens": 400,
            "ignore_eos": True}
    try:
        httpx.post(cluster.base_url + "/v1/completions", json=body, timeout=1.0)
    except httpx.TimeoutException:
        pass  # the client gives up and closes its connection
    wait_until(lambda: cluster.engine.num_in_flight == 0, timeout=10, what="the abort")
    stats = httpx.get(cluster.base_url + "/stats").json()
    assert stats["num_requests_running"] == 0 and stats["kv_cache_usage_perc"] == 0


def test_metrics_and_stats_across_replicas(cluster, client):
    # Two requests at once land on different replicas (the second sees the first's load).
    async def two():
        ac = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(ac.completions.create(
            model=MODEL, prompt=p, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
            for p in ("Alpha beta gamma", "One two three")))
    before = _routed(cluster)
    asyncio.run(two())
    after = _routed(cluster)
    assert [a - b for a, b in zip(after, before)] == [1, 1]
    text = httpx.get(cluster.base_url + "/metrics").text
    for i in ("0", "1"):
        assert _metric(text, "inflight:time_to_first_token_seconds_count", replica=i,
                       model_name=MODEL) >= 1
        assert _metric(text, "inflight:router_requests_total", replica=i) == after[int(i)]
        assert _metric(text, "inflight:replica_up", replica=i) == 1
        assert _metric(text, "inflight:kv_cache_usage_perc", replica=i) == 0
    assert "# TYPE inflight:router_prefix_hits_total counter" in text
    # One family per name (a second TYPE line would break Prometheus's parser).
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types))
    stats = httpx.get(cluster.base_url + "/stats").json()
    assert stats["data_parallel_size"] == 2 and stats["router"]["policy"] == "prefix_affinity"
    ttft = stats["time_to_first_token_seconds"]
    per_replica = [r["stats"]["time_to_first_token_seconds"]["count"] for r in stats["replicas"]]
    assert ttft["count"] == sum(per_replica) and ttft["p95"] >= ttft["p50"] > 0
    assert stats["generation_tokens_total"] >= 48


def test_prefix_affinity_keeps_a_prefix_on_one_replica(cluster, client):
    router = cluster.engine.router
    hits = router.hits
    served: list[int] = []
    for q in ("Is it windy?", "Did it rain?", "How cold was it?", "When is it sent?"):
        before = _routed(cluster)
        client.completions.create(model=MODEL, prompt=PREFIX + q, max_tokens=4, temperature=0)
        served.append(next(i for i, (a, b) in enumerate(zip(_routed(cluster), before)) if a > b))
    assert len(set(served)) == 1, served
    assert router.hits - hits >= 3
    stats = httpx.get(cluster.base_url + "/stats").json()
    assert stats["replicas"][served[0]]["stats"]["prefix_cache_hits_total"] >= 3 * 16
    # The router learns the answer's blocks too (the replica caches them), all but the last
    # sampled token's, whose K/V is never computed: P prompt tokens and G generated leave
    # (P + G - 1) // 16 hashes. G is chosen so that P + G is a multiple of 16: counting the
    # last token as well would give one more.
    prompt = "Count the sheep in the far meadow, slowly."
    p = len(cluster.engine.tokenizer.encode(prompt, True))
    g = 48 - p % 16
    before = _routed(cluster)
    remembered = [len(seen) for seen in router._seen]
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=g, temperature=0,
                                     extra_body={"ignore_eos": True})
    i = next(i for i, (a, b) in enumerate(zip(_routed(cluster), before)) if a > b)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (p, g)
    assert len(router._seen[i]) - remembered[i] == (p + g - 1) // 16 == (p + g) // 16 - 1
    # Resetting the caches resets the router's memory of them: the prefix is new again.
    assert httpx.post(cluster.base_url + "/reset_prefix_cache").status_code == 200
    hits = router.hits
    client.completions.create(model=MODEL, prompt=PREFIX + "Is it sunny?", max_tokens=2, temperature=0)
    assert router.hits == hits
    # Round robin, for contrast, alternates whatever the prefix.
    cluster.engine.router = make_router("round_robin")
    try:
        served = []
        for q in ("Is it windy?", "Did it rain?"):
            before = _routed(cluster)
            client.completions.create(model=MODEL, prompt=PREFIX + q, max_tokens=2)
            served.append(next(i for i, (a, b) in enumerate(zip(_routed(cluster), before))
                               if a > b))
        assert sorted(served) == [0, 1]
    finally:
        cluster.engine.router = router


def test_overload_gets_503(cluster):
    # 2 replicas x (4 running + 4 waiting) places; 30 at once overflow them.
    async def burst():
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json={
                "model": MODEL, "prompt": f"Item {i}:", "max_tokens": 16, "ignore_eos": True})
                for i in range(30)))
    codes = [r.status_code for r in asyncio.run(burst())]
    refused = [r for r in codes if r == 503]
    assert refused and codes.count(200) >= 16 and set(codes) <= {200, 503}, codes
    wait_until(lambda: cluster.engine.num_in_flight == 0, timeout=30, what="burst done")


def test_killed_replica_fails_its_requests_and_rejoins(cluster):
    engine = cluster.engine
    pids = [r.pid for r in engine.replicas]
    body = {"model": MODEL, "max_tokens": 300, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    results: dict[str, dict] = {}

    def consume(name: str, prompt: str, started: "asyncio.Event") -> "asyncio.Future":
        async def run():
            out = {"chunks": 0, "tokens": None, "error": None, "done": False, "t_end": None}
            results[name] = out
            async with httpx.AsyncClient(timeout=60) as c:
                async with c.stream("POST", cluster.base_url + "/v1/completions",
                                    json={**body, "prompt": prompt}) as r:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line.removeprefix("data: ")
                        if data == "[DONE]":
                            out["done"] = True
                            break
                        event = json.loads(data)
                        if "error" in event:
                            out["error"] = event["error"]
                            continue
                        if event.get("usage"):
                            out["tokens"] = event["usage"]["completion_tokens"]
                        out["chunks"] += 1
                        if out["chunks"] == 3:
                            started.set()
            out["t_end"] = time.monotonic()
        return asyncio.ensure_future(run())

    async def scenario():
        s0, s1 = asyncio.Event(), asyncio.Event()
        a = consume("a", "Tell me a long story about a dragon.", s0)
        await asyncio.wait_for(s0.wait(), 30)
        b = consume("b", "Write a long poem about the sea.", s1)
        await asyncio.wait_for(s1.wait(), 30)
        owners = dict(engine._owner)
        assert sorted(owners.values()) == [0, 1], owners  # one request on each replica
        victim_rid = next(k for k, v in owners.items() if v == 0)
        t_kill = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(a, b), 60)
        return victim_rid, t_kill
    victim_rid, t_kill = asyncio.run(scenario())
    lost = [r for r in results.values() if r["error"] is not None]
    kept = [r for r in results.values() if r["error"] is None]
    assert len(lost) == 1 and len(kept) == 1, results
    assert "replica 0 died" in lost[0]["error"]["message"] and lost[0]["done"]
    assert lost[0]["t_end"] - t_kill < 10  # at once (Ray notices in ~1.5 s), never a hang
    print(f"killed replica's stream ended {lost[0]['t_end'] - t_kill:.2f} s after the kill")
    assert kept[0]["done"] and kept[0]["tokens"] == 300  # the other replica's is untouched
    assert engine.replicas[0].lost == 1
    # While it is down nothing is routed to it (it reloads its model meanwhile).
    if not engine.replicas[0].up:
        before = _routed(cluster)
        r = httpx.post(cluster.base_url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "Meanwhile", "max_tokens": 2})
        assert r.status_code == 200
        if not engine.replicas[0].up:
            assert [a - b for a, b in zip(_routed(cluster), before)] == [0, 1]
    # Ray restarts it and it rejoins.
    wait_until(lambda: engine.replicas[0].up, timeout=120, interval=0.5, what="replica back")
    assert engine.replicas[0].restarts == 1 and engine.replicas[0].pid != pids[0]
    text = httpx.get(cluster.base_url + "/metrics").text
    assert _metric(text, "inflight:replica_restarts_total", replica="0") == 1
    assert _metric(text, "inflight:replica_lost_requests_total", replica="0") == 1
    before = _routed(cluster)

    async def two():
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json={
                "model": MODEL, "prompt": p, "max_tokens": 16, "ignore_eos": True})
                for p in ("After the restart", "Both serve again")))
    assert [r.status_code for r in asyncio.run(two())] == [200, 200]
    assert [a - b for a, b in zip(_routed(cluster), before)] == [1, 1]


def _descendants(root: int) -> list[tuple[int, str]]:
    """Live (not zombie) processes below ``root``: ``(pid, name)``."""
    parent: dict[int, int] = {}
    info: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] == "Z":
            continue
        parent[int(entry)] = int(fields[1])
        info[int(entry)] = name
    out, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        for child, pp in parent.items():
            if pp == p:
                out.append((child, info[child]))
                frontier.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_shutdown_leaves_no_ray_process(cluster):
    pids = [r.pid for r in cluster.engine.replicas]
    assert _descendants(os.getpid())  # gcs, raylet, workers run below this process
    t0 = time.monotonic()
    cluster.stop()
    wait_until(lambda: not _descendants(os.getpid()), timeout=30, interval=0.2,
               what=f"Ray processes to exit: {_descendants(os.getpid())}")
    assert not any(_alive(p) for p in pids if p)
    assert not ray.is_initialized()
    assert time.monotonic() - t0 < 30
    # Nothing left that names this Ray session either (a worker reparented elsewhere).
    session = os.path.basename(cluster.session_dir)
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _alive(int(entry)):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    assert session.encode() not in f.read(), entry
            except OSError:
                pass
