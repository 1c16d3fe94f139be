"""Pipeline parallelism, part 1: splitting the model into stages (the schedules come next).

`split_layers` assigns contiguous blocks to `pp * virtual_stages` stages so that the most
expensive stage is as cheap as possible (exact dynamic programme over the split points), with
the cost of a stage = training FLOPs per token of its blocks, plus the output head on the last
stage and the embedding lookup on the first (6*V*D and ~0: a lookup does no matmul; its
gradient scatter-add is 2*D per token, counted as such). `keep_stage` removes from a model
built on meta everything another stage owns; the model code is untouched, and parameter names
stay those of the full model, so checkpoints reshard across pipeline layouts like any other.
"""

from __future__ import annotations

from shardwise.models.llama.config import ModelConfig


def stage_costs(cfg: ModelConfig, seq_len: int) -> tuple[list[float], float, float]:
    """(cost of each block, cost of the embedding, cost of the norm + output head), FLOPs per token."""
    attention = 12 * cfg.n_heads * cfg.head_size * seq_len
    block = 6 * cfg.block_params() + attention
    return [float(block)] * cfg.n_layers, 2.0 * cfg.dim, 6.0 * cfg.vocab_size * cfg.dim + 6 * cfg.dim


def split_layers(cfg: ModelConfig, *, num_stages: int, seq_len: int) -> list[list[int]]:
    """Contiguous block indices per stage, minimising the largest stage cost; every stage gets
    at least one block."""
    if num_stages < 1 or num_stages > cfg.n_layers:
        raise ValueError(f"parallel.pp = {num_stages} stages is invalid for model.n_layers = {cfg.n_layers}: "
                         f"use between 1 and {cfg.n_layers} stages (each needs at least one block)")
    blocks, first_extra, last_extra = stage_costs(cfg, seq_len)
    prefix = [0.0]
    for cost in blocks:
        prefix.append(prefix[-1] + cost)

    def cost(start: int, end: int, stage: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == num_stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    n = len(blocks)
    inf = float("inf")
    # best[k][i]: the smallest achievable max cost of stages 0..k-1 covering blocks 0..i-1.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], cost(j, i, k - 1))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, end = [], n
    for k in range(num_stages, 0, -1):
        start = cut[k][end]
        bounds.append(list(range(start, end)))
        end = start
    return bounds[::-1]


def keep_stage(model, layer_ids: list[int], *, is_first: bool, is_last: bool) -> None:
    """Drop from `model` (on meta, before materialising) what other stages own."""
    if model.cfg.tie_embeddings and not (is_first and is_last):
        raise ValueError("model.tie_embeddings = True is not supported with parallel.pp > 1 yet: the first and "
                         "last stages would both need the table; set model.tie_embeddings = false")
    keep = {str(i) for i in layer_ids}
    for name in [name for name in model.layers if name not in keep]:
        del model.layers[name]
    if not is_first:
        model.embed_tokens = None
    if not is_last:
        model.norm = None
        model.lm_head = None
