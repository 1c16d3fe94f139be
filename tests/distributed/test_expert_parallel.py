"""Expert parallelism: parity with one process (harness.py tolerance; dropless unless said, aux
and z losses on, so the per-step loss compared includes them), capacity dropping under ep equal to
its single-process definition, and the layout checks."""

import json

from pathlib import Path

import pytest

from harness import check_parity, layout, run_reference
from shardwise.distributed.dims import ParallelDims

pytestmark = pytest.mark.slow


def moe_layout(tmp_path, data_cache, name, **parallel):
    overrides = layout(tmp_path, data_cache, name, **parallel)
    overrides["model.preset"] = "moe-debug"  # 4 experts of 80, top-2; the debug model's active size
    return overrides


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    """One single-process run serves every dropless layout below (same model, data and batch)."""
    overrides = moe_layout(tmp_path_factory.mktemp("moe-ref"), data_cache, "single")
    return run_reference(overrides), overrides["run.dir"] + "-reference"


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def first_record(run_dir) -> dict:
    return records(run_dir)[0]


def check_moe_parity(pool, overrides, reference):
    """check_parity, and also equal gradient norms (before clipping) and expert loads per step:
    AdamW's update hardly changes when a gradient is scaled, so parameters alone would not catch a
    wrong divisor in the expert-gradient reduction."""
    reference_run, reference_dir = reference
    check_parity(pool, overrides, reference_run)
    ours, single = records(overrides["run.dir"]), records(reference_dir)
    for mine, theirs in zip(ours, single, strict=True):
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        assert mine["moe_tokens_per_expert"] == theirs["moe_tokens_per_expert"]
        assert mine["moe_aux_loss"] == pytest.approx(theirs["moe_aux_loss"], rel=1e-5)


def test_ep2(pool2, tmp_path, data_cache, reference):
    check_moe_parity(pool2, moe_layout(tmp_path, data_cache, "ep2", ep=2), reference)
    record = first_record(tmp_path / "ep2")
    assert record["moe_aux_loss"] > 0 and record["moe_z_loss"] > 0 and record["loss"] > record["lm_loss"]
    # Per MoE layer and micro-batch: one all-to-all of counts, dispatch and combine forward, the two transposed in backward.
    layers, micro_batches, k, experts, row_bytes = 2, 2, 2, 4, 4 * 64
    assert record["comm"]["all_to_all"]["calls"] == layers * micro_batches * 5
    # Bytes (payload = input) on rank 0: dispatch sends S rows and the combine's transpose gets them back;
    # combine sends the R rows rank 0's experts received and the dispatch's transpose too; plus E int64 counts.
    sent = layers * (8 // 2) * 32 * k  # its 4 sequences of 32 tokens, k assignments each, dropless
    received = sum(load[e] for load in record["moe_tokens_per_expert"].values() for e in range(experts // 2))
    counts = layers * micro_batches * 8 * experts
    assert record["comm"]["all_to_all"]["bytes"] == row_bytes * 2 * (sent + received) + counts


@pytest.mark.parametrize("parallel", [dict(ep=4), dict(ep=2, tp=2), dict(ep=2, zero=3), dict(ep=2, zero=1)],
                         ids=["ep4", "ep2xtp2", "ep2xdp2-zero3", "ep2xdp2-zero1"])
def test_four_ranks(pool4, tmp_path, data_cache, reference, parallel):
    check_moe_parity(pool4, moe_layout(tmp_path, data_cache, "run", **parallel), reference)


@pytest.mark.parametrize("zero", [0, 1])
def test_ep2_with_pipeline(pool4, tmp_path, data_cache, reference, zero):
    check_moe_parity(pool4, moe_layout(tmp_path, data_cache, "pp2-ep2", ep=2, pp=2, zero=zero), reference)


def test_capacity_dropping_under_ep_equals_one_process(pool2, tmp_path, data_cache):
    """Capacity is per expert and per rank's micro-batch, applied before dispatch: the same drops as
    one process running the same micro-batches."""
    overrides = moe_layout(tmp_path, data_cache, "ep2-capacity", ep=2)
    overrides["model.capacity_factor"] = 1.0
    check_parity(pool2, overrides)
    assert first_record(tmp_path / "ep2-capacity")["moe_dropped_fraction"] > 0


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        ({"parallel.ep": 2}, 2, r"parallel.ep = 2 is invalid: the model is dense \(no experts\); use 1"),
        ({"parallel.ep": 3, "model.preset": "moe-debug", "train.global_batch_size": 6}, 3, "model.n_experts = 4 must divide by it"),
        ({"parallel.ep": 4, "parallel.tp": 2, "model.preset": "moe-debug"}, 4,
         "ep is carved from the dp x cp = 2 data ranks: use a divisor of 2"),
        ({"parallel.ep": 2, "parallel.tp": 2, "parallel.sp": True, "model.preset": "moe-debug"}, 4,
         "parallel.sp = True is invalid: MoE layers take whole sequences"),
    ],
)
def test_invalid_layouts_are_refused(overrides, world, message, tiny_config):
    cfg = tiny_config(**overrides)
    with pytest.raises(ValueError, match=message):
        ParallelDims.from_config(cfg.parallel, world).check(cfg)


@pytest.mark.parametrize("zero", [1, 2])
def test_ep2_with_zero_1_and_2(pool2, tmp_path, data_cache, reference, zero):
    """The dense parameters row-sharded over the 2 data ranks, the experts over ep."""
    overrides = moe_layout(tmp_path, data_cache, f"ep2-zero{zero}", ep=2, zero=zero)
    check_moe_parity(pool2, overrides, reference)
    assert first_record(overrides["run.dir"])["comm"]["reduce_scatter"]["bytes"] > 0


def test_ep2_carved_from_context_parallel_ranks(pool2, tmp_path, data_cache, reference):
    """ep over the two ranks of a cp2 layout: each holds half of every sequence and half the
    experts; the load-balancing loss uses the whole micro-batch's expert counts (all-reduced over
    cp), so losses with the aux losses on equal one process's."""
    check_moe_parity(pool2, moe_layout(tmp_path, data_cache, "ep2-cp2", ep=2, cp=2), reference)


def test_moe_under_context_parallel_alone(pool2, tmp_path, data_cache, reference):
    check_moe_parity(pool2, moe_layout(tmp_path, data_cache, "cp2", cp=2), reference)
