"""Pipeline schedules over the `pp` mesh axis: PyTorch's (`torch.distributed.pipelining`) on this
rank's stages, and `TimedStage`, which records when each forward (F), backward (B), input-
gradient (I) and weight-gradient (W) computation starts and ends, for the measured bubble.

All five schedules run on gloo and give the single-process gradients
(tests/distributed/test_pipeline_parallel.py).
"""

from __future__ import annotations

import time

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from shardwise.models.common.chunked_loss import IGNORE_INDEX
from shardwise.models.common.loss import correct_predictions, document_ids_kwargs, micro_batch_parts, token_loss
from shardwise.models.common.moe import stats_paused

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}


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
    The schedule scales gradients by 1/m; the loss weights each micro-batch by its share of the
    global batch's loss tokens (`tokens_per_micro_batch`), so they equal the global loss's.
    A packed batch's document ids go to every stage as the model's keyword (torch's schedules
    hand keyword inputs to each stage): each builds its own blocks' mask."""

    def __init__(self, parts, cfg, *, pp_mesh, num_micro_batches: int, device, tied=None):
        """`tied`: the tied embedding's gradient sum over its two copies (`TiedEmbeddingSync`), if any."""
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
        self.schedule = cls(stages, n_microbatches=num_micro_batches, loss_fn=self.loss, scale_grads=True)
        self.tied = tied
        self.plan = parts.plan
        self.tokens_per_micro_batch: float | None = None
        """During a training step, N / (R m): the global batch's N loss tokens over the R ranks that
        average gradients and the m micro-batches (train/step.py); None in evaluation (each
        micro-batch's mean loss)."""
        self.correct: list[int] | None = None
        """During a classifier's evaluation: the right answers of each micro-batch, counted by `loss`."""

    def loss(self, output, target):
        """The schedule's loss on the last stage: `token_loss`, weighted in training by the
        micro-batch's c loss tokens (x m R c / N, one division: exactly 1 where every micro-batch
        holds N / (R m)), counting a classifier's right answers when an evaluation asks for them."""
        if self.correct is not None:
            self.correct.append(correct_predictions(output.detach(), target))
        loss = token_loss(output, target)
        if self.tokens_per_micro_batch is None:
            return loss
        tokens = target.ne(IGNORE_INDEX).sum(dtype=torch.float64)  # 0 tokens: divided by inf, a loss of 0
        return loss / (self.tokens_per_micro_batch / tokens).to(loss.dtype)

    def finish_gradients(self) -> None:
        """After the data-parallel reduction: sum the tied table's gradient over its two copies."""
        if self.tied is not None:
            self.tied.all_reduce_grads()

    def step(self, micro_batches, device, *, tokens_per_micro_batch: float | None = None) -> float:
        """Forward and backward of all micro-batches, weighted by `tokens_per_micro_batch` (see its
        attribute; None: each micro-batch's mean, as for equal counts); the mean of their losses
        (0.0 without the last stage)."""
        for stage in self.stages:
            stage.events = []
        inputs, targets, kwargs = self.whole_batch(micro_batches, device)
        losses: list[torch.Tensor] = []
        self.tokens_per_micro_batch = tokens_per_micro_batch
        try:
            self.schedule.step(*inputs, target=targets, losses=losses, return_outputs=False, **kwargs)
        finally:
            self.tokens_per_micro_batch = None
        if not self.has_last:
            return 0.0
        total = sum(float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())
                    for loss in losses)
        return total / len(losses)

    def whole_batch(self, micro_batches, device) -> tuple[list[torch.Tensor], torch.Tensor | None, dict]:
        """The schedule's inputs: the step's tokens for the first stage, its targets for the last,
        and a packed batch's document ids for every stage (the model's keyword arguments)."""
        parts = [micro_batch_parts(micro_batch) for micro_batch in micro_batches]
        inputs = [torch.cat([x for x, _, _ in parts]).to(device)] if self.has_first else []
        targets = torch.cat([y for _, y, _ in parts]).to(device) if self.has_last else None
        document_ids = torch.cat([d for _, _, d in parts]) if parts[0][2] is not None else None
        return inputs, targets, document_ids_kwargs(self.plan, document_ids, device)

    def evaluate(self, micro_batches, device, *, count_correct: bool = False) -> tuple[list[float], list[int]]:
        """Forward only through the same schedule (torch's `eval`: no backward, no gradients): the
        loss of each micro-batch on the last stage's ranks, [] elsewhere, and with `count_correct`
        a classifier's right answers in each. The timeline keeps the training step's events."""
        kept = [list(stage.events) for stage in self.stages]
        inputs, targets, kwargs = self.whole_batch(micro_batches, device)
        losses: list[torch.Tensor] = []
        self.correct = [] if count_correct else None
        try:
            self.schedule.eval(*inputs, target=targets, losses=losses, **kwargs)
        finally:
            correct, self.correct = self.correct or [], None
        for stage, events in zip(self.stages, kept):
            stage.events = events
        if not self.has_last:
            return [], []
        return [float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())
                for loss in losses], correct

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
