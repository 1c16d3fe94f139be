"""The planner's activation memory per block for the LayerNorm families (GPT-2, BERT, ViT: 8h + 2f
elements per token, planner/memory.py) against what autograd really saves (observe/activations.py),
measured on this CPU in fp32 for one layout per family (one process, and tp2 + sp is covered by
the Llama validation's shared code path). One block's bytes are the difference between the model
with 3 blocks and with 2, so embeddings, heads and the loss cancel out.

Tolerance: 2%. What the count leaves out is LayerNorm's per-token mean and rstd (4 elements per
block) and SDPA's log-sum-exp (n_heads = 4 elements per token): measured / predicted was 1.0078 for
all three families (8 of 1,032 elements) when this test was written.

T5 (encoder-decoder, planner/memory.py's `t5_block_elements`) is measured per stack: an encoder
block is the model with 3 encoder blocks minus 2 (decoder depth fixed), a decoder block likewise with
the decoder's depth, v1.0 (ReLU MLP) and v1.1 (gated GELU). `layout_activation_bytes` feeds seq_len
tokens to both stacks; training feeds span corruption's (seq_len - 2n + 1 and 4n + 1), which the
planner assumes, so a second check runs the model on a real span-corrupted batch through
`saved_activation_bytes` and compares with the planner's own per-block count. What the count leaves
out is 1 fp32 rsqrt per RMSNorm and the cross-attention's log-sum-exp (n_heads per decoder token):
2 of 1,024 elements per encoder token and 7 of 1,472 per decoder token at equal lengths, v1.0
(measured / predicted 1.0020 and 1.0048 when this test was written)."""

import numpy as np
import pytest
import torch

from shardwise.config.loader import load_config
from shardwise.core.model_counts import SPAN_MASK_FRACTION
from shardwise.config.schema import DataConfig
from shardwise.data.objectives import SpanCorruption
from shardwise.models.t5.model import build_model
from shardwise.observe.activations import layout_activation_bytes, saved_activation_bytes
from shardwise.planner.layout import Layout
from shardwise.planner.memory import block_activation_elements, span_corruption_lengths, t5_block_elements
from shardwise.planner.model_resolution import resolve_model

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


T5 = {"model.preset": "t5-debug", "data.source": "stdlib", "data.vocab_size": 512, "train.seq_len": 64,
      "train.micro_batch_size": 4, "train.global_batch_size": 4, "train.chunked_loss": False}
T5_VERSIONS = {"v1.0": {}, "v1.1": {"model.gated_mlp": True, "model.tie_embeddings": False}}
SEQUENCES = 4
FP32 = 4


def t5_config(version: str, encoder_blocks: int, decoder_blocks: int):
    return load_config(overrides={**T5, **T5_VERSIONS[version], "model.n_layers": encoder_blocks,
                                  "model.n_decoder_layers": decoder_blocks})


def t5_shape(version: str):
    cfg = t5_config(version, 2, 2).model
    return resolve_model({"preset": "t5-debug", "gated_mlp": cfg.gated_mlp, "tie_embeddings": cfg.tie_embeddings})


def block_differences(measure) -> tuple[int, int]:
    """(one encoder block's bytes, one decoder block's bytes): 3 blocks of a stack minus 2."""
    base = measure(2, 2)
    return measure(3, 2) - base, measure(2, 3) - base


@pytest.mark.parametrize("version", T5_VERSIONS)
def test_t5_blocks_match_the_planner(version):
    """Both stacks at seq_len tokens, as `layout_activation_bytes` feeds them."""
    seq_len = T5["train.seq_len"]
    encoder, decoder = block_differences(lambda e, d: layout_activation_bytes(t5_config(version, e, d)))
    shape, layout = t5_shape(version), Layout(micro_batch=SEQUENCES, seq_len=seq_len)
    for measured, is_decoder in ((encoder, False), (decoder, True)):
        elements = t5_block_elements(shape, layout, decoder=is_decoder, encoder_len=seq_len, decoder_len=seq_len)
        predicted = elements * SEQUENCES * seq_len * FP32
        assert measured == pytest.approx(predicted, rel=0.02), (version, is_decoder, measured, predicted)


def span_corrupted_batch(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    windows = torch.randint(40, 512, (SEQUENCES, seq_len + 1), generator=torch.Generator().manual_seed(0))
    objective = SpanCorruption(sentinel_ids=tuple(range(2, 34)), eos_id=0, fraction=SPAN_MASK_FRACTION, seed=0)
    return objective(windows, np.arange(SEQUENCES))


def test_planner_span_lengths_are_the_objectives():
    assert SPAN_MASK_FRACTION == DataConfig.mask_fraction  # the counts assume the config's default
    for seq_len in (16, 64, 100, 512):
        inputs, targets = span_corrupted_batch(seq_len)
        assert span_corruption_lengths(seq_len) == (inputs.shape[1], targets.shape[1])


@pytest.mark.parametrize("version", T5_VERSIONS)
def test_t5_blocks_at_span_corruption_lengths(version):
    """The planner's own T5 count (span-corruption lengths of seq_len) against a span-corrupted batch."""
    seq_len = T5["train.seq_len"]
    inputs, targets = span_corrupted_batch(seq_len)

    def measure(encoder_blocks: int, decoder_blocks: int) -> int:
        model = build_model(t5_config(version, encoder_blocks, decoder_blocks).model)
        return saved_activation_bytes(model, inputs, targets_BT=targets)[1]

    encoder, decoder = block_differences(measure)
    shape, layout = t5_shape(version), Layout(micro_batch=SEQUENCES, seq_len=seq_len)
    first_decoder_block = shape.n_layers
    for measured, layer, tokens in ((encoder, 0, inputs.shape[1]), (decoder, first_decoder_block, targets.shape[1])):
        predicted = block_activation_elements(shape, layout, layer) * SEQUENCES * tokens * FP32
        assert measured == pytest.approx(predicted, rel=0.02), (version, layer, measured, predicted)
