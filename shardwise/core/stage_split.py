"""The pipeline stage splitter, one algorithm for the runtime and the planner.

Contiguous blocks are assigned to `num_stages` stages so that the most expensive stage is as
cheap as possible; every stage gets at least one block; the first stage also pays
`first_extra` (the embedding) and the last `last_extra` (final norm and output head). The
optimum is found by binary search over the cost bound with a greedy fill: O(L log L) rather
than the O(S*L^2) dynamic programme the runtime used before, and it reaches the same
largest-stage cost (to 1e-9 relative; where several splits reach it, greedy gives the early
stages as many blocks as the bound allows).

Costs are training FLOPs per token. The runtime's (`stage_costs`) count each block's weights
norms included (`model_counts.model_flops_per_token`'s convention); the planner passes its
own, norms excluded (`model_counts.block_matmul_flops_per_token`), and its estimates were
recorded with them.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardwise.core import model_counts
from shardwise.core.family import FamilySpec
from shardwise.core.layout_rules import stage_count_violations


def stage_costs(cfg, spec: FamilySpec, seq_len: int) -> tuple[list[float], float, float]:
    """(cost of each block, cost of the embedding, cost of the norm + output head), FLOPs per token
    of a `ModelConfig` of the family `spec`. The embedding lookup does no matmul; its gradient
    scatter-add is 2*D per token. A MoE block costs what one token computes in it: router, top-k and
    shared experts."""
    attention = model_counts.attention_flops_per_token(cfg, seq_len)
    blocks = [float(6 * model_counts.block_params(cfg, spec, i, active=True) + attention)
              for i in range(cfg.n_layers)]
    return blocks, 2.0 * cfg.dim, 6.0 * cfg.vocab_size * cfg.dim + 6 * cfg.dim


def check_stage_count(num_stages: int, n_layers: int) -> None:
    """The runtime's error for a pipeline with more stages than blocks."""
    for _ in stage_count_violations(pp=num_stages, num_stages=num_stages, n_layers=n_layers):
        raise ValueError(f"parallel.pp x parallel.pp_virtual_stages = {num_stages} stages is invalid for "
                         f"model.n_layers = {n_layers}: use between 1 and {n_layers} stages "
                         f"(each needs at least one block)")


def split_layers(cfg, spec: FamilySpec, *, num_stages: int, seq_len: int) -> list[list[int]]:
    """Block indices per stage of a `ModelConfig` of the family `spec` (the runtime's split)."""
    check_stage_count(num_stages, cfg.n_layers)
    return split_stage_costs(stage_costs(cfg, spec, seq_len), num_stages=num_stages)


def split_stage_costs(costs: tuple[Sequence[float], float, float], *, num_stages: int) -> list[list[int]]:
    """Block indices per stage for `costs` = (blocks, first_extra, last_extra), as a model
    family's `ModelPlan.stage_costs(seq_len)` gives them."""
    blocks, first_extra, last_extra = costs
    check_stage_count(num_stages, len(blocks))
    return [list(stage) for stage in split_costs(blocks, first_extra, last_extra, num_stages)]


def split_costs(blocks: Sequence[float], first_extra: float, last_extra: float,
                num_stages: int) -> tuple[tuple[int, ...], ...]:
    """Block indices per stage, minimising the costliest stage (needs 1 <= num_stages <= len(blocks))."""
    blocks = list(blocks)
    if num_stages == 1:
        return (tuple(range(len(blocks))),)
    low, high = max(blocks), sum(blocks) + first_extra + last_extra
    best = _greedy_bounds(blocks, first_extra, last_extra, num_stages, high)
    for _ in range(60):
        mid = (low + high) / 2
        found = _greedy_bounds(blocks, first_extra, last_extra, num_stages, mid)
        if found is None:
            low = mid
        else:
            high, best = mid, found
        if high - low <= 1e-9 * high:
            break
    stages, start = [], 0
    for end in best:
        stages.append(tuple(range(start, end)))
        start = end
    return tuple(stages)


def _greedy_bounds(blocks: list[float], first: float, last: float, num_stages: int, bound: float) -> list[int] | None:
    """Stage end indices with every stage's cost <= bound (filling each stage as far as it goes
    while leaving a block for each later stage), or None."""
    n = len(blocks)
    bounds, start = [], 0
    for stage in range(num_stages):
        extra = (first if stage == 0 else 0.0) + (last if stage == num_stages - 1 else 0.0)
        remaining_stages = num_stages - stage - 1
        total, end = extra, start
        while end < n - remaining_stages and (end == start or total + blocks[end] <= bound):
            if total + blocks[end] > bound:
                return None
            total += blocks[end]
            end += 1
        if stage == num_stages - 1 and end < n:
            return None
        bounds.append(end)
        start = end
    return bounds
