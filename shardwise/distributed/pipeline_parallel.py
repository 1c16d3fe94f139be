"""Pipeline parallelism over the `pp` mesh axis: stage split, this rank's stages, and schedules.

`split_layers` assigns contiguous blocks to `pp * virtual_stages` stages so that the most
expensive stage is as cheap as possible (exact dynamic programme over the split points), with
the cost of a stage = training FLOPs per token of its blocks, plus the output head on the last
stage and the embedding lookup on the first (6*V*D and ~0: a lookup does no matmul; its
gradient scatter-add is 2*D per token, counted as such). `keep_stage` removes from a model
built on meta everything another stage owns; the model code is untouched, and parameter names
stay those of the full model, so checkpoints reshard across pipeline layouts like any other.

With `parallel.pp_virtual_stages = v` the model is cut into pp*v stages; rank r holds stages
r, r+pp, ... (the loop placement of interleaved 1F1B), or r and 2pp-1-r for the V-shaped zbv.
A rank's stages are separate modules (`ModelParts`), each its own FSDP root when zero = 3.

Schedules are PyTorch's (`torch.distributed.pipelining`): all five run on gloo and give the
single-process gradients (tests/distributed/test_pipeline_parallel.py). Written here: the
placement, the checks, and `TimedStage`, which records when each forward (F), backward (B), input-
gradient (I) and weight-gradient (W) computation starts and ends, for the measured bubble.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from shardwise.config.errors import invalid
from shardwise.config.model import ModelConfig
from shardwise.models.common.moe import stats_paused
from shardwise.models.llama.model import Llama

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}


def stage_costs(cfg: ModelConfig, seq_len: int) -> tuple[list[float], float, float]:
    """(cost of each block, cost of the embedding, cost of the norm + output head), FLOPs per token."""
    attention = 12 * cfg.n_heads * cfg.head_size * seq_len
    # A MoE block costs what one token computes in it: the router and its top-k (and shared) experts.
    blocks = [float(6 * cfg.layer_params(i, active=True) + attention) for i in range(cfg.n_layers)]
    return blocks, 2.0 * cfg.dim, 6.0 * cfg.vocab_size * cfg.dim + 6 * cfg.dim


def split_layers(cfg: ModelConfig, *, num_stages: int, seq_len: int) -> list[list[int]]:
    """Contiguous block indices per stage, minimising the largest stage cost; every stage gets
    at least one block."""
    if num_stages < 1 or num_stages > cfg.n_layers:
        raise ValueError(f"parallel.pp x parallel.pp_virtual_stages = {num_stages} stages is invalid for "
                         f"model.n_layers = {cfg.n_layers}: use between 1 and {cfg.n_layers} stages "
                         f"(each needs at least one block)")
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
    """Drop from `model` (on meta, before materialising) what other stages own. With tied
    embeddings the last stage keeps a copy of the table for its head (see `TiedEmbeddingSync`)."""
    keep = {str(i) for i in layer_ids}
    for name in [name for name in model.layers if name not in keep]:
        del model.layers[name]
    if not is_first and not (is_last and model.cfg.tie_embeddings):
        model.embed_tokens = None
    if not is_last:
        model.norm = None
        model.lm_head = None


ZBV_MIN_TORCH = "2.13"


def schedule_available(schedule: str) -> bool:
    """ZBV ran on torch 2.13 in our tests; on torch 2.11 its first P2P fails with gloo."""
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return schedule != "zbv" or version >= tuple(int(x) for x in ZBV_MIN_TORCH.split("."))


def stage_ids_of(rank: int, *, pp: int, virtual: int, schedule: str) -> list[int]:
    """The stages rank `rank` of the pp axis holds, in the order its parts are built."""
    if schedule == "zbv":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(virtual)]


def check_pipeline(cfg, *, pp: int, num_micro_batches: int) -> None:
    """Stop before any work when the model, the batch or the schedule cannot form this pipeline."""
    if pp == 1:
        return
    split_layers(cfg.model, num_stages=pp * cfg.parallel.pp_virtual_stages, seq_len=cfg.train.seq_len)
    schedule, m = cfg.parallel.pp_schedule, num_micro_batches
    if cfg.model.tie_embeddings and schedule == "zbv":
        raise invalid("model.tie_embeddings", True, "zbv puts the first and last stages on one rank, which would "
                      "hold two copies of the tied table; use another schedule or model.tie_embeddings = false")
    if not schedule_available(schedule):
        raise invalid("parallel.pp_schedule", schedule, f"torch {torch.__version__}'s ZBV schedule fails on gloo "
                      f"(a P2P pair is never connected); use zero-bubble, or torch >= {ZBV_MIN_TORCH}")
    fix = "raise train.global_batch_size or lower train.micro_batch_size"
    if schedule != "gpipe" and m < pp:
        raise invalid("train.global_batch_size", cfg.train.global_batch_size,
                      f"the {schedule} schedule needs at least parallel.pp = {pp} micro-batches per data-parallel "
                      f"rank and step, and this batch gives {m}; {fix}")
    rounds = max(1, m // pp)
    if schedule in ("interleaved-1f1b", "zero-bubble") and m % rounds:
        raise invalid("train.global_batch_size", cfg.train.global_batch_size,
                      f"the {schedule} schedule runs micro-batches in rounds of pp = {pp}: {m} micro-batches per "
                      f"rank and step must be a multiple of {rounds}; {fix}")


class ModelParts(nn.Module):
    """This rank's pipeline stages seen as one model: parameters and state_dict under the full
    model's names (the parts are registered as children only so that `to_empty`/`train` reach them)."""

    def __init__(self, parts: list[Llama], stage_ids: list[int]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.stage_ids = stage_ids
        self.cfg = parts[0].cfg

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for part in self.parts:
            yield from part.named_parameters(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        merged = {}
        for part in self.parts:
            merged.update(part.state_dict(*args, **kwargs))
        return merged

    def init_weights(self, seed: int) -> None:
        for part in self.parts:
            part.init_weights(seed)

    def initial_value(self, name: str, shape, device, seed: int) -> torch.Tensor:
        return self.parts[0].initial_value(name, shape, device, seed)

    def tied_table_copy(self) -> nn.Parameter | None:
        """The embedding table this rank holds only for a tied head (another rank embeds with it)."""
        if 0 in self.stage_ids or not self.cfg.tie_embeddings:
            return None
        tables = [part.embed_tokens.weight for part in self.parts if part.embed_tokens is not None]
        return tables[0] if tables else None


class TiedEmbeddingSync:
    """Tied embeddings across pipeline stages (as Megatron-LM does): the first stage embeds with
    the table, the last multiplies by it, each holding a copy with the same initial value. After
    backward the two copies' gradients are summed over the group of the first and last pipeline
    ranks that share the other coordinates, so both copies take the same optimizer step and stay
    equal. The copy on the last stage is left out of the gradient norm, which counts it once."""

    def __init__(self, parts: "ModelParts", pp_mesh_ranks: torch.Tensor):
        pairs = pp_mesh_ranks.reshape(pp_mesh_ranks.shape[0], -1)
        groups = [[int(pairs[0, j]), int(pairs[-1, j])] for j in range(pairs.shape[1])]
        self.group, _ = dist.new_subgroups_by_enumeration(groups)  # a collective: every rank calls it
        self.tables = [part.embed_tokens.weight for part in parts.parts if part.embed_tokens is not None]

    def all_reduce_grads(self) -> None:
        if self.group is None:
            return
        for table in self.tables:
            grad = table.grad.to_local() if hasattr(table.grad, "to_local") else table.grad
            dist.all_reduce(grad, group=self.group)


def parts_of(model: nn.Module) -> list[nn.Module]:
    return list(model.parts) if isinstance(model, ModelParts) else [model]


def build_stage_parts(cfg, *, pp_rank: int, pp: int) -> ModelParts:
    """This rank's stages of the model, on meta (the layout is applied to them next)."""
    par = cfg.parallel
    num_stages = pp * par.pp_virtual_stages
    split = split_layers(cfg.model, num_stages=num_stages, seq_len=cfg.train.seq_len)
    ids = stage_ids_of(pp_rank, pp=pp, virtual=par.pp_virtual_stages, schedule=par.pp_schedule)
    parts = []
    for stage in ids:
        with torch.device("meta"):
            part = Llama(cfg.model)
        keep_stage(part, split[stage], is_first=stage == 0, is_last=stage == num_stages - 1)
        parts.append(part)
    return ModelParts(parts, ids)


class TimedStage(PipelineStage):
    """A PipelineStage that records (kind, stage, micro-batch, start, end) of each computation;
    times are `time.perf_counter()` seconds, comparable between processes of one machine."""

    events: list
    memory_probe = None
    """Called, when set, after each forward and before each backward: where saved activations
    peak (the last stage computes the loss between the two)."""

    def timed(self, kind: str, chunk: int, run):
        if kind in ("B", "I") and self.memory_probe is not None:
            self.memory_probe()
        start = time.perf_counter()
        result = run()
        self.events.append((kind, self.stage_index, chunk, start, time.perf_counter()))
        if kind == "F" and self.memory_probe is not None:
            self.memory_probe()
        return result

    def _forward_metadata_inference(self, *args, **kwargs):
        # torch runs the stage once on empty tensors to learn shapes: not a training forward.
        with stats_paused(self.submod):
            return super()._forward_metadata_inference(*args, **kwargs)

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        return self.timed("F", fwd_chunk_id, lambda: super(TimedStage, self).forward_one_chunk(fwd_chunk_id, *args, **kwargs))

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        return self.timed("B" if full_backward else "I", bwd_chunk_id, lambda: super(TimedStage, self).backward_one_chunk(
            bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward))

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        return self.timed("W", bwd_chunk_id, lambda: super(TimedStage, self).backward_weight_one_chunk(
            bwd_chunk_id, last_backward=last_backward))


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The trainer's loss, per micro-batch: mean cross-entropy in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def textbook_order(schedule: str, *, rank: int, pp: int, micro_batches: int) -> list[tuple[str, int, int]]:
    """GPipe (Huang et al., 2019): every forward, then every backward. 1F1B (PipeDream-Flush,
    Narayanan et al., 2021): p-1-r warm-up forwards, then one forward and one backward in turn,
    then the remaining backwards; at most p - r micro-batches are in flight on rank r."""
    m = micro_batches
    if schedule == "gpipe":
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    warmup = min(pp - 1 - rank, m)
    order = [("F", rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", rank, warmup + i), ("B", rank, i)]
    return order + [("B", rank, i) for i in range(m - warmup, m)]


class Pipeline:
    """Runs one step's micro-batches through this rank's stages with the configured schedule.
    The schedule scales gradients by 1/m, so they equal those of the mean loss over the step."""

    def __init__(self, parts: ModelParts, cfg, *, mesh, num_micro_batches: int, device):
        pp_mesh = mesh["pp"]
        num_stages = pp_mesh.size() * cfg.parallel.pp_virtual_stages
        self.rank = pp_mesh.get_local_rank()
        group = pp_mesh.get_group()
        self.stages = [TimedStage(part, stage, num_stages, device, group=group)
                       for part, stage in zip(parts.parts, parts.stage_ids)]
        for stage in self.stages:
            stage.events = []
        self.has_first = 0 in parts.stage_ids
        self.has_last = num_stages - 1 in parts.stage_ids
        cls = SCHEDULES[cfg.parallel.pp_schedule]
        stages = self.stages[0] if issubclass(cls, PipelineScheduleSingle) else self.stages
        self.schedule = cls(stages, n_microbatches=num_micro_batches, loss_fn=token_loss, scale_grads=True)
        self.tied = TiedEmbeddingSync(parts, mesh.mesh) if cfg.model.tie_embeddings else None

    def finish_gradients(self) -> None:
        """After the data-parallel reduction: sum the tied table's gradient over its two copies."""
        if self.tied is not None:
            self.tied.all_reduce_grads()

    def step(self, micro_batches, device) -> float:
        """Forward and backward of all micro-batches; this rank's mean loss (0.0 without the last stage)."""
        for stage in self.stages:
            stage.events = []
        inputs = [torch.cat([x for x, _ in micro_batches]).to(device)] if self.has_first else []
        targets = torch.cat([y for _, y in micro_batches]).to(device) if self.has_last else None
        losses: list[torch.Tensor] = []
        self.schedule.step(*inputs, target=targets, losses=losses, return_outputs=False)
        if not self.has_last:
            return 0.0
        total = sum(float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())
                    for loss in losses)
        return total / len(losses)

    def events(self) -> list[tuple]:
        """This step's computations on this rank, in the order they ran."""
        return sorted((e for stage in self.stages for e in stage.events), key=lambda e: e[3])

    def defined_order(self) -> list[tuple[str, int, int]]:
        """The schedule's definition of this rank's computations: (kind, stage, micro-batch).
        GPipe and 1F1B: the textbook definition (`textbook_order`; torch's own listing of 1F1B
        is shifted by one micro-batch on the last rank, though it runs correctly). The others:
        the action list torch's runtime executes."""
        if isinstance(self.schedule, PipelineScheduleSingle):
            name = "gpipe" if isinstance(self.schedule, ScheduleGPipe) else "1f1b"
            return textbook_order(name, rank=self.rank, pp=self.schedule._num_stages,
                                  micro_batches=self.schedule._n_microbatches)
        return [(a.computation_type.value, a.stage_index, a.microbatch_index)
                for a in self.schedule.pipeline_order[self.rank]
                if a is not None and a.computation_type.value in ("F", "B", "I", "W")]
