"""`shardwise.runtime.launch`: --nproc, the torchrun check, and local launches.

The launches run `_launch_probe` (beside this file) instead of the trainer: it joins gloo
from the environment the elastic agent sets, all-reduces the ranks and writes one file per
rank, so the launcher's mechanics are tested without a distributed trainer.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.cli.main import build_parser
from shardwise.config.loader import config_from_args
from shardwise.runtime import launch
from shardwise.runtime.launch import (already_launched, config_argv, launch_local, resolve_nproc,
                                          threads_per_worker)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture
def no_accelerator(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)


def test_nproc_auto_on_cpu_is_two_at_most_the_cores(no_accelerator, monkeypatch):
    monkeypatch.setattr(launch, "usable_cpu_count", lambda: 16)
    assert resolve_nproc("auto") == 2
    monkeypatch.setattr(launch, "usable_cpu_count", lambda: 1)
    assert resolve_nproc("auto") == 1


def test_nproc_auto_is_one_per_accelerator(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 8)
    assert resolve_nproc("auto") == 8


@pytest.mark.parametrize("value, expected", [(1, 1), (3, 3), ("4", 4), (" 2 ", 2)])
def test_nproc_counts_are_taken_as_given(value, expected):
    assert resolve_nproc(value) == expected


@pytest.mark.parametrize("value", ["x", "0", 0, -1, "-2", "2.5", "", True, 2.0, None])
def test_bad_nproc_names_the_flag_value_and_fix(value):
    with pytest.raises(ValueError) as err:
        resolve_nproc(value)
    assert str(err.value) == f"--nproc = {value!r} is invalid: use auto or a positive integer"


def test_already_launched_reads_torchrun_environment(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert not already_launched()
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert not already_launched()  # WORLD_SIZE alone (left over in a shell) is not a launch
    monkeypatch.setenv("RANK", "3")
    assert already_launched()


def test_threads_per_worker_share_the_cores(monkeypatch):
    monkeypatch.setattr(launch, "usable_cpu_count", lambda: 16)
    assert [threads_per_worker(n) for n in (1, 2, 8, 32)] == [16, 8, 2, 1]


def test_config_argv_rebuilds_the_same_config_without_launcher_flags():
    parser = build_parser()
    argv = ["train", "--nproc", "2", "--config", str(ROOT / "configs/debug.toml"), "--train.steps=3",
            "--train.lr", "0.001", "--run.progress", "false", "--model.n_layers", "1", "--train.deterministic", "--run.name=-dashed-name",
            "--run.loggers", "jsonl,tensorboard"]
    args = parser.parse_args(argv)
    rebuilt = config_argv(args)
    assert not [a for a in rebuilt if a.startswith("--nproc")] and rebuilt[0] == f"--config={ROOT / 'configs/debug.toml'}"
    again = build_parser().parse_args(["train", *rebuilt])
    assert config_from_args(again) == config_from_args(args)
    assert config_from_args(again).run.name == "-dashed-name" and config_from_args(again).train.deterministic
    assert config_from_args(again).run.loggers == ["jsonl", "tensorboard"]


def run_module_entry(*argv):
    return subprocess.run([sys.executable, "-m", "shardwise.train", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, env={**os.environ, "SHARDWISE_DEBUG": ""})


def test_module_entry_parses_the_train_arguments():
    result = run_module_entry("--train.steps", "many")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "shardwise: error: argument --train.steps: invalid int value: 'many' (see: shardwise train --help)"]


def test_module_entry_rejects_bad_input_in_one_line():
    result = run_module_entry("--train.steps", "0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["shardwise: error: train.steps = 0 is invalid: use a positive integer"]


@pytest.fixture
def probe_env(monkeypatch):
    """Workers must import `_launch_probe`; OMP_NUM_THREADS unset so the launcher picks it."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SHARDWISE_DEBUG", "LOGLEVEL"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.slow
def test_launch_local_runs_two_ranks_that_all_reduce(probe_env, tmp_path):
    assert launch_local(2, [str(tmp_path)], module="_launch_probe") == 0
    records = sorted((json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")), key=lambda r: r["rank"])
    assert [(r["rank"], r["local_rank"], r["world_size"], r["rank_sum"]) for r in records] == [(0, 0, 2, 1.0), (1, 1, 2, 1.0)]
    assert {r["omp_num_threads"] for r in records} == {str(threads_per_worker(2))}
    assert "OMP_NUM_THREADS" not in os.environ  # the launcher's own environment is left as it was


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, code, reason",
    [
        ("exit", 3, "rank 1 exited with code 3; its output above says why"),
        ("raise", 1, "rank 1 exited with code 1: RuntimeError: probe failure on rank 1"),
    ],
)
def test_a_failed_rank_is_named_in_one_line(probe_env, tmp_path, capfd, how, code, reason):
    assert launch_local(2, [str(tmp_path), "--fail-rank", "1", "--fail-how", how], module="_launch_probe") == code
    err_lines = capfd.readouterr().err.strip().splitlines()
    summary = [line for line in err_lines if line.startswith("shardwise: error:")]
    assert summary == [f"shardwise: error: {reason}; the other ranks were stopped"]
    assert not [line for line in err_lines if "torch/distributed/elastic" in line and "Traceback" not in line
                and "errors/__init__.py" not in line]  # the agent's own log lines are hidden


def child_failed(exitcodes: dict[int, int]):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="/nonexistent")
                for rank, code in exitcodes.items()}
    return ChildFailedError(name="shardwise.train", failures=failures)


def test_the_failed_rank_is_blamed_not_the_ranks_the_agent_stopped():
    # Both without error files: elastic's whole-second timestamps tie; rank 0 was only SIGTERMed.
    err = child_failed({0: -15, 1: 2, 3: 1})
    assert launch.describe_failure(err) == (
        "rank 1 exited with code 2; its output above says why (ranks 3 failed too); the other ranks were stopped")
    assert launch.exit_code_of(err) == 2


def test_a_killed_rank_gets_the_out_of_memory_hint():
    # rank 1 was killed from outside; rank 0 got the agent's SIGTERM, rank 2 lost its peer
    err = child_failed({0: -15, 1: -9, 2: 1})
    assert launch.describe_failure(err).startswith("rank 1 was killed by signal SIGKILL")
    assert launch.describe_failure(child_failed({0: -15, 1: -15})).startswith("rank 0 was killed by signal SIGTERM")
    err = child_failed({1: -9})
    assert launch.describe_failure(err) == ("rank 1 was killed by signal SIGKILL; SIGKILL is often the kernel's "
                                            "out-of-memory killer; the other ranks were stopped")
    assert launch.exit_code_of(err) == 137


def test_launch_local_rejects_a_bad_count():
    with pytest.raises(ValueError, match=r"--nproc = 0 is invalid"):
        launch_local(0, [])
