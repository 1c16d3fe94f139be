"""What the user sees during training: a live bar on a terminal, plain lines in a log.

The bar is redrawn by the step loop, at most every `REDRAW_INTERVAL_S` (a redraw takes about 0.6 ms),
not by rich's refresh thread: that thread redraws 10 times a second whatever happens, about 11 ms of
CPU a second holding the GIL (2-core Xeon, torch 2.13, 2026-11-27), taken from the training step's
cores and its Python thread. Between two steps only the elapsed and remaining times would change.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.panel import Panel
from rich.text import Text
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from shardwise.config.schema import lora_target_names
from shardwise.models.families import counts_of
from shardwise.planner.adapters import trainable_params


REDRAW_INTERVAL_S = 0.5


def adapters_note(cfg) -> str:
    """", LoRA rank r: N trainable" for a LoRA run (the base is frozen), else nothing."""
    if not cfg.train.lora_rank:
        return ""
    roles = tuple(lora_target_names(cfg.train.lora_targets))
    return f", LoRA rank {cfg.train.lora_rank}: {trainable_params(cfg.model, cfg.train.lora_rank, roles) / 1e6:.2f}M trainable"


def sequences_note(cfg) -> str:
    """A DPO step's samples are pairs, each two sequences."""
    return "2x" if cfg.train.objective == "dpo" else ""


class StepReporter:
    def __init__(self, cfg, *, first_step: int, last_step: int, console: Console | None = None, layout: str = ""):
        self.console = console or Console()
        self.log_every = cfg.train.log_every
        self.last_step = last_step
        self.progress = None
        self.drawn_at = 0.0
        self.console.print(
            f"[bold]shardwise[/bold] {cfg.run.name}: {counts_of(cfg.model).num_params() / 1e6:.2f}M parameters "
            f"({cfg.model.preset}){adapters_note(cfg)}, {layout or '1 process'}, steps {first_step}..{last_step}, "
            f"{cfg.train.global_batch_size}x{sequences_note(cfg)}{cfg.train.seq_len} tokens/step -> {cfg.run.dir}",
            soft_wrap=True
        )
        if cfg.run.progress and self.console.is_terminal and first_step <= last_step:
            self.progress = Progress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tok_s]:,.0f} tok/s"),
                TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, auto_refresh=False,
            )
            self.task = self.progress.add_task("train", total=last_step, completed=first_step - 1,
                                               loss=float("nan"), tok_s=0.0)
            self.progress.start()

    def update(self, record: dict) -> None:
        if self.progress is not None:
            now = time.monotonic()
            redraw = now - self.drawn_at >= REDRAW_INTERVAL_S or record["step"] == self.last_step
            self.drawn_at = now if redraw else self.drawn_at
            self.progress.update(self.task, completed=record["step"], loss=record["loss"], tok_s=record["tokens_per_s"],
                                 refresh=redraw)
            if "val_loss" in record:  # above the bar, which shows only the training loss
                self.show_text(f"step {record['step']}: {validation_text(record)}")
        elif record["step"] % self.log_every == 0 or record["step"] in (1, self.last_step) or "val_loss" in record:
            self.show_text(step_line(record, self.last_step))

    def show_memory(self, report: str, layout: str) -> None:
        """Per-rank bytes of parameters, gradients and optimizer states next to the ZeRO formula."""
        self.show_text(f"memory per rank ({layout}), measured after the first step:\n{report}")

    def show_text(self, text: str) -> None:
        """Plain text, above the live bar if there is one; never wrapped (a piped log keeps one line per step)."""
        target = self.progress.console if self.progress is not None else self.console
        target.print(text, markup=False, highlight=False, soft_wrap=True)

    def show_sample(self, text: str) -> None:
        self.console.print(Panel(Text(text), title="sample", expand=False))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def validation_text(record: dict) -> str:
    accuracy = f"  val_accuracy {record['val_accuracy']:.1%}" if "val_accuracy" in record else ""
    return f"val_loss {record['val_loss']:.4f}  val_ppl {record['val_ppl']:.2f}{accuracy}"


def step_line(record: dict, last_step: int) -> str:
    """One log line of a step: what a piped log or a file shows every train.log_every steps."""
    line = (f"step {record['step']:>6}/{last_step}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
            f"grad_norm {record['grad_norm']:.3f}  {record['tokens_per_s']:,.0f} tok/s  mfu {record['mfu']:.1%}")
    return f"{line}  {validation_text(record)}" if "val_loss" in record else line
