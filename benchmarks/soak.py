"""Soak test: replay a trace's request sizes for a long time, aborting some, and check that
nothing is lost, nothing is left behind and the server's memory does not grow.

The long variant of tests/reliability/test_abort_storm.py. Requests take their prompt and
output lengths from the Azure conversation trace (through inflight's own bench dataset
loader, ``inflight.bench.datasets``: lengths times ``--length-scale``, clipped to the caps,
rows in a seeded random order, prompts fitted to exact token counts with the server's
``/tokenize``), arrive as a Poisson process at ``--rate``, and are streamed from
``/v1/completions``; ``--abort-fraction`` of the clients leave at a random point (before
the first byte, or after a random number of chunks). Everything random is seeded.

Promises (exit status 1 when one is broken, 2 for a usage or setup error):

- lost == 0: every client that stayed got HTTP 200, a ``stop``/``length`` finish, no error
  event and ``data: [DONE]`` last;
- once the load stops, running, waiting and KV usage return to 0 (polled on ``/stats``);
- ``inflight:request_success_total`` (all finish reasons) grew by one per request that
  reached the engine: between ``sent - aborted before the first byte`` and ``sent``, with no
  ``error`` finish, and stop+length at least the completed count;
- the server's RSS at the end is within ``--max-rss-growth`` (5 %) of its RSS after the
  warm-up (psutil if installed, else /proc/PID/status VmRSS). The KV pool is lazily mapped
  zero pages that the allocator walks through in LRU order, so RSS rises until every block
  was written once; the warm-up therefore lasts until the server computed more tokens than
  the pool holds (a note in ``warnings`` when half the run passed first). Keep the pool
  small enough for that (``--num-kv-blocks`` in the serve command) on short runs.

Pick ``--rate`` at about 80 % of the server's operating limit, found with (README.md):

    .venv/bin/inflight bench capacity --serve-cmd ".venv/bin/inflight serve --port 8000" \\
        --dataset trace --length-scale 0.125 --max-input-len 256 --max-output-len 128 \\
        --no-ignore-eos --slo ttft_p95=2,itl_p95=1 --rate-start 2 --report capacity-report

(``capacity-report/report.md`` gives the limit in requests/s.) Then, against a server this
script starts on a free 127.0.0.1 port and stops at the end:

    .venv/bin/python benchmarks/soak.py \\
        --serve-cmd ".venv/bin/inflight serve --dtype bfloat16 --num-kv-blocks 1024" \\
        --rate 0.8 --duration 600 --output soak.json

or against one already running (give its PID for the RSS check unless it listens locally):

    .venv/bin/python benchmarks/soak.py --base-url http://127.0.0.1:8000 --rate 0.8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pathlib
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _runs import free_port  # noqa: E402  (sibling benchmark module)

from inflight.bench.arrivals import rate_offsets  # noqa: E402
from inflight.bench.datasets import AZURE_CONV_FILE, DatasetConfig, build_dataset, default_data_dir  # noqa: E402
from inflight.bench.client import make_client  # noqa: E402
from inflight.bench.prompts import make_counter  # noqa: E402

SUCCESS = "inflight:request_success_total"
REASONS = ("stop", "length", "abort", "error")


@dataclass
class Result:
    """One request's fate, as the client saw it."""

    index: int
    sent_at: float
    prompt_len: int | None
    max_tokens: int
    abort: str | None  # None, "before_first_byte" or "chunks"
    status: int | None = None
    chunks: int = 0
    finish_reason: str | None = None
    done: bool = False
    left: bool = False  # the client left on purpose
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None

    def problem(self) -> str | None:
        """Why a client that stayed did not get a whole response (None: it did)."""
        if self.left:
            return None
        if self.status != 200:
            return f"status {self.status}" + (f": {self.error}" if self.error else "")
        if self.error:
            return self.error
        if self.finish_reason not in ("stop", "length"):
            return f"finish_reason {self.finish_reason!r}"
        if not self.done:
            return "no data: [DONE]"
        return None


@dataclass
class Report:
    config: dict
    sent: int = 0
    completed: int = 0
    aborted: int = 0
    aborted_before_first_byte: int = 0
    lost: int = 0
    lost_examples: list = field(default_factory=list)
    error_statuses: dict = field(default_factory=dict)
    final_running: float | None = None
    final_waiting: float | None = None
    final_kv_usage: float | None = None
    idle_after_s: float | None = None
    finished_counters: dict = field(default_factory=dict)
    finished_counters_sum: float | None = None
    rss_pid: int | None = None
    rss_source: str | None = None
    rss_after_warmup_bytes: int | None = None
    rss_end_bytes: int | None = None
    rss_growth_pct: float | None = None
    rss_timeline: list = field(default_factory=list)
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    load_average_start: list | None = None
    load_average_end: list | None = None
    wall_s: float | None = None
    warmup_end_s: float | None = None
    warnings: list = field(default_factory=list)
    broken_promises: list = field(default_factory=list)


# --- server side --------------------------------------------------------------------------
def rss_bytes(pid: int) -> tuple[int | None, str]:
    """Resident set size of ``pid``: psutil when installed, else /proc/PID/status VmRSS."""
    try:
        import psutil
        return psutil.Process(pid).memory_info().rss, "psutil"
    except ImportError:
        pass
    except Exception:
        return None, "psutil"
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024, "/proc/PID/status"
    except OSError:
        pass
    return None, "/proc/PID/status"


def find_listener_pid(port: int, candidates: list[int] | None = None) -> int | None:
    """The PID listening on 127.0.0.1:``port`` (among ``candidates`` and their children
    when given), via psutil; None when it cannot tell."""
    try:
        import psutil
    except ImportError:
        return None
    procs = []
    if candidates:
        for pid in candidates:
            try:
                p = psutil.Process(pid)
                procs += [p, *p.children(recursive=True)]
            except psutil.Error:
                pass
    else:
        procs = list(psutil.process_iter())
    for p in procs:
        try:
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
                    return p.pid
        except (psutil.Error, AttributeError):
            continue
    return candidates[0] if candidates else None


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    text = (await client.get(base_url + "/metrics", timeout=10)).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == SUCCESS:
                out[s.labels.get("finished_reason", "")] = s.value
            elif s.name in ("inflight:num_requests_running", "inflight:num_requests_waiting",
                            "inflight:kv_cache_usage_perc"):
                out[s.name] = s.value
    return out


async def kv_pool_tokens(client: httpx.AsyncClient, base_url: str) -> int | None:
    """KV pool size in tokens, from ``inflight:engine_config_info`` (None if not shown)."""
    text = (await client.get(base_url + "/metrics", timeout=10)).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "inflight:engine_config_info":
                try:
                    return int(s.labels["num_kv_blocks"]) * int(s.labels["block_size"])
                except (KeyError, ValueError):
                    return None
    return None


async def computed_tokens(client: httpx.AsyncClient, base_url: str) -> int:
    s = (await client.get(base_url + "/stats", timeout=10)).json()
    return int(s.get("prompt_tokens_total", 0)) + int(s.get("generation_tokens_total", 0))


# --- one client ---------------------------------------------------------------------------
async def run_one(client: httpx.AsyncClient, base_url: str, res: Result, prompt: str,
                  ignore_eos: bool, rng: random.Random, model: str | None) -> None:
    body: dict = {"prompt": prompt, "max_tokens": res.max_tokens, "stream": True,
                  "ignore_eos": ignore_eos, "temperature": 0.0}
    if model:
        body["model"] = model
    abort_after_chunks = rng.randint(1, max(1, res.max_tokens - 1))
    abort_after_s = rng.uniform(0.0, 2.0)
    t0 = time.monotonic()

    async def follow() -> None:
        async with client.stream("POST", base_url + "/v1/completions", json=body) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode(errors="replace")[:300]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    res.done = True
                    continue
                if res.done:
                    res.error = "data after [DONE]"
                event = json.loads(payload)
                if "error" in event:
                    res.error = f"error event: {event['error']}"
                res.chunks += 1
                if res.ttft_s is None:
                    res.ttft_s = time.monotonic() - t0
                for c in event.get("choices", []):
                    if c.get("finish_reason") is not None:
                        res.finish_reason = c["finish_reason"]
                if res.abort == "chunks" and res.chunks >= abort_after_chunks and not res.done \
                        and res.finish_reason is None:
                    res.left = True
                    return  # closing the response mid-stream drops the connection
        res.e2e_s = time.monotonic() - t0

    try:
        if res.abort == "before_first_byte":
            try:
                await asyncio.wait_for(follow(), timeout=abort_after_s)
            except asyncio.TimeoutError:
                res.left = True
        else:
            await follow()
    except Exception as e:
        res.error = f"{type(e).__name__}: {e}"


# --- the run ------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


async def soak(args: argparse.Namespace, base_url: str, server_pid: int | None) -> Report:
    report = Report(config={k: v for k, v in vars(args).items()} | {"base_url": base_url})
    report.load_average_start = list(os.getloadavg())
    t_start = time.monotonic()
    n = max(1, math.ceil(args.rate * args.duration))
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=30),
                                 limits=limits, trust_env=False) as client:
        cfg = DatasetConfig(name="trace", num_prompts=min(n, args.max_distinct_prompts),
                            seed=args.seed, trace_file=args.trace, length_scale=args.length_scale,
                            max_input_len=args.max_input_len, max_output_len=args.max_output_len,
                            ignore_eos=args.ignore_eos, shuffle=True)
        async with make_client() as bench_client:  # the bench's tokenizer counter speaks aiohttp
            counter = await make_counter("auto", bench_client, base_url, args.model, None)
            print(f"building {cfg.num_prompts} prompts from {cfg.trace_path()} "
                  f"(token counter: {counter.mode})", flush=True)
            specs = await build_dataset(cfg, counter)
        report.config["dataset"] = cfg.describe()
        report.config["token_counter"] = counter.mode
        offsets = rate_offsets(n, args.rate, "poisson", seed=args.seed)
        offsets = [o for o in offsets if o < args.duration]
        before = await scrape(client, base_url)
        results: list[Result] = []
        tasks: list[asyncio.Task] = []
        warmup_done = False
        next_rss = 0.0
        t0 = time.monotonic()
        print(f"sending {len(offsets)} requests over {args.duration:g} s at {args.rate:g} req/s, "
              f"{args.abort_fraction:.0%} aborted", flush=True)

        def sample_rss(label: str) -> int | None:
            if server_pid is None:
                return None
            value, source = rss_bytes(server_pid)
            report.rss_source = source
            report.rss_timeline.append({"t": round(time.monotonic() - t0, 1), "what": label,
                                        "rss_bytes": value})
            return value

        # The KV pool is zero pages mapped lazily (inflight/runner.py ``_zeros``) and the
        # allocator hands out least recently freed blocks first, so RSS grows until every
        # block has been written once: that is first touch, not a leak. The reference RSS
        # is therefore taken once the server has computed more tokens than the pool holds
        # (and --warmup seconds passed), or at half the run at the latest, with a note.
        pool_tokens = await kv_pool_tokens(client, base_url)
        report.config["kv_pool_tokens"] = pool_tokens
        tokens0 = await computed_tokens(client, base_url)

        async def warmed_up(now: float) -> bool:
            if now < args.warmup:
                return False
            if now >= args.duration / 2 or pool_tokens is None:
                report.warnings.append(
                    f"RSS reference taken at {now:.0f} s before the KV pool ({pool_tokens} "
                    "tokens) was surely written once: the growth includes first-touch of KV "
                    "pages; use a longer run or a smaller --num-kv-blocks")
                return True
            done = await computed_tokens(client, base_url) - tokens0
            return done >= 1.1 * pool_tokens

        next_warm_check = 0.0
        for i, offset in enumerate(offsets):
            while True:  # sleep to the next arrival, sampling RSS on the way
                now = time.monotonic() - t0
                if not warmup_done and now >= next_warm_check:
                    next_warm_check = now + 1.0
                    if await warmed_up(now):
                        report.rss_after_warmup_bytes = sample_rss("after warm-up")
                        report.warmup_end_s = round(now, 1)
                        warmup_done = True
                if now >= next_rss:
                    sample_rss("periodic")
                    next_rss = now + args.rss_interval
                if now >= offset:
                    break
                await asyncio.sleep(min(offset - now, 1.0))
            spec = specs[i % len(specs)]
            draw = rng.random()
            abort = None
            if draw < args.abort_fraction:
                abort = "before_first_byte" if rng.random() < 0.3 else "chunks"
            res = Result(i, offset, spec.prompt_len, spec.output_len, abort)
            results.append(res)
            tasks.append(asyncio.create_task(run_one(
                client, base_url, res, spec.as_text(), spec.ignore_eos,
                random.Random(args.seed * 1_000_003 + i), args.model)))
            if i % 50 == 0:
                in_flight = sum(not t.done() for t in tasks)
                print(f"  t={time.monotonic() - t0:6.1f} s sent {i + 1}, in flight {in_flight}",
                      flush=True)
        if not warmup_done:
            report.rss_after_warmup_bytes = sample_rss("after warm-up (run shorter than it)")
        print("load stopped; waiting for requests in flight", flush=True)
        if tasks:
            await asyncio.wait(tasks, timeout=args.request_timeout + 30)
        for t in tasks:
            if not t.done():
                t.cancel()

        # Idle again? Poll /stats until running, waiting and KV usage are 0, or give up.
        t_idle = time.monotonic()
        stats = {}
        while time.monotonic() - t_idle < args.idle_timeout:
            stats = (await client.get(base_url + "/stats", timeout=10)).json()
            if (stats["num_requests_running"], stats["num_requests_waiting"],
                    stats["kv_cache_usage_perc"]) == (0, 0, 0):
                break
            await asyncio.sleep(0.2)
        report.idle_after_s = round(time.monotonic() - t_idle, 2)
        report.final_running = stats.get("num_requests_running")
        report.final_waiting = stats.get("num_requests_waiting")
        report.final_kv_usage = stats.get("kv_cache_usage_perc")
        after = await scrape(client, base_url)
        report.rss_end_bytes = sample_rss("end, idle")

    # --- the tally
    report.sent = len(results)
    report.aborted = sum(r.left for r in results)
    report.aborted_before_first_byte = sum(r.left and r.abort == "before_first_byte"
                                           and r.status is None for r in results)
    report.completed = sum(not r.left and r.problem() is None for r in results)
    lost = [r for r in results if r.problem() is not None]
    report.lost = len(lost)
    report.lost_examples = [{"index": r.index, "problem": r.problem()} for r in lost[:10]]
    for r in results:
        if r.status is not None and r.status != 200:
            report.error_statuses[str(r.status)] = report.error_statuses.get(str(r.status), 0) + 1
    report.finished_counters = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in REASONS}
    report.finished_counters_sum = sum(report.finished_counters.values())
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None and not r.left]
    report.ttft_p50_s, report.ttft_p95_s = percentile(ttfts, 0.5), percentile(ttfts, 0.95)
    report.rss_pid = server_pid
    if report.rss_after_warmup_bytes and report.rss_end_bytes:
        report.rss_growth_pct = round(100.0 * (report.rss_end_bytes - report.rss_after_warmup_bytes)
                                      / report.rss_after_warmup_bytes, 2)
    report.load_average_end = list(os.getloadavg())
    report.wall_s = round(time.monotonic() - t_start, 1)

    # --- the promises
    broken = report.broken_promises
    if report.lost:
        broken.append(f"lost {report.lost} requests (e.g. {report.lost_examples[:3]})")
    if (report.final_running, report.final_waiting, report.final_kv_usage) != (0, 0, 0):
        broken.append(f"not idle {args.idle_timeout:g} s after the load: running "
                      f"{report.final_running}, waiting {report.final_waiting}, KV usage "
                      f"{report.final_kv_usage}")
    c = report.finished_counters
    lo = report.sent - report.aborted_before_first_byte
    if not lo <= report.finished_counters_sum <= report.sent:
        broken.append(f"request_success_total grew by {report.finished_counters_sum:g} "
                      f"({c}); expected between {lo} (sent - left before the first byte) and "
                      f"{report.sent} (sent)")
    if c["error"]:
        broken.append(f"{c['error']:g} requests finished with an engine error")
    if c["stop"] + c["length"] < report.completed:
        broken.append(f"stop+length counters {c['stop'] + c['length']:g} < completed "
                      f"{report.completed}")
    if report.rss_growth_pct is None:
        broken.append("RSS not measured (no server PID: pass --server-pid)")
    elif report.rss_growth_pct >= args.max_rss_growth:
        broken.append(f"RSS grew {report.rss_growth_pct:.1f} % after warm-up "
                      f"(limit {args.max_rss_growth:g} %)")
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a server already running, e.g. http://127.0.0.1:8000")
    where.add_argument("--serve-cmd", help="start this server command (e.g. '.venv/bin/inflight "
                       "serve'); '--host 127.0.0.1 --port FREE' is appended unless it has {port}")
    p.add_argument("--server-pid", type=int, help="PID of the --base-url server, for the RSS "
                   "check (default: the local process listening on its port, via psutil)")
    p.add_argument("--rate", type=float, default=None,
                   help="requests/s, Poisson; pass about 80%% of the operating limit "
                        "(`inflight bench capacity`, see the epilog). Required.")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--warmup", type=float, default=None,
                   help="least seconds before the reference RSS sample, which also waits until "
                        "the server computed more tokens than its KV pool holds (default: "
                        "min(60, duration/4))")
    p.add_argument("--abort-fraction", type=float, default=0.2, help="clients that leave (0.2)")
    p.add_argument("--trace", default=str(default_data_dir() / AZURE_CONV_FILE),
                   help="trace file (default: the Azure conversation trace in ../shared/data)")
    p.add_argument("--length-scale", type=float, default=0.125,
                   help="multiplies the trace's lengths (default 0.125, as README's capacity run)")
    p.add_argument("--max-input-len", type=int, default=256)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate the trace's output lengths exactly (default on)")
    p.add_argument("--max-distinct-prompts", type=int, default=400,
                   help="prompts built (each needs a few /tokenize calls); cycled beyond that")
    p.add_argument("--model", default=None, help="'model' field to send (default: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds after the load for running/waiting/KV to reach 0")
    p.add_argument("--rss-interval", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--max-rss-growth", type=float, default=5.0, help="percent (default 5)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--output", default=None, help="write the JSON result here")
    args = p.parse_args(argv)
    if args.rate is None or args.rate <= 0:
        p.error("--rate is required: pass about 80% of the operating limit in requests/s; "
                "find the limit with `.venv/bin/inflight bench capacity ...` (see --help)")
    if not 0 <= args.abort_fraction <= 1:
        p.error("--abort-fraction must be in [0, 1]")
    if args.warmup is None:
        args.warmup = min(60.0, args.duration / 4)
    return args


async def main_async(args: argparse.Namespace) -> Report:
    if args.base_url:
        base_url = args.base_url.rstrip("/")
        pid = args.server_pid
        if pid is None:
            port = httpx.URL(base_url).port or 80
            pid = find_listener_pid(port)
        return await soak(args, base_url, pid)
    from inflight.bench.server_proc import ServerProcess
    port = free_port()
    cmd = args.serve_cmd
    cmd = cmd.format(port=port) if "{port}" in cmd else f"{cmd} --host 127.0.0.1 --port {port}"
    base_url = f"http://127.0.0.1:{port}"
    server = ServerProcess(cmd, base_url, start_timeout=args.start_timeout)
    print(f"starting: {cmd} (log {server.log_path})", flush=True)
    async with server:
        pid = find_listener_pid(port, [server.proc.pid]) if server.proc else None
        report = await soak(args, base_url, pid)
    report.config["serve_cmd_resolved"] = cmd
    report.config["server_log"] = server.log_path
    report.config["server_exit_code"] = server.proc.returncode if server.proc else None
    if server.proc is not None and server.proc.returncode not in (0, None):
        report.broken_promises.append(f"server exited with {server.proc.returncode} on SIGINT")
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = asyncio.run(main_async(args))
    except (RuntimeError, OSError, httpx.HTTPError) as e:
        print(f"soak: setup failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    out = asdict(report)
    text = json.dumps(out, indent=2, default=str)
    if args.output:
        pathlib.Path(args.output).write_text(text + "\n")
    summary = {k: out[k] for k in (
        "sent", "completed", "aborted", "aborted_before_first_byte", "lost", "error_statuses",
        "final_running", "final_waiting", "final_kv_usage", "idle_after_s",
        "finished_counters", "finished_counters_sum", "rss_after_warmup_bytes",
        "rss_end_bytes", "rss_growth_pct", "rss_source", "ttft_p50_s", "ttft_p95_s",
        "warmup_end_s", "load_average_start", "load_average_end", "wall_s", "warnings",
        "broken_promises")}
    print(json.dumps(summary, indent=2, default=str))
    print("soak: PASS" if not report.broken_promises else
          "soak: FAIL: " + "; ".join(report.broken_promises))
    return 1 if report.broken_promises else 0


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    sys.exit(main())
