"""The compile backend that applies the rewrite rules to each block graph, then inductor."""

from __future__ import annotations

from collections import Counter

import torch
import torch._functorch.config

from shardwise.compile.rules.registry import RULES
from shardwise.compile.rules.rule import apply_rules

FIRED: Counter = Counter()
"""Matches of each rule over every graph this process compiled (tests read how it grows)."""


PARTITIONER = {"ban_recompute_materialized_backward": False}
"""How AOTAutograd's partitioner splits a block's forward and backward under the rules. By default
it never recomputes an element-wise result that backward would have to write out in full (the input
of a matmul there); that keeps each RMSNorm's normalised output, the next matmul's input, beside
the norm's input and 1/rms, from which one fused pass rebuilds it. Lifted, a Llama block keeps
11.6h per token instead of 13.6h, and the CPU step is no slower (docs/benchmarks.md, "Compiler").
Read while the graph compiles, so it is set for the rules backend's compilations only."""


CPU_INDUCTOR = {"cpp_wrapper": True}
"""Inductor's options for a block graph on a CPU: the code that calls the graph's kernels and
matmuls is generated in C++ rather than Python, so the ~100 calls of a block's forward and backward
pay no Python per call. Measured on the fp32 step, A/B in one process (forward graphs only then):
1.007x, 1.033x and 1.06x faster; the block's first compile takes ~2 s longer. Not on CUDA, where it
has not been measured against the Python wrapper and CUDA graphs. Nor where torch 2.13's C++
wrapper refuses the graph (tests/distributed/test_compile.py found both): a graph holding a
higher-order op (a recomputed block's checkpoint, whose random-state ops it cannot call), one
whose inputs are tensor subclasses (tensor parallelism's DTensors: their ops take a DeviceMesh), or
one that calls an op with an argument of type Any ("arg type Any is not yet supported by
custom_op_wrapper"): a collective's group, as in context parallelism's all-to-all inside a block."""


def wrapper_options(gm: torch.fx.GraphModule, example_inputs) -> dict | None:
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    plain_on_cpu = all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" for t in tensors)
    higher_order = any(isinstance(node.target, torch._ops.HigherOrderOperator) for node in gm.graph.nodes)
    untyped = any(str(argument.type) == "Any" for node in gm.graph.nodes for schema in op_schemas(node.target)
                  for argument in schema.arguments)
    return CPU_INDUCTOR if plain_on_cpu and not higher_order and not untyped else None


def op_schemas(target) -> list:
    """The schemas a graph node's target may dispatch to (none for a Python function)."""
    if isinstance(target, torch._ops.OpOverload):
        return [target._schema]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return [getattr(target, name)._schema for name in target.overloads()]
    return []


def rules_backend(gm: torch.fx.GraphModule, example_inputs):
    """A dynamo backend: rewrite the captured graph with every rule, then compile with inductor
    (its partitioner set as `PARTITIONER` says; on a CPU with `CPU_INDUCTOR`'s options, which
    inductor also applies to the backward graph it compiles later)."""
    from torch._inductor.compile_fx import compile_fx

    FIRED.update(apply_rules(gm, RULES))
    with torch._functorch.config.patch(**PARTITIONER):
        return compile_fx(gm, example_inputs, config_patches=wrapper_options(gm, example_inputs))


def count_matches(module, *args, rules=RULES) -> dict[str, int]:
    """How many times each of `rules` fires on the graph(s) dynamo captures of `module(*args)`
    (a module or a function), without compiling them (the rewritten graph runs eagerly, once)."""
    return run_rewritten(module, *args, rules=rules)[1]


def run_rewritten(module, *args, rules=RULES):
    """(what `module(*args)` returns with `rules` applied to its captured graphs, run eagerly; how
    many times each rule fired)."""
    fired: Counter = Counter({rule.name: 0 for rule in rules})

    def counting_backend(gm, example_inputs):
        fired.update(apply_rules(gm, rules))
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(module, backend=counting_backend, dynamic=False)(*args)
    torch._dynamo.reset()
    return out, dict(fired)
