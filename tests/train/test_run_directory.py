"""A run directory holds one run (train/run_directory.py, train/run_lock.py), and a full disk during a save
is one line (checkpoint/store.py): starting over beside checkpoints is refused or, with
checkpoint.overwrite, moves the old run aside; a second training at once is refused, and a dead holder
leaves no stale lock; a save that meets a full disk leaves no partial checkpoint and the run resumes."""

import errno
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem

import shardwise.checkpoint.store as store
from shardwise.checkpoint.store import CheckpointDiskFull, checkpoint_dirs, save_checkpoint
from shardwise.cli.main import main
from shardwise.train.run_lock import RunLock
from shardwise.train.trainer import train

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--config", str(ROOT / "configs/debug.toml"), "--train.seq_len", "32", "--train.sample_tokens", "0",
         "--run.progress", "false", "--checkpoint.every", "1"]


def snapshot(root: Path) -> dict[str, str | None]:
    """Every file (its SHA-256) and directory (None) under `root`, by relative path."""
    return {path.relative_to(root).as_posix(): None if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*"))}


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_info:
        return exit_info.code


def one_error_line(capsys, status: int) -> str:
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("shardwise: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def cli_train(tmp_path, data_cache):
    def argv(*flags: str, nproc: str = "1", steps: int = 2) -> list[str]:
        return ["train", "--nproc", nproc, *FLAGS, "--data.cache_dir", data_cache, "--train.steps", str(steps),
                "--run.dir", str(tmp_path / "run"), *flags]
    return argv


@pytest.fixture
def no_launch(monkeypatch):
    """`train --nproc 2` refuses in the launching process; a case that got as far as launching fails."""
    import shardwise.runtime.launch as launch

    def refuse(*args, **kwargs):
        raise AssertionError("the launcher started the ranks")

    monkeypatch.setattr(launch, "launch_local", refuse)


# ---- starting over in a run directory that has checkpoints ----

@pytest.mark.parametrize("nproc", ["1", "2"])
def test_starting_over_beside_checkpoints_is_refused_naming_the_choices(nproc, cli_train, tmp_path, capsys,
                                                                        no_launch):
    assert run_cli(cli_train()) == 0
    before = snapshot(tmp_path)
    capsys.readouterr()
    err = one_error_line(capsys, run_cli(cli_train("--checkpoint.resume", "false", nproc=nproc)))
    assert "checkpoint.resume = False is invalid" in err and "step_00000002" in err, err
    assert "a new --run.dir" in err and "--checkpoint.overwrite true" in err, err
    assert snapshot(tmp_path) == before


def test_overwrite_needs_resume_false(tiny_config):
    with pytest.raises(ValueError, match=r"checkpoint.overwrite = True is invalid: .*--checkpoint.resume false"):
        tiny_config(**{"checkpoint.overwrite": True})


def test_overwrite_moves_the_old_run_aside_and_a_plain_rerun_resumes_the_new_one(tiny_config, tmp_path):
    old = train(tiny_config(**{"train.steps": 4, "checkpoint.every": 2}))
    old_files = snapshot(old.run_dir)
    new = train(tiny_config(**{"train.steps": 4, "train.stop_at_step": 2, "checkpoint.every": 2,
                               "checkpoint.resume": False, "checkpoint.overwrite": True}))
    assert new.first_step == 1 and new.losses == old.losses[:2]  # from step 0: the same seed, the same losses
    (moved,) = (old.run_dir / "previous").iterdir()
    assert snapshot(moved) == {name: digest for name, digest in old_files.items() if name != ".lock"}
    assert [p.name for p in checkpoint_dirs(new.run_dir)] == ["step_00000002"]
    rerun = train(tiny_config(**{"train.steps": 4, "checkpoint.every": 2}))
    assert rerun.first_step == 3  # the new run's step 2, not the old run's step 4
    assert rerun.losses == old.losses[2:]
    steps = [json.loads(line)["step"] for line in (new.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # the new run's alone; the old run's lines are in previous/


# ---- two trainings at once ----

@pytest.mark.parametrize("nproc", ["1", "2"])
def test_a_second_training_on_a_held_run_directory_is_refused(nproc, cli_train, tmp_path, capsys, no_launch):
    run_dir = tmp_path / "run"
    with RunLock(run_dir).acquire():  # a training in this process holds it
        before = snapshot(tmp_path)
        capsys.readouterr()
        err = one_error_line(capsys, run_cli(cli_train(nproc=nproc)))
        assert snapshot(tmp_path) == before
    assert f"run.dir = '{run_dir}' is invalid: another training is using it (pid {os.getpid()} on " in err, err
    assert "use a new --run.dir" in err


def test_a_training_holds_its_run_directory_until_it_ends(tiny_config, tmp_path):
    refusals = []

    def try_second(step, record):
        with pytest.raises(ValueError, match=f"another training is using it \\(pid {os.getpid()} on ") as refused:
            RunLock(tmp_path / "run").acquire()
        refusals.append(refused)

    train(tiny_config(**{"train.steps": 2}), after_step=try_second)
    assert len(refusals) == 2
    RunLock(tmp_path / "run").acquire().release()  # released at the end


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from shardwise.train.run_lock import RunLock
        RunLock({str(tmp_path)!r}).acquire()
        print("held", flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ValueError, match=f"another training is using it \\(pid {holder.pid} on "):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    RunLock(tmp_path).acquire().release()  # the kernel released the dead holder's lock


# ---- a full disk during a save ----

def fill_the_disk_at(monkeypatch, step_name: str, error: BaseException) -> None:
    """DCP's writer fails, after writing some bytes, for the files of checkpoint `step_name`."""
    original = dcp_filesystem._write_item

    def write_item(transforms, stream, data, write_item, storage_key, serialization_format):
        if step_name in getattr(stream, "name", ""):
            stream.write(b"partial")
            raise error
        return original(transforms, stream, data, write_item, storage_key, serialization_format)

    monkeypatch.setattr(dcp_filesystem, "_write_item", write_item)


def test_a_full_disk_during_a_save_is_one_line_and_the_run_resumes_once_there_is_room(
        cli_train, tmp_path, capsys, monkeypatch):
    fill_the_disk_at(monkeypatch, ".step_00000002.partial", OSError(errno.ENOSPC, "No space left on device"))
    err = one_error_line(capsys, run_cli(cli_train(steps=3)))
    checkpoint = tmp_path / "run/checkpoints/step_00000002"
    assert f"checkpoint {checkpoint} could not be saved: the disk is full (it needs about " in err, err
    assert "bytes" in err and "it resumes from step_00000001" in err, err
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").iterdir()) == ["step_00000001"]  # no partial left
    monkeypatch.undo()  # room again
    assert run_cli(cli_train(steps=3)) == 0
    assert "trained steps 2..3" in capsys.readouterr().out
    assert run_cli(cli_train("--run.dir", str(tmp_path / "whole"), steps=3)) == 0
    assert logged_losses(tmp_path / "run") == logged_losses(tmp_path / "whole")  # as if the disk had never filled


def logged_losses(run_dir: Path) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in map(json.loads, (run_dir / "metrics.jsonl").open())}


def test_a_full_disk_reported_without_an_errno_is_named_from_the_free_space(tmp_path, monkeypatch):
    """torch's zip writer reports ENOSPC as a RuntimeError naming inline_container.cc and no errno."""
    fill_the_disk_at(monkeypatch, ".step_00000001.partial",
                     RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing "
                                  "file data/0: file write failed"))
    monkeypatch.setattr(store, "free_space", lambda directory: 1000)
    with pytest.raises(CheckpointDiskFull, match=r"the disk is full \(it needs about 4,096 bytes, 0\.0 MiB; "
                                                 r"1,000 bytes were free when it began\).*resumes from step 0"):
        save_checkpoint(tmp_path, 1, tensors={"w": torch.ones(1024)}, state={}, keep=1)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_failed_save_with_room_to_spare_is_not_called_a_full_disk(tmp_path, monkeypatch):
    fill_the_disk_at(monkeypatch, ".step_00000001.partial", OSError(errno.EIO, "Input/output error"))
    with pytest.raises(RuntimeError, match="Input/output error") as failed:
        save_checkpoint(tmp_path, 1, tensors={"w": torch.ones(4)}, state={}, keep=1)
    assert not isinstance(failed.value, CheckpointDiskFull)
