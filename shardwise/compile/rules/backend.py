"""The compile backend that applies the rewrite rules to each block graph, then inductor."""

from __future__ import annotations

from collections import Counter

import torch

from shardwise.compile.rules.registry import RULES
from shardwise.compile.rules.rule import apply_rules

FIRED: Counter = Counter()
"""Matches of each rule over every graph this process compiled (tests read how it grows)."""


def rules_backend(gm: torch.fx.GraphModule, example_inputs):
    """A dynamo backend: rewrite the captured graph with every rule, then compile with inductor."""
    FIRED.update(apply_rules(gm, RULES))
    return torch._dynamo.lookup_backend("inductor")(gm, example_inputs)


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
