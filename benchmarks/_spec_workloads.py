"""What ``speculative.py`` sends and reads besides ``inflight bench serve``: the copy-heavy
chat prompts (built from ``vllm_sonnet.txt`` and the Azure trace's rows, seeded), the
speculative-decoding counters of a server (``GET /stats`` ``spec_decode``, else the
``*spec_decode_*`` Prometheus counters of ``GET /metrics``; nothing when the server has
neither), and how much CPU other processes took during a run.

Copy-heavy means the answer repeats long stretches of the prompt, where prompt-lookup
(n-gram) drafting (Saxena, "Prompt Lookup Decoding", 2023; vLLM's ``method: ngram``) finds
its drafts: "repeat exactly", "rewrite with one word changed", "rename one identifier in
this code", "repeat these CSV rows".
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import resource
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from inflight.bench.machine import HostMonitor

SONNET_LINES = 14
REPLACEMENTS = ("river", "lantern", "garden", "silver", "winter", "candle", "harbor", "meadow")


def _sonnets(data_dir: pathlib.Path) -> list[list[str]]:
    lines = [ln.rstrip() for ln in (data_dir / "vllm_sonnet.txt").read_text(encoding="utf-8").splitlines()
             if ln.strip()]
    return [lines[i:i + SONNET_LINES] for i in range(0, len(lines) - SONNET_LINES + 1, SONNET_LINES)]


def _passage(rng: random.Random, sonnets: list[list[str]]) -> tuple[int, list[str]]:
    n = rng.randrange(len(sonnets))
    count = rng.randint(4, 8)
    start = rng.randrange(SONNET_LINES - count + 1)
    return n + 1, [ln.strip() for ln in sonnets[n][start:start + count]]


def _repeat(rng: random.Random, sonnets: list[list[str]], trace: list[str]) -> str:
    _, lines = _passage(rng, sonnets)
    return "Repeat the following text exactly, line by line, with no other words:\n\n" + "\n".join(lines)


def _rewrite(rng: random.Random, sonnets: list[list[str]], trace: list[str]) -> str:
    _, lines = _passage(rng, sonnets)
    words = sorted({w.strip(",.;:!?'") for ln in lines for w in ln.split() if len(w.strip(",.;:!?'")) >= 5})
    old, new = rng.choice(words or ["beauty"]), rng.choice(REPLACEMENTS)
    return (f"Rewrite this paragraph with one change: replace the word \"{old}\" with \"{new}\". "
            "Keep everything else exactly the same.\n\n" + " ".join(lines))


def _code(rng: random.Random, sonnets: list[list[str]], trace: list[str]) -> str:
    n, lines = _passage(rng, sonnets)
    body = "\n".join(f"        {json.dumps(ln)}," for ln in lines)
    code = (f"def sonnet_{n}(numbered=False):\n    lines = [\n{body}\n    ]\n"
            "    if numbered:\n        return [f\"{i + 1}. {line}\" for i, line in enumerate(lines)]\n"
            "    return lines\n")
    return (f"Rewrite this Python code with one change: rename the function sonnet_{n} to verse_{n}. "
            f"Keep everything else exactly the same.\n\n```python\n{code}```")


def _csv(rng: random.Random, sonnets: list[list[str]], trace: list[str]) -> str:
    start = rng.randrange(1, max(2, len(trace) - 8))
    rows = [trace[0]] + trace[start:start + rng.randint(4, 7)]
    return "Repeat the following CSV rows exactly, with no other words:\n\n" + "\n".join(rows)


KINDS = (_repeat, _rewrite, _code, _csv)


def copy_prompts(data_dir: pathlib.Path, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` copy-heavy chat prompts, ``{"prompt": text, "kind": name}``, the four kinds in
    turn, passages drawn with ``seed``. Raises FileNotFoundError without ``vllm_sonnet.txt``
    or the Azure conversation trace in ``data_dir``."""
    rng = random.Random(seed)
    sonnets = _sonnets(data_dir)
    trace = (data_dir / "azure_llm_2023_conv_1815-1900.csv").read_text(encoding="utf-8").splitlines()
    return [{"prompt": KINDS[i % len(KINDS)](rng, sonnets, trace), "kind": KINDS[i % len(KINDS)].__name__[1:]}
            for i in range(n)]


def write_copy_jsonl(path: pathlib.Path, data_dir: pathlib.Path, n: int, seed: int = 0) -> pathlib.Path:
    """The prompts as a JSONL of ``{"prompt": ...}`` lines (``bench serve --chat-file``)."""
    path.write_text("".join(json.dumps(p) + "\n" for p in copy_prompts(data_dir, n, seed)), encoding="utf-8")
    return path


# ---------------------------------------------------------------- speculative counters

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _get(url: str, timeout: float = 5.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return str(r.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None


def _from_stats(text: str | None) -> dict[str, Any] | None:
    try:
        spec = json.loads(text or "null").get("spec_decode") if text else None
    except (ValueError, AttributeError):
        return None
    if not isinstance(spec, dict) or not all(k in spec for k in COUNTERS):
        return None
    return {**{k: float(spec[k]) for k in COUNTERS},
            "accepted_per_position": [float(x) for x in spec.get("accepted_per_position") or []],
            "source": "/stats"}


def _from_metrics(text: str | None) -> dict[str, Any] | None:
    """vLLM's ``vllm:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total`` and
    ``..._num_accepted_tokens_per_pos_total{position=i}``, under any prefix (``inflight:``)."""
    if not text:
        return None
    out: dict[str, Any] = {}
    per_pos: dict[int, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                name = s.name.rsplit(":", 1)[-1].removesuffix("_total")
                if not name.startswith("spec_decode_") or s.name.endswith("_created"):
                    continue
                key = name.removeprefix("spec_decode_")
                if key == "num_accepted_tokens_per_pos" and "position" in s.labels:
                    pos = int(s.labels["position"])
                    per_pos[pos] = per_pos.get(pos, 0.0) + float(s.value)
                elif key in COUNTERS:
                    out[key] = out.get(key, 0.0) + float(s.value)
    except ValueError:
        return None
    if not all(k in out for k in COUNTERS):
        return None
    out["accepted_per_position"] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)] if per_pos else []
    out["source"] = "/metrics"
    return out


def spec_counters(base_url: str) -> dict[str, Any] | None:
    """The server's speculative-decoding counters since start (``num_drafts``,
    ``num_draft_tokens``, ``num_accepted_tokens``, ``accepted_per_position`` list, ``source``),
    or None when it reports none (speculation off, or a build without them)."""
    return _from_stats(_get(base_url + "/stats")) or _from_metrics(_get(base_url + "/metrics"))


def spec_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a run added: counter growth, ``acceptance_rate`` (accepted / drafted tokens),
    ``mean_acceptance_length`` (1 + accepted / drafts: tokens per verification, vLLM's
    figure) and ``accepted_per_position`` as fractions of drafts (position i accepted in
    that share of verifications). None without both scrapes."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in COUNTERS}
    a, b = after["accepted_per_position"], before["accepted_per_position"]
    pos = [a[i] - (b[i] if i < len(b) else 0.0) for i in range(len(a))]
    drafts, tokens = d["num_drafts"], d["num_draft_tokens"]
    return {**d, "acceptance_rate": d["num_accepted_tokens"] / tokens if tokens else None,
            "mean_acceptance_length": 1 + d["num_accepted_tokens"] / drafts if drafts else None,
            "accepted_per_position": [round(x / drafts, 4) for x in pos] if drafts else [],
            "source": after["source"]}


# ---------------------------------------------------------------- host noise

class RunNoise:
    """The host during one measured run: the 1-minute load average before and after, and
    the cores' worth of CPU taken by processes other than this script, the server
    (``server_pid``'s tree) and the bench client (a waited-for child: ``RUSAGE_CHILDREN``)."""

    def __init__(self, server_pid: int | None) -> None:
        self.load_before = _load1()
        self._children0 = _children_cpu_s()
        self._monitor = HostMonitor([server_pid] if server_pid else []).start()

    def stop(self) -> dict[str, Any]:
        load = self._monitor.stop()
        client_s = _children_cpu_s() - self._children0
        out: dict[str, Any] = {"loadavg1_before": self.load_before, "loadavg1_after": _load1()}
        if load is not None:
            out["others_cores"] = round(max(0.0, load.others_cores - client_s / max(load.seconds, 1e-9)), 3)
            out["steal"] = round(load.steal, 4)
        return out


def _load1() -> float:
    return round(os.getloadavg()[0], 2)


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_quiet(max_load: float, timeout_s: float) -> float:
    """Waits (at most ``timeout_s``) for the 1-minute load average to fall to ``max_load``;
    returns it. 0 or less for either: no wait."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    while max_load > 0 and _load1() > max_load and time.monotonic() < deadline:
        time.sleep(5)
    return _load1()
