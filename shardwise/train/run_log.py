"""What a run records and shows: on rank 0 `run.json`, one `metrics.jsonl` line per step
(loss, throughput, MFU, memory, communication, MoE statistics, validation), the same records to
the loggers of run.loggers (TensorBoard, W&B), the live progress, the first step's memory
report and the closing sample; every rank its `memory/rank<r>.json` after the first step, and
with a pipeline its timeline of each step's computations (`pipeline/rank<r>.jsonl`)."""

from __future__ import annotations

import json
import sys

import torch

from shardwise.observe.loggers import open_loggers
from shardwise.observe.memory import format_memory_report, zero_formula_bytes
from shardwise.observe.pipeline_timeline import TimelineWriter
from shardwise.checkpoint.store import write_json_atomic
from shardwise.config.schema import sequences_per_sample
from shardwise.models.families import counts_of
from shardwise.train.dpo import REWARD_METRICS
from shardwise.train.metrics import MetricsWriter, peak_flops, peak_memory_gib, read_metrics_log
from shardwise.train.progress import StepReporter


def pipeline_timeline_writer(pm, run) -> TimelineWriter | None:
    if pm.pipeline is None:
        return None
    cfg = run.cfg
    header = {"schedule": cfg.parallel.pp_schedule, "pp": run.dims.pp, "virtual_stages": cfg.parallel.pp_virtual_stages,
              "micro_batches": run.dims.num_micro_batches(cfg), "pp_rank": pm.pipeline.rank,
              "defined_order": pm.pipeline.defined_order()}
    return TimelineWriter(run.dir, run.rank, header)


def announce_layout_change(run, resumed_step: int) -> None:
    """One line when a run resumes on another world size or layout than it last ran on (a job on several
    nodes that shrank or grew, or a rerun by hand): the old and new layouts, how the global batch is kept,
    and the steps lost (logged after the checkpoint, to be redone)."""
    try:
        before = json.loads((run.dir / "run.json").read_text())
        logged = [record["step"] for _, record in read_metrics_log(run.dir / "metrics.jsonl", warn=False)]
    except (OSError, ValueError):
        return
    layout = run.dims.describe()
    if before.get("world_size") == run.dims.world_size and before.get("layout") == layout:
        return
    lost = max(0, max(logged, default=resumed_step) - resumed_step)
    micro = run.dims.num_micro_batches(run.cfg)
    print(f"shardwise: the layout changed: {before.get('layout')} on {before.get('world_size')} ranks -> {layout} on "
          f"{run.dims.world_size} ranks ({micro} micro-batch{'es' if micro > 1 else ''} a step keep the global batch of "
          f"{run.cfg.train.global_batch_size}); resuming after step {resumed_step}, {lost} step{'' if lost == 1 else 's'} "
          "lost", file=sys.stderr, flush=True)


class RunLog:
    def __init__(self, run, pm, *, first_step: int, last_step: int, resumed_from, console=None):
        cfg, self.run = run.cfg, run
        self.first_step = first_step
        self.metrics = self.reporter = None
        self.timeline = pipeline_timeline_writer(pm, run)
        if not run.is_main:
            return
        self.peak = peak_flops(run.device, getattr(torch, cfg.train.autocast_dtype))
        counts = counts_of(cfg.model)
        self.flops_per_token = counts.flops_per_token(cfg.train.seq_len)
        self.tokens_per_step = cfg.train.global_batch_size * sequences_per_sample(cfg) * cfg.train.seq_len
        if resumed_from:
            announce_layout_change(run, first_step - 1)
        write_json_atomic(run.dir / "run.json", {
            "device": str(run.device), "world_size": run.dims.world_size, "layout": run.dims.describe(),
            "num_params": counts.num_params(), "num_active_params": counts.num_active_params(),
            "flops_per_token": self.flops_per_token,
            "peak_flops_per_device": self.peak.flops_per_s, "peak_flops_source": self.peak.source,
            "peak_memory_measures": peak_memory_gib(run.device)[1], "tokens_per_step": self.tokens_per_step,
            "resumed_from": str(resumed_from) if resumed_from else None,
        })
        self.metrics = MetricsWriter(run.dir / "metrics.jsonl", resume_from_step=first_step - 1)
        self.loggers = open_loggers(cfg.run.loggers, run.dir, run_name=cfg.run.name, project=cfg.run.wandb_project,
                                    config=cfg.to_dict(), resume_step=first_step - 1)
        self.reporter = StepReporter(cfg, first_step=first_step, last_step=last_step, console=console,
                                     layout=run.dims.describe())

    def write(self, step: int, measured: dict, pm) -> None:
        if self.timeline is not None:
            self.timeline.write(step, pm.pipeline.events())
        memory = self.write_memory(measured["memory_bytes"]) if step == self.first_step else None
        if self.metrics is None:
            return
        dims, moe = self.run.dims, measured["moe"]
        tokens_per_s = self.tokens_per_step / measured["step_time_s"]
        record = {
            "step": step, "loss": measured["loss"], "lr": measured["lr"], "grad_norm": measured["grad_norm"],
            "step_time_s": measured["step_time_s"], "tokens_per_s": tokens_per_s,
            "mfu": self.flops_per_token * tokens_per_s / (self.peak.flops_per_s * dims.world_size),
            "peak_memory_gib": peak_memory_gib(self.run.device)[0], "tokens_seen": step * self.tokens_per_step,
            **{f"{kind}_bytes": value for kind, value in measured["memory_bytes"].items()},
            "comm": measured["comm"], "skipped_steps": measured.get("skipped_steps", 0),
            **({"lm_loss": measured["lm_loss"], **moe.metrics()} if moe is not None else {}),
            **{key: measured[key] for key in ("val_loss", "val_ppl", "val_accuracy", "base_val_loss", *REWARD_METRICS)
               if key in measured},
        }
        self.metrics.write(record)
        for logger in self.loggers:
            logger.log(record)
        if memory is not None:
            self.reporter.show_memory(format_memory_report(memory["measured"], memory["formula"]), dims.describe())
        self.reporter.update(record)

    def write_memory(self, measured_bytes: dict) -> dict:
        """RUN/memory/rank<r>.json, every rank's: its bytes of each state after the first step, next to
        the ZeRO formula where one applies (`shardwise report` draws them side by side)."""
        dims = self.run.dims
        # The ZeRO formula covers data parallelism; with tp the norms stay replicated,
        # pipeline stages hold unequal parts, and ep shards the experts otherwise: no formula.
        formula = None if dims.tp > 1 or dims.pp > 1 or dims.ep > 1 else zero_formula_bytes(
            counts_of(self.run.cfg.model).num_params(), dims.zero if dims.is_distributed else 0, dims.dp * dims.cp)
        peak, measures = peak_memory_gib(self.run.device)
        memory = {"rank": self.run.rank, "layout": dims.describe(), "measured": measured_bytes, "formula": formula,
                  "peak_memory_gib": peak, "peak_memory_measures": measures}
        (self.run.dir / "memory").mkdir(exist_ok=True)
        write_json_atomic(self.run.dir / "memory" / f"rank{self.run.rank}.json", memory)
        return memory

    def show_profile(self, table: str | None) -> None:
        if table is not None and self.reporter is not None:
            self.reporter.show_text(table)

    def show_sample(self, text: str) -> None:
        if self.reporter is not None:
            self.reporter.show_sample(text)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            for logger in self.loggers:
                logger.close()
            self.reporter.close()
