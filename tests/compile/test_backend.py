"""The rules backend's inductor options: C++ wrapper code for plain CPU graphs, the Python wrapper
where torch's C++ wrapper refuses the graph (tests/distributed/test_compile.py runs those layouts)."""

import torch
from torch.utils.checkpoint import checkpoint

from shardwise.compile.rules.backend import CPU_INDUCTOR, wrapper_options


def captured(fn, *args):
    """(the graph dynamo captures of fn(*args), its example inputs)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    return seen[0]


def mlp(x, w):
    return torch.relu(x @ w).sum()


def test_a_plain_cpu_graph_gets_the_cpp_wrapper():
    gm, inputs = captured(mlp, torch.randn(4, 8), torch.nn.Parameter(torch.randn(8, 8)))
    assert wrapper_options(gm, inputs) == CPU_INDUCTOR == {"cpp_wrapper": True}


def test_a_graph_with_a_checkpoint_keeps_the_python_wrapper():
    def recomputed(x, w):
        return checkpoint(mlp, x, w, use_reentrant=False)

    gm, inputs = captured(recomputed, torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True))
    assert any(isinstance(node.target, torch._ops.HigherOrderOperator) for node in gm.graph.nodes)
    assert wrapper_options(gm, inputs) is None


class Wrapped(torch.Tensor):
    """A tensor subclass, as a DTensor is."""


def test_tensor_subclass_inputs_keep_the_python_wrapper():
    gm, inputs = captured(mlp, torch.randn(4, 8), torch.randn(8, 8))
    assert wrapper_options(gm, [inputs[0].as_subclass(Wrapped), inputs[1]]) is None
    assert wrapper_options(gm, [inputs[0].to("meta"), inputs[1]]) is None  # not a CPU tensor
