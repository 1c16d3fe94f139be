"""Llama-family variants under the layouts: Qwen3's per-head q/k norms (`model.qk_norm`) and
sliding-window attention (`model.sliding_window`), parity with one process (harness.py states
the tolerance); ring attention's refusal of a window; generation of such a model under TP.

The harness's sequences are 32 tokens long and the window is 8, so every layout's attention is
cut short by it for most queries. Under tensor parallelism a q/k norm sees only its rank's heads,
so its gradient is partial per rank: a layout that did not sum it over tp ranks would train the
norms differently on each rank (the q/k norm tests would fail).
"""

import pytest

from harness import check_parity, check_tp_generation, layout, run_reference, train_job

pytestmark = pytest.mark.slow

QK_NORM = {"model.qk_norm": True}
WINDOW = {"model.sliding_window": 8}


@pytest.fixture(scope="module")
def references(tmp_path_factory, data_cache):
    """One single-process reference per model variant, shared by its layouts."""
    cache = {}

    def get(model: dict):
        key = tuple(sorted(model.items()))
        if key not in cache:
            cache[key] = run_reference({**layout(tmp_path_factory.mktemp("reference"), data_cache, "run"), **model})
        return cache[key]

    return get


def variant_layout(tmp_path, data_cache, model: dict, **parallel):
    name = "-".join(f"{k}{v}" for k, v in parallel.items()) or "one-process"
    return {**layout(tmp_path, data_cache, name, **parallel), **model}


@pytest.mark.parametrize("parallel", [
    {"tp": 2},
    {"tp": 2, "sp": True},
    {"zero": 3},
], ids=["tp2", "tp2-sp", "dp2-zero3"])
def test_qk_norm_equals_one_process(pool2, tmp_path, data_cache, references, parallel):
    check_parity(pool2, variant_layout(tmp_path, data_cache, QK_NORM, **parallel), references(QK_NORM))


@pytest.mark.parametrize("parallel", [
    {"zero": 0},
    {"tp": 2},
    {"tp": 2, "sp": True},
    {"pp": 2},
    {"cp": 2, "cp_mode": "alltoall"},
], ids=["dp2", "tp2", "tp2-sp", "pp2", "cp2-alltoall"])
def test_sliding_window_equals_one_process(pool2, tmp_path, data_cache, references, parallel):
    check_parity(pool2, variant_layout(tmp_path, data_cache, WINDOW, **parallel), references(WINDOW))


def test_ring_attention_refuses_a_window_before_any_work(pool2, tmp_path, data_cache):
    overrides = variant_layout(tmp_path, data_cache, WINDOW, cp=2, cp_mode="ring")
    with pytest.raises(RuntimeError, match=r"parallel.cp_mode = 'ring' is invalid: ring attention has no sliding "
                                           r"window \(model.sliding_window = 8\) yet"):
        pool2.run(train_job, overrides)
    assert not (tmp_path / "cp2-cp_modering" / "checkpoints").exists()


def test_generation_of_qk_norm_and_window_under_tp_equals_one_process(pool2, tmp_path, data_cache):
    """The engine over the TP plan (q/k norms replicated over the head shards) and the KV cache's
    windowed mask; prompt and output together are longer than the window."""
    overrides = {**variant_layout(tmp_path, data_cache, {**QK_NORM, **WINDOW, "model.tie_embeddings": False}),
                 "train.steps": 20, "train.lr": 1e-2}
    check_tp_generation(pool2, overrides)
