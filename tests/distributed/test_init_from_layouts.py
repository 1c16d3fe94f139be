"""train.init_from under the layouts: a run started from a Hugging Face directory (Llama: every tensor
a renamed slice; GPT-2: q/k/v computed from the fused c_attn) or from a run directory (DCP) equals one
process's run from the same source (the first loss and the parameters after one step, the parity
harness's tolerance), and each rank reads only its share of the weights."""

import pytest

from harness import check_parity, layout
from pretrained_dirs import write_hf_dir
from shardwise.config.loader import load_config
from shardwise.train.trainer import train

pytest.importorskip("transformers")

LAYOUTS = {"dp2-zero3": dict(zero=3), "tp2": dict(tp=2), "pp2": dict(pp=2)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory, data_cache):
    """The HF directories, and a run directory (one step of the debug model from scratch)."""
    root = tmp_path_factory.mktemp("sources")
    found = {family: write_hf_dir(root / family, family) for family in ("llama", "gpt2")}
    run_values = layout(root, data_cache, "run")
    train(load_config(overrides={**run_values, "train.steps": 1}))
    return found | {"run": root / "run"}


def init_layout(tmp_path, data_cache, name, source, **parallel) -> dict:
    """The harness's tiny run, one step, from `source` (model.* and the tokenizer come from it)."""
    overrides = layout(tmp_path, data_cache, name, **parallel)
    del overrides["model.preset"], overrides["data.vocab_size"]
    return overrides | {"train.init_from": str(source), "train.steps": 1}


@pytest.mark.parametrize("name", LAYOUTS)
def test_llama_from_hf_equals_one_process(pool2, tmp_path, data_cache, sources, name):
    check_parity(pool2, init_layout(tmp_path, data_cache, name, sources["llama"], **LAYOUTS[name]))


@pytest.mark.parametrize("name", ["dp2-zero3", "tp2"])
def test_gpt2_from_hf_equals_one_process(pool2, tmp_path, data_cache, sources, name):
    check_parity(pool2, init_layout(tmp_path, data_cache, name, sources["gpt2"], **LAYOUTS[name]))


def test_run_directory_under_zero3_equals_one_process(pool2, tmp_path, data_cache, sources):
    check_parity(pool2, init_layout(tmp_path, data_cache, "run-dp2-zero3", sources["run"], zero=3))


def bytes_read_job(overrides: dict) -> int:
    """The weight bytes this rank reads when its laid-out model loads train.init_from."""
    from shardwise.checkpoint.init_from import load_pretrained
    from shardwise.distributed.dims import ParallelDims
    from shardwise.distributed.parallelize import parallelize_config
    import torch

    cfg = load_config(overrides=overrides)
    pm = parallelize_config(cfg, ParallelDims.from_config(cfg.parallel, 2), device=torch.device("cpu"))
    return load_pretrained(pm, cfg)


@pytest.mark.parametrize("name, share", [("dp2-zero3", 0.5), ("tp2", 0.55)])
def test_each_rank_reads_only_its_share(pool2, tmp_path, data_cache, sources, name, share):
    """ZeRO-3 ranks read half of every tensor each; tp2 ranks half of the split ones, all of the norms."""
    model_bytes = (sources["llama"] / "model.safetensors").stat().st_size
    by_rank = pool2.run(bytes_read_job, init_layout(tmp_path, data_cache, name, sources["llama"], **LAYOUTS[name]))
    assert all(0.45 * model_bytes < read <= share * model_bytes for read in by_rank), (by_rank, model_bytes)
