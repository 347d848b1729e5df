"""`inflight bench serve` next to GuideLLM and AIPerf on the same server and load (issue 16).

Starts ``inflight serve`` on a free 127.0.0.1 port (prefix caching off, so that no tool's
prompts hit another's cache; ``--num-threads`` half the CPUs unless ``--serve-flags`` sets it,
so that a client's CPU use does not stall the server's thread pool), exports the served GGUF's tokenizer to a local Hugging Face
tokenizer directory (no network: every tool counts tokens with it), sends one warm-up round,
then runs ``inflight bench serve``, GuideLLM and AIPerf in turn, ``--cycles`` times (the order
rotates each cycle), each with the same load: ``--requests`` requests of ``--input-len``
synthetic prompt tokens and exactly ``--output-len`` output tokens (ignore_eos; the peers send
no temperature, ``inflight bench`` sends 0: same cost per token), to
/v1/completions, streamed, ``--streams`` closed-loop streams. It parses each tool's JSON
output and prints the metrics side by side, each peer's figure with its ratio to
``inflight bench``'s like-for-like figure (docs/bench.md, "TTFT, ITL and TPOT in GuideLLM and
AIPerf": their ITL is our TPOT; AIPerf's ``inter_chunk_latency`` is our pooled ITL; GuideLLM's
TPOT is E2E / n), with the load average before each run and the CPU time each client spent.
Then it stops the server.

On a small shared machine the runs do not see the same load (other work, and the clients'
own CPU: GuideLLM and AIPerf use 10-100x the CPU of ``inflight bench`` for the same requests,
taken from the server's cores), so the ratios of the tools' figures mix measurement and load.
What does not depend on the load is each tool against the server's own view of the same
requests: the change of the server's TTFT and ITL histograms (/metrics ``_sum``/``_count``)
over each run gives the server-side means, and the rows "TTFT mean / server's" and "TPOT mean
/ server's ITL mean" compare each tool's figure to them (interleaved mode). ``--mode
together`` instead runs each peer at the same time as an ``inflight bench`` run.

The peers live in their own virtualenvs, outside the repo's (never dependencies of the repo or
of CI); give their executables by flag or environment variable, a tool left out or absent is
skipped with a message:

    GUIDELLM=/work/peers/guidellm/bin/guidellm AIPERF=/work/peers/aiperf/bin/aiperf \\
        .venv/bin/python benchmarks/peer_clients.py --cycles 2

Invocations (GuideLLM 0.8.1, AIPerf 0.13.0; printed with ``--verbose``)::

    guidellm run --backend kind=openai_http,target=URL,model=M,request_format=/v1/completions \\
        --profile kind=concurrent,streams=4 --constraint kind=max_requests,count=8 \\
        --constraint kind=max_duration,seconds=300 --tokenizer kind=hf_auto,model=TOKDIR \\
        --data kind=synthetic_text,prompt_tokens=128,output_tokens=64 \\
        --seed kind=static,value=S --output kind=json,path=OUT.json --disable-progress
    aiperf profile --model M --url URL --endpoint-type completions --streaming \\
        --tokenizer TOKDIR --use-server-token-count --prompt-input-tokens-mean 128 \\
        --prompt-input-tokens-stddev 0 --prompt-output-tokens-mean 64 \\
        --prompt-output-tokens-stddev 0 --extra-inputs ignore_eos:true --concurrency 4 \\
        --request-count 8 --random-seed S --output-artifact-dir DIR --ui-type none \\
        --no-gpu-telemetry

GuideLLM sends ``ignore_eos`` and ``stream_options.continuous_usage_stats`` by itself for a
fixed output length. AIPerf needs ``--extra-inputs ignore_eos:true``, and
``--use-server-token-count`` (else it counts output tokens by re-tokenizing the text, which
gives 62-64 for 64, and divides by that). AIPerf runs with ``HF_HUB_OFFLINE`` removed from its
environment: with it set, AIPerf 0.13.0 takes the local tokenizer directory for a Hub repo id
(``aiperf/common/tokenizer.py``, ``_load_from_hub`` -> ``_from_pretrained_local`` ->
``snapshot_download``: HFValidationError); GuideLLM runs with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
sys.path.insert(0, str(REPO))
from _runs import free_port  # noqa: E402  (sibling benchmark module)
TOOLS = ("inflight", "guidellm", "aiperf")
LABEL = {"inflight": "inflight bench", "guidellm": "GuideLLM", "aiperf": "AIPerf"}


def export_tokenizer(out: pathlib.Path, gguf: str | None) -> pathlib.Path:
    """The GGUF's tokenizer as a local Hugging Face tokenizer directory."""
    import transformers

    from inflight.model.bundled import find_bundled_model
    from inflight.tokenizer import Tokenizer

    path = gguf or find_bundled_model()
    tok = Tokenizer.from_gguf(path)
    specials = {k: v for k, v in (("bos_token", tok.bos_token), ("eos_token", tok.eos_token))
                if v is not None}
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend, **specials)
    fast.save_pretrained(str(out))
    return out


def get_json(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


class Server:
    """``inflight serve`` on 127.0.0.1:port in its own process group; stopped by ``stop``."""

    def __init__(self, flags: list[str], port: int, log: pathlib.Path):
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [str(BIN / "inflight"), "serve", "--host", "127.0.0.1", "--port", str(port),
                    "--no-enable-prefix-caching", *flags]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> str:
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT,
                                         cwd=REPO, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n"
                                   + self.log.read_text()[-3000:])
            try:
                return get_json(self.url + "/v1/models")["data"][0]["id"]
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"server not up in {timeout:.0f} s:\n" + self.log.read_text()[-3000:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


class Proc:
    """A tool's run in its own process group (AIPerf starts several service processes),
    output to ``log``; ``cpu_s`` is the user + system CPU time of the process and of the
    descendants it reaped (``wait4``), the client's own cost on the server's cores."""

    def __init__(self, cmd: list[str], env: dict, cwd: pathlib.Path, log: pathlib.Path):
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                         cwd=cwd, start_new_session=True)
        self.t0 = time.monotonic()
        self.rc: int | None = None
        self.cpu_s: float | None = None
        self.wall_s: float | None = None

    def poll(self) -> bool:
        if self.rc is None:
            pid, status, ru = os.wait4(self.proc.pid, os.WNOHANG)
            if pid:
                self.rc = self.proc.returncode = os.waitstatus_to_exitcode(status)
                self.cpu_s = ru.ru_utime + ru.ru_stime
                self.wall_s = time.monotonic() - self.t0
        return self.rc is not None

    def kill(self) -> None:
        for sig in (signal.SIGINT, signal.SIGKILL):
            if self.poll():
                return
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            for _ in range(150):
                if self.poll():
                    break
                time.sleep(0.1)
        if self.rc is not None and self.rc == 0:
            self.rc = 124
        elif self.rc is None:
            self.rc = 124


def wait_all(procs: list[Proc], deadline: float) -> None:
    """Wait for every run; kill those still going at ``deadline`` (exit 124)."""
    try:
        while not all(p.poll() for p in procs):
            if time.monotonic() > deadline:
                for p in procs:
                    if not p.poll():
                        p.kill()
                        p.rc = 124
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if not p.poll():
                p.kill()


SERVER_SERIES = ("time_to_first_token_seconds", "inter_token_latency_seconds")


def server_sums(url: str) -> dict[str, float]:
    """The server's own latency histograms' ``_sum`` and ``_count`` (from /metrics): their
    change over one run is the server-side mean TTFT and ITL of exactly that run's requests,
    measured where the machine's load is the same for client and server."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in SERVER_SERIES:
            for suffix in ("_sum", "_count"):
                if line.startswith(f"inflight:{name}{suffix}"):
                    key = name + suffix
                    out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def server_means(before: dict, after: dict) -> dict[str, float | None]:
    res: dict[str, float | None] = {}
    for name, key in zip(SERVER_SERIES, ("srv_ttft", "srv_itl")):
        n = after.get(name + "_count", 0) - before.get(name + "_count", 0)
        total = after.get(name + "_sum", 0) - before.get(name + "_sum", 0)
        res[key] = 1e3 * total / n if n > 0 else None
    return res


def in_flight(url: str) -> float:
    """Requests running + waiting on the server, from /metrics."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0.0
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("inflight:num_requests_running", "inflight:num_requests_waiting")):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- the three tools: command and parser ---------------------------------------------------

def cmd_inflight(a, url, model, tok, out: pathlib.Path, seed: int, n: int | None = None):
    return [str(BIN / "inflight"), "bench", "serve", "--base-url", url, "--model", model,
            "--endpoint-type", "completions", "--dataset", "random",
            "--input-len", str(a.input_len), "--output-len", str(a.output_len),
            "--range-ratio", "0", "--ignore-eos", "--temperature", "0",
            "--max-concurrency", str(a.streams), "--request-rate", "inf",
            "--num-prompts", str(n or a.requests), "--num-warmups", "0",
            "--tokenizer", str(tok), "--seed", str(seed), "--disable-tqdm",
            "--request-timeout", str(a.run_timeout), "--save-result", str(out / "result.json")]


def cmd_guidellm(a, url, model, tok, out: pathlib.Path, seed: int):
    return [a.guidellm, "run",
            "--backend", f"kind=openai_http,target={url},model={model},"
                         "request_format=/v1/completions",
            "--profile", f"kind=concurrent,streams={a.streams}",
            "--constraint", f"kind=max_requests,count={a.requests}",
            "--constraint", f"kind=max_duration,seconds={int(a.run_timeout)}",
            "--tokenizer", f"kind=hf_auto,model={tok}",
            "--data", f"kind=synthetic_text,prompt_tokens={a.input_len},"
                      f"output_tokens={a.output_len}",
            "--seed", f"kind=static,value={seed}",
            "--output", f"kind=json,path={out / 'guidellm.json'}",
            "--disable-progress"]


def cmd_aiperf(a, url, model, tok, out: pathlib.Path, seed: int):
    return [a.aiperf, "profile", "--model", model, "--url", url,
            "--endpoint-type", "completions", "--streaming", "--tokenizer", str(tok),
            "--use-server-token-count",
            "--prompt-input-tokens-mean", str(a.input_len), "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(a.output_len),
            "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
            "--concurrency", str(a.streams), "--request-count", str(a.requests),
            "--random-seed", str(seed), "--request-timeout-seconds", str(int(a.run_timeout)),
            "--output-artifact-dir", str(out / "aiperf"), "--ui-type", "none",
            "--no-gpu-telemetry"]


def _ms(stats: dict, scale: float = 1.0) -> dict:
    return {k: stats[k] * scale for k in ("mean", "p50", "p95") if stats.get(k) is not None}


def parse_inflight(out: pathlib.Path) -> dict:
    doc = json.loads((out / "result.json").read_text())
    s = doc["summary"]
    pick = lambda m: {"mean": s[m]["mean"] * 1e3, "p50": s[m]["median"] * 1e3,  # noqa: E731
                      "p95": s[m]["p95"] * 1e3}
    e2e_per_token = [1e3 * (r["chunk_times"][-1] - r["send_time"]) / r["output_tokens"]
                     for r in doc["requests"]
                     if r["success"] and not r.get("warmup") and r.get("output_tokens")
                     and r.get("chunk_times")]
    return {"ok": s["completed"], "failed": s["failed"],
            "ttft": pick("ttft"), "tpot": pick("tpot"), "itl": pick("itl"),
            "e2e_per_token": {"mean": sum(e2e_per_token) / len(e2e_per_token)}
            if e2e_per_token else {},
            "out_tps": s["output_throughput"], "out_tokens": s["total_output_tokens"]}


def parse_guidellm(out: pathlib.Path) -> dict:
    doc = json.loads((out / "guidellm.json").read_text())
    m = doc["benchmarks"][0]["metrics"]

    def pick(name):
        st = m[name]["successful"]
        return {"mean": st["mean"], "p50": st["median"], "p95": st["percentiles"]["p95"]}

    totals = m["request_totals"]
    return {"ok": totals["successful"], "failed": totals["errored"] + totals["incomplete"],
            "ttft": pick("time_to_first_token_ms"),
            "tpot": pick("inter_token_latency_ms"),          # its ITL = our TPOT
            "itl": {},                                       # no pooled gaps
            "e2e_per_token": pick("time_per_output_token_ms"),  # its TPOT = E2E / n
            "out_tps": m["output_tokens_per_second"]["successful"]["mean"],
            "out_tokens": m["output_token_count"]["successful"]["total_sum"]}


def parse_aiperf(out: pathlib.Path) -> dict:
    doc = json.loads((out / "aiperf" / "profile_export_aiperf.json").read_text())

    def pick(name):
        st = doc.get(name) or {}
        return {"mean": st.get("avg"), "p50": st.get("p50"), "p95": st.get("p95")} if st else {}

    errors = sum(e.get("count", 0) for e in doc.get("error_summary") or [])
    return {"ok": int(doc["request_count"]["avg"]) if doc.get("request_count") else 0,
            "failed": errors,
            "ttft": pick("time_to_first_token"),
            "tpot": pick("inter_token_latency"),             # its ITL = our TPOT
            "itl": pick("inter_chunk_latency"),              # pooled chunk gaps = our ITL
            "e2e_per_token": {},
            "out_tps": doc["output_token_throughput"]["avg"],
            "out_tokens": (doc.get("total_usage_completion_tokens")
                           or doc.get("total_osl") or {}).get("avg")}


COMMANDS = {"inflight": cmd_inflight, "guidellm": cmd_guidellm, "aiperf": cmd_aiperf}
PARSERS = {"inflight": parse_inflight, "guidellm": parse_guidellm, "aiperf": parse_aiperf}

# (row label, key, stat, GuideLLM's name, AIPerf's name)
ROWS = [
    ("TTFT mean", "ttft", "mean", "time_to_first_token_ms", "time_to_first_token"),
    ("TTFT p50", "ttft", "p50", "", ""),
    ("TTFT p95", "ttft", "p95", "", ""),
    ("TPOT mean", "tpot", "mean", "inter_token_latency_ms", "inter_token_latency"),
    ("TPOT p50", "tpot", "p50", "", ""),
    ("TPOT p95", "tpot", "p95", "", ""),
    ("ITL (pooled gaps) mean", "itl", "mean", "none", "inter_chunk_latency"),
    ("ITL p50", "itl", "p50", "", ""),
    ("ITL p95", "itl", "p95", "", ""),
    ("E2E / n mean", "e2e_per_token", "mean", "time_per_output_token_ms", "none"),
    ("output tok/s", "out_tps", None, "output_tokens_per_second", "output_token_throughput"),
    ("client CPU s", "client_cpu_s", None, "", ""),
    # interleaved only: the server's own view of the same requests (its /metrics histograms)
    ("server's TTFT mean", "srv_ttft", None, "", ""),
    ("server's ITL mean", "srv_itl", None, "", ""),
    ("TTFT mean / server's", "ttft_vs_srv", None, "", ""),
    ("TPOT mean / server's ITL mean", "tpot_vs_srv", None, "", ""),
]


def value(res: dict | None, key: str, stat: str | None):
    if res is None:
        return None
    v = res.get(key)
    if stat is None:
        return v
    return v.get(stat) if isinstance(v, dict) else None


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def fmt(v, digits=1):
    return "—" if v is None else f"{v:.{digits}f}"


def table(results: dict[str, list[dict | None]], tools: list[str], together: bool) -> str:
    """Mean over cycles of each figure; each peer's ratio is to `inflight bench`'s runs of
    the same cycles (interleaved) or to the runs that went with it (together)."""
    peers = [t for t in tools if t != "inflight"]
    ours_for = {t: results["inflight"] for t in peers}
    if together:  # inflight runs in launch order: cycle 1 with each peer, cycle 2, ...
        ours_for = {t: results["inflight"][i::len(peers)] for i, t in enumerate(peers)}
    head, sep = "| metric (ms; tok/s; s) |", "|---|"
    if not together:
        head, sep = head + " inflight bench |", sep + "---:|"
    for t in peers:
        if together:
            head, sep = head + f" inflight bench (with {LABEL[t]}) |", sep + "---:|"
        head, sep = head + f" {LABEL[t]} | ratio |", sep + "---:|---:|"
    lines = [head, sep]
    for label, key, stat, g_name, a_name in ROWS:
        digits = 3 if key.endswith("_vs_srv") else 1
        line = f"| {label} |"
        if not together:
            line += f" {fmt(mean([value(r, key, stat) for r in results['inflight']]), digits)} |"
        for t in peers:
            ours = mean([value(r, key, stat) for r in ours_for[t]])
            if together:
                line += f" {fmt(ours, digits)} |"
            name = {"guidellm": g_name, "aiperf": a_name}[t]
            theirs = mean([value(r, key, stat) for r in results[t]])
            cell = fmt(theirs, digits) + (f" (`{name}`)" if name and name != "none" else "")
            ratio = f"{theirs / ours:.3f}" if theirs is not None and ours else "—"
            line += f" {cell} | {ratio} |"
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guidellm", default=os.environ.get("GUIDELLM"),
                   help="guidellm executable (default $GUIDELLM)")
    p.add_argument("--aiperf", default=os.environ.get("AIPERF"),
                   help="aiperf executable (default $AIPERF)")
    p.add_argument("--streams", type=int, default=4, help="concurrent streams (default 4)")
    p.add_argument("--requests", type=int, default=8, help="requests per run (default 8)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--mode", choices=("interleaved", "together"), default="interleaved",
                   help="interleaved: one tool at a time, in turn; together: each peer at the "
                        "same time as an `inflight bench` run (2 x --streams on the server), "
                        "so both see the same server and machine load")
    p.add_argument("--seed", type=int, default=1, help="seed of cycle 1 (cycle c: seed + c - 1)")
    p.add_argument("--serve-flags", default="",
                   help="more `inflight serve` flags (default adds --num-threads CPUs/2)")
    p.add_argument("--gguf", help="GGUF whose tokenizer the tools use (default: the bundled "
                                  "model; pass the served one with --serve-flags '--model ...')")
    p.add_argument("--tokenizer", help="a local HF tokenizer directory instead of exporting one")
    p.add_argument("--run-timeout", type=float, default=300.0,
                   help="seconds one tool's run may take before it is killed (default 300)")
    p.add_argument("--server-start-timeout", type=float, default=300.0)
    p.add_argument("--keep", help="keep logs and outputs in this directory")
    p.add_argument("--save", help="write the per-run results as JSON here")
    p.add_argument("--verbose", action="store_true", help="print each command")
    a = p.parse_args()

    tools = ["inflight"]
    for name in ("guidellm", "aiperf"):
        exe = getattr(a, name)
        if exe and shutil.which(exe):
            setattr(a, name, shutil.which(exe))
            tools.append(name)
        else:
            print(f"{LABEL[name]}: skipped ({'not found: ' + exe if exe else 'not given'}; "
                  f"--{name} PATH or ${name.upper()})", flush=True)

    if len(tools) == 1:
        a.mode = "interleaved"
    work = pathlib.Path(a.keep) if a.keep else pathlib.Path(tempfile.mkdtemp(prefix="peers-"))
    work.mkdir(parents=True, exist_ok=True)
    tok = pathlib.Path(a.tokenizer) if a.tokenizer else export_tokenizer(work / "tokenizer",
                                                                         a.gguf)
    env_offline = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                       HF_HUB_DISABLE_TELEMETRY="1", DO_NOT_TRACK="1")
    env_aiperf = {k: v for k, v in env_offline.items()
                  if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    envs = {"inflight": env_offline, "guidellm": env_offline, "aiperf": env_aiperf}

    flags = shlex.split(a.serve_flags)
    if not any(f.startswith("--num-threads") for f in flags):
        # leave cores to the clients: with every core in the server's thread pool, a client
        # that needs a core (AIPerf: about one) stalls the pool's threads, TPOT x20 on 2 CPUs
        flags += ["--num-threads", str(max(1, (os.cpu_count() or 2) // 2))]
    server = Server(flags, free_port(), work / "server.log")
    results: dict[str, list[dict | None]] = {t: [] for t in tools}
    runs = []

    def finish(t: str, c: int, proc: Proc, out: pathlib.Path, load: float, note: str = "",
               srv: dict | None = None):
        try:
            res = PARSERS[t](out) if proc.rc == 0 else None
        except (OSError, KeyError, ValueError, IndexError, TypeError) as e:
            print(f"  {LABEL[t]}: output not parsed: {e!r}", flush=True)
            res = None
        if res is not None:
            res["client_cpu_s"] = proc.cpu_s
            if srv:
                res.update(srv)
                if srv.get("srv_ttft") and res["ttft"].get("mean") is not None:
                    res["ttft_vs_srv"] = res["ttft"]["mean"] / srv["srv_ttft"]
                if srv.get("srv_itl") and res["tpot"].get("mean") is not None:
                    res["tpot_vs_srv"] = res["tpot"]["mean"] / srv["srv_itl"]
        results[t].append(res)
        runs.append({"cycle": c + 1, "tool": t, "rc": proc.rc, "load_avg_1m": load,
                     "wall_s": proc.wall_s, "client_cpu_s": proc.cpu_s, "result": res,
                     "note": note})
        if res is None:
            tail = proc.log.read_text(errors="replace")[-2000:]
            print(f"cycle {c + 1} {LABEL[t]}: FAILED (exit {proc.rc}) after "
                  f"{proc.wall_s or 0:.0f} s; log {proc.log}:\n{tail}", flush=True)
            return
        print(f"cycle {c + 1} {LABEL[t]:<14}{note} load avg {load:.2f}: {res['ok']} ok "
              f"{res['failed']} failed, TTFT mean {fmt(res['ttft'].get('mean'))} ms, "
              f"TPOT mean {fmt(res['tpot'].get('mean'))} ms, ITL p50 "
              f"{fmt(res['itl'].get('p50'))} ms, {fmt(res['out_tps'], 2)} tok/s, "
              f"{proc.wall_s:.0f} s, client CPU {proc.cpu_s:.1f} s"
              + (f"; server's own TTFT mean {fmt(res.get('srv_ttft'))} ms, ITL mean "
                 f"{fmt(res.get('srv_itl'))} ms" if srv else ""), flush=True)

    def launch(t: str, c: int, tag: str = "") -> tuple[Proc, pathlib.Path]:
        out = work / f"c{c + 1}-{t}{tag}"
        out.mkdir(exist_ok=True)
        cmd = COMMANDS[t](a, server.url, model, tok, out, a.seed + c)
        if a.verbose:
            print("  $ " + shlex.join(cmd), flush=True)
        return Proc(cmd, envs[t], work, out / "log.txt"), out

    try:
        t0 = time.monotonic()
        model = server.start(a.server_start_timeout)
        print(f"server {shlex.join(server.cmd[1:])}\n"
              f"server {server.url} ({model}) up in {time.monotonic() - t0:.0f} s; tokenizer "
              f"{tok}; {a.requests} requests x {a.input_len} prompt + {a.output_len} output "
              f"tokens, {a.streams} streams, {a.cycles} cycles, {a.mode}", flush=True)
        warm = work / "warmup"
        warm.mkdir(exist_ok=True)
        wp = Proc(cmd_inflight(a, server.url, model, tok, warm, 0, n=a.streams), env_offline,
                  work, warm / "log.txt")
        wait_all([wp], time.monotonic() + a.run_timeout)
        for c in range(a.cycles):
            if a.mode == "interleaved":
                order = tools[c % len(tools):] + tools[:c % len(tools)]
                for t in order:
                    load = os.getloadavg()[0]
                    before = server_sums(server.url)
                    proc, out = launch(t, c)
                    wait_all([proc], time.monotonic() + a.run_timeout)
                    finish(t, c, proc, out, load,
                           srv=server_means(before, server_sums(server.url)))
            else:
                # together: each peer with an `inflight bench` run started the moment the
                # peer's first request reaches the server (the peers take 10-20 s to start)
                for t in tools[1:]:
                    load = os.getloadavg()[0]
                    peer, peer_out = launch(t, c)
                    deadline = time.monotonic() + a.run_timeout
                    while not peer.poll() and time.monotonic() < deadline \
                            and in_flight(server.url) == 0:
                        time.sleep(0.1)
                    ours, ours_out = launch("inflight", c, f"-with-{t}")
                    wait_all([peer, ours], deadline)
                    finish("inflight", c, ours, ours_out, load, f" (with {LABEL[t]})")
                    finish(t, c, peer, peer_out, load)
            for t in tools[1:]:
                i = c if a.mode == "interleaved" else c * (len(tools) - 1) + tools.index(t) - 1
                mine, res = results["inflight"][i], results[t][c]
                if mine and res:
                    print(f"cycle {c + 1} {LABEL[t]} / inflight bench: TTFT mean "
                          f"x{res['ttft']['mean'] / mine['ttft']['mean']:.3f}, TPOT mean "
                          f"x{res['tpot']['mean'] / mine['tpot']['mean']:.3f}, output tok/s "
                          f"x{res['out_tps'] / mine['out_tps']:.3f}", flush=True)
    finally:
        server.stop()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)

    print()
    print(f"mean over {a.cycles} cycles, {a.mode} (ratio = peer / inflight bench, like-for-like "
          f"metric; their ITL is our TPOT, GuideLLM's TPOT is E2E / n):")
    print(table(results, tools, a.mode == "together"))
    loads = [f"{r['load_avg_1m']:.2f}" for r in runs]
    print(f"\nload average (1 min) before each run: {', '.join(loads)} "
          f"({os.cpu_count()} CPUs)")
    if a.save:
        pathlib.Path(a.save).write_text(json.dumps(
            {"args": {k: v for k, v in vars(a).items()}, "runs": runs}, indent=1))
    return 0 if all(r["result"] for r in runs) else 1


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    sys.exit(main())
