"""Validation (data.val_fraction, train.eval_every): the validation loss of every kind of layout
equals one process's, under the parity harness's tolerance (harness.py), at every evaluation."""

import pytest
import torch

from harness import ATOL, RTOL, layout, train_job

pytestmark = pytest.mark.slow


def val_layout(tmp_path, data_cache, name, model_preset="debug", **parallel):
    overrides = layout(tmp_path, data_cache, name, **parallel)
    overrides.update({"model.preset": model_preset, "model.n_layers": 4, "train.steps": 3, "data.val_fraction": 0.1,
                      "train.eval_every": 2, "train.eval_batches": 2})
    return overrides


@pytest.fixture(scope="module")
def references(tmp_path_factory, data_cache):
    cache = {}

    def get(preset="debug"):
        if preset not in cache:
            overrides = val_layout(tmp_path_factory.mktemp("val-reference"), data_cache, "run", preset)
            cache[preset] = train_job(overrides)["val_losses"]
        return cache[preset]

    return get


def check_validation_parity(pool, overrides, reference):
    assert sorted(reference) == [2, 3]  # every train.eval_every steps, and after the last step
    for rank, result in enumerate(pool.run(train_job, overrides)):
        assert sorted(result["val_losses"]) == sorted(reference), f"rank {rank} evaluated at other steps"
        torch.testing.assert_close(torch.tensor([result["val_losses"][s] for s in sorted(reference)]),
                                   torch.tensor([reference[s] for s in sorted(reference)]), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"rank {rank}: validation loss differs from one process: {m}")


@pytest.mark.parametrize("parallel", [
    {"dp": 2, "zero": 3},
    {"tp": 2, "sp": True},
    {"cp": 2, "cp_mode": "ring"},
    {"cp": 2, "cp_mode": "alltoall"},
    {"pp": 2, "pp_schedule": "1f1b"},
    {"pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2},
    {"pp": 2, "pp_schedule": "zero-bubble", "pp_virtual_stages": 2},
], ids=["fsdp2", "tp2-sp", "cp2-ring", "cp2-alltoall", "pp2-1f1b", "pp2-interleaved", "pp2-zero-bubble"])
def test_validation_loss_of_layout_equals_one_process(pool2, tmp_path, data_cache, references, parallel):
    check_validation_parity(pool2, val_layout(tmp_path, data_cache, "run", **parallel), references())


def test_validation_loss_of_moe_with_expert_parallel_equals_one_process(pool2, tmp_path, data_cache, references):
    # The router's auxiliary losses are training terms: val_loss is the language-model loss alone.
    check_validation_parity(pool2, val_layout(tmp_path, data_cache, "run", "moe-debug", ep=2),
                            references("moe-debug"))


def test_four_ranks_dp_pp_tp(pool4, tmp_path, data_cache, references):
    check_validation_parity(pool4, val_layout(tmp_path, data_cache, "run", dp=2, pp=2, zero=1), references())
