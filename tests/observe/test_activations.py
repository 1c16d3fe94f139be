"""saved_activation_bytes: hand-computed saved bytes, parameters left out, shared storage once,
and DTensors by their local shard (2 gloo processes, spawned once for this module)."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.observe.activations import saved_activation_bytes

FLOAT_BYTES = 4


def _mlp(d_in: int = 8, d_hidden: int = 16, d_out: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_out))


def test_linear_relu_linear_saves_its_input_and_the_relu_output():
    # Linear 1 saves x for its weight gradient (not its weight: x needs no grad); ReLU saves
    # its output, which Linear 2 saves again as its input (one storage); Linear 2's weight
    # (saved as weight.t() for the input gradient) is a parameter.
    x = torch.randn(5, 8)
    _, num_bytes = saved_activation_bytes(_mlp(), x)
    assert num_bytes == (5 * 8 + 5 * 16) * FLOAT_BYTES


def test_output_is_returned_and_backward_is_unchanged():
    mlp, x = _mlp(), torch.randn(5, 8)
    mlp(x).square().sum().backward()
    expected = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    output, _ = saved_activation_bytes(mlp, x)
    assert torch.equal(output, mlp(x))
    output.square().sum().backward()
    for param, grad in zip(mlp.parameters(), expected):
        assert torch.equal(param.grad, grad)


def test_keyword_arguments_reach_fn():
    x = torch.randn(4, 3, requires_grad=True) * 1
    output, num_bytes = saved_activation_bytes(torch.nn.functional.softmax, x, dim=-1)
    assert num_bytes == 4 * 3 * FLOAT_BYTES  # softmax saves its output
    assert torch.allclose(output.sum(-1), torch.ones(4))


def test_parameters_and_their_views_are_not_activations():
    weight = nn.Parameter(torch.randn(100, 10))
    _, num_bytes = saved_activation_bytes(lambda: torch.sin(weight).sum() + torch.cos(weight.t()).sum())
    assert num_bytes == 0  # sin and cos save their inputs: the parameter and a view of it
    # The input of a Linear whose input needs grad: the weight is saved too, and left out.
    x = torch.randn(2, 100) * torch.ones(1, requires_grad=True)
    _, num_bytes = saved_activation_bytes(nn.Linear(100, 1000), x)
    assert num_bytes == 2 * 100 * FLOAT_BYTES


def test_parameter_storage_reaching_autograd_as_a_plain_tensor_is_excluded_when_named():
    """A DTensor parameter's local shard (`to_local()`) reaches autograd as a plain tensor, not a
    leaf; the layout measurement names the model so its parameters' storages are not counted."""
    from shardwise.observe.activations import LiveSavedTensors

    layer = nn.Linear(10, 10, bias=False)
    x = torch.randn(3, 10) * torch.ones(1, requires_grad=True)

    def forward():
        plain_weight = layer.weight.detach().requires_grad_(False)  # same storage, not a leaf parameter
        return (x @ plain_weight.t()).sum()

    with LiveSavedTensors() as everything:
        kept = forward()  # the graph, and what it saved, live while its output does
        counted = everything.sample()
    with LiveSavedTensors(parameters_of=layer) as activations:
        kept = forward()
        assert kept.requires_grad and activations.sample() == 0
    assert counted == 10 * 10 * FLOAT_BYTES  # the matmul saves the weight (x's gradient needs it), not x


def test_views_of_one_tensor_count_once():
    hidden = torch.randn(6, 8, requires_grad=True) * 2  # an activation: not a leaf
    hidden_bytes = 6 * 8 * FLOAT_BYTES

    def three_views():  # sin and cos save their inputs: three views of hidden's storage
        return torch.sin(hidden.view(-1)).sum() + torch.cos(hidden.view(4, 12)).sum() + torch.sin(hidden[2:4]).sum()

    assert saved_activation_bytes(three_views)[1] == hidden_bytes
    # exp saves its output, a storage of its own
    assert saved_activation_bytes(lambda: torch.exp(hidden).sum() + torch.sin(hidden).sum())[1] == 2 * hidden_bytes


def test_a_graph_dropped_inside_fn_counts_nothing():
    x = torch.randn(16, 16, requires_grad=True) * 1

    def side_computation_then_result():
        torch.sin(x).sum()  # built and dropped: its saved input is freed with it
        return x * 2  # saves nothing (a scalar factor)

    _, num_bytes = saved_activation_bytes(side_computation_then_result)
    assert num_bytes == 0


def test_checkpointed_module_counts_only_its_input():
    x = torch.randn(5, 8)
    _, num_bytes = saved_activation_bytes(lambda: checkpoint(_mlp(), x, use_reentrant=False))
    assert num_bytes == 5 * 8 * FLOAT_BYTES


def test_no_grad_saves_nothing():
    with torch.no_grad():
        _, num_bytes = saved_activation_bytes(_mlp(), torch.randn(5, 8))
    assert num_bytes == 0


def _tensor_parallel_mlp_saved_bytes() -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    mlp = _mlp(8, 16, 8)
    parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x_BSD = torch.randn(2, 3, 8, requires_grad=True) * 1
    _, num_bytes = saved_activation_bytes(mlp, x_BSD)
    return num_bytes


@pytest.fixture(scope="module")
def pool(pool2):
    return pool2


def test_dtensor_activations_count_their_local_shard(pool):
    # Per rank: the replicated input [B*S, 8] (Linear 1's DTensor input), and the ReLU output's
    # column shard [B, S, 16/2], which Linear 2 saves as its Shard(-1) DTensor input. Each
    # rank's DTensor weights (saved as weight.t()) are parameters.
    tokens = 2 * 3
    assert pool.run(_tensor_parallel_mlp_saved_bytes) == [(tokens * 8 + tokens * 16 // 2) * FLOAT_BYTES] * 2
