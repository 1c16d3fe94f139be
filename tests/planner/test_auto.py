"""parallel.mode = "auto": the planner's layout, resolved in one place, trained on 2 processes."""

import json
import sys
from pathlib import Path

import pytest
import torch

from shardwise.config.loader import load_config
from shardwise.train.auto_layout import resolve_parallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from harness import ATOL, RTOL, layout, run_reference, train_job  # noqa: E402


def test_manual_mode_is_left_alone():
    cfg = load_config(overrides={"model.preset": "demo", "parallel.tp": 1})
    assert resolve_parallel(cfg, 2) is cfg


def test_auto_mode_gives_concrete_runnable_degrees(capsys):
    cfg = load_config(overrides={"model.preset": "demo", "parallel.mode": "auto", "train.global_batch_size": 16,
                                 "train.micro_batch_size": 2, "train.seq_len": 128})
    planned = resolve_parallel(cfg, 4, announce=True)
    p = planned.parallel
    assert p.mode == "manual" and p.dp * p.tp * p.pp * p.cp == 4
    p.validate()
    out = capsys.readouterr().out
    assert out.startswith("parallel.mode = auto on 4 x cpu:") and "chose " in out and "tokens/s/device" in out
    # the model, batch and everything else are untouched
    assert planned.model == cfg.model and planned.train.micro_batch_size == 2


def test_auto_mode_refuses_when_nothing_fits(tmp_path):
    hw = tmp_path / "tiny.json"
    hw.write_text(json.dumps({"base": "cpu", "name": "tiny", "memory_bytes": 2**20}))
    cfg = load_config(overrides={"model.preset": "demo", "parallel.mode": "auto", "parallel.hardware": str(hw)})
    with pytest.raises(ValueError, match=r"parallel.mode = 'auto' is invalid here: none of the .* fits tiny"):
        resolve_parallel(cfg, 2)


@pytest.mark.slow
def test_auto_layout_trains_on_two_ranks_like_one_process(pool2, tmp_path, data_cache):
    overrides = layout(tmp_path, data_cache, "auto", mode="auto")
    expected = resolve_parallel(load_config(overrides=overrides), 2, announce=False).parallel
    ref_losses, _ = run_reference(overrides)
    by_rank = pool2.run(train_job, overrides)
    for result in by_rank:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    written = json.loads((Path(overrides["run.dir"]) / "config.json").read_text())["parallel"]
    assert written["mode"] == "manual"
    assert {k: written[k] for k in ("dp", "tp", "pp", "cp", "zero", "sp")} == \
        {k: getattr(expected, k) for k in ("dp", "tp", "pp", "cp", "zero", "sp")}


def test_auto_mode_shards_the_states_when_memory_is_tight(tmp_path):
    from shardwise.train.auto_layout import plan_request
    from shardwise.planner.estimate import estimate
    from shardwise.planner.hardware import resolve_hardware
    from shardwise.planner.layout import Layout

    overrides = {"model.preset": "demo", "parallel.mode": "auto", "train.global_batch_size": 16,
                 "train.micro_batch_size": 2, "train.seq_len": 128}
    cfg = load_config(overrides=overrides)
    request = plan_request(cfg, 4, resolve_hardware("cpu"))
    replicated = estimate(request.model, Layout(dp=4, micro_batch=2, grad_accum=2, seq_len=128, dtype="fp32"),
                          request.hardware)
    hw = tmp_path / "tight.json"
    hw.write_text(json.dumps({"base": "cpu", "name": "tight", "memory_bytes": 0.9 * replicated.memory.peak}))
    roomy = resolve_parallel(cfg, 4, announce=False).parallel
    tight = resolve_parallel(load_config(overrides={**overrides, "parallel.hardware": str(hw)}), 4, announce=False).parallel
    assert (roomy.zero, roomy.tp, roomy.pp) == (0, 1, 1)
    assert tight.zero >= 1 or tight.tp > 1 or tight.pp > 1
