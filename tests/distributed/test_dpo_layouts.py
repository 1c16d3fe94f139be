"""DPO under data parallelism with ZeRO-3 and under tensor parallelism (+ sequence parallelism) equals one
process: losses per step and final parameters (the parity harness, tests/distributed/harness.py). Each
layout computes the reference log-probabilities over its ranks (data-parallel shares, the logits split
by vocabulary under tp) and the pairs' log-probabilities the same way in every step."""

from __future__ import annotations

import json
import math

import pytest

from harness import check_parity, layout
from preference_rows import dpo_overrides, write_preference_rows


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return write_preference_rows(tmp_path_factory.mktemp("dpo-data") / "pairs.jsonl")


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    """One directory for the module's runs: the one-process reference run the layouts share is in it."""
    return tmp_path_factory.mktemp("dpo-runs")


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("parallel", [
    pytest.param({"dp": 2, "zero": 3}, id="dp2-zero3"),
    pytest.param({"tp": 2, "sp": True}, id="tp2-sp"),
])
def test_dpo_layout_equals_one_process(parallel, pool2, runs_dir, data_cache, pairs_file, request):
    name = request.node.callspec.id
    overrides = {**layout(runs_dir, data_cache, name, **parallel), **dpo_overrides(pairs_file)}
    result = check_parity(pool2, overrides)
    assert result["losses"][0] == pytest.approx(math.log(2), abs=1e-6)  # the policy starts as its reference
    (reference_dir,) = runs_dir.glob("*-reference")  # made by the first layout's check_parity, kept for the rest
    for mine, one in zip(metrics(runs_dir / name)[1:], metrics(reference_dir)[1:], strict=True):
        # the rewards are means over every rank's pairs (a rank's own would differ by far more); from
        # step 2 on, as at step 1 the rewards are the last bits of policy - reference
        assert mine["reward_margin"] == pytest.approx(one["reward_margin"], abs=1e-5)
        assert mine["reward_accuracy"] == one["reward_accuracy"]
