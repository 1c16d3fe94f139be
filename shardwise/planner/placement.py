"""Which blocks, embedding and head each pipeline rank holds, and what of them each rank keeps
under tensor and expert parallelism: parameter counts per rank, no bytes yet.

The stage split is the runtime's splitter (`core/stage_split.split_costs`): contiguous
blocks, the largest stage cost as small as possible, a stage's cost = training FLOPs per token
of its blocks (matmul weights, norms excluded) plus 6*V*h for the output head on the last stage.
Rank r of the pp axis holds stages r, r+pp, ... (interleaved) or r and 2pp-1-r (zbv).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from functools import lru_cache

from shardwise.core import model_counts
from shardwise.core.family import FamilySpec
from shardwise.core.model import ModelConfig
from shardwise.core.stage_split import split_costs
from shardwise.planner.adapters import RankAdapters, rank_adapters
from shardwise.planner.layout import Layout
from shardwise.models.families import spec_of

LIST_FIELDS = tuple(field.name for field in dataclasses.fields(ModelConfig) if field.default_factory is list)
SCALAR_FIELDS = tuple(field.name for field in dataclasses.fields(ModelConfig) if field.name not in LIST_FIELDS)
scalar_values = operator.attrgetter(*SCALAR_FIELDS)


def field_values(model: ModelConfig) -> tuple:
    """The config's field values, hashable (lists as tuples): ModelConfig is a mutable dataclass,
    so its values, not the object, key what is cached of it."""
    return scalar_values(model) + tuple(tuple(getattr(model, name)) for name in LIST_FIELDS)


def split_layers(model: ModelConfig, num_stages: int, seq_len: int) -> tuple[tuple[int, ...], ...]:
    """Block indices per stage, minimising the costliest stage (every stage gets >= 1 block). A
    search asks for the same few splits of one model thousands of times: they are cached."""
    return split_layers_of_fields(field_values(model), num_stages, seq_len)


@lru_cache(maxsize=4096)
def split_layers_of_fields(values: tuple, num_stages: int, seq_len: int) -> tuple[tuple[int, ...], ...]:
    model = ModelConfig(**dict(zip(SCALAR_FIELDS + LIST_FIELDS, values)))
    spec = spec_of(model.family)
    costs = [model_counts.block_matmul_flops_per_token(model, spec, i, seq_len) for i in range(model.n_layers)]
    first, last = 2.0 * model.dim, model_counts.head_flops_per_token(model) + 6.0 * model.dim
    return split_costs(costs, first, last, num_stages)


def stages_of_rank(layout: Layout, pp_rank: int) -> list[int]:
    if layout.pp_schedule == "zbv" and layout.pp > 1:
        return [pp_rank, 2 * layout.pp - 1 - pp_rank]
    return [pp_rank + k * layout.pp for k in range(layout.virtual_stages)]


@dataclass(frozen=True)
class RankParams:
    """Parameters one rank holds (after pp, tp and ep; before ZeRO), by how they are sharded."""

    tp_sharded: float
    """Attention, dense/shared MLP, embedding and head: split over tp."""
    replicated: float
    """Norms and MoE layers (router, shared experts): whole on every tp rank."""
    experts: float
    """Routed experts: split over ep, whole on every tp rank."""
    layers: tuple
    """Block indices on this rank."""
    has_first: bool
    has_last: bool
    largest_block: float
    """This rank's share of its largest block (FSDP gathers one block at a time)."""
    lora: RankAdapters = RankAdapters()
    """LoRA's adapters on this rank, beside the (then frozen) parameters above."""

    @property
    def dense(self) -> float:
        return self.tp_sharded + self.replicated

    @property
    def total(self) -> float:
        return self.tp_sharded + self.replicated + self.experts


def block_params_by_sharding(model: ModelConfig, spec: FamilySpec) -> tuple[tuple, tuple | None]:
    """(tp-sharded, replicated, routed-expert) parameters of a dense block and of a MoE block (None
    for a dense model), worked out once for all of a rank's blocks."""
    attention = model_counts.attention_params(model, spec)
    norms = 2 * model_counts.params_per_norm(model, spec)  # two norms a block: each a weight (and a LayerNorm's bias)
    dense = (attention + model_counts.dense_mlp_params(model, spec), norms, 0.0)
    if not model.n_experts:
        return dense, None
    # The runtime replicates a MoE layer over tp (router, shared and routed experts); ep splits the experts.
    experts = model.n_experts * model_counts.expert_params(model)
    moe = (attention, norms + model_counts.moe_shared_params(model), experts)
    return dense, moe


def rank_params(model: ModelConfig, layout: Layout, pp_rank: int) -> RankParams:
    stages = split_layers(model, layout.num_stages, layout.seq_len)
    mine = stages_of_rank(layout, pp_rank)
    layers = tuple(i for s in mine for i in stages[s])
    has_first, has_last = 0 in mine, layout.num_stages - 1 in mine
    tp, ep = layout.tp, layout.ep
    sharded = replicated = experts = 0.0
    largest = 0.0
    spec = spec_of(model.family)
    dense, moe = block_params_by_sharding(model, spec)
    for i in layers:
        block_sharded, block_replicated, block_experts = moe if model.is_moe_layer(i) else dense
        sharded += block_sharded
        replicated += block_replicated
        experts += block_experts
        largest = max(largest, block_sharded / tp + block_replicated + block_experts / ep)
    if has_last and spec.encoder_decoder:
        # T5's decoder blocks (self- and cross-attention, MLP, three norms) go with the last stage, with
        # the relative-bias tables (split by heads, as the colwise projections) and the second final
        # norm: the runtime refuses pipelines for T5, and the planner's stages split the encoder only.
        decoder_block = 2 * model_counts.attention_params(model, spec) + model_counts.dense_mlp_params(model, spec)
        decoder_norms = 3 * model_counts.params_per_norm(model, spec)
        decoders = model_counts.decoder_layers(model, spec)
        sharded += decoders * decoder_block + model_counts.relative_bias_params(model, spec)
        replicated += decoders * decoder_norms + model_counts.params_per_norm(model, spec)
        largest = max(largest, decoder_block / tp + decoder_norms)
    holds_table = has_first or (has_last and model.tie_embeddings)
    if holds_table:
        sharded += model_counts.embedding_params(model, spec)
    if has_first:  # BERT's embedding LayerNorm, ViT's patch projection: run whole on every tp rank
        replicated += model_counts.input_compute_params(model, spec)
    if has_last:
        sharded += model_counts.output_head_params(model, spec)
        replicated += model_counts.params_per_norm(model, spec) if spec.final_norm else 0  # the final norm
    return RankParams(tp_sharded=sharded / tp, replicated=replicated, experts=experts / ep, layers=layers,
                      has_first=has_first, has_last=has_last, largest_block=largest,
                      lora=rank_adapters(model, layout, layers))
