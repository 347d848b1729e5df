"""``inflight bench ... --simulate PROFILE.json``: the same runs without a server.

A simulated session has the real one's request mix (built with the model's own tokenizer,
so prompt lengths and prefix blocks are exact), and its target, a :class:`SimSetup`,
replays each point's schedule through the simulator (``sim_point.simulate_point``) and
returns the same ``PointResult`` a measured point has. The verdicts, capacity search,
``tune`` and reports then run unchanged.

The engine settings come from the server command (``--serve-cmd``, so ``tune``'s knobs
apply) parsed by ``inflight serve``'s own parser (which the command line hands in: a
:data:`ServeParser`), else from the profile.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import pathlib
import re
import shlex
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

from inflight.bench.datasets import DatasetConfig, RequestSpec, build_dataset
from inflight.bench.session import ArrivalConfig, LoadConfig, PointResult, Session
from inflight.bench.summary import SLO
from inflight.bench.sustain import Thresholds
from inflight.config import DEFAULT_MAX_NUM_WAITING, EngineConfig
from inflight.core.spec_config import SpeculativeConfig
from inflight.routing import ROUTERS, make_router
from inflight.sim.profile import StepProfile, load_profile, profile_warnings
from inflight.sim.sim_point import simulate_point
from inflight.sim.simulator import Simulator
from inflight.sim.virtual_replica import NO_ACCEPTANCE

# ``inflight serve``'s argument parser: its flags after ``serve`` -> the parsed Namespace
# (SystemExit on bad flags, as argparse).
ServeParser = Callable[[list[str]], argparse.Namespace]
MAX_REPLICAS = 1024


def parse_serve_command(command: str, parse_serve: ServeParser) -> tuple[EngineConfig, dict[str, Any]]:
    """The engine settings and server flags of an ``inflight serve ...`` command line,
    parsed by ``parse_serve`` (the server's own parser). ValueError when it is not one."""
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
            args = parse_serve(rest)
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

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {"simulated": True, "profile": self.profile.describe(), "profile_source": self.profile.source,
                "machine": self.profile.machine, "replicas": self.replicas, "router": self.router,
                "command": self.command, "num_kv_blocks": self.num_blocks, "max_model_len": self.max_model_len,
                "engine": {"max_num_seqs": c.max_num_seqs, "max_num_batched_tokens": c.max_num_batched_tokens,
                           "enable_chunked_prefill": c.enable_chunked_prefill,
                           "enable_prefix_caching": c.enable_prefix_caching, "block_size": c.block_size,
                           "batching_policy": c.batching_policy, "scheduling_policy": c.scheduling_policy,
                           "max_num_waiting": self.max_num_waiting}}

    def banner(self, session: Session) -> str:
        return (f"SIMULATED: {self.profile.describe()}, {self.replicas} replica(s)"
                f"{f' behind {self.router}' if self.replicas > 1 else ''}; engine from "
                f"{self.command or 'the profile'}; {len(session.specs)} requests prepared in "
                f"{session.prepare_seconds:.1f} s")

    async def run_point(self, session: Session, arrival: ArrivalConfig, slo: SLO | None,
                        thresholds: Thresholds | None) -> PointResult:
        return await simulate_point(self, session, arrival, slo, thresholds)


def _spec_key(spec: RequestSpec) -> tuple[str, int]:
    return (spec.as_text(), spec.output_len)


def sim_setup(profile_path: str, command: str | None, parse_serve: ServeParser, replicas: int = 1,
              router: str = "prefix_affinity") -> SimSetup:
    """Load the profile and resolve the engine settings (``command``'s, read by
    ``parse_serve``, else the profile's).

    Raises:
        ValueError: a bad profile, command, replica count or router; a speculating
            engine with a profile that has no acceptance rates.
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
    config, extra = _engine_settings(profile, command, parse_serve)
    if config.speculative_config is not None and profile.acceptance is None:
        raise ValueError(f"{profile_path}: {NO_ACCEPTANCE}")
    eng = profile.engine
    num_blocks, max_model_len = _kv_capacity(profile, config)
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


def _engine_settings(profile: StepProfile, command: str | None, parse_serve: ServeParser,
                     ) -> tuple[EngineConfig, dict[str, Any]]:
    """The engine config and server flags: ``command``'s, else the profile's. ValueError
    where the command's block size is not the profile's."""
    eng = profile.engine
    extra: dict[str, Any] = {"max_num_waiting": eng.get("max_num_waiting", DEFAULT_MAX_NUM_WAITING), "served_model_name": None}
    if command:
        config, extra = parse_serve_command(command, parse_serve)
    else:
        known = {k: v for k, v in eng.get("config", {}).items() if k in EngineConfig.__dataclass_fields__}
        if isinstance(known.get("speculative_config"), dict):  # saved by dataclasses.asdict
            known["speculative_config"] = SpeculativeConfig.from_dict(known["speculative_config"])
        config = EngineConfig(**known)
    dtype = eng.get("dtype")
    if command and config.dtype not in ("auto", dtype):
        print(f"warning: the profile was measured in {dtype}, the command asks for {config.dtype}: "
              f"step times are the profile's", file=sys.stderr)
    if config.block_size != eng.get("block_size", config.block_size):
        raise ValueError(f"the profile was measured with --block-size {eng['block_size']}, the command "
                         f"sets {config.block_size}: profile that block size")
    return config, extra


def _kv_capacity(profile: StepProfile, config: EngineConfig) -> tuple[int, int]:
    """(KV-cache blocks, max model length in tokens) of the simulated engine."""
    eng = profile.engine
    block_bytes = eng.get("kv_block_bytes")
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory_bytes is not None and block_bytes:
        num_blocks = config.kv_cache_memory_bytes // block_bytes
    else:
        num_blocks = int(eng["num_kv_blocks"])
    max_model_len = int(config.max_model_len or eng.get("max_model_len")
                        or profile.model.get("max_position_embeddings") or num_blocks * config.block_size)
    return num_blocks, max_model_len


async def open_sim_session(load: LoadConfig, dataset: DatasetConfig, setup: SimSetup) -> Session:
    """A :class:`Session` whose points are simulated on ``setup``."""
    t = time.perf_counter()
    counter = _Counter(setup.tokenizer)
    endpoint = load.endpoint or ("chat" if dataset.name == "chat" else "completions")
    specs = await build_dataset(dataset, counter, dataset.num_prompts + load.num_warmups)
    return Session(target=setup, client=None, load=load, dataset=dataset, model=load.model or setup.model_name,
                   endpoint=endpoint, tokenizer_mode=counter.mode, specs=specs[load.num_warmups:],
                   warmups=specs[:load.num_warmups], server_models=[], server_info={"simulation": setup.describe()},
                   prepare_seconds=time.perf_counter() - t, counter=counter)
