"""inflight's server against the servers a CPU user would pick instead, side by side (issues
17, 51): llama.cpp's ``llama-server`` and vLLM's CPU backend; and offline, ``LLM.generate``
against OpenVINO GenAI's ``ContinuousBatchingPipeline`` (it ships no OpenAI server).

Served: one server at a time on 127.0.0.1, in interleaved cycles (every configuration once per
cycle), each measured at 1, 8 and 32 concurrent streams by the same load generator,
``inflight bench serve`` (closed loop: ``--max-concurrency`` streams, each sending its next
request when the last ends; ``--input-len`` prompt tokens counted with the model's own
tokenizer, ``--output-len`` tokens out with ``ignore_eos``, greedy). Before each server
starts, the machine's busy share over 2 s is read from /proc/stat (no server of ours is
running then): a run on a busy machine is marked, never silently kept.

Prints, per concurrency: output tokens/s, ITL p50 and TTFT p50 of every configuration in
every cycle, then inflight's best cycle against llama.cpp's best format and cycle.

No peer is built or installed here (they belong outside the repo); each comes from flags:
- llama.cpp: the binary (``--llama-server`` or ``$LLAMA_SERVER``) and its GGUF files
  (``--gguf LABEL=PATH`` or ``$LLAMACPP_GGUFS``: ``bf16=/x.gguf,q4_0=/y.gguf``);
  ``--llama-args`` (or ``$LLAMA_SERVER_ARGS``) adds flags to every run (``--no-repack``
  where its repacking crashes, as on Intel hosts with AMX);
- vLLM CPU: the Python of its own venv (``--vllm-python``), the bfloat16 HF folder it serves
  (``--vllm-model``), its ``libiomp5.so`` to preload (``--vllm-preload``), and
  ``--vllm-env KEY=VALUE`` for its settings (``VLLM_CPU_KVCACHE_SPACE``,
  ``VLLM_CPU_OMP_THREADS_BIND``);
- OpenVINO GenAI, offline: the Python of its venv (``--openvino-python``) and the GGUF it
  reads (``--openvino-gguf``); compared with ``LLM.generate`` on the same prompt strings,
  output lengths (EOS ignored, greedy) and batch sizes, one after the other, per cycle.
inflight's variants: ``--inflight 'LABEL=[KEY=VALUE ...] [serve flags]'`` (environment
first). A peer not given is left out, saying so; a server that fails to start is reported
as failed in the table and the run goes on.

    .venv/bin/python benchmarks/vs_peers.py --llama-server ~/llama.cpp/build/bin/llama-server \\
        --gguf q4_0=smollm2-q4_0.gguf --llama-args=--no-repack \\
        --vllm-python ~/vllm-venv/bin/python --vllm-model smollm2-hf-bf16 \\
        --vllm-preload ~/vllm-venv/lib/libiomp5.so --vllm-env VLLM_CPU_KVCACHE_SPACE=1 \\
        --openvino-python ~/ov-venv/bin/python --openvino-gguf smollm2.gguf --cycles 2 --out vs.json
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
        theirs = {k: v for k, v in best.items() if not k.startswith("inflight")}
        if ours and theirs:
            top = max(theirs, key=theirs.__getitem__)
            for k, v in ours.items():
                lines.append(f"  {k} / {top} (the best peer): {v / theirs[top]:.2f}x")
    return "\n".join(lines)


def inflight_configs(variants: dict[str, str], threads: int) -> dict[str, str]:
    """``LABEL -> command`` for ``inflight serve``: a variant's leading KEY=VALUE words are
    its environment, the rest its flags."""
    out = {}
    for label, spec in variants.items():
        words = shlex.split(spec)
        env = [w for w in words[:next((i for i, w in enumerate(words) if "=" not in w or
                                        w.startswith("-")), len(words))]]
        flags = words[len(env):]
        out[f"inflight {label}"] = " ".join(
            (["env", *env] if env else []) + [str(REPO / ".venv/bin/inflight"), "serve",
                                              "--num-threads", str(threads), *flags])
    return out


def peer_configs(args) -> dict[str, str]:
    """``LABEL -> command`` for each peer server given, saying which are left out."""
    configs = {}
    ggufs = parse_labeled(args.gguf, "--gguf")
    if not ggufs and os.environ.get("LLAMACPP_GGUFS"):
        ggufs = parse_labeled(os.environ["LLAMACPP_GGUFS"].split(","), "$LLAMACPP_GGUFS")
    if args.llama_server and pathlib.Path(args.llama_server).is_file() and ggufs:
        parallel = max(args.streams)
        for label, path in ggufs.items():
            if not pathlib.Path(path).is_file():
                raise SystemExit(f"--gguf {label}: no file at {path}")
            configs[f"llama.cpp {label}"] = (
                f"{args.llama_server} -m {shlex.quote(path)} -t {args.threads} -tb {args.threads} "
                f"-np {parallel} -c {parallel * (args.input_len + args.output_len + 16)} "
                f"--cont-batching --no-webui {args.llama_args}".rstrip())
    else:
        print("llama.cpp left out: give --llama-server (or $LLAMA_SERVER) and --gguf LABEL=PATH")
    if args.vllm_python and args.vllm_model:
        env = ["VLLM_TARGET_DEVICE=cpu", *args.vllm_env]
        if args.vllm_preload:
            env.append(f"LD_PRELOAD={args.vllm_preload}")
        configs["vLLM CPU"] = " ".join(
            ["env", *env, args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
             shlex.quote(args.vllm_model), "--dtype", "bfloat16", "--enforce-eager",
             "--max-model-len", "2048", "--max-num-seqs", str(max(args.streams))])
    else:
        print("vLLM CPU left out: give --vllm-python and --vllm-model")
    return configs


async def served(args, log_dir: pathlib.Path) -> list[dict]:
    """Every configuration once per cycle, each at every stream count."""
    configs = inflight_configs(parse_labeled(args.inflight, "--inflight") or {"default": ""},
                               args.threads)
    configs.update(peer_configs(args))
    runs = []
    print(f"{len(configs)} servers x {args.cycles} cycles, streams {args.streams}; logs in {log_dir}")
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
    return runs


OPENVINO = r"""
import json, sys, time
import openvino_genai as ov
gguf, prompts, out_len = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
cfg = ov.GenerationConfig()
cfg.max_new_tokens = out_len
cfg.min_new_tokens = out_len  # EOS ignored: every request makes out_len tokens
cfg.do_sample = False
cfg.apply_chat_template = False
sc = ov.SchedulerConfig()
sc.cache_size = 1
sc.max_num_seqs = max(32, len(prompts))
pipe = ov.ContinuousBatchingPipeline(gguf, sc, "CPU")
pipe.generate(prompts[:1], [cfg])  # warm-up
t = time.perf_counter()
res = pipe.generate(prompts, [cfg] * len(prompts))
dt = time.perf_counter() - t
# string prompts give texts back: count their tokens with the pipeline's own tokenizer
tok = pipe.get_tokenizer()
tokens = [tok.encode(r.m_generation_ids[0], add_special_tokens=False).input_ids.shape[1] for r in res]
print(json.dumps({"tokens": sum(tokens), "min_tokens": min(tokens), "seconds": dt}))
"""


def offline_prompts(n: int, words: int) -> list[str]:
    """``n`` distinct prompts of about ``words`` words, from the shared MT-Bench questions."""
    from inflight.bench.datasets import default_data_dir
    lines = (default_data_dir() / "mt_bench_questions.jsonl").read_text().splitlines()
    texts = [" ".join(json.loads(line)["turns"][0].split()) for line in lines]
    pool = " ".join(texts).split()
    return [" ".join(pool[i * 7 % len(pool):][:words]) for i in range(n)]


def offline(args) -> list[dict]:
    """``LLM.generate`` against OpenVINO's pipeline, per batch size and cycle: output tok/s."""
    if not args.openvino_python:
        print("OpenVINO left out: give --openvino-python (and --openvino-gguf)")
        return []
    gguf = args.openvino_gguf or args.tokenizer  # the bundled GGUF by default
    from inflight import LLM, SamplingParams
    llm = LLM(max_num_seqs=max(args.streams), num_threads=args.threads)
    rows = []
    for cycle in range(args.cycles):
        for n in args.streams:
            prompts = offline_prompts(n, args.input_len * 3 // 4)
            params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            llm.generate(prompts[:1], params, use_tqdm=False)
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            ours = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
            proc = subprocess.run([args.openvino_python, "-c", OPENVINO, gguf,
                                   json.dumps(prompts), str(args.output_len)],
                                  capture_output=True, text=True, timeout=args.point_timeout)
            if proc.returncode != 0:
                print(f"  OpenVINO failed at {n}: {proc.stderr[-500:]}")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            theirs = r["tokens"] / r["seconds"]
            if r["min_tokens"] < args.output_len * 0.95:  # a retokenized text may merge a few
                print(f"  note: OpenVINO stopped a request at {r['min_tokens']} tokens")
            rows.append({"cycle": cycle, "prompts": n, "inflight_tok_s": ours, "openvino_tok_s": theirs})
            print(f"  offline, {n:3d} prompts: LLM.generate {ours:7.1f} tok/s, OpenVINO "
                  f"{theirs:7.1f} tok/s: {ours / theirs:.2f}x", flush=True)
    return rows


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    p.add_argument("--gguf", action="append", default=[],
                   help="LABEL=PATH of a GGUF for llama-server (repeatable; or $LLAMACPP_GGUFS)")
    p.add_argument("--llama-args", default=os.environ.get("LLAMA_SERVER_ARGS", ""),
                   help="extra flags for every llama-server run (or $LLAMA_SERVER_ARGS), e.g. "
                   "--no-repack where its repacked or AMX kernels fail on this CPU")
    p.add_argument("--vllm-python", help="the Python of vLLM CPU's own venv")
    p.add_argument("--vllm-model", help="the bfloat16 HF folder vLLM serves")
    p.add_argument("--vllm-preload", help="vLLM's libiomp5.so, preloaded (LD_PRELOAD)")
    p.add_argument("--vllm-env", action="append", default=[], help="KEY=VALUE for vLLM (repeatable)")
    p.add_argument("--openvino-python", help="the Python of OpenVINO GenAI's venv (offline)")
    p.add_argument("--openvino-gguf", help="the GGUF OpenVINO reads (default: the bundled one)")
    p.add_argument("--inflight", action="append", default=[],
                   help="'LABEL=[KEY=VALUE ...] [serve flags]' (repeatable; default: default=)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="threads for every server")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-stream", type=int, default=3)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--point-timeout", type=float, default=900)
    p.add_argument("--tokenizer", default=None, help="tokenizer for prompt lengths (default: "
                   "the bundled model's GGUF)")
    p.add_argument("--no-served", action="store_true", help="only the offline comparison")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--out", default=None, help="write every run as JSON here")
    args = p.parse_args()
    from inflight.model.bundled import find_bundled_model
    if args.tokenizer is None:
        args.tokenizer = str(find_bundled_model())
    log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="vs-peers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    runs = [] if args.no_served else await served(args, log_dir)
    rows = offline(args)
    if args.out:
        from inflight.bench.machine import describe_machine
        with open(args.out, "w") as f:
            json.dump({"host": describe_machine(), "args": vars(args), "runs": runs,
                       "offline": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    from _runs import record_host
    record_host()
    sys.exit(asyncio.run(main()))
