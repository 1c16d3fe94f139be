"""The encoder families and T5 get their layouts from their plans alone (models/bert/plan.py,
models/vit/plan.py, models/t5/plan.py), each equal to one process within the harness's
tolerance (and for its reasons):

  BERT (masked LM)  data parallel (ZeRO-0, 1, 2 and 3), tensor parallel with and without sequence
                    parallelism (three tables split like the vocabulary, the output bias split
                    with the logits), pipeline parallel (the tied table across stages)
  ViT (digits)      data parallel (ZeRO-0, 1, 2 and 3), tensor parallel with and without sequence
                    parallelism (the patch embedding's output scattered over the sequence, the
                    class token gathered back), pipeline parallel (images into the first stage)
  T5 (spans)        data parallel (ZeRO-0 to 3, the decoder blocks their own FSDP units),
                    tensor parallel (both block stacks, the relative-bias tables split by heads),
                    with sequence parallelism (data.length_multiple rounds the lengths to even
                    ones; the encoder output gathered once for the decoder's cross-attention)

The masked-LM batches mask exactly round(0.15 x 32) = 5 tokens of each sequence, and span
corruption hides exactly round(0.15 x 32 / 3) = 2 spans, so every micro-batch's mean loss weighs
the same and the layouts' means equal one process's. Context parallelism is refused for all three,
pipeline parallelism for T5, before any work."""

import re

import pytest

from harness import check_parity, check_tp_generation, layout, run_reference
from shardwise.config.loader import load_config
from shardwise.distributed.dims import ParallelDims

pytestmark = pytest.mark.slow

BERT = {"model.preset": "bert-debug", "model.vocab_size": 515}
"""2 post-norm blocks, 4 heads, width 64, tied; an odd vocabulary (BERT's 30,522 does not divide by 4), so
tensor parallelism splits the table, the head and the output bias unevenly."""
VIT = {"model.preset": "vit-debug", "data.source": "digits", "data.image_pad": 1, "model.image_size": 10,
       "model.max_seq_len": 26, "train.seq_len": 26}
"""Digits padded to 10x10: 25 patches of 2x2 and the class token, 26 positions that split over 2 ranks."""

T5 = {"model.preset": "t5-debug", "data.length_multiple": 2}
"""2 + 2 blocks, 4 heads of 16, width 64, vocab 512, tied (v1.0); every layout (the reference too) rounds the
span-corrupted lengths to even ones: inputs 32 - 2*2 + 1 = 29 -> 28 tokens, targets 4*2 + 1 = 9 -> 10 (one
ignored), so that sequence parallelism can split both over 2 ranks."""

LAYOUTS = [{"zero": 0}, {"zero": 1}, {"zero": 2}, {"zero": 3}, {"tp": 2}, {"tp": 2, "sp": True},
           {"pp": 2, "pp_schedule": "1f1b"}]
IDS = ["dp2-zero0", "dp2-zero1", "dp2-zero2", "dp2-zero3", "tp2", "tp2-sp", "pp2-1f1b"]


def family_layout(family, tmp_path, data_cache, name, **parallel):
    return {**layout(tmp_path, data_cache, name, **parallel), **family}


@pytest.fixture(scope="module")
def bert_reference(tmp_path_factory, data_cache):
    return run_reference(family_layout(BERT, tmp_path_factory.mktemp("bert-reference"), data_cache, "run"))


@pytest.fixture(scope="module")
def vit_reference(tmp_path_factory, data_cache):
    return run_reference(family_layout(VIT, tmp_path_factory.mktemp("vit-reference"), data_cache, "run"))


@pytest.mark.parametrize("parallel", LAYOUTS, ids=IDS)
def test_bert_layouts_equal_one_process(pool2, tmp_path, data_cache, bert_reference, parallel):
    check_parity(pool2, family_layout(BERT, tmp_path, data_cache, "run", **parallel), bert_reference)


@pytest.mark.parametrize("parallel", LAYOUTS, ids=IDS)
def test_vit_layouts_equal_one_process(pool2, tmp_path, data_cache, vit_reference, parallel):
    check_parity(pool2, family_layout(VIT, tmp_path, data_cache, "run", **parallel), vit_reference)


@pytest.fixture(scope="module")
def t5_reference(tmp_path_factory, data_cache):
    return run_reference(family_layout(T5, tmp_path_factory.mktemp("t5-reference"), data_cache, "run"))


@pytest.mark.parametrize("parallel", LAYOUTS[:6], ids=IDS[:6])
def test_t5_layouts_equal_one_process(pool2, tmp_path, data_cache, t5_reference, parallel):
    check_parity(pool2, family_layout(T5, tmp_path, data_cache, "run", **parallel), t5_reference)


@pytest.mark.parametrize("parallel, message", [
    ({"parallel.pp": 2}, "parallel.pp = 2 is invalid: pipeline stages hand on one activation, and every T5 decoder"),
    ({"parallel.tp": 2, "parallel.sp": True, "data.length_multiple": 1},
     "parallel.sp = True is invalid: sequence parallelism splits each sequence over the tp ranks, and T5's "
     "span-corrupted inputs and targets have odd lengths: set data.length_multiple to a multiple of parallel.tp "
     "(now 1;"),
], ids=["pp", "sp-without-length-multiple"])
def test_pipeline_and_unrounded_sequence_parallel_are_refused_for_t5(tmp_path, data_cache, parallel, message):
    cfg = load_config(overrides={**family_layout(T5, tmp_path, data_cache, "run"), **parallel})
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelDims.from_config(cfg.parallel, 2).check(cfg)


@pytest.mark.parametrize("family", [BERT, VIT, T5], ids=["bert", "vit", "t5"])
def test_context_parallel_is_refused_for_encoders(tmp_path, data_cache, family):
    cfg = load_config(overrides={**family_layout(family, tmp_path, data_cache, "run"), "parallel.cp": 2})
    with pytest.raises(ValueError, match=re.escape("parallel.cp = 2 is invalid: context parallelism splits causal "
                                                   "attention")):
        ParallelDims.from_config(cfg.parallel, 2).check(cfg)


def test_t5_generation_under_tp_equals_one_process(pool2, tmp_path, data_cache):
    """The encoder-decoder engine under tensor parallelism (TensorParallelEncoderDecoderRunner): the
    leader broadcasts each new sequence's prompt to every rank's encoder, then the decode steps; the
    greedy text equals one process's."""
    check_tp_generation(pool2, {**family_layout(T5, tmp_path, data_cache, "gen"), "train.steps": 20,
                                "train.lr": 1e-2})
