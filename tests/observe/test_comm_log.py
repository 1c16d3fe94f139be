"""CommLog: byte conventions on 2 gloo processes (spawned once for this module), FSDP2 included."""

import json
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp
from torch import nn

from shardwise.observe.comm_log import CommLog

WORLD_SIZE = 2
FLOAT_BYTES = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collectives_case() -> dict:
    rank = dist.get_rank()
    out = {}
    dist.all_reduce(torch.ones(1000))  # outside any log: must not be counted
    never_entered = CommLog()
    with CommLog() as log:
        dist.all_reduce(torch.ones(1000))
    dist.all_reduce(torch.ones(1000))  # after exit: must not be counted
    out["all_reduce"] = log.summary()
    out["never_entered"] = never_entered.summary()

    with CommLog() as log, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated aliases of the *_single ops
        dist.all_gather_into_tensor(torch.empty(1000), torch.ones(500))
        dist.reduce_scatter_tensor(torch.empty(500), torch.ones(1000))
    out["gather_scatter"] = log.summary()
    out["gather_scatter_by_kind"] = log.summary(by="kind")

    with CommLog() as log:
        work = dist.all_reduce(torch.ones(10), async_op=True)
        out["async_counted_before_wait"] = log.summary()
        work.wait()
        dist.broadcast(torch.ones(100), src=0)
        dist.all_to_all_single(torch.empty(100), torch.ones(100))
        dist.all_gather([torch.empty(10) for _ in range(WORLD_SIZE)], torch.ones(10))
        peer = 1 - rank
        if rank == 0:
            dist.send(torch.ones(25), dst=peer)
        else:
            dist.recv(torch.empty(25), src=peer)
        # P2POp checks its op against distributed_c10d's isend/irecv: building one inside the log must work.
        ops = [dist.P2POp(dist.isend, torch.ones(8), peer), dist.P2POp(dist.irecv, torch.empty(8), peer)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    out["misc"] = log.summary()

    only_rank_0 = dist.new_group([0])
    with CommLog() as log:
        if rank == 1:
            dist.all_reduce(torch.ones(10), group=only_rank_0)  # a no-op on a rank outside the group
    out["outside_group"] = log.summary()
    return out


def _fsdp2_case() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))  # 40 + 18 params: no padding
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with CommLog() as step_log:
        with CommLog() as forward_log:  # a second, nested log counts independently
            loss = model(torch.randn(3, 4)).sum()
        loss.backward()
    return {
        "step": step_log.summary(),
        "forward": forward_log.summary(),
        "step_by_kind": step_log.summary(by="kind"),
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        results = {"collectives": _collectives_case(), "fsdp2": _fsdp2_case()}
    finally:
        dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("comm_log")
    mp.spawn(_worker, args=(_free_port(), str(out_dir)), nprocs=WORLD_SIZE)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


def test_all_reduce_counts_payload_and_ring_bus_bytes(results):
    for rank_results in results:
        # 2(n-1)/n * 4000 with n = 2
        expected = {"all_reduce": {"calls": 1, "bytes": 4000, "bus_bytes": 4000.0}}
        assert rank_results["collectives"]["all_reduce"] == expected


def test_nothing_is_counted_outside_the_context(results):
    collectives = results[0]["collectives"]
    assert collectives["all_reduce"]["all_reduce"]["calls"] == 1  # not the calls before or after
    assert collectives["never_entered"] == {}


def test_all_gather_counts_full_output_and_reduce_scatter_full_input(results):
    summary = results[0]["collectives"]["gather_scatter"]
    # Each alias calls its *_single replacement inside: counted once, under the name called.
    assert summary == {
        "all_gather_into_tensor": {"calls": 1, "bytes": 4000, "bus_bytes": 2000.0},
        "reduce_scatter_tensor": {"calls": 1, "bytes": 4000, "bus_bytes": 2000.0},
    }
    assert set(results[0]["collectives"]["gather_scatter_by_kind"]) == {"all_gather", "reduce_scatter"}


def test_async_call_is_counted_when_issued(results):
    assert results[0]["collectives"]["async_counted_before_wait"]["all_reduce"]["calls"] == 1


def test_broadcast_all_to_all_and_point_to_point(results):
    for rank, rank_results in enumerate(results):
        summary = rank_results["collectives"]["misc"]
        assert summary["broadcast"] == {"calls": 1, "bytes": 400, "bus_bytes": 200.0}
        assert summary["all_to_all_single"] == {"calls": 1, "bytes": 400, "bus_bytes": 200.0}
        assert summary["all_gather"] == {"calls": 1, "bytes": 80, "bus_bytes": 40.0}  # the list's total
        sent_or_received = ("send", 100.0) if rank == 0 else ("recv", 0.0)
        assert summary[sent_or_received[0]] == {"calls": 1, "bytes": 100, "bus_bytes": sent_or_received[1]}
        # batch_isend_irecv counts each op once, although it calls isend/irecv inside.
        assert summary["isend"] == {"calls": 1, "bytes": 32, "bus_bytes": 32.0}
        assert summary["irecv"] == {"calls": 1, "bytes": 32, "bus_bytes": 0.0}


def test_rank_outside_the_group_counts_nothing(results):
    assert results[1]["collectives"]["outside_group"] == {}


def test_fsdp2_all_gathers_in_forward_and_backward_and_reduce_scatters_grads(results):
    param_bytes = (4 * 8 + 8 + 8 * 2 + 2) * FLOAT_BYTES
    for rank_results in results:
        fsdp2 = rank_results["fsdp2"]
        # torch 2.13's fully_shard calls dist.all_gather_single and dist.reduce_scatter_single, one per layer.
        assert fsdp2["forward"] == {
            "all_gather_single": {"calls": 2, "bytes": param_bytes, "bus_bytes": param_bytes / 2}
        }
        assert fsdp2["step"] == {
            "all_gather_single": {"calls": 4, "bytes": 2 * param_bytes, "bus_bytes": param_bytes},
            "reduce_scatter_single": {"calls": 2, "bytes": param_bytes, "bus_bytes": param_bytes / 2},
        }


def test_zero3_moves_one_and_a_half_times_the_bus_bytes_of_an_all_reduce(results):
    step = results[0]["fsdp2"]["step_by_kind"]
    param_bytes = step["reduce_scatter"]["bytes"]
    all_reduce_bus_bytes = 2 * (WORLD_SIZE - 1) / WORLD_SIZE * param_bytes
    zero3_bus_bytes = step["all_gather"]["bus_bytes"] + step["reduce_scatter"]["bus_bytes"]
    assert zero3_bus_bytes == pytest.approx(1.5 * all_reduce_bus_bytes)


def test_exit_restores_the_original_functions():
    originals = (dist.all_reduce, dist.all_gather_single, dist.isend, c10d.isend)
    with CommLog():
        assert dist.all_reduce is not originals[0]
        assert dist.all_reduce.__name__ == "all_reduce"
        with CommLog():
            pass
        assert dist.all_reduce is not originals[0]  # still patched for the outer log
    assert (dist.all_reduce, dist.all_gather_single, dist.isend, c10d.isend) == originals


def test_entering_one_log_twice_is_refused():
    log = CommLog()
    with log:
        with pytest.raises(RuntimeError, match="already active"):
            log.__enter__()


def test_summary_rejects_an_unknown_grouping():
    with pytest.raises(ValueError, match="by='rank'"):
        CommLog().summary(by="rank")
