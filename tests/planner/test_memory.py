"""The memory model's parameter, gradient and optimizer terms, exactly (ZeRO paper, figure 1)."""

import pytest

from shardwise.config.presets import PRESETS
from shardwise.core import model_counts
from shardwise.models.families import counts_of, spec_of
from shardwise.planner.layout import Layout
from shardwise.planner.memory import peak_memory, rank_memory
from shardwise.planner.model_resolution import resolve_model
from shardwise.planner.placement import rank_params, split_layers

PSI = 8_030_261_248  # llama3-8b


@pytest.fixture(scope="module")
def llama8b():
    return resolve_model("llama3-8b")


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_fp32_zero_stages_divide_by_dp(llama8b, zero):
    dp = 8
    b = rank_memory(llama8b, Layout(dp=dp, zero=zero, dtype="fp32", seq_len=1024), 0).breakdown
    assert b["params"] == PSI * 4 / (dp if zero >= 3 else 1)
    assert b["grads"] == PSI * 4 / (dp if zero >= 2 else 1)
    assert b["optimizer"] == PSI * 8 / (dp if zero >= 1 else 1)
    assert b["grad_accum_buffer"] == 0


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_mixed_precision_with_fp32_accumulation(llama8b, zero):
    dp = 4
    layout = Layout(dp=dp, zero=zero, dtype="bf16", grad_accum_dtype="fp32", seq_len=1024)
    b = rank_memory(llama8b, layout, 0).breakdown
    assert b["params"] == PSI * 2 / (dp if zero >= 3 else 1)
    assert b["grads"] == PSI * 2 / (dp if zero >= 2 else 1)
    assert b["grad_accum_buffer"] == PSI * 4 / (dp if zero >= 2 else 1)
    assert b["optimizer"] == PSI * 12 / (dp if zero >= 1 else 1)


def test_tensor_parallel_divides_all_but_the_norms(llama8b):
    tp = 4
    b = rank_memory(llama8b, Layout(tp=tp, dtype="fp32", seq_len=1024), 0).breakdown
    norms = llama8b.n_layers * 2 * llama8b.dim + llama8b.dim
    assert b["params"] == ((PSI - norms) / tp + norms) * 4


def test_hsdp_shards_within_a_group(llama8b):
    b = rank_memory(llama8b, Layout(dp=8, dp_replicate=2, zero=3, dtype="fp32", seq_len=1024), 0).breakdown
    assert b["params"] == PSI * 4 / 4


def test_pipeline_stages_hold_their_blocks_and_the_ends(llama8b):
    stages = split_layers(llama8b, 4, 1024)
    assert [i for s in stages for i in s] == list(range(32)) and all(stages)
    first, last = rank_params(llama8b, Layout(pp=4, grad_accum=4), 0), rank_params(llama8b, Layout(pp=4, grad_accum=4), 3)
    block = counts_of(llama8b).layer_params(0)
    table = llama8b.vocab_size * llama8b.dim
    assert first.total == len(stages[0]) * block + table
    assert last.total == len(stages[3]) * block + table + llama8b.dim  # untied head + final norm
    # the head costs ~3.4 blocks of FLOPs: the last stage gets fewer blocks
    assert len(stages[3]) < len(stages[0])
    total = sum(rank_params(llama8b, Layout(pp=4, grad_accum=4), r).total for r in range(4))
    assert total == PSI


def test_tied_table_is_held_by_both_end_stages():
    model = resolve_model("llama3-1b")
    layout = Layout(pp=2, grad_accum=2)
    total = sum(rank_params(model, layout, r).total for r in range(2))
    assert total == counts_of(model).num_params() + model.vocab_size * model.dim


def test_split_is_as_balanced_as_the_runtime_split():
    from shardwise.core.stage_split import split_layers as runtime_split
    from shardwise.core.stage_split import stage_costs
    from shardwise.config.presets import model_config

    for preset, stages in (("llama3-8b", 4), ("llama3-1b", 3), ("demo", 2), ("llama3-3b", 8), ("llama3-70b", 16)):
        cfg, shape = model_config(preset), resolve_model(preset)
        blocks, first, last = stage_costs(cfg, spec_of(cfg.family), 512)

        def largest(split):
            return max(sum(blocks[i] for i in s) + (first if k == 0 else 0) + (last if k == len(split) - 1 else 0)
                       for k, s in enumerate(split))

        ours = split_layers(shape, stages, 512)
        runtime = runtime_split(cfg, spec_of(cfg.family), num_stages=stages, seq_len=512)
        assert largest(ours) == pytest.approx(largest(runtime), rel=1e-12), preset


def test_activations_follow_recompute_and_sequence_parallel(llama8b):
    base = dict(dp=1, tp=2, micro_batch=1, seq_len=2048)
    none = peak_memory(llama8b, Layout(**base)).breakdown["activations"]
    sp = peak_memory(llama8b, Layout(**base, sp=True)).breakdown["activations"]
    selective = peak_memory(llama8b, Layout(**base, recompute="selective")).breakdown["activations"]
    full = peak_memory(llama8b, Layout(**base, recompute="full")).breakdown["activations"]
    assert full < selective < none and sp < none
    # full recompute keeps each block's input: h elements per token, bf16
    assert full == pytest.approx(32 * 2048 * 4096 * 2 + 2048 * 4096 * 2)


def test_pipeline_rank0_holds_pp_micro_batches(llama8b):
    one = rank_memory(llama8b, Layout(pp=4, grad_accum=8, seq_len=1024), 0)
    gpipe = rank_memory(llama8b, Layout(pp=4, grad_accum=8, seq_len=1024, pp_schedule="gpipe"), 0)
    assert gpipe.breakdown["activations"] == pytest.approx(one.breakdown["activations"] * 8 / 4)


def test_moe_layers_are_replicated_over_tp_and_experts_split_over_ep():
    model = resolve_model({"preset": "demo", "n_experts": 4, "experts_per_token": 2})
    one = rank_params(model, Layout(), 0)
    split = rank_params(model, Layout(dp=2, tp=2, ep=2), 0)
    experts = model.n_layers * 4 * model_counts.expert_params(model)
    assert one.experts == experts and split.experts == experts / 2
    table = model_counts.embedding_params(model, spec_of(model.family))
    attention_and_table = model.n_layers * counts_of(model).attention_params() + table
    assert split.tp_sharded == attention_and_table / 2  # tied head: the table is counted once
    assert split.replicated == one.replicated  # norms, routers
    b = rank_memory(model, Layout(dp=2, tp=2, ep=2, dtype="fp32", seq_len=64), 0).breakdown
    assert b["params"] == 4 * (split.tp_sharded + split.replicated + split.experts)
    assert b["optimizer"] == 8 * (split.tp_sharded + split.replicated + split.experts)
    z3 = rank_memory(model, Layout(dp=2, tp=2, ep=2, zero=3, dtype="fp32", seq_len=64), 0).breakdown
    assert z3["params"] == 4 * (split.tp_sharded + split.replicated) / 2 + 4 * split.experts  # experts: dp/ep = 1 copy


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_one_rank_holds_every_parameter_of_every_family(preset):
    """The planner's per-rank parameters add up to the model's count for every preset: T5's decoder
    blocks, GPT-2's LayerNorm biases, BERT's embedding LayerNorm and ViT's patch projection included."""
    model = resolve_model(preset)
    assert rank_params(model, Layout(), 0).total == counts_of(model).num_params()
