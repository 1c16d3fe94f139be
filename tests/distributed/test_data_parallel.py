"""Parity of the data-parallel family with one process (see harness.py for the tolerance)."""

import json

import pytest

import torch

from harness import assert_resumed_run_equals, check_parity, layout, train_job
from shardwise.config.loader import load_config
from shardwise.train.trainer import train
from shardwise.observe.memory import zero_formula_bytes

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_two_ranks(pool2, tmp_path, data_cache, zero):
    check_parity(pool2, layout(tmp_path, data_cache, f"dp2-zero{zero}", zero=zero))


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_four_ranks_with_accumulation(pool4, tmp_path, data_cache, zero):
    # 16 sequences = 4 ranks x 2 micro-batches x 2 sequences: each rank accumulates 2 micro-batches.
    overrides = layout(tmp_path, data_cache, f"dp4-zero{zero}", zero=zero)
    overrides["train.global_batch_size"] = 16
    check_parity(pool4, overrides)


def test_hsdp_2x2_and_its_sharded_checkpoint_exports_to_hf(pool4, tmp_path, data_cache):
    check_parity(pool4, layout(tmp_path, data_cache, "hsdp", zero=3, dp_replicate=2))
    transformers = pytest.importorskip("transformers")
    from shardwise.cli.main import main
    from shardwise.infer.load import load_run

    assert main(["convert", "--to-hf", str(tmp_path / "hsdp"), "--out", str(tmp_path / "hf")]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    _, ours, _ = load_run(tmp_path / "hsdp")
    tokens = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


# -- memory and communication accounting ------------------------------------------------------

PSI = 119_104  # parameters of the debug preset (4 bytes each in fp32)
PARAM_TENSORS = 20  # AdamW keeps a 4-byte `step` scalar per parameter tensor, on every rank


def first_step_record(pool, tmp_path, data_cache, zero, **extra):
    overrides = layout(tmp_path, data_cache, f"acct-zero{zero}", zero=zero, **extra)
    # One micro-batch per rank, so each gradient is reduced exactly once per step.
    overrides.update({"train.steps": 1, "train.global_batch_size": 2 * pool.world_size, "checkpoint.at_end": False})
    pool.run(train_job, overrides)
    return json.loads((tmp_path / f"acct-zero{zero}" / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.parametrize("pool_name", ["pool2", "pool4"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_memory_per_rank_equals_zero_formula(request, pool_name, zero, tmp_path, data_cache):
    pool = request.getfixturevalue(pool_name)
    record = first_step_record(pool, tmp_path, data_cache, zero)
    formula = zero_formula_bytes(PSI, zero, pool.world_size)
    # The debug shapes divide by 2 and 4, so there is no padding: the formula holds exactly.
    assert record["params_bytes"] == formula["params"]
    assert record["grads_bytes"] == formula["grads"]
    assert record["optimizer_bytes"] == formula["optimizer"] + 4 * PARAM_TENSORS


@pytest.mark.parametrize("pool_name", ["pool2", "pool4"])
def test_communication_per_step_matches_formulas(request, pool_name, tmp_path, data_cache):
    pool = request.getfixturevalue(pool_name)
    n, size = pool.world_size, 4 * PSI
    comm = {zero: first_step_record(pool, tmp_path, data_cache, zero)["comm"] for zero in (0, 1, 2, 3)}
    # ZeRO-0: one all-reduce of all gradients, 2(n-1)/n of them sent per rank.
    assert comm[0] == {"all_reduce": {"calls": 1, "bytes": size, "bus_bytes": 2 * (n - 1) / n * size}}
    # ZeRO-1/2: reduce-scatter gradients + all-gather parameters (and a 4-byte all-reduce of the grad norm).
    for zero in (1, 2):
        assert comm[zero]["reduce_scatter"]["bytes"] == size
        assert comm[zero]["all_gather"]["bytes"] == size
        assert comm[zero]["all_reduce"]["bytes"] == 4
    # ZeRO-3: parameters all-gathered in forward and again in backward, gradients reduce-scattered.
    assert comm[3]["all_gather"]["bytes"] == 2 * size
    assert comm[3]["reduce_scatter"]["bytes"] == size
    bus = {zero: sum(v["bus_bytes"] for v in c.values()) for zero, c in comm.items()}
    assert bus[3] / bus[0] == pytest.approx(1.5)
    assert bus[1] / bus[0] == pytest.approx(1.0, abs=1e-4)


def test_checkpoint_reshards_across_layouts_and_training_continues(pool2, pool4, tmp_path, data_cache):
    """zero3 on 4 ranks (steps 1-2) -> zero1 on 2 ranks (3-4) -> one process (5-6) equals one uninterrupted run."""
    base = layout(tmp_path, data_cache, "resharded")
    base["train.steps"] = 6
    reference = train(load_config(overrides={**base, "run.dir": str(tmp_path / "uninterrupted")}))
    first = pool4.run(train_job, {**base, "parallel.zero": 3, "train.stop_at_step": 2})[0]["losses"]
    second = pool2.run(train_job, {**base, "parallel.zero": 1, "train.stop_at_step": 4})[0]["losses"]
    third = train(load_config(overrides=base))
    assert third.first_step == 5
    assert_resumed_run_equals(first + second + third.losses, tmp_path / "resharded", reference)


def collective_calls(pool, tmp_path, data_cache, zero, micro_batches):
    name = f"buckets-zero{zero}-m{micro_batches}"
    overrides = layout(tmp_path, data_cache, name, zero=zero, bucket_mb=0.1)
    overrides.update({"train.steps": 1, "checkpoint.at_end": False,
                      "train.global_batch_size": 2 * pool.world_size * micro_batches})
    pool.run(train_job, overrides)
    comm = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])["comm"]
    return {kind: v["calls"] for kind, v in comm.items()}


def test_gradients_are_bucketed_and_accumulation_syncs_once(pool2, tmp_path, data_cache):
    """100 KB buckets split the debug model's 476 KB of gradients into several collectives (DDP's first
    bucket is 1 MiB whatever bucket_cap_mb says, so ZeRO-0 has one here); with two micro-batches
    ZeRO-0/1 still reduce once per step, ZeRO-2 once per micro-batch."""
    one = {zero: collective_calls(pool2, tmp_path, data_cache, zero, 1) for zero in (0, 1, 2)}
    two = {zero: collective_calls(pool2, tmp_path, data_cache, zero, 2) for zero in (0, 1, 2)}
    assert two[0]["all_reduce"] == one[0]["all_reduce"]
    assert one[1]["reduce_scatter"] > 1 and two[1]["reduce_scatter"] == one[1]["reduce_scatter"]
    assert two[2]["reduce_scatter"] == 2 * one[2]["reduce_scatter"]
    assert two[2]["all_gather"] == one[2]["all_gather"] == one[2]["reduce_scatter"]  # one per bucket
