"""LoRA (rank 4, every role of the debug llama) under each layout equals one process (the harness's
tolerance and reasons): losses per step and the merged weights `load_run` serves; beside that, the
adapters themselves equal one process's, they moved, and the frozen base did not."""

import pytest
import torch

from harness import ATOL, RTOL, check_parity, final_params, layout
from shardwise.config.loader import load_config
from shardwise.train.trainer import train
from shardwise.infer.load import load_run
from shardwise.models.build import build_on_meta
from shardwise.models.common.lora import adapter_initial_value, is_adapter_name

pytestmark = pytest.mark.slow

LORA = {"train.lora_rank": 4, "train.lora_alpha": 8.0}


def adapted_params(run_dir) -> dict[str, torch.Tensor]:
    """The run's newest checkpoint as its base beside its adapters (not merged)."""
    _, model, _ = load_run(run_dir, merge=False)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def seeded_base(overrides) -> dict[str, torch.Tensor]:
    cfg = load_config(overrides=overrides)
    model = build_on_meta(cfg.model)
    model.to_empty(device="cpu")
    model.init_weights(cfg.train.seed)
    return dict(model.named_parameters())


@pytest.fixture(scope="module")
def references(tmp_path_factory, data_cache):
    """One process's LoRA run per extra setting (eager, compiled), shared by the layouts: (losses,
    merged weights, base and adapters)."""
    cache = {}

    def get(**extra):
        key = tuple(sorted(extra.items()))
        if key not in cache:
            overrides = {**layout(tmp_path_factory.mktemp("reference"), data_cache, "one"), **LORA, **extra}
            losses = train(load_config(overrides=overrides)).losses
            cache[key] = (losses, final_params(overrides["run.dir"]), adapted_params(overrides["run.dir"]))
        return cache[key]

    return get


def check_lora_parity(pool, overrides, reference) -> None:
    """Layout = one process, and what trained is the adapters alone."""
    losses, merged, reference = reference
    check_parity(pool, overrides, reference=(losses, merged))
    trained = adapted_params(overrides["run.dir"])
    base, seed = seeded_base(overrides), load_config(overrides=overrides).train.seed
    adapters = [name for name in trained if is_adapter_name(name)]
    assert len(adapters) == 2 * 7 * 2  # A and B of q, k, v, o, gate, up, down in 2 blocks
    for name, value in trained.items():
        if is_adapter_name(name):
            torch.testing.assert_close(value, reference[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
            assert not torch.equal(value, adapter_initial_value(name, value.shape, "cpu", seed)), f"{name} did not train"
        else:
            assert torch.equal(value, base[name]), f"the frozen base's {name} changed"


@pytest.mark.parametrize("parallel", [
    {"zero": 0},
    {"zero": 1},
    {"zero": 3},
    {"tp": 2, "sp": True},
    {"pp": 2},
], ids=["dp2", "dp2-zero1", "zero3", "tp2-sp", "pp2"])
def test_lora_layout_equals_one_process(pool2, tmp_path, data_cache, references, parallel):
    check_lora_parity(pool2, {**layout(tmp_path, data_cache, "lora", **parallel), **LORA}, references())


def test_compiled_lora_dp2_equals_compiled_one_process(pool2, tmp_path, data_cache, references):
    compiled = {"train.compile": True}
    overrides = {**layout(tmp_path, data_cache, "lora-compiled", zero=1), **LORA, **compiled}
    check_lora_parity(pool2, overrides, references(**compiled))
