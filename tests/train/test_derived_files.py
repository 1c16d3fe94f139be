"""What a run reads back from its own directory is checked, and a path it cannot write is one line
before any work: metrics.jsonl with a line cut short by a crash, a damaged line, a read-only run
directory; and the closing sample of a compiled one-process run."""

import hashlib
import json
import os

import pytest

import shardwise.train.preflight as preflight
from shardwise.train.metrics import MetricsWriter
from shardwise.train.trainer import train


def records(count: int) -> str:
    return "".join(json.dumps({"step": step, "loss": 1.0 / step}) + "\n" for step in range(1, count + 1))


def snapshot(root):
    return {p.relative_to(root).as_posix(): None if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def test_a_torn_last_line_is_dropped_with_one_warning_naming_the_file(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(records(3) + '{"step": 4, "loss": 0.2')  # the crash came mid-write
    MetricsWriter(path, resume_from_step=3).close()
    assert path.read_text() == records(3)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("shardwise: warning: ") and str(path) in line and "last line" in line


def test_a_damaged_line_before_the_last_is_one_line_naming_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = records(4).splitlines(keepends=True)
    path.write_text("".join(lines[:1] + ["\x00\x00garbage\n"] + lines[2:]))
    before = path.read_bytes()
    with pytest.raises(ValueError) as err:
        MetricsWriter(path, resume_from_step=4)
    assert "\n" not in str(err.value) and f"{path}: line 2 " in str(err.value)
    assert path.read_bytes() == before


def test_a_fresh_start_drops_every_line_without_reading_them(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("not json\n" + records(2))
    MetricsWriter(path, resume_from_step=0).close()
    assert path.read_text() == ""


def test_a_resume_with_a_torn_last_line_proceeds(tiny_config, capsys):
    cfg = tiny_config(**{"train.steps": 3, "train.stop_at_step": 2, "checkpoint.every": 1})
    first = train(cfg)
    metrics = first.run_dir / "metrics.jsonl"
    with metrics.open("a") as out:
        out.write('{"step": 3, "lo')
    capsys.readouterr()
    second = train(tiny_config(**{"train.steps": 3, "checkpoint.every": 1}))
    assert second.first_step == 3
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
    assert [line for line in capsys.readouterr().err.splitlines() if str(metrics) in line]


def test_a_damaged_metrics_line_stops_the_resume_before_any_file_is_written(tiny_config):
    cfg = tiny_config(**{"train.steps": 3, "train.stop_at_step": 2, "checkpoint.every": 1})
    run_dir = train(cfg).run_dir
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text("{oops\n" + metrics.read_text())
    before = snapshot(run_dir)
    with pytest.raises(ValueError, match=f"{metrics}: line 1 "):
        train(tiny_config(**{"train.steps": 3, "checkpoint.every": 1}))
    assert snapshot(run_dir) == before


def test_an_unwritable_run_dir_is_one_line_before_any_work(tiny_config, tmp_path, monkeypatch):
    # Tests run as root here, where chmod cannot take the right to write away: os.access answers as the
    # kernel would for a user without it.
    run_dir = tmp_path / "readonly"
    run_dir.mkdir()
    real_access = os.access
    monkeypatch.setattr(preflight.os, "access", lambda path, mode, **kw: path != run_dir and real_access(path, mode, **kw))
    with pytest.raises(ValueError) as err:
        train(tiny_config(**{"run.dir": str(run_dir)}))
    message = str(err.value)
    assert message.startswith(f"run.dir = '{run_dir}' is invalid: ") and "not writable" in message
    assert "\n" not in message and list(run_dir.iterdir()) == []


@pytest.mark.slow  # compiles the debug model's blocks (~8 s on 2 cores)
def test_a_compiled_one_process_run_ends_with_its_closing_sample(tiny_config):
    result = train(tiny_config(**{"train.compile": True, "train.steps": 2, "train.warmup_steps": 1,
                                  "train.global_batch_size": 2, "train.sample_tokens": 4}))
    assert len(result.losses) == 2
    assert result.sample.startswith("def ") and len(result.sample) > len("def ")


def test_a_permission_error_past_the_checks_is_one_line_naming_the_path(tmp_path, data_cache, monkeypatch, capsys):
    import shardwise.train.setup as setup
    from shardwise.cli.main import main

    denied = tmp_path / "run" / "config.json"

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(denied))

    monkeypatch.setattr(setup, "prepare_run_dir", refuse)  # e.g. a file made read-only by another user
    with pytest.raises(SystemExit) as stop:
        main(["train", "--nproc", "1", "--model.preset", "debug", "--data.vocab_size", "512",
              "--data.max_corpus_bytes", "200000", "--data.cache_dir", data_cache, "--train.seq_len", "32",
              "--train.sample_tokens", "0", "--run.progress", "false", "--run.dir", str(tmp_path / "run")])
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"shardwise: error: {denied} is not accessible to this user (Permission denied); ")
