"""Faults (issue 17): corrupt and incomplete checkpoints, a kill during a save, non-finite steps.

Each case asserts its outcome (recovered / warned and continued / one-line error) and that
nothing written before was damaged. Faults are injected with SHARDWISE_FAULT
(shardwise/train/faults.py) or by damaging files on disk.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from shardwise.cli import NONFINITE_EXIT, main
from shardwise.train import faults
from shardwise.train.checkpoint import checkpoint_dirs, save_checkpoint, step_dirs
from shardwise.train.checkpoint_integrity import MANIFEST_FILE, checkpoint_status, checkpoints_table
from shardwise.train.trainer import train


def saved(tmp_path, step=1):
    return save_checkpoint(tmp_path, step, tensors={"w": torch.arange(64.0)}, state={}, keep=5)


def data_file(path):
    return next(path.glob("__0_*.distcp"))


def test_fresh_checkpoint_is_ok_and_its_manifest_lists_every_file(tmp_path):
    path = saved(tmp_path)
    files = json.loads((path / MANIFEST_FILE).read_text())["files"]
    assert sorted(files) == sorted(p.name for p in path.iterdir() if p.name != MANIFEST_FILE)
    assert checkpoint_status(path) == ("ok", "")


@pytest.mark.parametrize("damage, status, reason", [
    (lambda p: data_file(p).write_bytes(data_file(p).read_bytes()[:-10]), "corrupt", "bytes, its manifest says"),
    (lambda p: data_file(p).write_bytes(bytes(reversed(data_file(p).read_bytes()))), "corrupt", "SHA-256"),
    (lambda p: data_file(p).unlink(), "incomplete", "is missing"),
    (lambda p: (p / MANIFEST_FILE).unlink(), "incomplete", "did not finish"),
    (lambda p: (p / MANIFEST_FILE).write_text("{not json"), "corrupt", "unreadable"),
], ids=["truncated", "same-size-garbled", "file-deleted", "no-manifest", "manifest-garbled"])
def test_damaged_checkpoint_is_named_with_its_status(tmp_path, damage, status, reason):
    path = saved(tmp_path)
    damage(path)
    found, why = checkpoint_status(path)
    assert found == status and reason in why


def test_shardwise_checkpoints_lists_steps_and_statuses(tmp_path, capsys):
    for step in (2, 4, 6):
        saved(tmp_path, step)
    newest = tmp_path / "checkpoints" / "step_00000006"
    data_file(newest).write_bytes(b"")
    assert main(["checkpoints", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[:2] for line in lines] == [["2", "ok"], ["4", "ok"], ["6", "corrupt"]]
    assert "resume loads this" in lines[1] and "resume" not in lines[0]
    assert checkpoints_table(tmp_path / "none", step_dirs(tmp_path / "none")).endswith("no checkpoints")


def test_corrupt_newest_checkpoint_is_skipped_and_the_run_resumes_from_the_previous(tiny_config, tmp_path, capsys):
    """Steps 5-8 after falling back to step 4 equal those of a run never interrupted."""
    full = train(tiny_config(**{"train.steps": 8, "run.dir": str(tmp_path / "full")}))
    settings = {"train.steps": 8, "checkpoint.every": 2, "checkpoint.keep": 3, "run.dir": str(tmp_path / "run")}
    first = train(tiny_config(**settings, **{"train.stop_at_step": 6}))
    newest = checkpoint_dirs(first.run_dir)[-1]
    assert newest.name == "step_00000006"
    data_file(newest).write_bytes(data_file(newest).read_bytes()[:100])
    capsys.readouterr()
    second = train(tiny_config(**settings))
    warning = capsys.readouterr().err
    assert f"skipping checkpoint {newest}: corrupt" in warning and warning.count("\n") == 1
    assert second.first_step == 5
    assert second.losses == pytest.approx(full.losses[4:], rel=0, abs=0)
    assert checkpoint_status(newest)[0] == "ok"  # step 6 written again, whole


def test_kill_during_save_keeps_the_previous_checkpoint_and_the_rerun_resumes_from_it(tiny_config, tmp_path):
    cfg = tiny_config(**{"train.steps": 6, "checkpoint.every": 2, "run.dir": str(tmp_path / "run"),
                         "train.sample_tokens": 0})
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(cfg.to_dict()))
    command = [sys.executable, "-m", "shardwise.train", f"--config={config_file}", "--nproc=1"]
    env = {**os.environ, faults.ENV: "save_kill@4:0"}
    killed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    run_dir = tmp_path / "run"
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step_00000002"]
    assert checkpoint_status(run_dir / "checkpoints" / "step_00000002")[0] == "ok"
    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "trained steps 3..6" in rerun.stdout
    assert [p.name for p in checkpoint_dirs(run_dir)][-1] == "step_00000006"


def test_nonfinite_step_stops_by_default_naming_the_step(tiny_config, monkeypatch, tmp_path):
    monkeypatch.setenv(faults.ENV, "nan@3")
    cfg = tiny_config(**{"train.steps": 5, "checkpoint.every": 2, "run.dir": str(tmp_path / "run")})
    with pytest.raises(FloatingPointError, match="step 3 was not finite"):
        train(cfg)
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step_00000002"]


def test_nonfinite_step_is_skipped_and_counted_with_on_nonfinite_skip(tiny_config, monkeypatch, tmp_path):
    clean = train(tiny_config(**{"train.steps": 2, "run.dir": str(tmp_path / "clean")}))
    monkeypatch.setenv(faults.ENV, "nan@3")
    result = train(tiny_config(**{"train.steps": 5, "train.on_nonfinite": "skip", "run.dir": str(tmp_path / "run")}))
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 1]
    assert result.losses[:2] == clean.losses and all(map(float.__eq__, result.losses[3:], result.losses[3:]))


def test_too_many_nonfinite_steps_in_a_row_stop_even_when_skipping(tiny_config, monkeypatch):
    monkeypatch.setenv(faults.ENV, "nan@2,nan@3")
    cfg = tiny_config(**{"train.steps": 5, "train.on_nonfinite": "skip", "train.max_nonfinite_in_row": 2})
    with pytest.raises(FloatingPointError, match="2 steps in a row"):
        train(cfg)


def test_nonfinite_stop_is_one_line_with_its_exit_status(tiny_config, monkeypatch, capsys):
    monkeypatch.setenv(faults.ENV, "nan@1")
    cfg = tiny_config(**{"train.steps": 2})
    config_file = cfg.run.dir + ".json"
    with open(config_file, "w") as handle:
        json.dump(cfg.to_dict(), handle)
    assert main(["train", f"--config={config_file}", "--nproc=1"]) == NONFINITE_EXIT
    err = capsys.readouterr().err
    assert err.startswith("shardwise: error: step 1 was not finite") and err.count("\n") == 1


@pytest.mark.parametrize("text", ["boom@3", "kill@x", "kill@3:r", "nan"])
def test_bad_fault_spec_is_refused(text):
    with pytest.raises(ValueError, match=faults.ENV):
        faults.parse(text)


def cli_train(tmp_path, name, *flags, fault=""):
    command = [sys.executable, "-c", "import sys; from shardwise.cli import main; sys.exit(main())", "train",
               f"--config={tmp_path / 'config.json'}", f"--run.dir={tmp_path / name}", *flags]
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", faults.ENV)}
    return subprocess.run(command, env={**env, faults.ENV: fault}, capture_output=True, text=True, timeout=600)


def final_losses(run_dir):
    """The loss of each step as last logged (a restarted run logs its redone steps again)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record["loss"] for record in records}


@pytest.mark.slow
def test_killed_rank_restarts_the_job_from_the_checkpoint_with_the_same_losses(tiny_config, tmp_path):
    cfg = tiny_config(**{"train.steps": 6, "checkpoint.every": 2})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    plain = cli_train(tmp_path, "plain", "--nproc=2")
    assert plain.returncode == 0, plain.stderr[-2000:]
    killed = cli_train(tmp_path, "killed", "--nproc=2", fault="kill@4:1")
    assert killed.returncode == 0, killed.stderr[-2000:]
    lines = [line for line in killed.stderr.splitlines() if line.startswith("shardwise:")]
    assert lines == ["shardwise: rank 1 was killed by signal SIGKILL during step 4; SIGKILL is often the kernel's "
                     "out-of-memory killer; the other ranks were stopped; restarting from the newest checkpoint "
                     "(restart 1 of 1)"], killed.stderr[-2000:]
    assert final_losses(tmp_path / "killed") == final_losses(tmp_path / "plain")


@pytest.mark.slow
def test_without_restarts_left_the_kill_is_reported_once_and_the_job_stops(tiny_config, tmp_path):
    cfg = tiny_config(**{"train.steps": 4, "checkpoint.every": 2})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    killed = cli_train(tmp_path, "run", "--nproc=2", "--train.max_restarts=0", fault="kill@3:1")
    assert killed.returncode == 128 + 9
    lines = [line for line in killed.stderr.splitlines() if line.startswith("shardwise:")]
    assert lines == ["shardwise: error: rank 1 was killed by signal SIGKILL during step 3; SIGKILL is often the "
                     "kernel's out-of-memory killer; the other ranks were stopped"]
