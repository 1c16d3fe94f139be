"""A second model family (toy_family.py: other module names, LayerNorm, GELU, learned positions)
gets data parallel, ZeRO-1/3, tensor parallel, pipeline parallel and recomputation from its
plan alone, each equal to one process (the harness's tolerance, same reasons)."""

import pytest
import torch

from harness import ATOL, RTOL
from shardwise.config.schema import Config
from shardwise.distributed.dims import ParallelDims
from shardwise.distributed.grad_sync import mean_over_dp
from shardwise.distributed.parallelize import parallelize
from shardwise.checkpoint.store import gather_full_state
from shardwise.train.optim import build_optimizer
from shardwise.train.step import train_step
from toy_family import ToyConfig, ToyLM, toy_plan

STEPS, BATCH, MICRO, SEQ = 3, 8, 2, 16


def toy_run(parallel: dict, recompute: str = "none") -> dict:
    """Train the toy model on this process group (or alone): losses per step, full final weights on rank 0."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    cfg = Config()
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    cfg.train.seq_len, cfg.train.lr, cfg.train.eps, cfg.train.recompute = SEQ, 1e-3, 1e-6, recompute  # as harness.layout
    cfg.train.global_batch_size, cfg.train.micro_batch_size = BATCH, MICRO
    dims = ParallelDims.from_config(cfg.parallel, world)
    meshes = dims.build_meshes("cpu")
    toy = ToyConfig()
    with torch.device("meta"):
        model = ToyLM(toy)
    pm = parallelize(model, toy_plan(toy), dims, cfg, meshes=meshes, device=torch.device("cpu"),
                     num_micro_batches=dims.num_micro_batches(cfg))
    optimizer = build_optimizer([p for _, p, _ in pm.sync.named_optimizer_params()], cfg.train)
    data = torch.randint(0, toy.vocab, (STEPS, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    share = BATCH // dims.dp
    first = dims.dp_rank(meshes) * share
    losses = []
    for step in range(STEPS):
        mine = data[step, first:first + share]
        micro_batches = [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(MICRO)]
        loss, _ = train_step(pm, optimizer, micro_batches, cfg, torch.device("cpu"))
        losses.append(mean_over_dp(loss, dims))
        pm.sync.zero_grad(optimizer)
    rank = torch.distributed.get_rank() if world > 1 else 0
    full = gather_full_state(pm, rank == 0) if world > 1 else {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": full}


@pytest.fixture(scope="module")
def reference():
    return toy_run({})


@pytest.mark.parametrize("parallel, recompute", [
    ({"zero": 0}, "none"),
    ({"zero": 1}, "full"),
    ({"zero": 3}, "selective"),
    ({"tp": 2}, "none"),
    ({"pp": 2, "pp_schedule": "1f1b"}, "full"),
], ids=["dp2", "dp2-zero1-recompute", "fsdp2-selective", "tp2", "pp2-1f1b-recompute"])
def test_toy_family_layouts_equal_one_process(pool2, reference, parallel, recompute):
    by_rank = pool2.run(toy_run, parallel, recompute)
    for result in by_rank:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]),
                                   rtol=RTOL, atol=ATOL)
    params = by_rank[0]["params"]
    assert params.keys() == reference["params"].keys()
    for name, value in params.items():
        torch.testing.assert_close(value, reference["params"][name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
