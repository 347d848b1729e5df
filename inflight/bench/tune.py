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

from inflight.bench.subcommands import (_args_json, _header, calibration, configs, connector, require_aggregate,
                                     search_space, thresholds)
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


# Spellings of one flag, the first the one written where a command has none: llama.cpp's
# llama-server (common/arg.cpp) and vLLM's short forms. A knob named by any of them (without
# its dashes: ``parallel``, ``np``) sets the flag in whichever spelling the command uses.
FLAG_SPELLINGS: tuple[tuple[str, ...], ...] = (
    # llama-server
    ("--parallel", "-np"), ("--ctx-size", "-c"), ("--batch-size", "-b"), ("--ubatch-size", "-ub"),
    ("--threads", "-t"), ("--threads-batch", "-tb"), ("--n-gpu-layers", "--gpu-layers", "-ngl"),
    ("--flash-attn", "-fa"), ("--cache-type-k", "-ctk"), ("--cache-type-v", "-ctv"),
    ("--defrag-thold", "-dt"), ("--cache-ram", "-cram"), ("--ctx-checkpoints", "--swa-checkpoints", "-ctxcp"),
    ("--slot-prompt-similarity", "-sps"), ("--model", "-m"), ("--timeout", "-to"),
    ("--cont-batching", "-cb"), ("--no-cont-batching", "-nocb"),
    ("--kv-unified", "-kvu"), ("--no-kv-unified", "-no-kvu"),
    # vLLM
    ("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp"), ("--data-parallel-size", "-dp"),
    ("--quantization", "-q"),
)
# Flags that take on/off as a value (``-fa on``), not as a switch (``--flag`` / ``--no-flag``).
ON_OFF_VALUES = {"--flash-attn"}
# Where a server listens without --port: only llama-server differs from --base-url's 8000.
DEFAULT_PORTS = {"llama-server": 8080}


def parse_knob(text: str) -> tuple[str, list[str]]:
    """``"max-num-seqs=8,16"`` (or ``--max-num-seqs=...``) -> ``("max-num-seqs", ["8", "16"])``.
    A short name that :data:`FLAG_SPELLINGS` knows, bare or with its dash, gives its long
    name (``np=8,16`` and ``-np=8,16`` -> ``"parallel"``); another one-dash name stays a
    short flag (``-x=1,2`` -> ``"-x"``)."""
    name, sep, values = text.partition("=")
    name = name.strip()
    name = name[2:] if name.startswith("--") else name
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not name.lstrip("-") or not vals:
        raise ValueError(f"bad --knob {text!r}: expected NAME=V1,V2,... (e.g. max-num-seqs=8,16,32)")
    first = spellings(name)[0]
    return (first[2:] if first.startswith("--") else first), vals


def spellings(name: str) -> tuple[str, ...]:
    """Every spelling of the flag a knob ``name`` names, the one to write first: ``parallel``
    and ``np`` give ``("--parallel", "-np")``; an unknown ``x`` gives ``("--x",)``, ``-x``
    ``("-x",)``."""
    flag = name if name.startswith("-") else f"--{name}"
    candidates = [flag] if name.startswith("-") else [flag, f"-{name}"]
    for c in candidates:
        for group in FLAG_SPELLINGS:
            if c in group:
                return group
    return (flag,)


def _negatives(spell: tuple[str, ...]) -> tuple[str, ...]:
    """The spellings of a switch's negative form (``--no-cont-batching``, ``-nocb``)."""
    if not spell[0].startswith("--"):
        return ()
    neg = "--no-" + spell[0][2:]
    return next((g for g in FLAG_SPELLINGS if neg in g), (neg,))


def _is_flag(token: str) -> bool:
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)  # a negative number is a value
    except ValueError:
        return True
    return False


def _find(tokens: list[str], spell: tuple[str, ...], neg: tuple[str, ...]) -> list[tuple[int, str, str | None, bool]]:
    """Each occurrence of the flag: (index, spelling, value written with ``=`` or None, negative)."""
    out = []
    for i, t in enumerate(tokens):
        head, eq, val = t.partition("=")
        if head in spell or head in neg:
            out.append((i, head, val if eq else None, head in neg))
    return out


def _takes_on_off(tokens: list[str], spell: tuple[str, ...], neg: tuple[str, ...]) -> bool:
    """Whether on/off is this flag's value (``-fa on``) rather than a switch."""
    if spell[0] in ON_OFF_VALUES:
        return True
    for i, head, val, negative in _find(tokens, spell, neg):
        if negative:
            continue
        nxt = val if val is not None else (tokens[i + 1] if i + 1 < len(tokens) else None)
        if nxt is not None and nxt.lower() in (*BOOL_VALUES, "auto"):
            return True
    return False


def set_flag(tokens: list[str], name: str, value: str) -> list[str]:
    """``tokens`` with the flag ``name`` (any of its :func:`spellings`) set to ``value``: an
    existing ``--name v`` / ``--name=v`` / ``-short v`` (or, for a switch set on/off,
    ``--name`` / ``--no-name`` and their short forms) replaced where it stands, in the
    spelling the command uses, later duplicates dropped; else ``--name value`` appended.
    Setting the value a command already has gives the same command, so its points are
    reused."""
    spell = spellings(name)
    neg = _negatives(spell)
    is_bool = value.lower() in BOOL_VALUES and not _takes_on_off(tokens, spell, neg)
    found = _find(tokens, spell, neg if is_bool else ())
    drop: set[int] = set()
    out = list(tokens)
    on = BOOL_VALUES.get(value.lower(), True)
    if not found:
        if is_bool:
            return out + ([spell[0]] if on else [neg[0]] if neg else [])  # no negative form: off is absent
        return out + [spell[0], value]
    for i, head, val, negative in found:
        if not is_bool and val is None and i + 1 < len(tokens) and not _is_flag(tokens[i + 1]):
            drop.add(i + 1)  # the value written after the flag
    i0, head0, _, neg0 = found[0]
    if is_bool:
        group = spell if on else neg  # in the command's spelling: -cb -> -nocb, --x -> --no-x
        k = (neg if neg0 else spell).index(head0)
        new = [group[min(k, len(group) - 1)]] if group else []
    else:
        new = [head0, value]
    drop |= {i for i, *_ in found[1:]}
    result: list[str] = []
    for i, t in enumerate(out):
        if i == i0:
            result += new
        elif i not in drop:
            result.append(t)
    return result


def flag_value(tokens: list[str], name: str) -> str | None:
    """The value ``tokens`` give the flag ``name`` (any of its :func:`spellings`; ``on``/``off``
    for a switch), or None."""
    spell = spellings(name)
    for i, head, val, negative in _find(tokens, spell, _negatives(spell)):
        if negative:
            return "off"
        if val is not None:
            return val
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        return nxt if nxt is not None and not _is_flag(nxt) else "on"
    return None


def check_port(tokens: list[str], base_url: str) -> None:
    """The server command must listen where the client sends (ValueError otherwise): its
    ``--port``, or where it listens without one (llama-server: 8080)."""
    port = flag_value(tokens, "port")
    if port is None:
        port = next((str(DEFAULT_PORTS[pathlib.PurePath(t).name]) for t in tokens
                     if pathlib.PurePath(t).name in DEFAULT_PORTS), None)
        if port is not None and urlparse(base_url).port != int(port):
            raise ValueError(f"--serve-cmd listens on port {port} (no --port given) but --base-url is "
                             f"{base_url}; give the server --port")
        return
    want = urlparse(base_url).port
    if want is not None and int(port) != want:
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
                served, predict, pids = command, None, None
                if getattr(args, "calibrate", False):
                    served, predict, pids = calibration(args, command, load, dataset, base, slo, space, th, label)
                res = await find_limit(connector(args, load, dataset, stack, served, label, pids), base, slo,
                                       space, th, label=label, cache=state.cache(command), hold=hold,
                                       predictor=predict)
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
