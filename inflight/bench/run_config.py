"""A bench run's configuration, parsed once from the command line (``configure``): the
frozen settings each part of a run reads, and nothing of argparse."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inflight.bench.datasets import DatasetConfig
from inflight.bench.limit import SearchSpace
from inflight.bench.lora_modules import LoraModules, with_server_flags
from inflight.bench.session import ArrivalConfig, LoadConfig
from inflight.bench.simulation import SearchPlan, SimulateOptions
from inflight.bench.summary import SLO
from inflight.bench.sustain import Thresholds
from inflight.bench.tiers import SloTier


@dataclass(frozen=True)
class OutputOptions:
    """What is written and printed: result file (``--save-result``, vLLM's ``--result-dir``,
    ``--result-filename``, ``--label``, ``--metadata``), vLLM's latency block, plot, CSV,
    report folder."""

    save_result: str | bool | None = None  # True: --save-result alone (vLLM's file name)
    result_dir: str | None = None
    result_filename: str | None = None
    label: str | None = None
    metadata: tuple[str, ...] = ()
    percentile_metrics: tuple[str, ...] = ()  # vLLM's names; () unless --percentile-metrics was given
    metric_percentiles: tuple[float, ...] = ()
    vllm_block: bool = False  # print vLLM's latency block (--percentile-metrics or --metric-percentiles)
    plot: str | None = None
    save_csv: str | None = None
    report: str | None = None


@dataclass(frozen=True)
class ServerOptions:
    """The server under test, when bench starts it: ``--serve-cmd`` (a template with
    ``{value}`` and ``--values`` for sweep and capacity), the LoRA adapters it loads
    (``--lora-modules NAME=PATH``), its start and stop timeouts (s), where its output goes,
    and the host checks."""

    serve_cmd: str | None = None
    lora: LoraModules = LoraModules()
    values: tuple[str, ...] = ()
    start_timeout: float = 600.0
    stop_timeout: float = 15.0
    log_dir: str | None = None
    on_busy_host: str = "warn"  # warn | stop
    calibrate: bool = False

    def knob_values(self) -> list[str | None]:
        """The knob values to start ``serve_cmd`` with; [None] for one server as given.
        ValueError where --values and --serve-cmd do not go together."""
        if self.values and not self.serve_cmd:
            raise ValueError("--values needs --serve-cmd")
        if self.serve_cmd and "{value}" in self.serve_cmd and not self.values:
            raise ValueError("--serve-cmd with {value} needs --values")
        if self.values and self.serve_cmd is not None and "{value}" not in self.serve_cmd:
            raise ValueError("--values needs {value} in --serve-cmd")
        return list(self.values) or [None]

    def command(self, value: str | None) -> str | None:
        """``serve_cmd`` for knob ``value``; None without one."""
        return self.serve_cmd.replace("{value}", str(value)) if self.serve_cmd else None

    def launch_command(self, command: str) -> str:
        """What is run to start the server of ``command`` (one of :meth:`command`'s, or one
        tune or calibration derived from it): ``command`` with the LoRA flags of ``lora``
        added (``lora_modules.server_flags``). The simulator reads ``command`` itself: adapters do
        not change its engine."""
        return with_server_flags(self.lora, command)


@dataclass(frozen=True)
class BenchConfig:
    """Everything a ``bench`` sub-command runs with. ``recorded``: the flags as the result
    records them (its ``args``), vLLM's spellings folded in; ``space``: the limit search
    (capacity, tune); ``request_rates``/``time_scales``: sweep's loads; ``knobs``: tune's
    (flag name, values) in order."""

    command: str
    load: LoadConfig
    dataset: DatasetConfig
    arrival: ArrivalConfig
    slo: SLO
    thresholds: Thresholds
    output: OutputOptions = OutputOptions()
    server: ServerOptions = ServerOptions()
    simulate: SimulateOptions | None = None
    space: SearchSpace | None = None
    request_rates: tuple[float, ...] = ()
    time_scales: tuple[float, ...] = ()
    knobs: tuple[tuple[str, tuple[str, ...]], ...] = ()
    fresh: bool = False
    recorded: dict[str, Any] = field(default_factory=dict)
    tiers: tuple[SloTier, ...] = ()  # capacity --users --slo-tiers: one limit per tier

    def plan(self) -> SearchPlan:
        """The limit search's plan (capacity, tune)."""
        assert self.space is not None, "only capacity and tune search"
        return SearchPlan(self.load, self.dataset, self.arrival, self.slo, self.space, self.thresholds)
