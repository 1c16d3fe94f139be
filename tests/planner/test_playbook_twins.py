"""benchmarks/playbook.py's check of the sweep against itself: ZeRO twins are paired right."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import playbook  # noqa: E402


def run(zero: int, tok_s: float, *, gpus: int = 8, mbs: int = 1, status: str = "Success") -> dict:
    """A sweep row of the 1.34B model on dp = gpus, its figures plausible for an 8xH100 node."""
    return {"hidden": "2048", "layers": "16", "heads": "32", "kv_heads": "32", "ffn": "8192", "vocab": "131072",
            "tied": "1", "nodes": str(max(1, gpus // 8)), "gpus": str(gpus), "dp": str(gpus), "tp": "1", "pp": "1",
            "zero": str(zero), "mbs": str(mbs), "grad_acc": str(256 // gpus // mbs), "seq": "4096", "status": status,
            "tok_s_gpu": str(tok_s), "mem_alloc_gb": "25.0", "mem_res_gb": "40.0", "ar_inter": "", "ag_inter": "",
            "rs_inter": "", "ar_intra": "450.0"}


def test_only_runs_differing_in_the_zero_stage_are_twins():
    rows = [run(0, 40_000), run(1, 10_000),              # twins, ZeRO-1 4x slower
            run(0, 30_000, mbs=2), run(1, 31_000, mbs=2),  # twins, alike
            run(0, 35_000, gpus=16),                      # no twin: another GPU count
            run(1, 20_000, mbs=4), run(0, 1, mbs=4, status="OOM")]  # no twin: one failed
    report = playbook.evaluate(rows, "preset")
    twins = playbook.zero_twins(rows, report)
    assert twins["pairs"] == 2
    assert twins["measured_z1_over_z0"]["min"] == pytest.approx(0.25)
    assert twins["measured_z1_over_z0"]["max"] == pytest.approx(31 / 30)
    assert twins["measured_apart_over_2x"] == 1 and twins["measured_apart_over_1.5x"] == 1
    assert twins["by_gpus_pairs_z0slow_z1slow"] == {8: (2, 0, 1)}
    # the estimator sees the twins as near-equal (ZeRO-1 only shards the optimizer step)
    assert 0.9 < twins["predicted_z1_over_z0"]["min"] <= twins["predicted_z1_over_z0"]["max"] < 1.1
