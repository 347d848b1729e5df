"""inflight's server against llama.cpp's ``llama-server``, side by side (issue 17).

One server at a time on 127.0.0.1, in interleaved cycles (every configuration once per
cycle), each measured at 1, 8 and 32 concurrent streams by the same load generator,
``inflight bench serve`` (closed loop: ``--max-concurrency`` streams, each sending its next
request when the last ends; ``--input-len`` prompt tokens counted with the model's own
tokenizer, ``--output-len`` tokens out with ``ignore_eos``, greedy). Before each server
starts, the machine's busy share over 2 s is read from /proc/stat (no server of ours is
running then): a run on a busy machine is marked, never silently kept.

Prints, per concurrency: output tokens/s, ITL p50 and TTFT p50 of every configuration in
every cycle, then inflight's best cycle against llama.cpp's best format and cycle.

llama-server is not built here (its build belongs outside the repo): give the binary with
``--llama-server`` or ``$LLAMA_SERVER``, and its GGUF files with ``--gguf LABEL=PATH`` or
``$LLAMACPP_GGUFS`` (``bf16=/x.gguf,q4_0=/y.gguf``). Without them the benchmark says so and
exits 0 (nothing to compare). ``--llama-args`` (or ``$LLAMA_SERVER_ARGS``) adds flags to
every llama-server run. A server that fails to start is reported as failed in the table and
the run goes on.

    .venv/bin/python benchmarks/vs_llamacpp.py --llama-server ~/llama.cpp/build/bin/llama-server \\
        --gguf bf16=smollm2-bf16.gguf --gguf q4_0=smollm2-q4_0.gguf --cycles 2 --out vs.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _runs import free_port  # noqa: E402  (sibling benchmark module)

from inflight.bench.server_proc import ServerProcess  # noqa: E402


def _cpu_times() -> tuple[int, int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v[:8]), idle, v[7]


def busy_share(seconds: float = 2.0) -> dict:
    """The machine's busy and stolen CPU share over ``seconds`` (from /proc/stat)."""
    t0, i0, s0 = _cpu_times()
    time.sleep(seconds)
    t1, i1, s1 = _cpu_times()
    total = max(1, t1 - t0)
    return {"busy": 1 - (i1 - i0) / total, "steal": (s1 - s0) / total,
            "load_average": os.getloadavg()[0]}


def parse_labeled(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        label, sep, value = item.partition("=")
        if not sep or not label:
            raise SystemExit(f"{what}: expected LABEL=VALUE, got {item!r}")
        out[label] = value
    return out


def bench_point(base_url: str, streams: int, args, tokenizer: str, out_json: str) -> dict:
    """One ``inflight bench serve`` run; returns its summary."""
    cmd = [str(REPO / ".venv/bin/inflight"), "bench", "serve", "--base-url", base_url,
           "--dataset", "random", "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--range-ratio", "0", "--ignore-eos",
           "--temperature", "0", "--max-concurrency", str(streams),
           "--request-rate", "inf", "--num-prompts", str(max(args.min_prompts,
                                                             args.prompts_per_stream * streams)),
           "--num-warmups", str(streams), "--tokenize", "local", "--tokenizer", tokenizer,
           "--no-metrics", "--no-reset-prefix-cache", "--disable-tqdm", "--seed", str(streams),
           "--save-result", out_json]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.point_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"bench failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(out_json) as f:
        return json.load(f)["summary"]


async def run_config(label: str, command: str, base_url: str, args, tokenizer: str,
                     log_dir: pathlib.Path) -> dict:
    machine = busy_share()
    log = log_dir / f"{label.replace(' ', '_')}-{int(time.time())}.log"
    server = ServerProcess(command, base_url, start_timeout=300, log_path=str(log))
    points = {}
    async with server:
        for streams in args.streams:
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                s = await asyncio.to_thread(bench_point, base_url, streams, args, tokenizer,
                                            tmp.name)
            points[streams] = {"output_tok_s": s["output_throughput"],
                               "itl_p50_ms": 1e3 * s["itl"]["median"],
                               "ttft_p50_ms": 1e3 * s["ttft"]["median"],
                               "completed": s["completed"], "failed": s["failed"]}
            print(f"  {label:28s} {streams:3d} streams: {s['output_throughput']:7.1f} tok/s, "
                  f"ITL p50 {1e3 * s['itl']['median']:6.1f} ms, TTFT p50 "
                  f"{1e3 * s['ttft']['median']:7.1f} ms", flush=True)
    return {"label": label, "command": command, "machine_before": machine, "points": points,
            "log": str(log)}


def table(runs: list[dict], streams: list[int]) -> str:
    lines = []
    for n in streams:
        lines.append(f"\n{n} stream(s): output tok/s (ITL p50 ms) per cycle")
        by_label: dict[str, list[dict]] = {}
        for r in runs:
            by_label.setdefault(r["label"], []).append(r)
        best = {}
        for label, rs in by_label.items():
            cells = ", ".join((f"{r['points'][n]['output_tok_s']:.1f} ({r['points'][n]['itl_p50_ms']:.1f})"
                               if n in r["points"] else "failed")
                              + (" busy" if r["machine_before"]["busy"] > 0.15 else "")
                              for r in rs)
            done = [r["points"][n]["output_tok_s"] for r in rs if n in r["points"]]
            if done:
                best[label] = max(done)
            lines.append(f"  {label:28s} {cells}")
        ours = {k: v for k, v in best.items() if k.startswith("inflight")}
        theirs = {k: v for k, v in best.items() if k.startswith("llama.cpp")}
        if ours and theirs:
            top = max(theirs, key=theirs.__getitem__)
            for k, v in ours.items():
                lines.append(f"  {k} / {top}: {v / theirs[top]:.2f}x")
    return "\n".join(lines)


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    p.add_argument("--gguf", action="append", default=[],
                   help="LABEL=PATH of a GGUF for llama-server (repeatable; or $LLAMACPP_GGUFS)")
    p.add_argument("--llama-args", default=os.environ.get("LLAMA_SERVER_ARGS", ""),
                   help="extra flags for every llama-server run (or $LLAMA_SERVER_ARGS), e.g. "
                   "--no-repack where its repacked or AMX kernels fail on this CPU")
    p.add_argument("--inflight", action="append", default=[],
                   help="LABEL=FLAGS for `inflight serve` (repeatable; default: default= (no flags))")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="threads for both servers")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-stream", type=int, default=3)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--point-timeout", type=float, default=900)
    p.add_argument("--tokenizer", default=None, help="tokenizer for prompt lengths (default: "
                   "the bundled model's GGUF)")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--out", default=None, help="write every run as JSON here")
    args = p.parse_args()
    ggufs = parse_labeled(args.gguf, "--gguf")
    if not ggufs and os.environ.get("LLAMACPP_GGUFS"):
        ggufs = parse_labeled(os.environ["LLAMACPP_GGUFS"].split(","), "$LLAMACPP_GGUFS")
    if not args.llama_server or not pathlib.Path(args.llama_server).is_file() or not ggufs:
        print("skipped: give llama-server (--llama-server or $LLAMA_SERVER) and its GGUF files "
              "(--gguf LABEL=PATH or $LLAMACPP_GGUFS); nothing to compare")
        return 0
    for label, path in ggufs.items():
        if not pathlib.Path(path).is_file():
            raise SystemExit(f"--gguf {label}: no file at {path}")
    inflight = parse_labeled(args.inflight, "--inflight") or {"default": ""}
    if args.tokenizer is None:
        from inflight.model.bundled import find_bundled_model
        args.tokenizer = str(find_bundled_model())
    log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="vs-llamacpp-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    parallel = max(args.streams)
    configs = {f"inflight {k}": f"{REPO / '.venv/bin/inflight'} serve --num-threads {args.threads} {v}"
               for k, v in inflight.items()}
    configs.update({f"llama.cpp {k}": f"{args.llama_server} -m {shlex.quote(v)} -t {args.threads} "
                    f"-tb {args.threads} -np {parallel} -c {parallel * (args.input_len + args.output_len + 16)} "
                    f"--cont-batching --no-webui {args.llama_args}".rstrip()
                    for k, v in ggufs.items()})
    runs = []
    print(f"{len(configs)} configurations x {args.cycles} cycles, streams {args.streams}; "
          f"logs in {log_dir}")
    for cycle in range(args.cycles):
        print(f"cycle {cycle + 1}")
        for label, command in configs.items():
            port = free_port()
            cmd = f"{command} --host 127.0.0.1 --port {port}"
            try:
                run = await run_config(label, cmd, f"http://127.0.0.1:{port}", args,
                                       args.tokenizer, log_dir)
            except RuntimeError as e:  # a server that crashes is a result, not the end
                print(f"  {label}: failed: {str(e).splitlines()[0]}", flush=True)
                run = {"label": label, "command": cmd, "machine_before": busy_share(),
                       "points": {}, "error": str(e)}
            run["cycle"] = cycle
            runs.append(run)
            m = run["machine_before"]
            if m["busy"] > 0.15:
                print(f"  note: the machine was {100 * m['busy']:.0f} % busy before {label}")
    print(table(runs, args.streams))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
