"""Packed batches (data.packing) and document masks on text (data.document_mask) under the layouts:
each equals one process (the harness's check_parity: losses per step and final parameters, fp32,
rtol = atol = 1e-5, see harness.py). Packed prompt_completion rows hold different numbers of loss
tokens per micro-batch and per rank, so these also check that the loss is normalised by the global
batch's loss tokens on every layout (train/step.py); and compiled blocks take the document mask as
an input, built outside them: one graph, no break, no recompilation when the documents change.
"""

from __future__ import annotations

import json

import pytest
import torch

from harness import check_parity, layout, train_job

pytestmark = pytest.mark.slow

PAIRS = [{"prompt": f"def f{k}(x):\n" + "    # note\n" * (k % 3),
          "completion": "    return x" + " + 1" * (k % 7) + "\n"} for k in range(48)]
"""Short pairs of uneven lengths: one to four examples a 32-token row, and uneven loss tokens."""


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(pair) + "\n" for pair in PAIRS))
    return str(path)


def packed(tmp_path, data_cache, pairs_file, name, **parallel) -> dict:
    return {**layout(tmp_path, data_cache, name, **parallel), "data.source": pairs_file,
            "data.format": "prompt_completion", "data.packing": True, "data.vocab_size": 300}


@pytest.mark.parametrize("parallel, extra", [
    ({"zero": 0}, {}),
    ({"zero": 3}, {}),
    ({"tp": 2, "sp": True}, {}),
    ({"tp": 2}, {"train.chunked_loss": False}),
    ({"pp": 2, "pp_schedule": "1f1b"}, {}),
], ids=["dp2", "dp2-zero3", "tp2-sp", "tp2-logits-loss", "pp2"])
def test_packed_layout_equals_one_process(pool2, tmp_path, data_cache, pairs_file, parallel, extra):
    check_parity(pool2, {**packed(tmp_path, data_cache, pairs_file, "run", **parallel), **extra})


@pytest.mark.parametrize("parallel", [{"zero": 1}, {"pp": 2, "pp_schedule": "1f1b"}], ids=["dp2", "pp2"])
def test_packed_validation_loss_equals_one_process(pool2, tmp_path, data_cache, pairs_file, parallel):
    """val_loss is the mean over the held-out examples' loss tokens, whichever rank or stage holds them."""
    evaluated = {"data.val_fraction": 0.25, "train.steps": 2, "train.eval_every": 2, "train.eval_batches": 1}
    single = train_job({**packed(tmp_path, data_cache, pairs_file, "reference"), **evaluated})["val_losses"]
    assert sorted(single) == [2]
    for result in pool2.run(train_job, {**packed(tmp_path, data_cache, pairs_file, "run", **parallel), **evaluated}):
        torch.testing.assert_close(torch.tensor(result["val_losses"][2]), torch.tensor(single[2]), rtol=1e-5, atol=1e-5)


def test_padded_examples_under_context_parallelism_equal_one_process(pool2, tmp_path, data_cache, pairs_file):
    """Padded (unpacked) examples split over cp ranks: each rank's halves hold different numbers of
    loss tokens, so only the global batch's token count makes cp2 equal one process."""
    check_parity(pool2, {**packed(tmp_path, data_cache, pairs_file, "run", cp=2), "data.packing": False})


def test_document_mask_on_text_dp2_equals_one_process(pool2, tmp_path, data_cache):
    check_parity(pool2, {**layout(tmp_path, data_cache, "run", zero=1), "data.document_mask": True})


def test_compiled_blocks_take_the_document_mask_as_an_input(tmp_path, data_cache, pairs_file):
    """Compiled blocks on packed batches: one graph shared by the blocks, no graph break, no
    recompilation as the batches' documents change, and the loss and gradients of the eager model."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from shardwise.config.loader import load_config
    from shardwise.data.training_data import build_run_loaders, prepare_data
    from shardwise.distributed.dims import ParallelDims
    from shardwise.distributed.parallelize import parallelize_config
    from shardwise.train.step import forward_backward

    def laid_out(compiled: bool):
        cfg = load_config(overrides={**packed(tmp_path, data_cache, pairs_file, "compiled"),
                                     "train.compile": compiled})
        return cfg, parallelize_config(cfg, ParallelDims.from_config(cfg.parallel, 1), device=torch.device("cpu"))

    torch._dynamo.reset()
    counters.clear()
    cfg, compiled = laid_out(True)
    _, eager = laid_out(False)
    loader = build_run_loaders(cfg, prepare_data(cfg))[0]
    steps = [loader.next_step() for _ in range(3)]
    assert all(len(micro_batch) == 3 for micro_batch in steps[0])
    assert not torch.equal(steps[0][0][2], steps[1][0][2])  # other documents, same shapes
    for index, micro_batches in enumerate(steps):
        with torch._dynamo.config.patch(error_on_recompile=index > 0):
            losses = [forward_backward(pm, micro_batches, cfg, torch.device("cpu")) for pm in (compiled, eager)]
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
        for (name, c), e in zip(compiled.model.named_parameters(), eager.model.parameters()):
            torch.testing.assert_close(c.grad, e.grad, rtol=1e-4, atol=1e-5, msg=name)
            c.grad, e.grad = None, None
    assert counters["stats"]["unique_graphs"] == 1
    assert dict(counters["graph_break"]) == {}
