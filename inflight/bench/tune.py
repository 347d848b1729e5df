"""``inflight bench tune``: the operating limit, one server knob at a time.

Coordinate search over server flags (``--knob max-num-seqs=8,16,32 --knob
max-num-batched-tokens=128,256,512``): for each knob in the order given, start the base
server command with that knob set to each value in turn (every other knob at its best so
far), find each configuration's operating limit (``limit.find_limit``: sustained points,
SLO statistics with confidence), keep the value with the highest limit and move on. A tie
goes to the value that uses clearly less of its tightest target at that load, else keeps
the value the configuration already had (``choose``). Values are ranked on
their searches' limits; the recommended configuration's limit is then held
(``--hold-duration``, see ``capacity``) and reported as held.

Every measured point is saved to ``DIR/tune-state.json`` as it completes, keyed by the full
server command, the repeat and the load. A killed run started again with the same flags
replays the saved points (no server is started for a configuration whose points are all
saved) and measures only what is missing; ``--fresh`` starts over. The report
(``report_page.write_report``) and ``tune.json`` are written at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shlex
import sys
from urllib.parse import urlparse

from inflight.bench.commands import (_args_json, _header, configs, connector, require_aggregate, search_space,
                                     thresholds)
from inflight.bench.limit import LimitResult, find_limit, limit_line
from inflight.bench.machine import describe_machine
from inflight.bench.report import write_json
from inflight.bench.report_page import write_report
from inflight.bench.vllm_compat import SAMPLING_FLAGS

BOOL_VALUES = {"on": True, "true": True, "yes": True, "off": False, "false": False, "no": False}
STATE_FILE = "tune-state.json"
# Flags that change how the run is reported or supervised, not what a point measures.
_NOT_FINGERPRINT = {"knob", "fresh", "report", "disable_tqdm", "server_log_dir", "server_start_timeout",
                    "server_stop_timeout", "save_result", "plot", "serve_cmd", "bench_command",
                    # vLLM's spellings: what they set is folded into the flags above (vllm_compat)
                    "host", "port", "endpoint", "served_model_name", "dataset_name", "dataset_path",
                    "custom_output_len", "skip_chat_template", "random_prefix_len", "goodput",
                    "percentile_metrics", "metric_percentiles", "result_dir", "result_filename", "label",
                    "metadata", "save_detailed", *SAMPLING_FLAGS}


def parse_knob(text: str) -> tuple[str, list[str]]:
    """``"max-num-seqs=8,16"`` (or ``--max-num-seqs=...``) -> ``("max-num-seqs", ["8", "16"])``."""
    name, sep, values = text.partition("=")
    name = name.strip().lstrip("-")
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not name or not vals:
        raise ValueError(f"bad --knob {text!r}: expected NAME=V1,V2,... (e.g. max-num-seqs=8,16,32)")
    return name, vals


def set_flag(tokens: list[str], name: str, value: str) -> list[str]:
    """``tokens`` with ``--name value`` set: an existing ``--name v`` / ``--name=v`` (or, for
    booleans, ``--name`` / ``--no-name``) replaced where it stands, else appended. Setting
    the value a command already has gives the same command, so its points are reused."""
    flag, neg = f"--{name}", f"--no-{name}"
    is_bool = value.lower() in BOOL_VALUES
    new = [flag if BOOL_VALUES[value.lower()] else neg] if is_bool else [flag, value]
    out, i, placed = [], 0, False
    while i < len(tokens):
        t = tokens[i]
        hit = 0
        if t == flag and not is_bool and i + 1 < len(tokens):
            hit = 2
        elif t.startswith(flag + "=") or (is_bool and t in (flag, neg)):
            hit = 1
        if hit:
            out += [] if placed else new
            placed, i = True, i + hit
            continue
        out.append(t)
        i += 1
    return out if placed else out + new


def flag_value(tokens: list[str], name: str) -> str | None:
    """The value ``tokens`` give ``--name`` (``on``/``off`` for a boolean), or None."""
    flag = f"--{name}"
    for i, t in enumerate(tokens):
        if t == f"--no-{name}":
            return "off"
        if t.startswith(flag + "="):
            return t.split("=", 1)[1]
        if t == flag:
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            return nxt if nxt is not None and not nxt.startswith("--") else "on"
    return None


def check_port(tokens: list[str], base_url: str) -> None:
    """The server command must listen where the client sends (ValueError otherwise)."""
    port = flag_value(tokens, "port")
    want = urlparse(base_url).port
    if port is not None and want is not None and int(port) != want:
        raise ValueError(f"--serve-cmd listens on port {port} but --base-url is {base_url}")


class TuneState:
    """The saved points of a tune run: ``{"fingerprint", "configs": {command: {"fixed", "points"}}}``."""

    def __init__(self, path: pathlib.Path, fingerprint: dict, fresh: bool) -> None:
        self.path = path
        self.data = {"fingerprint": fingerprint, "configs": {}}
        if path.exists() and not fresh:
            old = json.loads(path.read_text())
            if old.get("fingerprint") != fingerprint:
                diff = sorted(k for k in set(fingerprint) | set(old.get("fingerprint", {}))
                              if fingerprint.get(k) != old.get("fingerprint", {}).get(k))
                raise ValueError(f"{path} was saved by a run with other settings ({', '.join(diff)}); "
                                 f"use --fresh to start over or another --report folder")
            self.data = old

    def cache(self, command: str) -> "ConfigCache":
        return ConfigCache(self, self.data["configs"].setdefault(command, {"fixed": None, "points": {}}))

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, default=str))
        os.replace(tmp, self.path)


class ConfigCache:
    """One configuration's saved points (``limit.PointCache``)."""

    def __init__(self, state: TuneState, entry: dict) -> None:
        self._state, self._entry = state, entry

    @property
    def fixed(self) -> dict | None:
        return self._entry["fixed"]

    @staticmethod
    def _key(repeat: int, load: float, held: bool) -> str:
        return f"{repeat}:{'hold:' if held else ''}{load!r}"

    def get(self, repeat: int, load: float, held: bool = False) -> dict | None:
        return self._entry["points"].get(self._key(repeat, load, held))

    def put(self, repeat: int, load: float, point: dict, fixed: dict, held: bool = False) -> None:
        self._entry["points"][self._key(repeat, load, held)] = point
        self._entry["fixed"] = self._entry["fixed"] or fixed
        self._state.save()


def _mean_limit(res: LimitResult) -> float:
    m = res.spread["mean"]
    return -1.0 if m is None else m


TIE_MARGIN = 0.1  # a tied value must use 10 % less of its tightest target to replace another


def slo_usage(res: LimitResult) -> float:
    """The tightest target's use at the limit: max over the SLO statistics of the upper end
    of the 95 % interval / the target at ``res.best_point`` (1.0 = at the target). Infinite
    without a passing point."""
    p = res.best_point
    slo = ((p or {}).get("evidence") or {}).get("slo") or {}
    ratios = [float(iv["hi"]) / iv["target"] for iv in slo.values() if iv.get("target")]
    return max(ratios) if ratios else float("inf")


def choose(results: dict[str, LimitResult], current: str | None, by_scale: bool) -> str:
    """The value with the highest limit (the smallest time scale for trace replay). Values
    tied at it (same load, same arrivals) are told apart by the room they leave under the
    SLO there (:func:`slo_usage`): the one with the least use wins when it uses at least
    ``TIE_MARGIN`` less than ``current`` (else the first listed); otherwise ``current``
    stays, since a small difference between two servers measured minutes apart is noise."""
    def score(v: str) -> float:
        m = results[v].spread["mean"]
        if m is None:
            return -float("inf")
        return 1 / m if by_scale else m
    best = max(score(v) for v in results)
    tied = [v for v in results if score(v) == best]
    keep = current if current in tied else tied[0]
    roomiest = min(tied, key=lambda v: slo_usage(results[v]))
    if slo_usage(results[roomiest]) < (1 - TIE_MARGIN) * slo_usage(results[keep]):
        return roomiest
    return keep


def why_lost(name: str, value: str, res: LimitResult, best: str, best_res: LimitResult, unit: str) -> str:
    """One line: how a value compared with the chosen one, and what broke above its limit."""
    if value == best:
        return f"{name}={value}: chosen"
    m, b = res.spread["mean"], best_res.spread["mean"]
    if m is None:
        first = min(res.curve, key=lambda p: p["load"], default=None)
        reasons = "; ".join(first["reasons"]) if first else "not measured"
        return f"{name}={value}: no load passed (lowest tried: {reasons})"
    causes = ", ".join(res.lost_because()) or "not bounded: the highest load tried still passed"
    if m == b:
        use, best_use = slo_usage(res), slo_usage(best_res)
        return (f"{name}={value}: tied at {m:.4g} {unit} with {best} (tightest target used there: "
                f"{use:.0%} vs {best_use:.0%}); above it: {causes}")
    return f"{name}={value}: {m:.4g} {unit} vs {b:.4g} for {best}; above its limit: {causes}"


async def tune(args) -> int:
    load, dataset, base, slo = configs(args)
    require_aggregate(slo)
    space, th = search_space(args, base), thresholds(args)
    knobs = [parse_knob(k) for k in args.knob]
    repeated = sorted({n for n, _ in knobs if [m for m, _ in knobs].count(n) > 1})
    if repeated:
        raise ValueError(f"--knob {', '.join(repeated)} given more than once: list its values in one --knob")
    base_tokens = shlex.split(args.serve_cmd)
    if "{value}" in args.serve_cmd:
        raise ValueError("tune's --serve-cmd is the base command itself (no {value}); knobs come from --knob")
    check_port(base_tokens, args.base_url)
    out = pathlib.Path(args.report)
    fingerprint = {k: v for k, v in _args_json(args).items() if k not in _NOT_FINGERPRINT}
    state = TuneState(out / STATE_FILE, fingerprint, args.fresh)
    unit = "time scale" if space.by_scale else "req/s"
    machine_start = describe_machine()

    measured: dict[tuple[str, bool], LimitResult] = {}

    async def limit_of(tokens: list[str], label: str, hold: bool = False) -> LimitResult:
        """The configuration's limit: its searches only (knob values are ranked on those),
        or, for the recommendation, with each search's limit held (capacity.hold)."""
        command = shlex.join(tokens)
        if (command, hold) not in measured:
            print(f"\n--- {label}: {command}", file=sys.stderr)
            async with contextlib.AsyncExitStack() as stack:
                res = await find_limit(connector(args, load, dataset, stack, command, label), base, slo, space,
                                       th, label=label, cache=state.cache(command), hold=hold)
            res.command = command
            measured[(command, hold)] = res
            print(limit_line(res, space.by_scale), file=sys.stderr)
        return measured[(command, hold)]

    current = list(base_tokens)
    steps = []
    for name, values in knobs:
        results = {}
        for v in values:
            results[v] = await limit_of(set_flag(current, name, v), f"{name}={v}")
        before = flag_value(current, name)
        best = choose(results, before, space.by_scale)
        current = set_flag(current, name, best)
        steps.append({"knob": name, "base_value": before, "best": best,
                      "values": [{**results[v].to_json(), "value": v} for v in values],
                      "why": [why_lost(name, v, results[v], best, results[best], unit) for v in values]})
        print(f"knob {name}: best {best}", file=sys.stderr)
        for line in steps[-1]["why"]:
            print(f"    {line}", file=sys.stderr)
    final = await limit_of(current, "recommended", hold=True)
    doc = {**_header(args, "tune"), "simulated": bool(getattr(args, "simulate", None)), "slo": slo.to_json(), "search": "time_scale" if space.by_scale else "rate",
           "arrival": base.describe(), "thresholds": th.__dict__.copy(), "base_command": args.serve_cmd,
           "knobs": steps, "recommended": {"command": shlex.join(current), **final.to_json()},
           "machine": {"start": machine_start, "end": describe_machine()}}
    write_json(out / "tune.json", doc)
    path = write_report(out, doc)
    print(f"recommended: {shlex.join(current)}")
    print(limit_line(final, space.by_scale))
    print(f"report: {path}")
    return 0 if final.spread["found"] else 1
