"""The run context (train/context.py): built once from what the launcher said, holding what watches the
process; nothing of it outlives it, and nothing is read from the environment below it."""

import json
import os
import signal
import time

import pytest
import torch.distributed as dist

from shardwise.runtime.faults import Fault
from shardwise.runtime.launch import RankEnvironment, rank_environment
from shardwise.runtime.preemption import StopSignals
from shardwise.train.context import open_run_context


def test_the_launchers_environment_is_read_in_one_place():
    launched = rank_environment({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "SHARDWISE_HEARTBEAT_DIR": "/beats",
                                 "SHARDWISE_HEARTBEAT_INTERVAL": "0.5", "SHARDWISE_FAULT": "nan@2"})
    assert launched == RankEnvironment(rank=3, world_size=4, local_rank=1, heartbeat_dir=launched.heartbeat_dir,
                                       heartbeat_interval_s=0.5, faults="nan@2")
    assert str(launched.heartbeat_dir) == "/beats"
    assert rank_environment({}) == RankEnvironment()  # a plain one-process run


def test_the_flight_recorders_capacity_comes_from_the_launchers_environment(tiny_config):
    launched = rank_environment({"SHARDWISE_FR_BUFFER_SIZE": "7"})
    with open_run_context(tiny_config(), launched) as context:
        assert context.recorder.capacity == 7 and context.recorder.records.maxlen == 7
    with open_run_context(tiny_config(), rank_environment({})) as context:
        assert context.recorder.capacity == 128  # the default
    with pytest.raises(ValueError, match="SHARDWISE_FR_BUFFER_SIZE = '0' is invalid"):
        with open_run_context(tiny_config(), RankEnvironment(recorder_capacity="0")):
            pass


def test_the_context_beats_records_and_plans_faults_from_what_it_was_given(tiny_config, tmp_path):
    cfg = tiny_config()
    launched = RankEnvironment(heartbeat_dir=tmp_path, heartbeat_interval_s=60, faults="nan@3")
    original = dist.all_reduce
    with open_run_context(cfg, launched) as context:
        assert (context.rank, context.world_size, context.device.type) == (0, 1, "cpu")
        assert context.faults.faults == (Fault("nan", 3, None),) and context.faults.rank == 0
        assert dist.all_reduce is not original  # the flight recorder sees every collective from here on
        context.step_starting(2)
        context.progress(2)
        assert context.recorder.step == 2
        assert json.loads((tmp_path / "rank0.json").read_text())["step"] == 2
        heartbeat = context.heartbeat
    assert not heartbeat.thread.is_alive() and dist.all_reduce is original


def test_a_stop_signal_is_recorded_in_its_context_and_the_next_starts_clean(tiny_config):
    cfg = tiny_config(**{"train.preempt_signals": "SIGUSR1"})
    with open_run_context(cfg) as first:
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while first.stop_signals.received is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first.stop_signals.agreed(distributed=False) == "SIGUSR1"
    with open_run_context(cfg) as second:
        assert second.stop_signals.received is None
        assert second.recorder is not first.recorder and second.recorder.recorded == 0


def test_a_lost_peer_is_a_stop_only_once_a_stop_signal_came(monkeypatch):
    monkeypatch.setattr("shardwise.runtime.preemption.PEER_LOST_GRACE_S", 0.05)
    stop = StopSignals("SIGTERM")
    lost = RuntimeError("[gloo] Connection closed by peer")
    assert stop.stop_after(lost) is None  # no stop came within the grace: the error is this rank's to report
    stop.record(signal.SIGTERM, None)
    assert stop.stop_after(lost) == "SIGTERM"
    assert stop.stop_after(ValueError("bad input")) is None  # not a lost peer: reported as it is


@pytest.mark.parametrize("text", ["nan@x", "melt@3"])
def test_a_bad_fault_plan_is_refused_before_any_step(tiny_config, text):
    with pytest.raises(ValueError, match="SHARDWISE_FAULT"):
        with open_run_context(tiny_config(), RankEnvironment(faults=text)):
            pass
