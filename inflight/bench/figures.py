"""Figures for the bench's reports, drawn without pyplot.

Plots draw on ``matplotlib.figure.Figure`` with the Agg canvas directly, never pyplot, so
they need no display and do not change a global backend that another part of the
process may have chosen. matplotlib is imported when a figure is made, not with this
module: a run that plots nothing does not pay for it.
"""

from __future__ import annotations

import pathlib
import math
from typing import TYPE_CHECKING, Iterable, Literal, Sequence

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Where a legend goes: the corners these reports use.
Corner = Literal["upper left", "upper right", "lower left", "lower right", "best"]


def figure(nrows: int, height: float = 3.2) -> tuple[Figure, Sequence[Axes]]:
    """A figure 9 inches wide of ``nrows`` stacked axes, each ``height`` inches tall, on
    its own Agg canvas; returns the figure and its axes, top to bottom."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(9, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, 1, squeeze=False)[:, 0]
    return fig, list(axes)


def save(fig: Figure, path: str | pathlib.Path) -> None:
    """Write ``fig`` as a PNG at ``path`` (110 dpi), making its folder if needed."""
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)


def legend(ax: Axes, loc: Corner = "upper left") -> None:
    """A legend at ``loc``, only where something on ``ax`` has a label."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc=loc)


def plottable(values: Iterable[float | None]) -> list[float]:
    """``values`` with None as nan, which matplotlib leaves off the axes (as it does None)."""
    return [math.nan if v is None else v for v in values]
