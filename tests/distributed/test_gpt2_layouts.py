"""The GPT-2 family gets its layouts from its plan alone (models/gpt2/plan.py): data parallel
(ZeRO-0 to 3), tensor parallel (with and without sequence parallel: the learned position
table is split like the token table), pipeline parallel (tied table across stages) and ring
context parallel (each rank's global positions index the position table), each equal to one
process, with a vocabulary that does not divide by tp (the harness's tolerance and reasons); generation under tensor parallelism equals one
process; what GPT-2 has no part for is refused before any work."""

import re

import pytest

from harness import check_parity, check_tp_generation, layout, run_reference
from shardwise.config.loader import load_config
from shardwise.distributed.dims import ParallelDims

pytestmark = pytest.mark.slow

GPT2 = {"model.preset": "gpt2-debug", "model.vocab_size": 515}
"""2 blocks, 4 heads, width 64, tied; an odd vocabulary as GPT-2's 50,257 is, so tensor parallelism
splits the token table, the tied head and the logits unevenly (258 and 257 rows)."""


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


def vocabulary_rows_job(overrides: dict) -> dict:
    """This rank's rows of the token table and columns of the logits under the layout."""
    import torch
    import torch.distributed as dist

    from shardwise.distributed.parallelize import parallelize_config

    cfg = load_config(overrides=overrides)
    parallel = parallelize_config(cfg, ParallelDims.from_config(cfg.parallel, dist.get_world_size()),
                                  device=torch.device("cpu"))
    table = parallel.module.embed_tokens.weight
    logits = parallel.module(torch.zeros(1, 8, dtype=torch.long))
    return {"table_rows": table.to_local().shape[0], "logits_columns": logits.to_local().shape[-1]}


def test_tp_splits_an_odd_vocabulary_unevenly(pool2, tmp_path, data_cache):
    """What the tp parity cases above run on: 515 rows as torch.chunk cuts them, not padded, not whole."""
    by_rank = pool2.run(vocabulary_rows_job, gpt2_layout(tmp_path, data_cache, "rows", tp=2))
    assert [r["table_rows"] for r in by_rank] == [258, 257]
    assert [r["logits_columns"] for r in by_rank] == [258, 257]


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
