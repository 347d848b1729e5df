"""``inflight bench ... --simulate PROFILE.json``: the same runs without a server.

A simulated session has the real one's request mix (built with the model's own tokenizer,
so prompt lengths and prefix blocks are exact), and ``simulate_point`` replays a point's
schedule (``bench.schedule.plan_point``: warm-up, window, cool-down) through the
:class:`~inflight.sim.cluster.Simulator` and returns the same ``PointResult`` a measured
point has: request records with streamed-chunk times, the summary, scraped gauges and
counter deltas. The verdicts, capacity search, ``tune`` and reports then run unchanged.

The engine settings come from the server command (``--serve-cmd``, so ``tune``'s knobs
apply) parsed by ``inflight serve``'s own parser, else from the profile.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import shlex
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

from inflight.bench.client import RequestRecord
from inflight.bench.conversations import with_stand_in_answers
from inflight.bench.datasets import DatasetConfig, RequestSpec, build_dataset
from inflight.bench.metrics_scrape import Snapshot
from inflight.bench.session import (ArrivalConfig, LoadConfig, PointResult, Session, goes_on, look_summary,
                                   mark_cancelled, view_at)
from inflight.bench.schedule import plan_point
from inflight.bench.summary import SLO, summarize
from inflight.bench.sustain import Thresholds, Window, judge
from inflight.config import EngineConfig
from inflight.routing import ROUTERS, make_router
from inflight.sim.cluster import SimRequest, Simulator
from inflight.sim.profile import StepProfile, load_profile, profile_warnings


MAX_REPLICAS = 1024


def parse_serve_command(command: str) -> tuple[EngineConfig, dict[str, Any]]:
    """The engine settings and server flags of an ``inflight serve ...`` command line,
    parsed by the server's own parser. ValueError when it is not one."""
    from inflight.cli import build_parser

    tokens = shlex.split(command)
    at = tokens.index("serve") if "serve" in tokens else -1
    # The program before `serve` must be inflight's: `inflight`, a path to it, or `-m inflight...`.
    if at < 1 or not any(t.rsplit("/", 1)[-1] == "inflight" or t.startswith("inflight.") for t in tokens[:at]):
        raise ValueError(f"--simulate reads engine settings from an `inflight serve ...` command; "
                         f"{command!r} is not one")
    rest = tokens[at + 1:]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args(["serve", *rest])
    except SystemExit:
        last = (err.getvalue().strip().splitlines() or ["bad arguments"])[-1]
        last = re.sub(r"^[\w .-]+: error: ", "", last)  # argparse's "prog: error: " prefix
        raise ValueError(f"--serve-cmd: {last}") from None
    return EngineConfig.from_cli_args(args), {"max_num_waiting": args.max_num_waiting,
                                              "served_model_name": getattr(args, "served_model_name", None)}


class _Counter:
    """A bench ``TokenCounter`` over the model's tokenizer (exact, as the server counts)."""

    mode = "simulated (model tokenizer)"
    exact = True

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    async def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))


@dataclass
class SimSetup:
    """What a simulated session runs: the profile, the engine settings, the replicas."""

    profile: StepProfile
    config: EngineConfig
    max_num_waiting: int | None
    num_blocks: int
    max_model_len: int
    eos_token_ids: list[int]
    replicas: int
    router: str
    tokenizer: Any
    model_name: str
    command: str | None
    noise: bool = True
    # Where the served model's outputs end (``calibrate_outputs``): per request, and as
    # fractions of max_tokens for requests never seen; empty: at the dataset's lengths.
    output_lengths: dict[tuple[str, int], int] = field(default_factory=dict, repr=False)
    output_fractions: list[float] = field(default_factory=list, repr=False)
    # id(spec) -> (spec, its prompt ids); holding the spec keeps its id from being reused
    _ids: dict[int, tuple[RequestSpec, list[int]]] = field(default_factory=dict, repr=False)

    def calibrate_outputs(self, outputs: list[tuple[RequestSpec, int]]) -> None:
        """Learn where a real server's outputs end: ``(spec, output tokens)`` of requests it
        completed. A request of the mix it answered ends there in the simulation; another
        one (not ``ignore_eos``) at a fraction of its ``max_tokens`` drawn, by its text,
        from those seen. Without this the simulator runs every output to ``max_tokens``
        and predicts a lower limit than a server that stops at its EOS reaches."""
        for spec, n in outputs:
            if not spec.ignore_eos:
                self.output_lengths[_spec_key(spec)] = n
                self.output_fractions.append(min(1.0, n / max(1, spec.output_len)))

    def output_len(self, spec: RequestSpec) -> int:
        """Tokens ``spec`` generates in the simulation (see :meth:`calibrate_outputs`)."""
        if spec.ignore_eos or not self.output_fractions:
            return spec.output_len
        key = _spec_key(spec)
        if key in self.output_lengths:
            return min(self.output_lengths[key], spec.output_len)
        pick = zlib.crc32(key[0].encode()) % len(self.output_fractions)
        return max(1, round(self.output_fractions[pick] * spec.output_len))

    def simulator(self, load: LoadConfig, seed: int = 0) -> Simulator:
        return Simulator(self.config, self.profile, num_blocks=self.num_blocks, max_model_len=self.max_model_len,
                         eos_token_ids=self.eos_token_ids, replicas=self.replicas,
                         router=make_router(self.router, self.config.block_size),
                         max_num_waiting=self.max_num_waiting, max_concurrency=load.max_concurrency,
                         metrics_interval=load.metrics_interval, noise=self.noise, seed=seed)

    def prompt_ids(self, spec: RequestSpec, endpoint: str, sent: RequestSpec | None = None) -> list[int]:
        """The token ids the server would queue for ``spec`` (its template and tokenizer),
        sent as ``sent`` (a follow-up turn with its history) if given; computed once per
        spec: a search re-sends the same mix at every load."""
        hit = self._ids.get(id(spec))
        if hit is None:
            tok, sent = self.tokenizer, sent or spec
            if endpoint == "chat":
                text = tok.apply_chat_template(sent.as_messages(), add_generation_prompt=True)
                ids = list(tok.encode(text, add_special_tokens=False))
            else:
                ids = list(tok.encode(sent.as_text()))
            hit = self._ids[id(spec)] = (spec, ids)
        return hit[1]

    def describe(self) -> dict:
        c = self.config
        return {"simulated": True, "profile": self.profile.describe(), "profile_source": self.profile.source,
                "machine": self.profile.machine, "replicas": self.replicas, "router": self.router,
                "command": self.command, "num_kv_blocks": self.num_blocks, "max_model_len": self.max_model_len,
                "engine": {"max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
                           "enable_chunked_prefill": c.enable_chunked_prefill,
                           "enable_prefix_caching": c.enable_prefix_caching, "block_size": c.block_size,
                           "batching_policy": c.batching_policy, "scheduling_policy": c.scheduling_policy,
                           "max_num_waiting": self.max_num_waiting}}


def _spec_key(spec: RequestSpec) -> tuple[str, int]:
    return (spec.as_text(), spec.output_len)


def sim_setup(profile_path: str, command: str | None, replicas: int = 1, router: str = "prefix_affinity",
              ) -> SimSetup:
    """Load the profile and resolve the engine settings (``command``'s, else the profile's).

    Raises:
        ValueError: a bad profile, command, replica count or router.
        FileNotFoundError: no profile, or the profile's model file is gone.
    """
    from inflight.tokenizer import Tokenizer

    if not 1 <= replicas <= MAX_REPLICAS:
        raise ValueError(f"--replicas must be in 1..{MAX_REPLICAS}, got {replicas} (each simulated replica "
                         f"holds a real engine's state, ~2 MB)")
    if router not in ROUTERS:
        raise ValueError(f"--router: unknown policy {router!r} (choose from {', '.join(ROUTERS)})")
    profile = load_profile(profile_path)
    for note, _ in profile_warnings(profile):
        print(f"WARNING: {profile_path}: {note}", file=sys.stderr)
    eng = profile.engine
    extra: dict[str, Any] = {"max_num_waiting": eng.get("max_num_waiting", 512), "served_model_name": None}
    if command:
        config, extra = parse_serve_command(command)
    else:
        known = {k: v for k, v in eng.get("config", {}).items() if k in EngineConfig.__dataclass_fields__}
        config = EngineConfig(**known)
    dtype = eng.get("dtype")
    if command and config.dtype not in ("auto", dtype):
        print(f"warning: the profile was measured in {dtype}, the command asks for {config.dtype}: "
              f"step times are the profile's", file=sys.stderr)
    if config.block_size != eng.get("block_size", config.block_size):
        raise ValueError(f"the profile was measured with --block-size {eng['block_size']}, the command "
                         f"sets {config.block_size}: profile that block size")
    block_bytes = eng.get("kv_block_bytes")
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory_bytes is not None and block_bytes:
        num_blocks = config.kv_cache_memory_bytes // block_bytes
    else:
        num_blocks = int(eng["num_kv_blocks"])
    max_model_len = int(config.max_model_len or eng.get("max_model_len")
                        or profile.model.get("max_position_embeddings") or num_blocks * config.block_size)
    path = eng.get("model_path")
    if not path:
        raise ValueError("the profile names no model file (model_path): its tokenizer builds the prompts")
    tokenizer = Tokenizer.from_pretrained(path) if pathlib.Path(path).is_dir() else Tokenizer.from_gguf(path)
    name = extra.get("served_model_name") or profile.model.get("name") or "simulated"
    if isinstance(name, list):
        name = name[0]
    return SimSetup(profile, config, extra.get("max_num_waiting"), num_blocks, max_model_len,
                    list(eng.get("eos_token_ids") or tokenizer.eos_token_ids), replicas, router, tokenizer,
                    str(name), command)


async def open_sim_session(load: LoadConfig, dataset: DatasetConfig, setup: SimSetup) -> Session:
    """A :class:`Session` whose points are simulated (``Session.simulation``)."""
    t = time.perf_counter()
    counter = _Counter(setup.tokenizer)
    endpoint = load.endpoint or ("chat" if dataset.name == "chat" else "completions")
    specs = await build_dataset(dataset, counter, dataset.num_prompts + load.num_warmups)
    session = Session(client=None, load=load, dataset=dataset, model=load.model or setup.model_name,  # type: ignore[arg-type]
                      endpoint=endpoint, tokenizer_mode=counter.mode, specs=specs[load.num_warmups:],
                      warmups=specs[:load.num_warmups], server_models=[], server_info={"simulation": setup.describe()},
                      prepare_seconds=time.perf_counter() - t, counter=counter, simulation=setup)
    return session


async def simulate_point(session: Session, arrival: ArrivalConfig, slo: SLO | None = None,
                         thresholds: Thresholds | None = None) -> PointResult:
    """``run_point`` on the simulator: the point's schedule, simulated; the same result.
    Every look a real point could take is simulated, then judged as it stood at each look
    (``runner.view_at``), so an undecided point is extended as a real one would be."""
    setup: SimSetup = session.simulation
    slots, window = await plan_point(session, arrival)
    longest = window.looks()[-1] if window is not None else None
    # A multi-turn mix: follow-ups carry their history, stand-in answers for the real ones.
    sent = with_stand_in_answers([s.spec for s in slots])
    reqs = [SimRequest(i, s.offset, setup.prompt_ids(s.spec, session.endpoint, x), s.spec.output_len,
                       setup.output_len(s.spec), s.spec.ignore_eos,
                       watched=window is not None and s.phase == "sample",
                       not_after_done=s.phase == "cooldown")
            for i, (s, x) in enumerate(zip(slots, sent))]
    t0 = time.perf_counter()
    run = setup.simulator(session.load, arrival.seed).run(reqs, until=None if longest is None else longest.deadline)
    wall = time.perf_counter() - t0
    records = []
    for slot, o in zip(slots, run.outcomes):
        if not o.sent and slot.phase == "cooldown":
            continue  # never sent: the sample had ended
        r = RequestRecord(o.index, slot.offset, warmup=slot.phase != "sample", phase=slot.phase)
        r.prompt_len, r.output_len = slot.spec.prompt_len, slot.spec.output_len
        r.send_time = o.send_time
        if o.end_time is None:
            r.chunk_times = list(o.token_times)
            mark_cancelled(r, run.end_time)
        else:
            r.chunk_times, r.end_time = list(o.token_times), o.end_time
            r.status, r.error = o.status, o.error
            r.success = o.status == 200 and o.finish_reason in ("stop", "length")
            r.finish_reason = o.finish_reason
            r.prompt_tokens, r.output_tokens = o.prompt_tokens, o.output_tokens
            r.output_tokens_from_usage = True
        records.append(r)
    samples, history = run.samples, list[dict]()
    if window is not None:
        records, window, samples, history = _judge_looks(records, window, run.samples, run.end_time, slo,
                                                         thresholds, arrival)
    steps = sum(r["steps"] for r in run.replicas)
    beyond = sum(r["extrapolated_steps"] for r in run.replicas)
    if beyond:
        print(f"warning: {beyond} of {steps} simulated steps were larger than any the profile measured; "
              f"their cost is extrapolated (profile the shapes you simulate: docs/simulator.md)", file=sys.stderr)
    summary = summarize(records, slo)
    before = Snapshot({k: 0.0 for k in run.counters})
    after = Snapshot(dict(run.counters))
    result = PointResult(arrival, records, summary, samples, before, after, time.time(), window, history)
    summary["preemptions"] = result.preemptions
    summary["server_counters"] = result.counters
    summary["simulation"] = {"wall_seconds": wall, "simulated_seconds": run.end_time, "replicas": run.replicas,
                             "router": {"policy": setup.router, **run.router}}
    return result


def _judge_looks(records: list[RequestRecord], window: Window, samples: list[dict], end: float,
                 slo: SLO | None, thresholds: Thresholds | None, arrival: ArrivalConfig,
                 ) -> tuple[list[RequestRecord], Window, list[dict], list[dict]]:
    """The records, window and gauge samples as they stood at the look that decided the
    point (the first not undecided, or the last), and the earlier looks' verdicts."""
    looks = window.looks()
    history: list[dict] = []
    for k, w in enumerate(looks):
        sample = [r for r in records if w.phase(r.scheduled_time) == "sample"]
        ended = [r.end_time for r in sample if not (r.unfinished or r.cancelled)]
        # As a real point: the look is taken when its sample has ended, or at its deadline.
        now = max(ended) if sample and len(ended) == len(sample) else w.deadline
        now = min(now, w.deadline, end)
        done = [not (r.unfinished or r.cancelled) and r.end_time <= now for r in records]
        view = view_at(records, done, None, w, now)
        seen = [s for s in samples if s["t"] <= now]
        if k == len(looks) - 1 or slo is None or not slo.aggregate:
            return view, w, seen, history
        verdict = judge(view, w, slo, None, thresholds, seen, final=False)
        if not goes_on(verdict, arrival):
            return view, w, seen, history
        history.append(look_summary(verdict, w))
    raise AssertionError("unreachable: the last look returns")
