"""The figures of `shardwise report`: one PNG each, several runs overlaid in one colour per run.

Figures are built with `matplotlib.figure.Figure` and saved by the Agg canvas, not through
`pyplot`: pyplot keeps every open figure in global state and picks a GUI backend when one
is around, and a report needs neither (the same holds for the pipeline timeline, drawn by
`pipeline_timeline.plot_timeline`).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from shardwise.observe.memory import STATES

STATE_COLOURS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868"}
DPI = 100


class Line(NamedTuple):
    """One run's values of one quantity, at the steps that have it."""

    label: str
    colour: str
    steps: list[int]
    values: list[float]


def byte_unit(largest: float) -> tuple[str, float]:
    """The binary unit that keeps `largest` at least 1, so a tiny test model and an 8B model both
    get readable tick labels."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= size:
            return unit, size
    return "B", 1


def new_figure(width: float = 8, height: float = 3.6) -> Figure:
    figure = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(figure)
    return figure


def save(figure: Figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)


def plot_lines(lines: list[Line], path: Path, *, title: str, ylabel: str, log_y: bool = False) -> None:
    """A quantity per step, one line per run (a run with one step shows as a dot)."""
    figure = new_figure()
    ax = figure.subplots()
    for line in lines:
        ax.plot(line.steps, line.values, color=line.colour, label=line.label,
                marker="." if len(line.steps) < 2 else None)
    # A log axis needs positive values; a metric that touched 0 stays linear.
    if log_y and all(v > 0 for line in lines for v in line.values):
        ax.set_yscale("log")
    decorate(ax, title=title, ylabel=ylabel)
    save(figure, path)


def plot_loss(train: list[Line], validation: list[Line], path: Path) -> None:
    """Training loss as lines; validation loss as circles joined by a dashed line, in the run's colour."""
    figure = new_figure()
    ax = figure.subplots()
    for line in train:
        ax.plot(line.steps, line.values, color=line.colour, label=f"{line.label} train",
                marker="." if len(line.steps) < 2 else None)
    for line in validation:
        ax.plot(line.steps, line.values, color=line.colour, label=f"{line.label} validation", linestyle="--",
                marker="o", markersize=5, markerfacecolor="white")
    decorate(ax, title="loss", ylabel="cross-entropy (nats/token)")
    save(figure, path)


def plot_comm(lines_by_kind: dict[str, list[Line]], path: Path) -> None:
    """Payload bytes per step of each collective kind, one panel per kind with every run in it."""
    kinds = sorted(lines_by_kind)
    figure = new_figure(height=2.4 * len(kinds) + 0.6)
    axes = figure.subplots(len(kinds), 1, sharex=True, squeeze=False)[:, 0]
    for ax, kind in zip(axes, kinds):
        unit, size = byte_unit(max(v for line in lines_by_kind[kind] for v in line.values))
        for line in lines_by_kind[kind]:
            ax.plot(line.steps, [v / size for v in line.values], color=line.colour, label=line.label,
                    marker="." if len(line.steps) < 2 else None)
        decorate(ax, title=kind, ylabel=f"{unit} per step")
    save(figure, path)


def plot_memory(memory_by_run: dict[str, list[dict]], path: Path) -> None:
    """Per rank, each state's measured bytes (solid) beside the formula's (hatched, where the
    layout has one); one panel per run, on a shared axis so runs compare by height."""
    runs = list(memory_by_run)
    largest = max(max([*rank["measured"].values(), *(rank["formula"] or {}).values()])
                  for ranks in memory_by_run.values() for rank in ranks)
    unit, size = byte_unit(largest)
    figure = new_figure(width=max(8.0, 3.2 * len(runs)), height=3.8)
    axes = figure.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    width = 0.8 / (2 * len(STATES))
    for ax, run in zip(axes, runs):
        ranks = memory_by_run[run]
        for index, state in enumerate(STATES):
            offset = (2 * index - len(STATES) + 0.5) * width
            x = [position + offset for position in range(len(ranks))]
            ax.bar(x, [rank["measured"][state] / size for rank in ranks], width, color=STATE_COLOURS[state],
                   label=f"{state} measured")
            formula = [(rank["formula"] or {}).get(state) for rank in ranks]
            ax.bar([position + width for position in x], [0 if f is None else f / size for f in formula], width,
                   color="white", edgecolor=STATE_COLOURS[state], hatch="//", label=f"{state} formula")
        ax.set_xticks(range(len(ranks)), [f"rank {rank['rank']}" for rank in ranks])
        has_formula = any(rank["formula"] for rank in ranks)
        ax.set_title(run if has_formula else f"{run} (no formula for this layout)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel(unit)
    handles, labels = axes[0].get_legend_handles_labels()
    # The legend fills by column: one column per state, measured above formula.
    order = [labels.index(f"{s} {kind}") for s in STATES for kind in ("measured", "formula")]
    figure.legend([handles[i] for i in order], [labels[i] for i in order], loc="lower center", ncols=len(STATES),
                  fontsize=7, frameon=False)
    figure.tight_layout(rect=(0, 0.12, 1, 1))
    figure.savefig(path, dpi=DPI)


def decorate(ax, *, title: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
