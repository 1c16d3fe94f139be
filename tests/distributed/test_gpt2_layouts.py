"""The GPT-2 family gets its layouts from its plan alone (models/gpt2/plan.py): data parallel
(ZeRO-0 to 3), tensor parallel (with and without sequence parallel: the learned position
table is split like the token table), pipeline parallel (tied table across stages) and ring
context parallel (each rank's global positions index the position table), each equal to one
process (the harness's tolerance and reasons); generation under tensor parallelism equals one
process; what GPT-2 has no part for is refused before any work."""

import re

import pytest

from harness import check_parity, check_tp_generation, layout, run_reference
from shardwise.config.loader import load_config
from shardwise.distributed.dims import ParallelDims

pytestmark = pytest.mark.slow

GPT2 = {"model.preset": "gpt2-debug"}  # 2 blocks, 4 heads, width 64, vocab 512, tied


def gpt2_layout(tmp_path, data_cache, name, **parallel):
    return {**layout(tmp_path, data_cache, name, **parallel), **GPT2}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_cache):
    """One single-process run shared by every layout (same model, seed and global batch)."""
    return run_reference(gpt2_layout(tmp_path_factory.mktemp("reference"), data_cache, "run"))


@pytest.mark.parametrize("parallel", [
    {"zero": 0},
    {"zero": 1},
    {"zero": 2},
    {"zero": 3},
    {"tp": 2},
    {"tp": 2, "sp": True},
    {"pp": 2, "pp_schedule": "1f1b"},
    {"cp": 2, "cp_mode": "ring"},
], ids=["dp2-zero0", "dp2-zero1", "dp2-zero2", "dp2-zero3", "tp2", "tp2-sp", "pp2-1f1b", "cp2-ring"])
def test_gpt2_layouts_equal_one_process(pool2, tmp_path, data_cache, reference, parallel):
    check_parity(pool2, gpt2_layout(tmp_path, data_cache, "run", **parallel), reference)


def test_generation_under_tp_equals_one_process(pool2, tmp_path, data_cache):
    """The engine's [B, S] positions through the tensor-parallel position table (the tied head under
    tensor-parallel generation is covered for Llama in test_tensor_parallel.py)."""
    overrides = {**gpt2_layout(tmp_path, data_cache, "gen"), "model.tie_embeddings": False, "train.steps": 20,
                 "train.lr": 1e-2}
    check_tp_generation(pool2, overrides)


def test_expert_parallel_is_refused_for_dense_gpt2(tmp_path, data_cache):
    cfg = load_config(overrides={**gpt2_layout(tmp_path, data_cache, "run"), "parallel.ep": 2})
    with pytest.raises(ValueError, match=re.escape("parallel.ep = 2 is invalid: the model is dense (no experts); use 1")):
        ParallelDims.from_config(cfg.parallel, 2).check(cfg)
