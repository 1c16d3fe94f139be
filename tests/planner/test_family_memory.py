"""The planner's activation memory per block for the LayerNorm families (GPT-2, BERT, ViT: 8h + 2f
elements per token, planner/memory.py) against what autograd really saves (observe/activations.py),
measured on this CPU in fp32 for one layout per family (one process, and tp2 + sp is covered by
the Llama validation's shared code path). One block's bytes are the difference between the model
with 3 blocks and with 2, so embeddings, heads and the loss cancel out.

Tolerance: 2%. What the count leaves out is LayerNorm's per-token mean and rstd (4 elements per
block) and SDPA's log-sum-exp (n_heads = 4 elements per token): measured / predicted was 1.0078 for
all three families (8 of 1,032 elements) when this test was written."""

import pytest

from shardwise.config.loader import load_config
from shardwise.observe.activations import layout_activation_bytes
from shardwise.planner.layout import Layout
from shardwise.planner.memory import block_activation_elements
from shardwise.planner.model_shape import resolve_model

FAMILIES = {
    "gpt2": {"model.preset": "gpt2-debug", "data.source": "stdlib", "data.vocab_size": 512, "train.seq_len": 64},
    "bert": {"model.preset": "bert-debug", "data.source": "stdlib", "data.vocab_size": 512, "train.seq_len": 64},
    "vit": {"model.preset": "vit-debug", "data.source": "digits", "train.seq_len": 17},
}


def measured_block_bytes(overrides: dict) -> int:
    per_depth = {}
    for layers in (2, 3):
        cfg = load_config(overrides={**overrides, "model.n_layers": layers, "train.micro_batch_size": 4,
                                     "train.global_batch_size": 4, "train.chunked_loss": False})
        per_depth[layers] = layout_activation_bytes(cfg)
    return per_depth[3] - per_depth[2]


@pytest.mark.parametrize("family", FAMILIES)
def test_block_activations_match_the_planner(family):
    overrides = FAMILIES[family]
    cfg = load_config(overrides=overrides)
    shape = resolve_model({"preset": overrides["model.preset"]})
    layout = Layout(dp=1, tp=1, pp=1, micro_batch=4, seq_len=cfg.train.seq_len)
    predicted = block_activation_elements(shape, layout, 0) * 4 * cfg.train.seq_len * 4  # fp32, 4 sequences
    measured = measured_block_bytes(overrides)
    assert measured == pytest.approx(predicted, rel=0.02), (family, measured, predicted)
