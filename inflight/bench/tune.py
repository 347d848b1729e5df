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
from typing import Any

from inflight.bench.connect import Run, calibration, connector, header
from inflight.bench.knob_flags import check_port, flag_value, set_flag
from inflight.bench.limit import LimitResult, Predictor, find_limit, limit_line
from inflight.bench.machine import describe_machine
from inflight.bench.report import write_json
from inflight.bench.report_page import write_report
from inflight.bench.vllm_compat import SAMPLING_FLAGS

STATE_FILE = "tune-state.json"
# Flags that change how the run is reported or supervised, not what a point measures.
_NOT_FINGERPRINT = {"knob", "fresh", "report", "disable_tqdm", "server_log_dir", "server_start_timeout",
                    "server_stop_timeout", "save_result", "plot", "serve_cmd", "bench_command",
                    # vLLM's spellings: what they set is folded into the flags above (vllm_compat)
                    "host", "port", "endpoint", "served_model_name", "dataset_name", "dataset_path",
                    "custom_output_len", "skip_chat_template", "random_prefix_len", "goodput",
                    "percentile_metrics", "metric_percentiles", "result_dir", "result_filename", "label",
                    "metadata", "save_detailed", *SAMPLING_FLAGS}


class TuneState:
    """The saved points of a tune run: ``{"fingerprint", "configs": {command: {"fixed", "points"}}}``."""

    def __init__(self, path: pathlib.Path, fingerprint: dict[str, Any], fresh: bool) -> None:
        self.path = path
        self.data: dict[str, Any] = {"fingerprint": fingerprint, "configs": {}}
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

    def __init__(self, state: TuneState, entry: dict[str, Any]) -> None:
        self._state, self._entry = state, entry

    @property
    def fixed(self) -> dict[str, Any] | None:
        fixed: dict[str, Any] | None = self._entry["fixed"]
        return fixed

    @fixed.setter
    def fixed(self, value: dict[str, Any] | None) -> None:
        self._entry["fixed"] = value

    @staticmethod
    def _key(repeat: int, load: float, held: bool) -> str:
        return f"{repeat}:{'hold:' if held else ''}{load!r}"

    def get(self, repeat: int, load: float, held: bool = False) -> dict[str, Any] | None:
        point: dict[str, Any] | None = self._entry["points"].get(self._key(repeat, load, held))
        return point

    def put(self, repeat: int, load: float, point: dict[str, Any], fixed: dict[str, Any],
            held: bool = False) -> None:
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
        return float(1 / m if by_scale else m)
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


async def tune(run: Run) -> int:
    config = run.config
    assert config.space is not None and config.server.serve_cmd is not None
    knobs = config.knobs
    repeated = sorted({n for n, _ in knobs if [m for m, _ in knobs].count(n) > 1})
    if repeated:
        raise ValueError(f"--knob {', '.join(repeated)} given more than once: list its values in one --knob")
    base_tokens = shlex.split(config.server.serve_cmd)
    if "{value}" in config.server.serve_cmd:
        raise ValueError("tune's --serve-cmd is the base command itself (no {value}); knobs come from --knob")
    check_port(base_tokens, config.load.base_url)
    assert config.output.report is not None
    out = pathlib.Path(config.output.report)
    fingerprint = {k: v for k, v in config.recorded.items() if k not in _NOT_FINGERPRINT}
    tuner = _Tuner(run, TuneState(out / STATE_FILE, fingerprint, config.fresh))
    machine_start = describe_machine()
    current = list(base_tokens)
    steps = []
    for name, values in knobs:
        step, current = await tuner.knob(name, values, current)
        steps.append(step)
    final = await tuner.limit_of(current, "recommended", hold=True)
    doc = {**header(config, "tune"), "simulated": run.simulated, "slo": config.slo.to_json(),
           "search": "time_scale" if config.space.by_scale else "rate",
           "hold_duration": config.space.hold_duration, "arrival": config.arrival.describe(), "thresholds": config.thresholds.__dict__.copy(),
           "base_command": config.server.serve_cmd, "knobs": steps,
           "recommended": {"command": shlex.join(current), **final.to_json()},
           "machine": {"start": machine_start, "end": describe_machine()}}
    write_json(out / "tune.json", doc)
    path = write_report(out, doc)
    print(f"recommended: {shlex.join(current)}")
    print(limit_line(final, config.space.by_scale))
    print(f"report: {path}")
    return 0 if final.spread["found"] else 1


class _Tuner:
    """The configurations a tune run measures, each once (its saved points replayed)."""

    def __init__(self, run: Run, state: TuneState) -> None:
        self.run, self.state = run, state
        self.measured: dict[tuple[str, bool], LimitResult] = {}

    async def knob(self, name: str, values: tuple[str, ...], current: list[str]) -> tuple[dict[str, Any], list[str]]:
        """Measure each value of knob ``name`` on the ``current`` command; keep the best. The
        step as saved, and the command with the best value set."""
        assert self.run.config.space is not None
        results = {}
        for v in values:
            results[v] = await self.limit_of(set_flag(current, name, v), f"{name}={v}")
        before = flag_value(current, name)
        best = choose(results, before, self.run.config.space.by_scale)
        unit = "time scale" if self.run.config.space.by_scale else "req/s"
        why = [why_lost(name, v, results[v], best, results[best], unit) for v in values]
        step = {"knob": name, "base_value": before, "best": best,
                "values": [{**results[v].to_json(), "value": v} for v in values], "why": why}
        print(f"knob {name}: best {best}", file=sys.stderr)
        for line in why:
            print(f"    {line}", file=sys.stderr)
        return step, set_flag(current, name, best)

    async def limit_of(self, tokens: list[str], label: str, hold: bool = False) -> LimitResult:
        """The configuration's limit: its searches only (knob values are ranked on those),
        or, for the recommendation, with each search's limit held (capacity.hold)."""
        command = shlex.join(tokens)
        if (command, hold) not in self.measured:
            print(f"\n--- {label}: {command}", file=sys.stderr)
            plan = self.run.config.plan()
            async with contextlib.AsyncExitStack() as stack:
                served: str | None = command
                predict: Predictor | None = None
                pids: list[int] | None = None
                if self.run.config.server.calibrate:
                    served, predict, pids = calibration(self.run, command, label)
                res = await find_limit(connector(self.run, stack, served, label, pids), plan.base, plan.slo,
                                       plan.space, plan.thresholds, label=label, cache=self.state.cache(command),
                                       hold=hold, predictor=predict)
            res.command = command
            self.measured[(command, hold)] = res
            print(limit_line(res, plan.space.by_scale), file=sys.stderr)
        return self.measured[(command, hold)]
