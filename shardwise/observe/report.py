"""`shardwise report`: one static HTML page comparing runs, with its PNG figures beside it.

The page (`report.html`, in the first run's directory or `--out`) holds a table of the runs
and a figure per quantity, every run overlaid in its own colour: loss (validation loss at the
steps that evaluated), learning rate, gradient norm, tokens/s, MFU, each rank's state memory
against the ZeRO formula, collective bytes per step and, for pipeline runs, the timeline
drawn by `pipeline_timeline.pipeline_report`. A figure no run has data for is left out with
a note saying why.

It is written to be copied and opened anywhere: images by relative path, CSS inline, no
script or font from outside. Its one inline script counts, on load, the images that loaded
and those that did not (`<body data-images-loaded data-images-broken>`), which is what the
headless-browser test reads.

Every run is read and every argument checked before anything is written, so bad input
leaves no half-written report behind.
"""

from __future__ import annotations

import html
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from matplotlib.colors import to_hex

from shardwise.observe import report_plots
from shardwise.observe.pipeline_timeline import TIMELINE_DIR, load_timelines, pipeline_report
from shardwise.observe.report_plots import Line

PAGE = "report.html"
# (metrics.jsonl key, file name, title, y label, scale, log axis)
METRIC_FIGURES = [
    ("lr", "report_lr.png", "Learning rate", "lr", 1.0, False),
    ("grad_norm", "report_grad_norm.png", "Gradient norm (before clipping)", "L2 norm", 1.0, True),
    ("tokens_per_s", "report_tokens_per_s.png", "Throughput", "tokens/s (all ranks)", 1.0, False),
    ("mfu", "report_mfu.png", "Model FLOPs utilisation", "MFU (%)", 100.0, False),
]


@dataclass
class Run:
    """What the report reads from one run directory."""

    dir: Path
    config: dict
    info: dict  # run.json; empty for a run that wrote none
    metrics: list[dict]
    memory: list[dict]  # memory/rank<r>.json, by rank
    label: str = ""
    colour: str = ""

    @property
    def name(self) -> str:
        return str(self.config.get("run", {}).get("name") or self.dir.name)

    @property
    def has_pipeline(self) -> bool:
        return any((self.dir / TIMELINE_DIR).glob("rank*.jsonl"))

    def points(self, key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
        """(steps, values) of the steps whose metrics line has `key`."""
        have = [m for m in self.metrics if m.get(key) is not None]
        return [m["step"] for m in have], [m[key] * scale for m in have]


def read_json(path: Path, run_dir: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"RUN_DIR = {run_dir} is invalid: {path.name} is not JSON ({err}); "
                         f"give a run directory written by `shardwise train`") from None


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records. A last line cut short is skipped: the trainer may be writing it now."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"RUN_DIR = {run_dir} is invalid: metrics.jsonl line {number} is not JSON; "
                             f"remove the damaged line or leave this run out") from None
        records.append(record)
    if not records:
        raise ValueError(f"RUN_DIR = {run_dir} has no metrics (metrics.jsonl is missing or empty): "
                         f"give a run that trained at least one step")
    return records


def load_run(run_dir: Path) -> Run:
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"RUN_DIR = {run_dir} is not a run directory (no config.json): "
                                f"give the run.dir of a `shardwise train` run")
    config = read_json(run_dir / "config.json", run_dir)
    info = read_json(run_dir / "run.json", run_dir) if (run_dir / "run.json").is_file() else {}
    memory_files = sorted((run_dir / "memory").glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    memory = [read_json(path, run_dir) for path in memory_files]
    return Run(run_dir, config, info, read_metrics(run_dir), memory)


def label_runs(runs: list[Run]) -> None:
    """Label each run by run.name; when names collide, by directory name, then by path."""
    for labels in ([r.name for r in runs], [r.dir.name for r in runs], [str(r.dir) for r in runs]):
        if len(set(labels)) == len(labels):
            break
    for index, (run, label) in enumerate(zip(runs, labels)):
        run.label, run.colour = label, f"C{index}"


def check_arguments(runs: list[Run], out_dir: Path, step: int | None) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out = {out_dir} is invalid: it is a file; give a directory (created if missing)")
    if step is None:
        return
    pipelines = [run for run in runs if run.has_pipeline]
    if not pipelines:
        raise ValueError(f"--step = {step} is invalid: it picks the pipeline timeline to draw, and no run given "
                         f"has one (parallel.pp > 1); leave --step out")
    for run in pipelines:
        steps = load_timelines(run.dir)[1]
        if step not in steps:
            raise ValueError(f"--step = {step} is invalid: the timelines of {run.dir} hold steps "
                             f"{min(steps)}..{max(steps)}")


def write_report(run_dirs: list[Path], *, out_dir: Path | None = None, step: int | None = None) -> tuple[Path, str]:
    """Write the page and its figures; return its path and the first run's pipeline text ("" without one)."""
    runs = [load_run(Path(d)) for d in run_dirs]
    label_runs(runs)
    out_dir = Path(out_dir) if out_dir is not None else runs[0].dir
    check_arguments(runs, out_dir, step)
    out_dir.mkdir(parents=True, exist_ok=True)
    sections = [metric_sections(runs, out_dir), memory_section(runs, out_dir), comm_section(runs, out_dir)]
    pipeline_html, pipeline_texts = pipeline_section(runs, out_dir, step)
    page = out_dir / PAGE
    page.write_text(render_page(runs, "".join([*sections, pipeline_html])))
    return page, pipeline_texts.get(runs[0].label, "")


# ---- sections: each draws its figure(s) and returns its HTML ----

def figure_html(title: str, file_name: str, caption: str = "") -> str:
    note = f'<p class="note">{html.escape(caption)}</p>' if caption else ""
    return (f'<section><h2>{html.escape(title)}</h2><img src="{html.escape(file_name)}" '
            f'alt="{html.escape(title)}">{note}</section>')


def missing_html(title: str, why: str) -> str:
    return f'<section><h2>{html.escape(title)}</h2><p class="note">No figure: {html.escape(why)}.</p></section>'


def metric_sections(runs: list[Run], out_dir: Path) -> str:
    train = [Line(r.label, r.colour, *r.points("loss")) for r in runs]
    validation = [Line(r.label, r.colour, *r.points("val_loss")) for r in runs]
    train, validation = [x for x in train if x.steps], [x for x in validation if x.steps]
    parts = []
    if train or validation:
        report_plots.plot_loss(train, validation, out_dir / "report_loss.png")
        caption = "" if validation else "No run recorded a validation loss (train.eval_every)."
        parts.append(figure_html("Loss", "report_loss.png", caption))
    else:
        parts.append(missing_html("Loss", "no run recorded loss"))
    for key, file_name, title, ylabel, scale, log_y in METRIC_FIGURES:
        lines = [Line(r.label, r.colour, *r.points(key, scale)) for r in runs]
        lines = [line for line in lines if line.steps]
        if not lines:
            parts.append(missing_html(title, f"no run recorded {key} in metrics.jsonl"))
            continue
        report_plots.plot_lines(lines, out_dir / file_name, title=title, ylabel=ylabel, log_y=log_y)
        parts.append(figure_html(title, file_name))
    return "".join(parts)


def memory_section(runs: list[Run], out_dir: Path) -> str:
    title = "Memory per rank: measured vs formula"
    memory = {r.label: r.memory for r in runs if r.memory}
    if not memory:
        return missing_html(title, "no run has memory/rank<r>.json (written by `shardwise train` after its first "
                                   "step)")
    report_plots.plot_memory(memory, out_dir / "report_memory.png")
    return figure_html(title, "report_memory.png",
                       "Bytes of parameters, gradients and optimizer states each rank holds after the first step; "
                       "the formula is the ZeRO paper's for the run's dp and zero (none with tp, pp or ep > 1).")


def comm_section(runs: list[Run], out_dir: Path) -> str:
    title = "Communication per step"
    lines_by_kind: dict[str, list[Line]] = {}
    for run in runs:
        kinds = sorted({kind for m in run.metrics for kind in m.get("comm") or {}})
        for kind in kinds:
            have = [m for m in run.metrics if kind in (m.get("comm") or {})]
            lines_by_kind.setdefault(kind, []).append(
                Line(run.label, run.colour, [m["step"] for m in have], [m["comm"][kind]["bytes"] for m in have]))
    if not lines_by_kind:
        return missing_html(title, "no run called a collective (one process, or a run that logged none)")
    report_plots.plot_comm(lines_by_kind, out_dir / "report_comm.png")
    return figure_html(title, "report_comm.png", "Payload bytes of each collective kind per step, on rank 0.")


def pipeline_section(runs: list[Run], out_dir: Path, step: int | None) -> tuple[str, dict[str, str]]:
    """Each pipeline run's timeline (pipeline_report draws RUN/pipeline.png, as `shardwise report`
    always has; a copy goes beside the page when that is elsewhere) and its bubble text by label."""
    parts, texts = [], {}
    for index, run in enumerate(runs, start=1):
        if not run.has_pipeline:
            continue
        text, picture = pipeline_report(run.dir, step=step)
        texts[run.label] = text
        if picture.parent.resolve() != out_dir.resolve():
            picture = Path(shutil.copyfile(picture, out_dir / f"report_pipeline_{index}.png"))
        parts.append(figure_html(f"Pipeline timeline: {run.label}", picture.name)
                     + f"<pre>{html.escape(text)}</pre>")
    if not parts:
        return missing_html("Pipeline timeline", "no run used pipeline parallelism (parallel.pp > 1)"), texts
    return "".join(parts), texts


# ---- the page ----

def run_row(run: Run) -> list[str]:
    info, last = run.info, run.metrics[-1]
    validation = [m["val_loss"] for m in run.metrics if m.get("val_loss") is not None]
    params = info.get("num_params")
    active = info.get("num_active_params")
    params_text = "-" if params is None else f"{params / 1e6:.2f} M" + (
        f" ({active / 1e6:.2f} M active)" if active not in (None, params) else "")
    device = info.get("device", "-") + (f" × {info['world_size']}" if "world_size" in info else "")
    return [run.label, str(run.dir), info.get("layout", "-"), device, params_text,
            f"{run.metrics[0]['step']}..{last['step']}", number(last.get("loss")),
            number(validation[-1] if validation else None), number(min(validation) if validation else None)]


def number(value) -> str:
    return "-" if value is None else f"{value:.4f}"


HEADINGS = ["run", "run dir", "layout", "device × processes", "parameters", "steps", "final loss",
            "final val_loss", "best val_loss"]

STYLE = """
body { font-family: sans-serif; margin: 1.5em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }
th { background: #f3f3f3; }
td.swatch { width: 1em; }
img { max-width: 100%; border: 1px solid #eee; }
.note { color: #666; font-size: 0.9em; }
pre { background: #f7f7f7; padding: 0.6em; font-size: 0.8em; white-space: pre-wrap; }
"""

# Counts the images that loaded and those that did not, into <body data-...>, for the browser test.
IMAGE_CHECK = """
window.addEventListener("load", function () {
  var images = Array.prototype.slice.call(document.images);
  var loaded = images.filter(function (img) { return img.complete && img.naturalWidth > 0; }).length;
  document.body.dataset.imagesLoaded = loaded;
  document.body.dataset.imagesBroken = images.length - loaded;
});
"""


def render_page(runs: list[Run], body: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ["", *HEADINGS])
    rows = "".join(
        f'<tr><td class="swatch" style="background: {to_hex(run.colour)}"></td>'
        + "".join(f"<td>{html.escape(cell)}</td>" for cell in run_row(run)) + "</tr>" for run in runs)
    title = "shardwise report: " + ", ".join(run.label for run in runs)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style><script>{IMAGE_CHECK}</script></head>\n<body>"
            f"<h1>{html.escape(title)}</h1><table><tr>{head}</tr>{rows}</table>\n{body}\n</body></html>\n")
