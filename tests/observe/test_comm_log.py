"""CommLog: byte conventions on 2 gloo processes (spawned once for this module), FSDP2 and
DTensor / tensor parallel (functional collectives) included."""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

from shardwise.observe.comm_log import CommLog

WORLD_SIZE = 2
FLOAT_BYTES = 4


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


def _dtensor_case() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    sharded = distribute_tensor(torch.ones(8, 6), mesh, [Shard(0)])  # a 4 x 6 shard per rank
    partial = DTensor.from_local(torch.ones(5, 3), mesh, [Partial()])
    out = {}
    sharded.redistribute(mesh, [Replicate()]).to_local()  # outside any log: must not be counted
    with CommLog() as log:
        sharded.redistribute(mesh, [Replicate()]).to_local()
    sharded.redistribute(mesh, [Replicate()]).to_local()  # after exit: must not be counted
    out["shard_to_replicate"] = log.summary()
    with CommLog() as log:
        partial.redistribute(mesh, [Replicate()]).to_local()
    out["partial_to_replicate"] = log.summary()
    with CommLog() as log:
        partial.redistribute(mesh, [Shard(0)]).to_local()
    out["partial_to_shard"] = log.summary()
    with CommLog() as log:
        distribute_tensor(torch.ones(8, 6), mesh, [Replicate()]).redistribute(mesh, [Shard(0)]).to_local()
    out["replicate_to_shard"] = log.summary()  # each rank keeps its chunk: no communication

    with CommLog() as log:
        dist.all_reduce(torch.ones(10))  # dispatches the c10d.allreduce_ op, which the mode ignores
        sharded.redistribute(mesh, [Replicate()]).to_local()
    out["c10d_and_functional"] = log.summary()

    import torch.distributed._functional_collectives as funcol

    x = torch.ones(3, 4, requires_grad=True)
    with CommLog() as log:  # the autograd variant: an all-gather forward, a reduce-scatter backward
        funcol.wait_tensor(funcol.all_gather_single_autograd(x, 0, mesh)).sum().backward()
    out["autograd_all_gather"] = log.summary()

    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    logits = distribute_tensor(torch.randn(6, 10), mesh, [Shard(1)]).requires_grad_()  # vocabulary-sharded
    with CommLog() as forward_log, loss_parallel():
        loss = F.cross_entropy(logits, torch.randint(0, 10, (6,)))
    with CommLog() as backward_log, loss_parallel():
        loss.backward()
    out["loss_parallel"] = {"forward": forward_log.summary(), "backward": backward_log.summary()}

    peer = 1 - dist.get_rank()
    with CommLog() as log:  # functional point-to-point, as compiled pipelines issue it
        if peer == 1:
            funcol.wait_tensor(funcol.isend_inplace(torch.ones(25), peer))
        else:
            funcol.wait_tensor(funcol.irecv_inplace(torch.empty(25), peer))
        received, _ = funcol.batch_p2p_ops_inplace(
            ["irecv", "isend"], [peer, peer], [0, 0], [torch.empty(8), torch.ones(8)], ""
        )
        funcol.wait_tensor(received)
    out["point_to_point"] = log.summary()
    return out


def _tensor_parallel_case(input_requires_grad: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    # In a model this input is the previous layer's output, which requires grad.
    x_BSD = torch.randn(2, 3, 8, requires_grad=input_requires_grad)
    with CommLog() as step_log:
        with CommLog() as forward_log:  # nested: each log's mode sees each op once
            loss = mlp(x_BSD).sum()
        loss.backward()
    return {"forward": forward_log.summary(), "step_by_kind": step_log.summary(by="kind")}


@pytest.fixture(scope="module")
def pool(pool2):
    return pool2


@pytest.fixture(scope="module")
def results(pool) -> list[dict]:
    collectives, fsdp2 = pool.run(_collectives_case), pool.run(_fsdp2_case)
    return [{"collectives": c, "fsdp2": f} for c, f in zip(collectives, fsdp2)]


@pytest.fixture(scope="module")
def dtensor_results(pool) -> list[dict]:
    return pool.run(_dtensor_case)


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


def test_exit_restores_the_original_functions_and_dispatch_modes():
    originals = (dist.all_reduce, dist.all_gather_single, dist.isend, c10d.isend)
    num_modes = torch._C._len_torch_dispatch_stack()
    with CommLog():
        assert dist.all_reduce is not originals[0]
        assert dist.all_reduce.__name__ == "all_reduce"
        with CommLog():
            assert torch._C._len_torch_dispatch_stack() == num_modes + 2
        assert dist.all_reduce is not originals[0]  # still patched for the outer log
        assert torch._C._len_torch_dispatch_stack() == num_modes + 1
    assert (dist.all_reduce, dist.all_gather_single, dist.isend, c10d.isend) == originals
    assert torch._C._len_torch_dispatch_stack() == num_modes
    with CommLog(functional_collectives=False):  # dist.* calls only: no dispatch mode, no per-op cost
        assert torch._C._len_torch_dispatch_stack() == num_modes


def test_ordinary_ops_and_autograd_are_unchanged_inside_a_log():
    x = torch.randn(3, 4, requires_grad=True)
    expected = (x.relu() * 2).sum()
    with CommLog() as log:
        y = (x.relu() * 2).sum()
        y.backward()
    assert torch.equal(y, expected)
    assert torch.equal(x.grad, (x > 0).float() * 2)
    assert log.summary() == {}


def test_torch_compile_still_compiles_inside_a_log():
    # An ordinary dispatch mode would make Dynamo skip every frame; the trainer runs each step in a log.
    graphs = []

    def count_graphs(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    double_relu = torch.compile(lambda x: (x * 2).relu(), backend=count_graphs)
    with CommLog():
        double_relu(torch.randn(4))
    assert len(graphs) == 1


def test_entering_one_log_twice_is_refused():
    log = CommLog()
    with log:
        with pytest.raises(RuntimeError, match="already active"):
            log.__enter__()


def test_summary_rejects_an_unknown_grouping():
    with pytest.raises(ValueError, match="by='rank'"):
        CommLog().summary(by="rank")


# --- DTensor / functional collectives ---


def test_shard_to_replicate_counts_one_all_gather_of_the_full_tensor(dtensor_results):
    full_bytes = 8 * 6 * FLOAT_BYTES
    for rank_results in dtensor_results:
        assert rank_results["shard_to_replicate"] == {
            "_c10d_functional.all_gather_into_tensor": {"calls": 1, "bytes": full_bytes, "bus_bytes": full_bytes / 2}
        }


def test_partial_to_replicate_counts_an_all_reduce_and_to_shard_a_reduce_scatter(dtensor_results):
    tensor_bytes = 5 * 3 * FLOAT_BYTES
    for rank_results in dtensor_results:
        assert rank_results["partial_to_replicate"] == {
            "_c10d_functional.all_reduce": {"calls": 1, "bytes": tensor_bytes, "bus_bytes": tensor_bytes}
        }
        # 5 rows over 2 ranks: DTensor pads to 6 rows before reduce-scattering, and the log counts what is sent.
        assert rank_results["partial_to_shard"] == {
            "_c10d_functional.reduce_scatter_tensor": {"calls": 1, "bytes": 72, "bus_bytes": 36.0}
        }
        assert rank_results["replicate_to_shard"] == {}


def test_c10d_and_functional_calls_are_each_counted_once(dtensor_results):
    summary = dtensor_results[0]["c10d_and_functional"]
    assert summary == {
        "all_reduce": {"calls": 1, "bytes": 40, "bus_bytes": 40.0},
        "_c10d_functional.all_gather_into_tensor": {"calls": 1, "bytes": 192, "bus_bytes": 96.0},
    }


def test_autograd_functional_collective_counts_forward_and_backward_once(dtensor_results):
    gathered_bytes = 2 * 3 * 4 * FLOAT_BYTES
    # _c10d_functional_autograd.all_gather_into_tensor reaches the mode only as the plain op it wraps.
    assert dtensor_results[0]["autograd_all_gather"] == {
        "_c10d_functional.all_gather_into_tensor": {"calls": 1, "bytes": gathered_bytes, "bus_bytes": 48.0},
        "_c10d_functional.reduce_scatter_tensor": {"calls": 1, "bytes": gathered_bytes, "bus_bytes": 48.0},
    }


def test_colwise_rowwise_mlp_all_reduces_once_forward_and_once_backward(pool):
    """Megatron (Shoeybi et al. 2019, fig. 3): an MLP split column- then row-wise needs one
    all-reduce of the [B, S, D] activation in forward (g, after the row-parallel layer) and one
    of its gradient in backward (f, the column-parallel layer's input gradient), and no other."""
    activation_bytes = 2 * 3 * 8 * FLOAT_BYTES  # B * S * D * 4
    all_reduce = {"calls": 1, "bytes": activation_bytes, "bus_bytes": float(activation_bytes)}
    for rank_results in pool.run(_tensor_parallel_case, True):
        assert rank_results["forward"] == {"_c10d_functional.all_reduce": all_reduce}
        assert rank_results["step_by_kind"] == {
            "all_reduce": {"calls": 2, "bytes": 2 * activation_bytes, "bus_bytes": 2.0 * activation_bytes}
        }


def test_colwise_input_gradient_all_reduce_is_skipped_when_the_input_needs_no_grad(pool):
    # The first layer of a model sees token embeddings' output, which does need grad; a leaf
    # input that does not gives autograd nothing to all-reduce in backward.
    activation_bytes = 2 * 3 * 8 * FLOAT_BYTES
    for rank_results in pool.run(_tensor_parallel_case, False):
        assert rank_results["step_by_kind"] == {
            "all_reduce": {"calls": 1, "bytes": activation_bytes, "bus_bytes": float(activation_bytes)}
        }


def test_loss_parallel_all_reduces_three_per_token_values_in_forward_and_none_in_backward(dtensor_results):
    # The row max and the sum of exponentials of the log-softmax, then the target's log-probability:
    # one fp32 per token each (6 tokens). The gradient stays vocabulary-sharded.
    per_token_bytes = 6 * FLOAT_BYTES
    assert dtensor_results[0]["loss_parallel"] == {
        "forward": {"_c10d_functional.all_reduce": {
            "calls": 3, "bytes": 3 * per_token_bytes, "bus_bytes": 3.0 * per_token_bytes}},
        "backward": {},
    }


def test_functional_point_to_point_counts_like_send_and_recv(dtensor_results):
    # Rank 0 sends 25 floats, rank 1 receives them; then batch_p2p_ops swaps 8 floats, counted
    # per queued op as its isend/irecv.
    isend, irecv = "_c10d_functional.isend", "_c10d_functional.irecv"
    assert dtensor_results[0]["point_to_point"] == {
        isend: {"calls": 2, "bytes": 132, "bus_bytes": 132.0},
        irecv: {"calls": 1, "bytes": 32, "bus_bytes": 0.0},
    }
    assert dtensor_results[1]["point_to_point"] == {
        irecv: {"calls": 2, "bytes": 132, "bus_bytes": 0.0},
        isend: {"calls": 1, "bytes": 32, "bus_bytes": 32.0},
    }
