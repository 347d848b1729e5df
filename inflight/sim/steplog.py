"""Step logs: a serving engine's steps as they ran, to fit a profile from real serving.

``inflight serve --step-log FILE.jsonl`` writes a header line (engine settings and model
shapes, as ``inflight profile`` saves them) and then, after every step, the step's shape
(:class:`~inflight.sim.step_shape.StepShape`), the time it was published and how often the
engine loop had waited so far. ``inflight profile --from-step-log FILE.jsonl`` fits a
profile from them: a step's duration is the time from the previous step's publication to
its own, kept only where the loop did not wait in between, so it is the whole iteration of
the engine thread under serving conditions (command drain, step, delivery to the event
loop, metrics), with the HTTP server and its clients on the same cores. An offline
``inflight profile`` misses that cost; docs/simulator.md measures how much it is.

A speculating engine's log also holds, about once a second, a line
``{"spec_decode": {num_drafts, num_draft_tokens, num_accepted_tokens,
accepted_per_position}}``: its ``SpecDecodeStats`` so far, from which the fitted profile
takes its acceptance rates (:mod:`inflight.sim.acceptance`).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any, TextIO

from inflight.sim.acceptance import add_stats, stats_json
from inflight.sim.step_shape import StepShape

STEP_LOG_KIND = "inflight-step-log"
FLUSH_EVERY_S = 1.0


class StepLog:
    """A step listener for ``AsyncEngine`` (``listener(stats, outputs, now)``) that writes
    the step log. ``close()`` flushes it."""

    def __init__(self, path: str | pathlib.Path, async_engine: Any, max_num_waiting: int | None,
                 header: dict[str, Any] | None = None) -> None:
        if header is None:  # a model engine: its settings and shapes, as profiles save them
            from inflight.sim.measure import engine_header
            header = engine_header(async_engine.engine, max_num_waiting)
        self._engine = async_engine
        self._file: TextIO = open(path, "w", buffering=1 << 16)
        self._file.write(json.dumps({"kind": STEP_LOG_KIND, **header}) + "\n")
        self._last_plan: Any = None
        self._flushed = 0.0
        self._spec_written = 0  # verifications counted in the last spec_decode line

    def __call__(self, stats: Any, outputs: Any, now: float) -> None:
        plan = self._engine.engine.last_plan
        if plan is None or plan is self._last_plan:
            return  # this iteration ran no step
        self._last_plan = plan
        s = StepShape.of(plan.scheduled)
        self._file.write(f"[{now:.6f},{self._engine.num_waits},{s.tokens},{s.rows},{s.samples},"
                         f"{s.prefill_tokens},{s.decode_context},{s.prefill_pairs}]\n")
        if now - self._flushed >= FLUSH_EVERY_S:  # readable while serving (bench capacity --calibrate)
            self._write_spec_stats()
            self._file.flush()
            self._flushed = now

    def _write_spec_stats(self) -> None:
        """The engine's speculation counters, when it speculates and they moved."""
        spec = getattr(getattr(self._engine.engine, "scheduler", None), "speculation", None)
        if spec is not None and spec.stats.num_drafts != self._spec_written:
            self._spec_written = spec.stats.num_drafts
            self._file.write(json.dumps({"spec_decode": stats_json(spec.stats)}) + "\n")

    def close(self) -> None:
        self._write_spec_stats()
        self._file.close()


def read_step_logs(paths: Sequence[str | pathlib.Path], max_gap_s: float = 60.0,
                   ) -> tuple[dict[str, Any], list[StepShape], list[float]]:
    """``(header, shapes, seconds)`` of the back-to-back steps of one or more step logs
    (the first file's header, with ``"spec_decode"``: the speculation counters, each
    file's last summed, where any file has them). ValueError for a file that is not a
    step log."""
    header: dict[str, Any] | None = None
    shapes: list[StepShape] = []
    seconds: list[float] = []
    spec: dict[str, Any] | None = None
    for path in paths:
        if pathlib.Path(path).is_dir():
            raise ValueError(f"{path}: a directory, not a step log")
        with open(path) as f:
            try:
                first = json.loads(f.readline() or "{}")
            except ValueError:
                first = {}
            if not isinstance(first, dict) or first.get("kind") != STEP_LOG_KIND:
                raise ValueError(f"{path}: not an inflight step log (inflight serve --step-log)")
            header = header or first
            prev: list[float] | None = None
            last_spec: dict[str, Any] | None = None
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    break  # a server killed mid-line
                if isinstance(row, dict):  # counters, not a step: the steps around it stay back to back
                    last_spec = row.get("spec_decode", last_spec)
                    continue
                if prev is not None and row[1] == prev[1] and 0 < row[0] - prev[0] < max_gap_s:
                    shapes.append(StepShape(*(int(v) for v in row[2:8])))
                    seconds.append(row[0] - prev[0])
                prev = row
            if last_spec is not None:
                spec = add_stats(spec, last_spec)
    if header is None:
        raise ValueError("no step log given")
    header.pop("kind", None)
    if spec is not None:
        header["spec_decode"] = spec
    return header, shapes, seconds
