"""The training loop of one process: set up, build, loop (step, metrics, checkpoints), close.

The run directory holds everything needed to resume or to generate: `config.json`,
`tokenizer.json`, `run.json` (device, parameter count, where the FLOP peak comes from),
`metrics.jsonl` and `checkpoints/`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardwise.config.schema import Config, profiled_steps
from shardwise.data.objectives import objective_of
from shardwise.distributed.grad_sync import mean_over_dp
from shardwise.distributed.moe_stats import collect_moe_stats, update_router_biases
from shardwise.distributed.parallelize import ParallelModel
from shardwise.observe.comm_log import CommLog
from shardwise.observe.memory import state_memory
from shardwise.observe.profiler import StepProfiler
from shardwise.runtime.preemption import Preempted
from shardwise.checkpoint.store import (PendingSave, checkpoint_tensors, resume, rng_state, save_checkpoint,
                                        save_checkpoint_async)
from shardwise.train.context import RunContext, open_run_context
from shardwise.train.dpo_reference import attach_reference
from shardwise.train.evaluate import evaluate
from shardwise.train.optim import lr_at, set_lr
from shardwise.train.run_log import RunLog
from shardwise.train.sample import closing_sample
from shardwise.train.setup import Run, build, set_up
from shardwise.train.step import train_step

StepHook = Callable[[int, dict], None]
"""Called on each rank after each step with the step and its record (what metrics.jsonl gets), before
the next step starts: for benchmarks (benchmarks/trainer_overhead.py) and notebooks."""


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    """Loss of each step run in this call (a resumed run starts after its checkpoint)."""
    first_step: int = 1
    micro_batches_per_step: int = 0
    """Micro-batches this rank ran per step: global batch / (micro-batch x data-parallel ranks)."""
    val_losses: dict[int, float] = field(default_factory=dict)
    """Validation loss by step, at the steps that evaluated."""
    val_accuracies: dict[int, float] = field(default_factory=dict)
    """A classifier's held-out accuracy by step, at the steps that evaluated."""
    sample: str = ""
    wall_time_s: float = 0.0


def train(cfg: Config, *, console=None, after_step: StepHook | None = None) -> TrainResult:
    """Train `cfg`; train.preempt_signals end it after the current step with a checkpoint (`Preempted`)."""
    started = time.perf_counter()
    # Every collective of the run (set-up, steps, evaluations, saves) is recorded from here on, and
    # each rank's last ones are written to RUN/collectives/ when one fails or the job stalls.
    with open_run_context(cfg) as context:
        result = train_in(context, cfg, console, after_step)
    result.wall_time_s = time.perf_counter() - started
    return result


def train_in(context: RunContext, cfg: Config, console=None, after_step: StepHook | None = None) -> TrainResult:
    """The run in `context`: set up, build, resume, the step loop, the closing sample."""
    run = set_up(cfg, context)
    cfg = run.cfg  # with parallel.mode = "auto" resolved into concrete degrees
    context.progress()
    pm, optimizer = build(run)
    if cfg.train.objective == "dpo":  # from the initial weights: before a checkpoint replaces them
        attach_reference(run, pm)
    done, checkpoint = resume(run.dir, pm, optimizer, run.loader) if cfg.checkpoint.resume else (0, None)
    context.progress(done)
    last_step = min(cfg.train.steps, cfg.train.stop_at_step or cfg.train.steps)
    log = RunLog(run, pm, first_step=done + 1, last_step=last_step, resumed_from=checkpoint, console=console)
    result = TrainResult(run_dir=run.dir, first_step=done + 1, micro_batches_per_step=run.loader.num_micro_batches)
    pm.module.train()
    # Functional collectives (DTensor) cost a dispatch hook per op: count them only when used.
    comm_log = CommLog(functional_collectives=run.dims.tp > 1)
    nonfinite = NonfiniteSteps(cfg.train)

    base_eval = evaluate_base(pm, run, done)
    if base_eval is not None:
        result.val_losses[0] = base_eval["base_val_loss"]
    checkpoints = Checkpointer(run, pm, optimizer)
    profiler = StepProfiler(profiled_steps(cfg.run.profile_steps), run.dir, run.rank, run.device)
    try:
        for step in range(done + 1, last_step + 1):
            context.step_starting(step)
            profiler.step_starting(step)
            record = run_step(run, pm, optimizer, comm_log, step)
            log.show_profile(profiler.step_finished(step))
            nonfinite.check(step, record)
            if step == done + 1 and base_eval is not None:
                record.update(base_eval)
            result.losses.append(record["loss"])
            if evaluates_at(step, cfg, run, last_step):
                record.update(evaluate(pm, run.val_loader, cfg, run.device))
                result.val_losses[step] = record["val_loss"]
                if "val_accuracy" in record:
                    result.val_accuracies[step] = record["val_accuracy"]
                context.progress()
            log.write(step, record, pm)
            context.progress(step)
            saved = None
            if step == last_step and cfg.checkpoint.at_end:
                saved = checkpoints.save(step)
            elif cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                saved = checkpoints.save(step, background=cfg.checkpoint.async_save)
            if step < last_step and (signal_name := context.stop_signals.agreed(run.dims.is_distributed)):
                checkpoints.finish_pending()
                raise Preempted(signal_name, step, saved or checkpoints.save(step))
            if after_step is not None:
                after_step(step, record)
        checkpoints.finish_pending()
    finally:
        profiler.close()
        log.close()
    if cfg.train.sample_tokens and objective_of(cfg.model.family) == "causal_lm":
        result.sample = closing_sample(pm, run)
        log.show_sample(result.sample)
    return result


def evaluate_base(pm: ParallelModel, run: Run, done: int) -> dict | None:
    """A run that starts from pretrained weights (train.init_from) with a validation split evaluates them
    before its first step: {"base_val_loss": ...}, recorded with step 1, the figure fine-tuning must beat."""
    if done or not run.cfg.train.init_from or run.val_loader is None:
        return None
    figures = evaluate(pm, run.val_loader, run.cfg, run.device)
    return {"base_val_loss": figures["val_loss"]}


def evaluates_at(step: int, cfg: Config, run: Run, last_step: int) -> bool:
    """With a validation split: every train.eval_every steps and after the last step of this call."""
    every = cfg.train.eval_every
    return run.val_loader is not None and (step == last_step or bool(every) and step % every == 0)


class Checkpointer:
    """The run's saves: synchronous, or started in the background (checkpoint.async_save) and completed
    at the next save or at the end. Every rank calls it at the same steps (the saves are collective)."""

    def __init__(self, run: Run, pm: ParallelModel, optimizer):
        self.run, self.pm, self.optimizer = run, pm, optimizer
        self.pending: PendingSave | None = None

    def save(self, step: int, *, background: bool = False) -> Path:
        self.finish_pending()
        run = self.run
        tensors = checkpoint_tensors(self.pm, self.optimizer)
        state = {"loader": run.loader.state_dict(), "layout": run.dims.describe(), "rng": rng_state()}
        context, keep = run.context, run.cfg.checkpoint.keep
        if background:
            self.pending = save_checkpoint_async(run.dir, step, tensors=tensors, state=state, keep=keep,
                                                 process_group=context.checkpoint_group, faults=context.faults)
            return self.pending.final
        path = save_checkpoint(run.dir, step, tensors=tensors, state=state, keep=keep, faults=context.faults)
        context.progress()
        return path

    def finish_pending(self) -> None:
        if self.pending is not None:
            self.pending, pending = None, self.pending
            pending.finish()
            self.run.context.progress()


class NonfiniteSteps:
    """train.on_nonfinite: a step whose loss or gradient norm is NaN/inf (its optimizer step was
    not taken, see `train_step`) stops the run, or is skipped and counted until
    train.max_nonfinite_in_row in a row. The loss and the grad norm are the same on every rank,
    so every rank decides alike."""

    def __init__(self, train_cfg):
        self.action, self.limit = train_cfg.on_nonfinite, train_cfg.max_nonfinite_in_row
        self.in_row = self.skipped = 0

    def check(self, step: int, record: dict) -> None:
        finite = math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])
        self.in_row = 0 if finite else self.in_row + 1
        self.skipped += not finite
        record["skipped_steps"] = self.skipped
        if finite:
            return
        what = f"loss {record['loss']}, gradient norm {record['grad_norm']}"
        if self.action == "stop":
            raise NonfiniteLoss(f"step {step} was not finite ({what}); its update was not applied. Resume from "
                                "the newest checkpoint with a lower train.lr, or set train.on_nonfinite = skip")
        if self.in_row >= self.limit:
            raise NonfiniteLoss(f"{self.in_row} steps in a row were not finite, the last step {step} ({what}): "
                                f"train.max_nonfinite_in_row = {self.limit} reached; lower train.lr")


class NonfiniteLoss(FloatingPointError):
    """Training stopped on a non-finite loss or gradient (exit status exit_status.NONFINITE)."""


def run_step(run: Run, pm: ParallelModel, optimizer, comm_log: CommLog, step: int) -> dict:
    """One optimizer step and what it measured (loss over all ranks, grad norm, time, memory,
    communication, MoE statistics, DPO's rewards)."""
    cfg, device = run.cfg, run.device
    step_start = time.perf_counter()
    lr = lr_at(step - 1, cfg.train)
    set_lr(optimizer, lr)
    with comm_log:
        comm_log.reset()
        local_loss, grad_norm, *dpo_rewards = train_step(pm, optimizer, run.loader.next_step(), cfg, device,
                                                         poison=run.context.faults.poisons_loss(step))
    lm_loss = loss = mean_over_dp(local_loss, run.dims)
    moe = collect_moe_stats(pm.model, cfg.model, tp=run.dims.tp, distributed=run.dims.is_distributed)
    if moe is not None:  # the loss optimised includes the routers' auxiliary losses
        loss += moe.aux_loss + moe.z_loss
        update_router_biases(pm.model, cfg.model, moe)
    # Measured after the optimizer step and before zero_grad: every kind of state exists.
    memory_bytes = state_memory(pm.model, optimizer, extra_grads=pm.sync.grad_tensors())
    pm.sync.zero_grad(optimizer)
    if device.type != "cpu":
        torch.accelerator.synchronize()
    step_time = time.perf_counter() - step_start
    return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": step_time, "memory_bytes": memory_bytes,
            "comm": comm_log.summary(by="kind"), "lm_loss": lm_loss, "moe": moe,
            **(dpo_rewards[0].metrics(run.dims) if dpo_rewards else {})}
