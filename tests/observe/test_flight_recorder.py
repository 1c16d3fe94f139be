"""The flight recorder (issue 19, item 6): each rank's last collectives, on 2 gloo processes (spawned
once for this module), and the launcher's copy and summary of them (runtime/heartbeat.py)."""

import json
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from shardwise.runtime import collective_files, heartbeat
from shardwise.observe.comm_log import CommLog
from shardwise.observe.flight_recorder import CollectiveRecord, FlightRecorder, recording

RECORD_FIELDS = {"global_seq", "seq", "p2p_seq", "op", "kind", "group", "group_desc", "group_ranks", "shapes",
                 "dtypes", "bytes", "step", "async_op", "state", "start_time", "end_time", "error"}


def _wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def _sequence_case(run_dir: str) -> dict:
    rank = dist.get_rank()
    second = dist.new_group([0, 1])
    out = {}
    with recording(FlightRecorder(rank, run_dir, capacity=4)) as recorder:
        recorder.step = 7
        for _ in range(3):
            dist.all_reduce(torch.ones(10))
        dist.all_reduce(torch.ones(2, 3), group=second)
        dist.barrier()
        work = dist.all_reduce(torch.ones(5), async_op=True)
        out["async_state_before_wait"] = recorder.records[-1].state if rank == 0 else None  # rank 1 may be done
        work.wait()
        out["async_completed"] = _wait_until(lambda: recorder.records[-1].state == "completed")
        recorder.step = None
        peer = 1 - rank
        ops = [dist.P2POp(dist.isend, torch.ones(8), peer), dist.P2POp(dist.irecv, torch.empty(8), peer)]
        requests = dist.batch_isend_irecv(ops)
        for request in requests:
            request.wait()
        out["snapshot"] = recorder.snapshot("test")  # while the Works live: else "released"
        out["second_group"] = second.group_name
    dist.barrier()
    out["stopped_at_exit"] = recorder.recorded == 8  # the barrier above, outside, is not recorded
    return out


def _in_flight_case(run_dir: str) -> dict:
    """Rank 1 joins the all-reduce late: meanwhile rank 0's last record is issued, not finished."""
    rank = dist.get_rank()
    dist.barrier()
    out = {}
    with recording(FlightRecorder(rank, run_dir)) as recorder:
        if rank == 0:
            caller = threading.Thread(target=dist.all_reduce, args=(torch.ones(3),))
            caller.start()
            _wait_until(lambda: recorder.records and recorder.records[-1].op == "all_reduce")
            time.sleep(0.2)
            out["waiting"] = recorder.records[-1].as_dict()
            caller.join()
        else:
            time.sleep(1.0)
            dist.all_reduce(torch.ones(3))
        out["finished"] = recorder.records[-1].as_dict()
    return out


def _failure_case(run_dir: str) -> dict:
    """A collective that raises (here gloo refuses a root rank outside the group, on every rank at
    once, so no peer is left waiting) is recorded as failed and dumped at once."""
    rank = dist.get_rank()
    with recording(FlightRecorder(rank, run_dir)):
        dist.all_reduce(torch.ones(4))
        try:
            dist.broadcast(torch.ones(4), src=5)
        except RuntimeError as err:
            error = str(err)
        else:
            error = None
        dumped = collective_files.collectives_run_file(run_dir, rank)
        body = json.loads(dumped.read_text()) if dumped.is_file() else None
    return {"error": error, "dump": body}


def _logs_and_recorder_case(run_dir: str) -> dict:
    """One record per call and recorder, whether no, one or two CommLogs are active, and when two logs carry
    the same recorder; functional collectives once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    sharded = distribute_tensor(torch.ones(8, 6), mesh, [Shard(0)])
    out = {}
    second = FlightRecorder(rank, None)
    with recording(FlightRecorder(rank, run_dir)) as recorder:
        dist.all_reduce(torch.ones(4))
        with CommLog() as outer, CommLog(tracer=recorder) as inner, recording(second):
            dist.all_reduce(torch.ones(4))
            sharded.redistribute(mesh, [Replicate()]).to_local()
        sharded.redistribute(mesh, [Replicate()]).to_local()  # no log: no dispatch mode, not seen
        out["ops"] = [record.op for record in recorder.records]
        out["states"] = [record.state for record in recorder.records]
        out["second_ops"] = [record.op for record in second.records]
        out["outer"], out["inner"] = outer.summary(), inner.summary()
    return out


@pytest.fixture(scope="module")
def pool(pool2):
    return pool2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("flight-recorder")


def test_sequence_numbers_count_per_group_and_the_ring_keeps_the_last(pool, run_dir):
    results = pool.run(_sequence_case, str(run_dir / "sequence"))
    for out in results:
        snapshot = out["snapshot"]
        records = snapshot["records"]
        assert snapshot["recorded"] == 8 and snapshot["capacity"] == 4 and len(records) == 4
        assert [r["global_seq"] for r in records] == [5, 6, 7, 8]
        assert [r["op"] for r in records] == ["barrier", "all_reduce", "isend", "irecv"]
        # the world group: 3 all-reduces, a barrier, an async all-reduce; the second group: one all-reduce
        assert [r["seq"] for r in records] == [4, 5, None, None]
        assert [r["p2p_seq"] for r in records] == [None, None, 1, 2]
        assert [r["step"] for r in records] == [7, 7, None, None]
        by_group = {group["name"]: group for group in snapshot["groups"]}
        assert by_group[out["second_group"]]["seq"] == 1 and by_group[out["second_group"]]["ranks"] == [0, 1]
        world = records[1]
        assert world["group_ranks"] == [0, 1] and world["group_desc"] == "default_pg"
        assert world["shapes"] == [[5]] and world["dtypes"] == ["float32"] and world["bytes"] == 20
        assert world["async_op"] and out["async_completed"]
        assert records[0]["bytes"] == 0 and records[0]["shapes"] == []
        # gloo's point-to-point Works have no future: seen completed when written, without an end time
        assert [r["state"] for r in records] == ["completed"] * 4
        assert records[1]["end_time"] >= records[1]["start_time"] and records[3]["end_time"] is None
        assert set(records[0]) == RECORD_FIELDS
        assert out["stopped_at_exit"]
    assert results[0]["async_state_before_wait"] in ("issued", "completed")  # completed if rank 1 was quick


def test_a_call_still_waiting_is_issued_and_not_finished(pool, run_dir):
    waiting, finished = pool.run(_in_flight_case, str(run_dir / "in-flight"))[0].values()
    assert waiting["op"] == "all_reduce" and waiting["state"] == "issued" and waiting["end_time"] is None
    assert finished["global_seq"] == waiting["global_seq"] and finished["state"] == "completed"
    assert finished["end_time"] - finished["start_time"] > 0.3  # it waited for rank 1


def test_a_failed_collective_is_dumped_to_the_run_directory_at_once(pool, run_dir):
    for rank, out in enumerate(pool.run(_failure_case, str(run_dir / "failure"))):
        assert out["error"], "gloo was expected to refuse root rank 5"
        dump = out["dump"]
        assert dump["rank"] == rank and dump["source"] == "dump" and dump["pid"] > 0
        assert dump["reason"].startswith("broadcast #2 on group 0 (default_pg) raised RuntimeError: ")
        last = dump["records"][-1]
        assert last["state"] == "failed" and last["error"] and last["seq"] == 2
        assert dump["records"][-2]["state"] == "completed"


def test_each_call_is_recorded_once_with_comm_logs_active(pool, run_dir):
    for out in pool.run(_logs_and_recorder_case, str(run_dir / "logs")):
        assert out["ops"] == ["all_reduce", "all_reduce", "_c10d_functional.all_gather_into_tensor"]
        assert out["states"] == ["completed", "completed", "issued"]  # a functional collective's wait is not followed
        assert out["second_ops"] == out["ops"][1:]  # a second recorder, nested, sees what happens inside it
        assert out["outer"] == out["inner"]
        assert out["outer"]["all_reduce"]["calls"] == 1


# --- in this process: recording, the dump's writing, the heartbeat hook ---


def test_recording_wraps_torch_distributed_while_inside_and_logs_keep_it_while_active(tmp_path):
    original = dist.all_reduce
    with recording(FlightRecorder(0, tmp_path)):
        assert dist.all_reduce is not original and dist.all_reduce.__name__ == "all_reduce"
        with recording(FlightRecorder(1, tmp_path / "other")):  # nested: the outer one stays
            pass
        assert dist.all_reduce is not original
        log = CommLog(functional_collectives=False)
        log.__enter__()
    assert dist.all_reduce is not original  # the log still needs it
    log.__exit__(None, None, None)
    assert dist.all_reduce is original


def test_recording_hooks_into_the_heartbeat_while_inside(tmp_path):
    beat = heartbeat.Heartbeat(tmp_path, rank=2, interval=1)
    recorder = FlightRecorder(2, tmp_path)
    with recording(recorder, beat):
        beat.progress(5)
        assert beat.hooks == [recorder.write_beat]
    assert beat.hooks == []
    written = json.loads(collective_files.collectives_beat_file(tmp_path, 2).read_text())
    assert written["source"] == "heartbeat" and written["rank"] == 2


def test_dump_is_atomic_and_a_failed_write_keeps_the_previous_file(tmp_path, monkeypatch, capsys):
    recorder = FlightRecorder(3, tmp_path)
    path = recorder.dump("first")
    assert path == tmp_path / "collectives" / "rank3.json"
    body = json.loads(path.read_text())
    assert {key: body[key] for key in ("rank", "reason", "source", "recorded", "records", "groups")} == {
        "rank": 3, "reason": "first", "source": "dump", "recorded": 0, "records": [], "groups": []}

    def no_rename(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", no_rename)
    assert recorder.dump("second") is None
    assert "could not write rank 3's last collectives" in capsys.readouterr().err
    assert json.loads(path.read_text())["reason"] == "first"
    assert sorted(p.name for p in path.parent.iterdir()) == ["rank3.json"]  # no temporary file left


def test_nothing_is_dumped_without_a_run_directory():
    assert FlightRecorder(0, None).dump("why") is None


def test_the_heartbeat_writes_the_records_only_when_they_changed(tmp_path):
    recorder = FlightRecorder(2, tmp_path)
    beat_file = collective_files.collectives_beat_file(tmp_path, 2)
    recorder.write_beat(tmp_path)
    assert json.loads(beat_file.read_text())["source"] == "heartbeat"
    beat_file.unlink()
    recorder.write_beat(tmp_path)
    assert not beat_file.exists()  # nothing new
    recorder.version += 1
    recorder.write_beat(tmp_path)
    assert beat_file.exists()


def _add_record(recorder, state):
    record = CollectiveRecord()
    for name in CollectiveRecord.FIELDS:
        setattr(record, name, None)
    record.shapes, record.dtypes, record.state, record.work, record.text = [torch.Size([4])], [torch.float32], state, \
        None, None
    recorder.records.append(record)
    recorder.version += 1
    return record


def test_a_final_record_is_encoded_once_and_an_unfinished_one_at_each_write(tmp_path):
    recorder = FlightRecorder(0, tmp_path)
    done, running = _add_record(recorder, "completed"), _add_record(recorder, "issued")
    recorder.write_beat(tmp_path)
    written = json.loads(collective_files.collectives_beat_file(tmp_path, 0).read_text())
    assert [record["state"] for record in written["records"]] == ["completed", "issued"]
    assert written["records"][0] == {**dict.fromkeys(RECORD_FIELDS), "shapes": [[4]], "dtypes": ["float32"],
                                     "state": "completed"}
    done.step = 9  # nothing changes a final record: its first encoding stands (this only shows it is kept)
    running.state = "completed"
    records = recorder.snapshot("why")["records"]
    assert records[0]["step"] is None and records[1]["state"] == "completed"


def test_a_failing_beat_hook_is_dropped_and_the_beat_goes_on(tmp_path, capsys):
    def broken(directory):
        raise KeyError("bug")

    beat = heartbeat.Heartbeat(tmp_path, rank=0, interval=1)
    beat.add_hook(broken)
    beat.run_hooks()
    assert broken not in beat.hooks
    assert "heartbeat hook" in capsys.readouterr().err


# --- the launcher's side: RUN/collectives and summary.txt ---


def _record(seq, op="all_reduce", state="completed", step=3, start=990.0):
    return {"global_seq": seq, "seq": seq, "p2p_seq": None, "op": op, "kind": op, "group": "0",
            "group_desc": "default_pg", "group_ranks": [0, 1], "shapes": [[4]], "dtypes": ["float32"], "bytes": 16,
            "step": step, "async_op": False, "state": state, "start_time": start, "end_time": None, "error": None}


def _rank_file(rank, records, when, source="heartbeat", reason="heartbeat"):
    last_seq = records[-1]["seq"] if records else 0
    return {"rank": rank, "pid": 100 + rank, "host": "h", "reason": reason, "time": when, "source": source,
            "step": records[-1]["step"] if records else None, "capacity": 128, "recorded": last_seq,
            "groups": [{"name": "0", "desc": "default_pg", "ranks": [0, 1], "seq": last_seq, "p2p_seq": 0}],
            "records": records}


def test_the_launcher_copies_each_ranks_newest_file_and_names_the_rank_behind(tmp_path):
    beats, run = tmp_path / "beats", tmp_path / "run"
    beats.mkdir()
    (run / "collectives").mkdir(parents=True)
    now = time.time()
    rank0 = _rank_file(0, [_record(40), _record(41, state="issued", start=now - 5)], now - 0.5)
    rank1 = _rank_file(1, [_record(39, step=2), _record(40, step=2)], now - 4)
    (beats / "collectives_rank0.json").write_text(json.dumps(rank0))
    (beats / "collectives_rank1.json").write_text(json.dumps(rank1))
    stale = _rank_file(1, [_record(7)], now - 3600, source="dump", reason="an earlier launch")
    (run / "collectives" / "rank1.json").write_text(json.dumps(stale))

    summary = collective_files.save_collectives(beats, run, 2, "stall: rank 1 stalled", since=now - 60,
                                         stopped={1: "its heartbeat went quiet (frozen)"})
    assert summary == run / "collectives" / "summary.txt"
    for rank, expected in ((0, rank0), (1, rank1)):
        copied = json.loads((run / "collectives" / f"rank{rank}.json").read_text())
        assert copied["records"] == expected["records"] and copied["reason"] == "stall: rank 1 stalled"
    text = summary.read_text()
    assert "rank 0: last all_reduce #41 on group 0 (default_pg) at step 3: issued 5" in text
    assert "not finished" in text.splitlines()[2]
    assert "its heartbeat went quiet (frozen): later collectives are unseen" in text.splitlines()[3]
    assert ("group 0 (default_pg, ranks 0, 1): rank 1 behind at #40 at its last heartbeat; rank 0 waiting in "
            "all_reduce #41 (step 3, issued 5") in text


def test_a_ranks_own_newer_dump_is_kept_over_its_heartbeat_copy(tmp_path):
    beats, run = tmp_path / "beats", tmp_path / "run"
    beats.mkdir()
    (run / "collectives").mkdir(parents=True)
    now = time.time()
    own = _rank_file(0, [_record(5, state="failed")], now - 1, source="dump", reason="all_reduce #5 raised")
    (beats / "collectives_rank0.json").write_text(json.dumps(_rank_file(0, [_record(5, state="issued")], now - 2)))
    (run / "collectives" / "rank0.json").write_text(json.dumps(own))
    collective_files.save_collectives(beats, run, 2, "failure: rank 1 was killed", since=now - 60)
    assert json.loads((run / "collectives" / "rank0.json").read_text()) == own
    text = (run / "collectives" / "summary.txt").read_text()
    assert "written by the rank itself: all_reduce #5 raised" in text
    assert "rank 1: no records" in text


def test_nothing_is_written_when_no_rank_recorded(tmp_path):
    (tmp_path / "beats").mkdir()
    assert collective_files.save_collectives(tmp_path / "beats", tmp_path / "run", 2, "why", since=0) is None
    assert not (tmp_path / "run").exists()


def test_the_stall_verdict_names_where_the_collectives_are():
    watchdog = heartbeat.Watchdog("unused", nproc=2, timeout=10, interval=1)
    watchdog.started = 0
    beats = {rank: heartbeat.RankBeat(rank, 100 + rank, 3, progress_time=900.0, beat_time=1000.0) for rank in (0, 1)}
    verdict = watchdog.check(beats, 1000.0, note="; each rank's last collectives: RUN/collectives/summary.txt")
    assert verdict.endswith("(train.stall_timeout_s = 10); each rank's last collectives: "
                            "RUN/collectives/summary.txt; last step finished: rank 0 step 3, rank 1 step 3")
