"""Stage splitting for pipeline parallelism (one process: no schedule yet)."""

import itertools

import pytest
import torch

from shardwise.core.stage_split import split_layers, stage_costs
from shardwise.distributed.pipeline_parallel import keep_stage
from shardwise.models.families import counts_of
from shardwise.models.llama.model import Llama, build_model
from shardwise.models.llama.spec import SPEC as LLAMA
from shardwise.config.presets import model_config


@pytest.mark.parametrize("preset, stages", [("llama3-8b", 4), ("llama3-1b", 3), ("debug", 2), ("demo", 4)])
def test_split_covers_every_block_once_and_balances_cost(preset, stages):
    cfg = model_config(preset)
    split = split_layers(cfg, LLAMA, num_stages=stages, seq_len=4096)
    assert [i for stage in split for i in stage] == list(range(cfg.n_layers))
    assert all(stage for stage in split)
    blocks, first, last = stage_costs(cfg, LLAMA, 4096)
    costs = [sum(blocks[i] for i in stage) + (first if k == 0 else 0) + (last if k == stages - 1 else 0)
             for k, stage in enumerate(split)]
    # Exhaustive check: no contiguous split has a cheaper most-expensive stage.
    best = min(
        max(sum(blocks[a:b]) + (first if k == 0 else 0) + (last if k == stages - 1 else 0)
            for k, (a, b) in enumerate(zip((0, *cuts), (*cuts, cfg.n_layers))))
        for cuts in itertools.combinations(range(1, cfg.n_layers), stages - 1)
    )
    assert max(costs) == pytest.approx(best)


def test_moe_blocks_cost_their_active_experts():
    """Every 2nd block a MoE of 8 experts of 2x the dense FFN, top-2: a MoE block computes more per
    token than a dense one, so a stage takes fewer of them."""
    cfg = model_config("demo", n_layers=8, n_experts=8, experts_per_token=2, moe_ffn_dim=1408, moe_layer_step=2)
    blocks, _, _ = stage_costs(cfg, LLAMA, 128)
    dense, moe = {blocks[i] for i in range(8) if not cfg.is_moe_layer(i)}, {blocks[i] for i in range(8) if cfg.is_moe_layer(i)}
    assert len(dense) == len(moe) == 1 and moe.pop() > dense.pop()
    dense_block = counts_of(cfg).block_params()
    expected = 6 * (dense_block - 3 * cfg.dim * cfg.ffn_dim + cfg.dim * 8 + 2 * 3 * cfg.dim * 1408)
    assert max(blocks) == expected + 12 * cfg.n_heads * cfg.head_size * 128


def test_output_head_cost_moves_blocks_off_the_last_stage():
    cfg = model_config("llama3-8b")  # a 128k vocabulary head costs about 1.8 blocks
    split = split_layers(cfg, LLAMA, num_stages=4, seq_len=4096)
    assert len(split[-1]) < len(split[0])


@pytest.mark.parametrize("tied", [False, True])
def test_stages_run_in_sequence_equal_the_whole_model(tied):
    cfg = model_config("debug", n_layers=4, tie_embeddings=tied)
    full = build_model(cfg, seed=3)
    split = split_layers(cfg, LLAMA, num_stages=2, seq_len=32)
    stages = []
    for k, layer_ids in enumerate(split):
        with torch.device("meta"):
            part = Llama(cfg)
        keep_stage(part, layer_ids, is_first=k == 0, is_last=k == len(split) - 1)
        part.to_empty(device="cpu")
        part.init_weights(3)  # the same values as the full model: each tensor is seeded by its name
        stages.append(part)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        hidden = stages[0](tokens)
        torch.testing.assert_close(stages[1](hidden), full(tokens), rtol=0, atol=0)
    names = set().union(*(dict(s.named_parameters()).keys() for s in stages))
    assert names == set(dict(full.named_parameters()))


def test_bad_stage_counts_are_refused():
    cfg = model_config("debug")
    with pytest.raises(ValueError, match=r"parallel.pp x parallel.pp_virtual_stages = 3 stages is invalid for model.n_layers = 2"):
        split_layers(cfg, LLAMA, num_stages=3, seq_len=32)


def test_tied_last_stage_keeps_the_table_and_middle_stages_drop_it():
    cfg = model_config("debug", n_layers=3)
    names = []
    for k in range(3):
        with torch.device("meta"):
            model = Llama(cfg)
        keep_stage(model, [k], is_first=k == 0, is_last=k == 2)
        names.append({n for n, _ in model.named_parameters()})
    assert "embed_tokens.weight" in names[0] and "embed_tokens.weight" in names[2]
    assert "embed_tokens.weight" not in names[1]
