"""A rewrite rule and the pass that applies rules to an FX graph."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.fx import subgraph_rewriter
from torch.utils.checkpoint import CheckpointPolicy


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: Callable
    """The source: torch code as a model writes it; its arguments match any node or literal."""
    replacement: Callable
    """The result, with the same arguments."""
    constraints: Sequence[Callable[[dict], bool]] = field(default_factory=tuple)
    """Each gets {pattern argument name: the matched node or literal} and says whether the
    match may be rewritten (e.g. eps is a number, the cast goes back to the input's dtype)."""
    description: str = ""
    recompute: bool = False
    """The replacement's operations are recomputed in backward instead of their results being kept:
    each of its nodes is tagged as selective activation checkpointing tags one, a tag AOTAutograd
    copies onto the operations it traces from the node and the partitioner obeys."""


def _bindings(match, pattern_graph: fx.Graph) -> dict:
    """Pattern argument name -> matched graph node or literal."""
    names = [node.name for node in pattern_graph.nodes if node.op == "placeholder"]
    placeholders = [node for node in match.nodes_map if node.op == "placeholder"]
    by_name = {node.name: match.nodes_map[node] for node in placeholders}
    return {name: by_name.get(name) for name in names}


def _filter(rule: Rule):
    def accept(match, original_graph: fx.Graph, pattern_graph: fx.Graph) -> bool:
        bound = _bindings(match, pattern_graph)
        return all(constraint(bound) for constraint in rule.constraints)

    return accept


def pattern_graph(fn: Callable) -> fx.GraphModule:
    """The traced pattern, with keyword arguments that only restate a default dropped: dynamo
    records `F.silu(a)` without the `inplace=False` that tracing the pattern spells out."""
    gm = fx.symbolic_trace(fn)
    for node in gm.graph.nodes:
        if node.op != "call_function" or not node.kwargs:
            continue
        try:
            defaults = {k: p.default for k, p in inspect.signature(node.target).parameters.items()}
        except (TypeError, ValueError):
            continue
        node.kwargs = {k: v for k, v in node.kwargs.items() if k not in defaults or defaults[k] != v}
    gm.recompile()
    return gm


def apply_rules(gm: fx.GraphModule, rules: Sequence[Rule]) -> dict[str, int]:
    """Rewrite `gm` in place with each rule in turn; returns how many times each fired."""
    fired = {}
    for rule in rules:
        matches = subgraph_rewriter.replace_pattern_with_filters(gm, pattern_graph(rule.pattern), rule.replacement,
                                                                 match_filters=[_filter(rule)])
        fired[rule.name] = len(matches)
        if rule.recompute:
            for node in (node for match in matches for node in match.replacements if node.op == "call_function"):
                node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    gm.graph.lint()
    gm.recompile()
    return fired


# -- constraints shared by rules -----------------------------------------------------------------


def example(value):
    """The example tensor dynamo recorded for a node (None for a literal or when absent)."""
    return value.meta.get("example_value") if isinstance(value, fx.Node) else None


def is_number(name: str):
    return lambda bound: isinstance(bound[name], (int, float)) and not isinstance(bound[name], bool)


def casts_back(dtype_name: str, tensor_name: str):
    """The pattern's cast goes back to the input's own dtype (a norm in fp32, cast back)."""
    def check(bound) -> bool:
        tensor = example(bound[tensor_name])
        return isinstance(bound[dtype_name], torch.dtype) and tensor is not None and tensor.dtype == bound[dtype_name]

    return check


def at_most_fp32(tensor_name: str):
    """`.float()` on the input widens it or leaves it (fp32, bf16, fp16); on fp64 it would narrow,
    which the fused op would not repeat."""
    def check(bound) -> bool:
        tensor = example(bound[tensor_name])
        return tensor is not None and tensor.dtype in (torch.float32, torch.bfloat16, torch.float16)

    return check


def last_dim_of(tensor_name: str, weight_name: str):
    """The weight is a vector as wide as the input's last dimension (a per-channel scale)."""
    def check(bound) -> bool:
        tensor, weight = example(bound[tensor_name]), example(bound[weight_name])
        return tensor is not None and weight is not None and weight.dim() == 1 and weight.shape[0] == tensor.shape[-1]

    return check
