"""State memory: ZeRO formula, de-duplication rule, AdamW measurement, FSDP2 halving on 2 gloo ranks."""


import pytest
import torch
from torch import nn

from shardwise.observe.memory import (
    format_bytes,
    format_memory_report,
    state_memory,
    tensor_bytes,
    unique_bytes,
    zero_formula_bytes,
)

WORLD_SIZE = 2
STEP_SCALAR_BYTES = 4  # AdamW's per-parameter fp32 `step` tensor, outside the ZeRO formula


def _tiny_model() -> nn.Module:
    # 7 output rows do not split evenly over 2 ranks: FSDP2 pads one shard.
    return nn.Sequential(nn.Linear(16, 7), nn.ReLU(), nn.Linear(7, 4))


def _one_adamw_step(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 16)).sum().backward()
    optimizer.step()
    return optimizer


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "zero, expected",
    [
        (0, {"params": 4000, "grads": 4000, "optimizer": 8000}),
        (1, {"params": 4000, "grads": 4000, "optimizer": 2000}),
        (2, {"params": 4000, "grads": 1000, "optimizer": 2000}),
        (3, {"params": 1000, "grads": 1000, "optimizer": 2000}),
    ],
)
def test_zero_formula_shards_one_more_state_per_stage(zero, expected):
    assert zero_formula_bytes(1000, zero, dp=4) == expected


def test_zero_formula_mixed_precision_bytes():
    assert zero_formula_bytes(10, 0, 1, param_bytes=2, grad_bytes=2, optim_bytes=12) == {
        "params": 20,
        "grads": 20,
        "optimizer": 120,
    }


@pytest.mark.parametrize(
    "kwargs, message", [({"zero": 4, "dp": 2}, "zero=4"), ({"zero": 1, "dp": 0}, "dp=0")]
)
def test_zero_formula_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        zero_formula_bytes(10, **kwargs)


def test_unique_bytes_counts_views_of_one_flat_buffer_once():
    flat = torch.zeros(100)
    overlapping = [flat[:60], flat[40:], flat.view(10, 10), flat]
    assert unique_bytes(overlapping) == 400
    assert unique_bytes([flat[:10], flat[50:60]]) == 80  # disjoint slices count each
    assert unique_bytes([flat[:10], torch.zeros(10)]) == 80  # separate storages count each
    assert unique_bytes([flat.view(10, 10)[:, 0]]) == 91 * 4  # a strided view covers its gaps
    assert unique_bytes([torch.zeros(0)]) == 0


def test_unique_bytes_tells_meta_storages_apart():
    # Meta storages all sit at address 0; they are still different storages.
    a, b = torch.empty(10, device="meta"), torch.empty(10, device="meta")
    assert unique_bytes([a, b, a[:5]]) == 80


def test_tensor_bytes_is_numel_times_element_size():
    assert tensor_bytes(torch.zeros(3, 5, dtype=torch.bfloat16)) == 30


def test_state_memory_of_adamw_matches_zero0_formula_up_to_step_scalars():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))
    optimizer = _one_adamw_step(model)
    num_param_tensors = len(list(model.parameters()))
    measured = state_memory(model, optimizer)
    formula = zero_formula_bytes(_num_params(model), zero=0, dp=1)
    assert measured["params"] == formula["params"]
    assert measured["grads"] == formula["grads"]
    assert measured["optimizer"] == formula["optimizer"] + STEP_SCALAR_BYTES * num_param_tensors


def test_extra_grads_sharing_p_grad_storage_are_not_counted_twice():
    model = nn.Linear(4, 2)
    flat_grads = torch.zeros(_num_params(model))
    offset = 0
    for p in model.parameters():  # a ZeRO implementation's gradient buffer, p.grad as views into it
        p.grad = flat_grads[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    measured = state_memory(model, None, extra_grads=[flat_grads])
    assert measured == {"params": 40, "grads": 40, "optimizer": 0}


def test_format_memory_report_is_a_table_with_total_and_ratio():
    report = format_memory_report(
        {"params": 3 * 2**20, "grads": 3 * 2**20, "optimizer": 6 * 2**20},
        {"params": 3 * 2**20, "grads": 3 * 2**20, "optimizer": 6 * 2**20},
    )
    lines = report.splitlines()
    assert lines[0].split() == ["state", "measured", "formula", "ratio"]
    assert [line.split()[0] for line in lines[2:]] == ["params", "grads", "optimizer", "total"]
    assert lines[-1].split() == ["total", "12.00", "MiB", "12.00", "MiB", "1.000"]
    assert "formula" not in format_memory_report({"params": 1, "grads": 0, "optimizer": 0})


def test_format_bytes_picks_the_unit():
    sizes = (512, 2048, 5 * 2**20, 3 * 2**30)
    assert [format_bytes(n) for n in sizes] == ["512 B", "2.00 KiB", "5.00 MiB", "3.00 GiB"]


def _fsdp2_state_memory() -> dict:
    """On each rank of the session's 2-rank pool: a tiny FSDP2 model after one AdamW step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    torch.manual_seed(0)
    model = _tiny_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = _one_adamw_step(model)
    return state_memory(model, optimizer)


@pytest.fixture(scope="module")
def fsdp2_memory(pool2) -> list[dict]:
    return pool2.run(_fsdp2_state_memory)


def test_fsdp2_halves_params_grads_and_optimizer_per_rank_up_to_padding(fsdp2_memory):
    model = _tiny_model()
    num_param_tensors = len(list(model.parameters()))
    full = zero_formula_bytes(_num_params(model), zero=0, dp=1)
    per_rank = zero_formula_bytes(_num_params(model), zero=3, dp=WORLD_SIZE)
    # Padding is not in a shard's numel: the ranks' shards add up to the whole model exactly.
    step_scalars = STEP_SCALAR_BYTES * num_param_tensors  # replicated on every rank
    totals = {state: sum(rank[state] for rank in fsdp2_memory) for state in full}
    assert totals == {**full, "optimizer": full["optimizer"] + WORLD_SIZE * step_scalars}
    # Padding: at most one row of each parameter (16 + 1 + 7 + 1 elements) per rank.
    max_padding_params = 16 + 1 + 7 + 1
    for rank in fsdp2_memory:
        assert abs(rank["params"] - per_rank["params"]) <= 4 * max_padding_params
        assert abs(rank["grads"] - per_rank["grads"]) <= 4 * max_padding_params
        assert abs(rank["optimizer"] - step_scalars - per_rank["optimizer"]) <= 8 * max_padding_params
