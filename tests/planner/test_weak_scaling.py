"""The planner's weak scaling against published runs (benchmarks/weak_scaling.py holds the figures
and their sources; docs/planning.md, "Weak scaling against published runs", the table)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import weak_scaling  # noqa: E402


def rows(series: str) -> list[dict]:
    return weak_scaling.series_rows(weak_scaling.SERIES[series](), weak=series != "megatron_gpt")


def test_fsdp_8b_keeps_its_per_gpu_throughput_from_8_to_128_gpus():
    """torchtitan keeps 97.3% (eager) to 98.2% (Float8): ZeRO-3's gathers and reduce-scatters hide
    behind each block's compute on 16 nodes as on one, so the prediction must keep >= 95%; above
    100% only by the optimizer step, sharded 16 times thinner (<1% of the step)."""
    first, last = rows("torchtitan_llama3_8b_fsdp")
    assert (first["gpus"], last["gpus"], last["published_kept"]) == (8, 128, pytest.approx(0.973, abs=1e-3))
    assert 0.95 <= last["predicted_kept"] <= 1.01


def test_data_parallel_scaling_follows_the_playbook_within_15_percent():
    """The Ultra-Scale Playbook's DP-only 1.34B keeps 77.5% at 64 GPUs and 39% at 256: the
    prediction's kept fraction is within 15% of the published one at every GPU count."""
    points = rows("playbook_dp_1p34b")
    assert [p["gpus"] for p in points] == [8, 16, 32, 64, 128, 256]
    for point in points[1:]:
        assert point["predicted_kept"] == pytest.approx(point["published_kept"], rel=0.15), point["point"]


def test_llama3_405b_loses_per_gpu_throughput_to_the_bubble_as_dp_doubles():
    """16M tokens a step on 8,192 then 16,384 GPUs: each pipeline gets half the micro-batches (32 ->
    16) while its bubble stays, so per-GPU throughput drops (Meta: 430 -> 400 TFLOP/s, 93% kept);
    predicted within 15% of that fraction and below 100%."""
    first, last = rows("llama3_405b")
    assert (first["gpus"], last["gpus"]) == (8192, 16384)
    assert last["predicted_kept"] < 1.0
    assert last["predicted_kept"] == pytest.approx(last["published_kept"], rel=0.15)


def test_megatron_70b_layout_is_bound_by_compute_and_its_data_parallel_transfers():
    """GPT 70B on tp 8 x pp 2 x dp 48 (Megatron-Core, published MFU 42%, step 2.2 s). With its
    overlaps the tensor-parallel collectives hide behind the matmuls and no pipeline skew is paid;
    what is left is compute (2.1 s at MATMUL_EFFICIENCY), the bubble (0.13 s) and the exposed
    data-parallel transfers (fp32 reduce-scatter and bf16 gather of 4.4B parameters over one NIC
    per rank at COMM_EFFICIENCY, ~1.1 s of ~1.7 s). That puts MFU at 0.25-0.31, about 0.6-0.75 of
    the published figure (the rest: docs/planning.md); blocking, as shardwise's runtime, ~0.11."""
    point = next(p for p in rows("megatron_gpt") if p["point"].startswith("GPT 70B"))
    assert point["time_s"]["tp_comm"] == 0.0 and point["time_s"]["pp_comm"] == 0.0
    assert 0.25 <= point["predicted_mfu"] <= 0.31
    assert point["predicted_without_overlap"] / 989 < 0.12  # TFLOP/s over the H100 preset's peak
    assert point["predicted"] < point["published"] < 1.05 * point["predicted_compute_only"]
