"""`shardwise report RUN [RUN2 ...]`: the HTML page and its PNGs, read back as files and rendered in
headless Chromium, and its one-line errors.

The runs are written by hand (config.json, run.json, metrics.jsonl, memory/rank<r>.json and, for
one, pipeline/rank<r>.jsonl through the trainer's own TimelineWriter), so no test trains.
"""

import contextlib
import io
import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from shardwise.cli.main import main
from shardwise.observe.pipeline_timeline import TimelineWriter

STEPS = 6
EVAL_STEPS = (3, 6)


def write_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def metrics_line(step: int, *, offset: float, comm: bool) -> dict:
    record = {"step": step, "loss": 8.0 - step * 0.3 + offset, "lr": 1e-3 * min(1, step / 2), "grad_norm": 2.0 / step,
              "step_time_s": 0.4, "tokens_per_s": 5000.0 + 10 * step, "mfu": 0.12, "peak_memory_gib": 0.9,
              "tokens_seen": 2048 * step, "params_bytes": 4096, "grads_bytes": 4096, "optimizer_bytes": 4096,
              "comm": {"all_reduce": {"calls": 3, "bytes": 8192, "bus_bytes": 8192.0},
                       "all_gather": {"calls": 2, "bytes": 4096, "bus_bytes": 2048.0}} if comm else {},
              "skipped_steps": 0}
    if step in EVAL_STEPS:
        record.update(val_loss=record["loss"] + 0.2, val_ppl=2.718 ** (record["loss"] + 0.2))
    return record


def make_run(root: Path, name: str, *, pp: int = 1, offset: float = 0.0, memory: bool = True, comm: bool = True,
             drop: tuple[str, ...] = ()) -> Path:
    """A run directory as `shardwise train` leaves it, with `drop` metrics left out of every line."""
    run = root / name
    layout = f"pp={pp}" if pp > 1 else "dp=2, zero=1"
    write_json(run / "config.json", {"model": {"preset": "demo"}, "train": {"steps": STEPS},
                                     "parallel": {"pp": pp, "dp": 0 if pp > 1 else 2, "zero": 0 if pp > 1 else 1},
                                     "run": {"name": name, "dir": str(run)}})
    write_json(run / "run.json", {"device": "cpu", "world_size": 2, "layout": layout, "num_params": 4194304,
                                  "num_active_params": 4194304, "flops_per_token": 25165824,
                                  "peak_flops_per_device": 1e11, "peak_flops_source": "measured",
                                  "peak_memory_measures": "process peak RSS", "tokens_per_step": 2048,
                                  "resumed_from": None})
    lines = []
    for step in range(1, STEPS + 1):
        record = metrics_line(step, offset=offset, comm=comm)
        lines.append(json.dumps({k: v for k, v in record.items() if k not in drop}))
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    if memory:
        for rank in range(2):
            params = 4194304 * 4
            formula = None if pp > 1 else {"params": params, "grads": params, "optimizer": 2 * params / 2}
            write_json(run / "memory" / f"rank{rank}.json", {
                "rank": rank, "layout": layout, "measured": {"params": params, "grads": params,
                                                             "optimizer": params + 4 * 9},
                "formula": formula, "peak_memory_gib": 0.93, "peak_memory_measures": "process peak RSS"})
    if pp > 1:
        write_timelines(run, pp)
    return run


def write_timelines(run: Path, pp: int, micro_batches: int = 2) -> None:
    """GPipe-like steps of two stages: every forward, then every backward, 10 ms each."""
    for rank in range(pp):
        writer = TimelineWriter(run, rank, {"schedule": "gpipe", "pp": pp, "virtual_stages": 1,
                                            "micro_batches": micro_batches, "pp_rank": rank, "defined_order": []})
        for step in range(1, STEPS + 1):
            start = step * 10.0 + rank * 0.01
            order = [("F", mb) for mb in range(micro_batches)] + [("B", mb) for mb in range(micro_batches)]
            writer.write(step, [(kind, rank, mb, start + i * 0.01, start + (i + 1) * 0.01 - 0.001)
                                for i, (kind, mb) in enumerate(order)])


class PageReader(HTMLParser):
    """The <img src>s, <body data-*> attributes and text of a page."""

    def __init__(self, text: str):
        super().__init__()
        self.images, self.body, self.text = [], {}, []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        elif tag == "body":
            self.body = dict(attrs)

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two runs reported together, the first with a pipeline: (runs, the CLI's stdout)."""
    root = tmp_path_factory.mktemp("runs")
    first, second = make_run(root, "pipe", pp=2), make_run(root, "zero1", offset=0.5)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["report", str(first), str(second)]) == 0
    return (first, second), out.getvalue()


def test_report_of_two_runs_names_both_and_every_image_exists(two_runs):
    (first, second), out = two_runs
    page = first / "report.html"
    assert out.splitlines()[-1] == f"report: {page}"
    assert "theory (p-1)/(v*m) = 0.500" in out  # the first run's bubble: p = 2, v = 1, m = 2
    reader = PageReader(page.read_text())
    text = " ".join(reader.text)
    assert "pipe" in text and "zero1" in text and str(second) in text
    assert "4.19 M" in text and "dp=2, zero=1" in text
    expected = {"report_loss.png", "report_lr.png", "report_grad_norm.png", "report_tokens_per_s.png",
                "report_mfu.png", "report_memory.png", "report_comm.png", "pipeline.png"}
    assert set(reader.images) == expected
    for src in reader.images:
        assert not Path(src).is_absolute() and "://" not in src  # the folder can be copied
        assert (first / src).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "No figure" not in text
    assert not any(second.glob("report*"))  # the page went to the first run only


def rendered(page: Path, profile: Path) -> PageReader:
    """The DOM of `page` after load, as headless Chromium leaves it."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("chromium not installed (Debian package chromium): apt-get install chromium")
    argv = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom", page.as_uri()]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return PageReader(result.stdout)


def test_report_renders_in_headless_chromium_with_every_image(two_runs, tmp_path):
    (first, _), _ = two_runs
    copy = shutil.copytree(first, tmp_path / "copied")  # relative image paths survive a move
    page = copy / "report.html"
    dom = rendered(page, tmp_path / "profile")
    count = len(dom.images)
    assert count == 8
    assert (dom.body.get("data-images-loaded"), dom.body.get("data-images-broken")) == (str(count), "0")

    (copy / "report_memory.png").unlink()  # the check must be able to fail: a missing image is reported broken
    dom = rendered(page, tmp_path / "profile")
    assert (dom.body.get("data-images-loaded"), dom.body.get("data-images-broken")) == (str(count - 1), "1")


def test_missing_metrics_are_left_out_with_a_note_and_colliding_names_use_dir_names(tmp_path, capsys):
    first = make_run(tmp_path / "a", "same", memory=False, comm=False, drop=("grad_norm", "val_loss"))
    second = make_run(tmp_path / "b", "same", memory=False, comm=False, drop=("grad_norm", "mfu"))
    second.rename(tmp_path / "b" / "other")
    out = tmp_path / "new" / "report"
    assert main(["report", str(first), str(tmp_path / "b" / "other"), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"report: {out / 'report.html'}\n"  # no pipeline: no bubble text
    reader = PageReader((out / "report.html").read_text())
    text = " ".join(reader.text)
    assert set(reader.images) == {"report_loss.png", "report_lr.png", "report_tokens_per_s.png", "report_mfu.png"}
    assert all((out / src).is_file() for src in reader.images)
    assert "No figure: no run recorded grad_norm in metrics.jsonl" in text
    assert "No figure: no run has memory/rank<r>.json" in text
    assert "No figure: no run called a collective" in text
    assert "No figure: no run used pipeline parallelism" in text
    assert "same" in text and "other" in text  # the dir names label the runs; both were named "same"
    assert not (first / "report.html").exists()


def test_step_picks_the_pipeline_timeline_drawn(tmp_path, capsys):
    run = make_run(tmp_path, "pipe", pp=2)
    assert main(["report", str(run), "--step", "2", "--out", str(tmp_path / "out")]) == 0
    assert f"timeline of step 2: {run / 'pipeline.png'}" in capsys.readouterr().out
    assert PageReader((tmp_path / "out" / "report.html").read_text()).images[-1] == "report_pipeline_1.png"
    assert (tmp_path / "out" / "report_pipeline_1.png").is_file()


def run_without_metrics(tmp_path: Path) -> str:
    run = make_run(tmp_path, "fresh")
    (run / "metrics.jsonl").write_text("")
    return str(run)


@pytest.mark.parametrize("make_argv, message", [
    (lambda tmp: ["report", str(tmp)], "RUN_DIR = {tmp} is not a run directory (no config.json): give the run.dir"),
    (lambda tmp: ["report", str(make_run(tmp, "ok")), str(tmp / "missing")],
     "RUN_DIR = {tmp}/missing is not a run directory (no config.json)"),
    (lambda tmp: ["report", run_without_metrics(tmp)],
     "RUN_DIR = {tmp}/fresh has no metrics (metrics.jsonl is missing or empty): give a run that trained"),
    (lambda tmp: ["report", str(make_run(tmp, "ok")), "--step", "2"],
     "--step = 2 is invalid: it picks the pipeline timeline to draw, and no run given has one"),
    (lambda tmp: ["report", str(make_run(tmp, "pipe", pp=2)), "--step", "99"],
     "--step = 99 is invalid: the timelines of {tmp}/pipe hold steps 1..6"),
    (lambda tmp: ["report", str(make_run(tmp, "ok")), "--out", str(make_run(tmp, "x") / "run.json")],
     "--out = {tmp}/x/run.json is invalid: it is a file; give a directory"),
], ids=["not-a-run", "second-not-a-run", "no-metrics", "step-without-pipeline", "step-out-of-range", "out-is-a-file"])
def test_bad_input_is_one_line_and_writes_nothing(make_argv, message, tmp_path, capsys):
    argv = make_argv(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("shardwise: error: ") and err.count("\n") == 1, err
    assert message.replace("{tmp}", str(tmp_path)) in err, err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written: no page, no PNG, no pipeline.png
