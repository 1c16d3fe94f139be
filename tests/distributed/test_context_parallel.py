"""Context parallelism (ring and all-to-all) and activation recomputation: parity with one process,
alone and composed with data, tensor and pipeline parallelism; the checks that stop bad layouts."""

import re

import pytest

from harness import check_parity, layout, run_reference
from shardwise.config.loader import load_config
from shardwise.distributed.dims import ParallelDims


@pytest.fixture(scope="module")
def references(tmp_path_factory, data_cache):
    """One single-process reference per model variant, shared by every layout of it."""
    cache = {}

    def get(**model):
        key = tuple(sorted(model.items()))
        if key not in cache:
            overrides = layout(tmp_path_factory.mktemp("reference"), data_cache, "run")
            overrides.update({f"model.{k}": v for k, v in model.items()})
            cache[key] = run_reference(overrides)
        return cache[key]

    return get


def cp_layout(tmp_path, data_cache, name, model=None, train=None, **parallel):
    overrides = layout(tmp_path, data_cache, name, **parallel)
    overrides.update({f"model.{k}": v for k, v in (model or {}).items()})
    overrides.update({f"train.{k}": v for k, v in (train or {}).items()})
    return overrides


@pytest.mark.parametrize("parallel", [
    {"cp": 2, "cp_mode": "ring"},
    {"cp": 2, "cp_mode": "ring", "cp_load_balance": False},
    {"cp": 2, "cp_mode": "alltoall"},
], ids=["ring-zigzag", "ring-contiguous", "alltoall"])
def test_cp2_equals_one_process(pool2, tmp_path, data_cache, references, parallel):
    check_parity(pool2, cp_layout(tmp_path, data_cache, "run", **parallel), references())


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_cp2_with_recompute_equals_one_process_without(pool2, tmp_path, data_cache, references, recompute):
    overrides = cp_layout(tmp_path, data_cache, "run", train={"recompute": recompute}, cp=2)
    check_parity(pool2, overrides, references())


@pytest.mark.parametrize("cp_mode", ["ring", "alltoall"])
def test_cp4_equals_one_process(pool4, tmp_path, data_cache, references, cp_mode):
    # 4 kv heads so that all-to-all can give each of 4 ranks one.
    check_parity(pool4, cp_layout(tmp_path, data_cache, "run", model={"n_kv_heads": 4}, cp=4, cp_mode=cp_mode),
                 references(n_kv_heads=4))


@pytest.mark.parametrize("parallel", [
    {"cp": 2, "tp": 2},
    {"cp": 2, "tp": 2, "sp": True, "cp_mode": "alltoall"},
    {"cp": 2, "dp": 2, "zero": 0},
    {"cp": 2, "dp": 2, "zero": 1},
    {"cp": 2, "dp": 2, "zero": 3},
    {"cp": 2, "dp": 2, "dp_replicate": 2, "zero": 3},
    {"cp": 2, "pp": 2},
], ids=["cp2xtp2", "cp2xtp2-sp-alltoall", "cp2xdp2", "cp2xdp2-zero1", "cp2xdp2-zero3", "cp2xhsdp2x1", "cp2xpp2"])
def test_cp2_composes(pool4, tmp_path, data_cache, references, parallel):
    model = {"n_heads": 8, "n_kv_heads": 4} if parallel.get("cp_mode") == "alltoall" else {}
    overrides = cp_layout(tmp_path, data_cache, "run", model=model, train={"recompute": "selective"}
                          if parallel.get("zero") == 3 else None, **parallel)
    check_parity(pool4, overrides, references(**model))


def test_recompute_alone_equals_no_recompute(tmp_path, data_cache, references):
    from shardwise.train.trainer import train
    from harness import final_params
    import torch

    ref_losses, ref_params = references()
    for mode in ("full", "selective"):
        overrides = layout(tmp_path, data_cache, mode)
        overrides["train.recompute"] = mode
        losses = train(load_config(overrides=overrides)).losses
        assert losses == ref_losses, f"{mode}: {losses} vs {ref_losses}"
        for name, value in final_params(overrides["run.dir"]).items():
            torch.testing.assert_close(value, ref_params[name], rtol=0, atol=0)


@pytest.mark.parametrize("parallel, model, seq_len, message", [
    ({"cp": 2}, {}, 30, "train.seq_len = 30 is invalid: context parallelism (ring, cp = 2) cuts each sequence into 4 chunks"),
    ({"cp": 2, "cp_load_balance": False}, {}, 31, "cuts each sequence into 2 chunks; use a multiple of 2"),
    ({"cp": 2, "tp": 2, "sp": True}, {}, 36, "4 chunks x parallel.tp = 2 (sequence parallel); use a multiple of 8"),
    ({"cp": 4, "cp_mode": "alltoall"}, {}, 32, "model.n_kv_heads = 2 does not divide by tp x cp = 4"),
    ({"cp": 2, "cp_mode": "sideways"}, {}, 32, "parallel.cp_mode = 'sideways' is invalid: use one of ring, alltoall"),
])
def test_bad_context_parallel_layouts_stop_with_the_constraint(tmp_path, data_cache, parallel, model, seq_len, message):
    overrides = cp_layout(tmp_path, data_cache, "run", model=model, train={"seq_len": seq_len}, **parallel)
    with pytest.raises(ValueError, match=re.escape(message)):
        cfg = load_config(overrides=overrides)
        world = parallel["cp"] * parallel.get("tp", 1)
        ParallelDims.from_config(cfg.parallel, world).check(cfg)


def test_bad_recompute_mode_names_the_choices(tmp_path, data_cache):
    with pytest.raises(ValueError, match="train.recompute = 'some' is invalid: use one of none, full, selective"):
        load_config(overrides={**layout(tmp_path, data_cache, "run"), "train.recompute": "some"})


def sample_job(overrides: dict) -> str:
    from shardwise.train.trainer import train

    return train(load_config(overrides=overrides)).sample


def test_closing_sample_after_context_parallel_training(pool2, tmp_path, data_cache):
    """Rank 0 samples from a plain copy of the weights (the cp attention and positions are not
    for generation) and gets the text one process gets from the same weights and seed."""
    from shardwise.train.trainer import train

    overrides = {**cp_layout(tmp_path, data_cache, "run", cp=2), "train.sample_tokens": 12, "train.steps": 2}
    samples = pool2.run(sample_job, overrides)
    single = {k: v for k, v in overrides.items() if not k.startswith("parallel.")}
    single["run.dir"] += "-single"
    assert samples[1] == ""
    assert samples[0] == train(load_config(overrides=single)).sample


@pytest.mark.parametrize("recompute, parallel", [
    ("selective", {"tp": 2, "sp": True}),
    ("full", {"pp": 2, "dp": 2}),
], ids=["selective-tp2-sp-dp2", "full-pp2-dp2"])
def test_recompute_composes_with_tensor_and_pipeline_parallel(pool4, tmp_path, data_cache, references,
                                                              recompute, parallel):
    overrides = cp_layout(tmp_path, data_cache, "run", train={"recompute": recompute}, **parallel)
    check_parity(pool4, overrides, references())
