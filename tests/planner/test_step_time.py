"""The time model's communication and attention terms, against their formulas."""

import math

import pytest

from shardwise.core.model_counts import q_width
from shardwise.planner import step_time
from shardwise.planner.hardware import preset
from shardwise.planner.layout import Layout
from shardwise.planner.model_resolution import resolve_model

H100 = preset("h100-80gb")
GIB = 2**30


@pytest.mark.parametrize("group_size, stride, expected", [
    (8, 1, 8),     # tp 8: one node
    (16, 1, 8),    # tp 16: 8 ranks in each of 2 nodes
    (64, 1, 8),    # dp over all GPUs of 8 nodes
    (8, 8, 1),     # dp beside tp 8: one rank per node
    (16, 2, 4),    # dp beside tp 2: 4 ranks per node
    (2, 4, 2),     # two ranks 4 apart share a node
])
def test_ranks_per_node(group_size, stride, expected):
    assert step_time.ranks_per_node(group_size, stride, H100) == expected


def wire_seconds(kind, size, ranks, per_node):
    """collective_time less its latency and issue terms."""
    total = step_time.collective_time(kind, size, ranks, per_node, H100)
    spans = per_node < ranks
    steps = math.ceil(math.log2(ranks)) * (2 if kind == "all_reduce" else 1)
    return total - H100.latency(spans_nodes=spans) * steps - step_time.COLLECTIVE_OVERHEAD_S


def test_a_group_across_nodes_gets_one_nic_per_rank_in_a_node():
    size = 4 * GIB
    one_nic = H100.inter["all_gather"] * step_time.COMM_EFFICIENCY
    # dp 8 beside tp 8: one rank (one NIC) per node
    assert wire_seconds("all_gather", size, 8, 1) == pytest.approx(7 / 8 * size / one_nic)
    # dp 16 over 4 ranks per node: 4 NICs
    assert wire_seconds("all_gather", size, 16, 4) == pytest.approx(15 / 16 * size / (4 * one_nic))
    # 8 ranks per node: 8 x 45 GB/s = 360 GB/s, the NVLink figure, which caps it
    nvlink = H100.intra["all_gather"] * step_time.COMM_EFFICIENCY
    assert wire_seconds("all_gather", size, 64, 8) == pytest.approx(63 / 64 * size / min(nvlink, 8 * one_nic))
    # inside one node: NVLink
    assert wire_seconds("all_gather", size, 8, 8) == pytest.approx(7 / 8 * size / nvlink)


def test_attention_runs_at_its_own_efficiency():
    model = resolve_model("llama3-8b")
    layout = Layout(dp=1, micro_batch=1, seq_len=8192)
    base = step_time.step_time(model, layout, H100).breakdown["compute"]
    original = step_time.ATTENTION_EFFICIENCY
    try:
        step_time.ATTENTION_EFFICIENCY = 1.0
        at_matmul_rate = step_time.step_time(model, layout, H100).breakdown["compute"]
    finally:
        step_time.ATTENTION_EFFICIENCY = original
    rate = H100.peak_flops("bf16") * step_time.MATMUL_EFFICIENCY
    causal_work = 6.0 * q_width(model) * layout.seq_len * layout.seq_len * model.n_layers
    assert base - at_matmul_rate == pytest.approx(causal_work / rate * (1 / original - 1), rel=1e-9)


def test_zero1_all_gathers_the_parameters_one_bucket_at_a_time():
    """distributed/zero.py issues one blocking all-gather per 25 MiB bucket of parameters: each
    call pays the collective's latency and issue cost, so ZeRO-1's exposed time grows with the
    number of buckets, not only with the bytes."""
    model = resolve_model("llama3-8b")
    layout = Layout(dp=64, zero=1, micro_batch=1, seq_len=4096, dtype="bf16", grad_accum_dtype="fp32").validate()
    params = step_time.rank_params(model, layout, 0)
    per_node = step_time.ranks_per_node(64, 1, H100)
    psi = params.total
    total, hidden = step_time.dp_time(params, layout, H100, mb_compute=1.0)
    buckets = step_time.bucket_calls(psi * 2)
    assert buckets == math.ceil(psi * 2 / step_time.GRADIENT_BUCKET_BYTES) > 100
    reduce = step_time.collective_time("reduce_scatter", psi * 4, 64, per_node, H100, step_time.bucket_calls(psi * 4))
    gather = step_time.collective_time("all_gather", psi * 2, 64, per_node, H100, buckets)
    assert total == pytest.approx(reduce + gather)
    one_call = step_time.collective_time("all_gather", psi * 2, 64, per_node, H100)
    per_call = H100.latency(spans_nodes=True) * 6 + step_time.COLLECTIVE_OVERHEAD_S
    assert gather - one_call == pytest.approx((buckets - 1) * per_call)


def overlap_layout(comm_overlap: str = "", **changes) -> Layout:
    """Megatron-Core's published 70B layout shape (tp 8 x pp 2 x dp 48), on the llama3-70b preset."""
    values = dict(dp=48, tp=8, pp=2, sp=True, zero=1, micro_batch=1, grad_accum=8, seq_len=4096, dtype="bf16",
                  grad_accum_dtype="fp32", comm_overlap=comm_overlap)
    return Layout(**{**values, **changes}).validate()


def test_posted_p2p_transfers_remove_exactly_the_pipeline_skew():
    model = resolve_model("llama3-70b")
    layers = model.n_layers // 2
    blocking = step_time.tp_time(model, overlap_layout(), H100, layers, False)
    posted = step_time.tp_time(model, overlap_layout("p2p"), H100, layers, False)
    # 8 collectives a block with sp, each (tp - 1) ring hand-offs, forward and backward
    assert blocking - posted == pytest.approx(8 * 7 * step_time.PIPELINE_SKEW_S * layers)
    # a pipeline inside one node (tp 4 x pp 2 = 8 GPUs) has no skew to remove
    in_node = dict(dp=1, tp=4)
    assert step_time.tp_time(model, overlap_layout(**in_node), H100, layers, False) == \
        step_time.tp_time(model, overlap_layout("p2p", **in_node), H100, layers, False)


def test_overlapped_tp_pays_only_the_wire_time_beyond_the_matmuls():
    model = resolve_model("llama3-70b")
    blocking = step_time.tp_time(model, overlap_layout(pp=1), H100, 10, False)
    wire = blocking - 8 * 10 * step_time.COLLECTIVE_OVERHEAD_S  # issuing asynchronous collectives costs nothing

    def overlapped(matmul_s):
        return step_time.tp_time(model, overlap_layout("tp", pp=1), H100, 10, False, matmul_s)

    assert overlapped(0.0) == pytest.approx(wire)
    assert overlapped(wire / step_time.COMM_OVERLAP / 2) == pytest.approx(wire / 2)
    assert overlapped(wire / step_time.COMM_OVERLAP) == pytest.approx(0.0, abs=1e-12)
    # the 70B layout's blocks hide their tensor-parallel collectives whole
    layout = overlap_layout("tp,p2p,dp")
    assert step_time.step_time(model, layout, H100).breakdown["tp_comm"] == 0.0


def test_overlapped_zero1_hides_its_parameter_gather_behind_the_next_forward():
    model = resolve_model("llama3-70b")
    params = step_time.rank_params(model, overlap_layout(), 0)
    total, hidden = step_time.dp_time(params, overlap_layout(), H100, mb_compute=100.0)
    total_dp, hidden_dp = step_time.dp_time(params, overlap_layout("dp"), H100, mb_compute=100.0)
    assert total_dp == total and hidden_dp == pytest.approx(total)  # a long step hides both directions
    assert hidden < total  # shardwise's blocking gather shows whatever the step's length
    calls = step_time.bucket_calls(params.total * 4) + step_time.bucket_calls(params.total * 2)
    _, issue_only = step_time.dp_time(params, overlap_layout("dp"), H100, mb_compute=0.0)
    assert issue_only == pytest.approx(calls * step_time.COLLECTIVE_OVERHEAD_S)  # no compute: the host cost alone
