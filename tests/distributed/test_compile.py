"""`train.compile`: each block compiled in place, in every layout. Compiled N processes equal
compiled one process (the harness's tolerance and reasons); compiled one process equals eager
one process within 1e-4 over 8 steps (inductor fuses element-wise ops and reorders their float
sums, so compiled and eager differ in the last bits from the first step; AdamW and 8 steps
amplify that, see harness.py)."""

import pytest
import torch

from harness import check_parity, final_params, layout

pytestmark = pytest.mark.slow

COMPILED = {"train.compile": True}


MOE = {"model.preset": "moe-debug"}  # 4 experts, top-2: regions around the experts (compile/regional.py)


@pytest.mark.parametrize("model", [{}, MOE], ids=["dense", "moe"])
def test_compiled_one_process_equals_eager_within_1e_4(tmp_path, data_cache, model):
    from shardwise.config.loader import load_config
    from shardwise.train.trainer import train

    runs = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        overrides = {**layout(tmp_path, data_cache, name), "train.steps": 8, "train.compile": compiled, **model}
        runs[name] = (train(load_config(overrides=overrides)).losses, final_params(overrides["run.dir"]))
    torch.testing.assert_close(torch.tensor(runs["compiled"][0]), torch.tensor(runs["eager"][0]), rtol=1e-4, atol=1e-4)
    for name, value in runs["compiled"][1].items():
        torch.testing.assert_close(value, runs["eager"][1][name], rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


FOUR_BLOCKS = {"model.n_layers": 4}  # two virtual stages on each of two pipeline ranks


@pytest.mark.parametrize("parallel, train", [
    ({"zero": 0}, {}),
    ({"zero": 1}, {"train.recompute": "full"}),
    ({"zero": 2}, {}),
    ({"zero": 3}, {"train.recompute": "selective"}),
    ({"tp": 2}, {}),
    ({"tp": 2, "sp": True}, {}),
    ({"tp": 2}, {"train.recompute": "full"}),
    ({"cp": 2, "cp_mode": "ring"}, {}),
    ({"cp": 2, "cp_mode": "alltoall"}, {}),
    ({"pp": 2, "pp_schedule": "1f1b"}, {}),
    ({"pp": 2, "pp_schedule": "gpipe"}, {"train.recompute": "full"}),
    ({"pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2}, FOUR_BLOCKS),
    ({"pp": 2, "pp_schedule": "zero-bubble", "pp_virtual_stages": 2}, FOUR_BLOCKS),
    ({"pp": 2, "pp_schedule": "zbv", "pp_virtual_stages": 2}, {**FOUR_BLOCKS, "model.tie_embeddings": False}),
    ({"ep": 2}, MOE),
    ({"ep": 2, "zero": 3}, {**MOE, "train.recompute": "full"}),
], ids=["dp2", "zero1-full-recompute", "zero2", "fsdp2-selective-recompute", "tp2", "tp2-sp", "tp2-full-recompute",
        "cp2-ring", "cp2-alltoall", "pp2-1f1b", "pp2-gpipe-full-recompute", "pp2-interleaved",
        "pp2-zero-bubble", "pp2-zbv",
        "moe-ep2", "moe-ep2-fsdp2-full-recompute"])
def test_compiled_layout_equals_compiled_one_process(pool2, tmp_path, data_cache, parallel, train):
    check_parity(pool2, {**layout(tmp_path, data_cache, "run", **parallel), **COMPILED, **train})


def test_compiled_hsdp_2x2_equals_compiled_one_process(pool4, tmp_path, data_cache):
    check_parity(pool4, {**layout(tmp_path, data_cache, "run", zero=3, dp_replicate=2), **COMPILED})


@pytest.mark.parametrize("preset, graphs", [("debug", 1), ("moe-debug", 3)], ids=["dense", "moe"])
def test_blocks_compile_to_one_graph_with_no_break_and_no_recompile(tiny_config, preset, graphs):
    """Every block compiled in place (names unchanged), all blocks sharing one graph, no graph
    break, and no recompilation after the first step at fixed shapes. A MoE block compiles as
    regions around its experts: the two norms (one graph: same code, same shapes), attention and
    router, shared by all blocks."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from shardwise.distributed.dims import ParallelDims
    from shardwise.distributed.parallelize import parallelize_config
    from shardwise.train.optim import build_optimizer
    from shardwise.train.step import train_step

    cfg = tiny_config(**{"train.compile": True, "model.preset": preset, "model.n_layers": 3})
    dims = ParallelDims.from_config(cfg.parallel, 1)
    torch._dynamo.reset()
    counters.clear()
    pm = parallelize_config(cfg, dims, device=torch.device("cpu"))
    blocks = list(pm.model.layers.values())
    def regions(block):
        return [block] if preset == "debug" else [block.attn_norm, block.attn, block.mlp_norm, block.mlp.router]

    assert all(region._compiled_call_impl is not None for block in blocks for region in regions(block))
    assert [name for name, _ in pm.model.named_parameters()][1] == "layers.0.attn_norm.weight"
    optimizer = build_optimizer([p for _, p, _ in pm.sync.named_optimizer_params()], cfg.train)
    gen = torch.Generator().manual_seed(0)

    def step():
        tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len + 1), generator=gen)
        train_step(pm, optimizer, [(tokens[:, :-1], tokens[:, 1:])], cfg, torch.device("cpu"))
        pm.sync.zero_grad(optimizer)

    step()
    assert counters["stats"]["unique_graphs"] == graphs  # three blocks, the graphs of one
    with torch._dynamo.config.patch(error_on_recompile=True):
        step()
        step()
    assert dict(counters["graph_break"]) == {}


@pytest.mark.parametrize("overrides, message", [
    ({"parallel.tp": 2, "train.recompute": "selective"},
     r"train.recompute = 'selective' is invalid: compiled blocks under tensor parallelism run with full recomputation"),
    ({"parallel.tp": 2, "parallel.sp": True, "train.recompute": "full"},
     r"train.recompute = 'full' is invalid: compiled blocks under tensor parallelism run with full recomputation only"),
])
def test_compile_where_it_does_not_run_yet_stops_before_any_work(tiny_config, overrides, message):
    from shardwise.distributed.dims import ParallelDims

    cfg = tiny_config(**{"train.compile": True, **overrides})
    with pytest.raises(ValueError, match=message):
        ParallelDims.from_config(cfg.parallel, cfg.parallel.tp * cfg.parallel.pp).check(cfg)
