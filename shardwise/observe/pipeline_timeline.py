"""The measured pipeline: per-rank computation timestamps, the bubble, and the timeline picture.

During training each rank appends one line per step to `RUN_DIR/pipeline/rank<r>.jsonl`:
`{"step": s, "events": [[kind, stage, micro_batch, start_s, end_s], ...]}`, kind F (forward),
B (full backward), I (input gradient) or W (weight gradient), times from `time.perf_counter()`
(one clock for all processes of a machine). The first line of each file is a header with the
schedule's own definition of that rank's order of computations.

Bubble definitions, for one step (the window runs from the first computation on any rank to the
last one on any rank):
- idle fraction of rank r = 1 - busy_r / window;
- bubble ratio = mean over ranks of (window - busy_r) / busy_r, the quantity the literature's
  (p - 1) / (v * m) estimates (bubble time over ideal compute time, Narayanan et al., 2021),
  assuming equal stages, backward = 2 x forward and free communication;
- busiest-rank bubble = (window - max_r busy_r) / max_r busy_r: the schedule's own bubble with
  stage imbalance taken out (ranks with less work than the slowest stage also wait for it).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

TIMELINE_DIR = "pipeline"
COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#DD8452", "W": "#55A868"}


class TimelineWriter:
    def __init__(self, run_dir: Path, rank: int, header: dict):
        folder = Path(run_dir) / TIMELINE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"rank{rank}.jsonl"
        with self.path.open("w") as f:
            f.write(json.dumps({"header": header}) + "\n")

    def write(self, step: int, events: list[tuple]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "events": [list(e) for e in events]}) + "\n")


def load_timelines(run_dir: Path) -> tuple[dict[int, dict], dict[int, dict[int, list]]]:
    """(header by rank, {step: {rank: events}}) from a run directory."""
    folder = Path(run_dir) / TIMELINE_DIR
    files = sorted(folder.glob("rank*.jsonl"), key=lambda p: int(p.stem[4:]))
    if not files:
        raise FileNotFoundError(f"{folder} has no pipeline timelines: the run did not use parallel.pp > 1")
    headers, steps = {}, {}
    for path in files:
        rank = int(path.stem[4:])
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "header" in record:
                headers[rank] = record["header"]
            else:
                steps.setdefault(record["step"], {})[rank] = record["events"]
    return headers, steps


def theoretical_bubble(pp: int, virtual: int, micro_batches: int) -> float:
    """(p - 1) / (v * m): bubble time over ideal compute time for AFAB, 1F1B and interleaved 1F1B."""
    return (pp - 1) / (virtual * micro_batches)


def step_bubble(events_by_rank: dict[int, list]) -> dict:
    """Idle fraction per rank and the bubble ratio of one step."""
    starts = [e[3] for events in events_by_rank.values() for e in events]
    ends = [e[4] for events in events_by_rank.values() for e in events]
    window = max(ends) - min(starts)
    busy = {rank: sum(e[4] - e[3] for e in events) for rank, events in events_by_rank.items()}
    return {
        "window_s": window,
        "idle_fraction": {rank: 1 - b / window for rank, b in busy.items()},
        "bubble_ratio": statistics.mean((window - b) / b for b in busy.values()),
        "busiest_rank_bubble": (window - max(busy.values())) / max(busy.values()),
    }


def measured_bubble(steps: dict[int, dict[int, list]], *, skip_first: bool = True) -> dict:
    """Median over steps (the first, which warms up the stages and their buffers, left out when
    there are others) of each step's bubble figures."""
    numbers = sorted(steps)
    if skip_first and len(numbers) > 1:
        numbers = numbers[1:]
    per_step = [step_bubble(steps[n]) for n in numbers]
    ranks = sorted(per_step[0]["idle_fraction"])
    return {
        "steps": numbers,
        "bubble_ratio": statistics.median(s["bubble_ratio"] for s in per_step),
        "busiest_rank_bubble": statistics.median(s["busiest_rank_bubble"] for s in per_step),
        "idle_fraction": {r: statistics.median(s["idle_fraction"][r] for s in per_step) for r in ranks},
        "window_s": statistics.median(s["window_s"] for s in per_step),
    }


def plot_timeline(events_by_rank: dict[int, list], path: Path, title: str) -> None:
    """One row per rank, a box per computation labelled with its micro-batch (and stage when a
    rank holds several), like the schedule figures of the GPipe/1F1B/zero-bubble papers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    origin = min(e[3] for events in events_by_rank.values() for e in events)
    ranks = sorted(events_by_rank)
    multi_stage = any(len({e[1] for e in events}) > 1 for events in events_by_rank.values())
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 1.4))
    for row, rank in enumerate(ranks):
        for kind, stage, mb, start, end in events_by_rank[rank]:
            left, width = (start - origin) * 1e3, (end - start) * 1e3
            ax.barh(row, width, left=left, height=0.8, color=COLOURS[kind], edgecolor="black", linewidth=0.4,
                    hatch="//" if kind == "I" else None)
            label = f"{mb}" if not multi_stage else f"{mb}.{stage}"
            ax.text(left + width / 2, row, label, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    fig.legend(handles=[Patch(color=COLOURS["F"], label="forward"), Patch(color=COLOURS["B"], label="backward"),
                        Patch(facecolor=COLOURS["I"], hatch="//", label="input grad"),
                        Patch(color=COLOURS["W"], label="weight grad")],
               loc="lower center", fontsize=7, ncols=4, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def pipeline_report(run_dir: Path, *, step: int | None = None) -> tuple[str, Path]:
    """The bubble table of a run (text) and its timeline picture (written as RUN_DIR/pipeline.png)."""
    headers, steps = load_timelines(run_dir)
    head = headers[min(headers)]
    pp, virtual, m, schedule = head["pp"], head["virtual_stages"], head["micro_batches"], head["schedule"]
    measured = measured_bubble(steps)
    shown = step if step is not None else measured["steps"][-1]
    if shown not in steps:
        raise ValueError(f"--step = {shown} is invalid: the timelines hold steps {min(steps)}..{max(steps)}")
    picture = Path(run_dir) / "pipeline.png"
    plot_timeline(steps[shown], picture, f"{schedule}: pp={pp}, v={virtual}, m={m} (step {shown})")
    lines = [
        f"pipeline: {schedule}, pp = {pp}, virtual stages = {virtual}, micro-batches = {m}",
        f"bubble ratio (idle / busy, median of steps {measured['steps'][0]}..{measured['steps'][-1]}): "
        f"measured {measured['bubble_ratio']:.3f} (busiest rank {measured['busiest_rank_bubble']:.3f}), "
        f"theory (p-1)/(v*m) = {theoretical_bubble(pp, virtual, m):.3f}",
        "idle fraction of the step by rank: " + ", ".join(
            f"rank {r} {f:.1%}" for r, f in measured["idle_fraction"].items()),
        f"timeline of step {shown}: {picture}",
    ]
    return "\n".join(lines), picture
