"""What the user sees during training: a live bar on a terminal, plain lines in a log."""

from __future__ import annotations

from rich.console import Console
from rich.panel import Panel
from rich.text import Text
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class StepReporter:
    def __init__(self, cfg, *, first_step: int, last_step: int, console: Console | None = None, layout: str = ""):
        self.console = console or Console()
        self.log_every = cfg.train.log_every
        self.last_step = last_step
        self.progress = None
        self.console.print(
            f"[bold]shardwise[/bold] {cfg.run.name}: {cfg.model.num_params() / 1e6:.2f}M parameters "
            f"({cfg.model.preset}), {layout or '1 process'}, steps {first_step}..{last_step}, "
            f"{cfg.train.global_batch_size}x{cfg.train.seq_len} tokens/step -> {cfg.run.dir}"
        )
        if cfg.run.progress and self.console.is_terminal and first_step <= last_step:
            self.progress = Progress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tok_s]:,.0f} tok/s"),
                TimeElapsedColumn(), TimeRemainingColumn(), console=self.console,
            )
            self.task = self.progress.add_task("train", total=last_step, completed=first_step - 1,
                                               loss=float("nan"), tok_s=0.0)
            self.progress.start()

    def update(self, record: dict) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=record["step"], loss=record["loss"], tok_s=record["tokens_per_s"])
        elif record["step"] % self.log_every == 0 or record["step"] in (1, self.last_step):
            self.console.print(
                f"step {record['step']:>6}/{self.last_step}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                f"grad_norm {record['grad_norm']:.3f}  {record['tokens_per_s']:,.0f} tok/s  mfu {record['mfu']:.1%}"
            )

    def show_memory(self, report: str, layout: str) -> None:
        """Per-rank bytes of parameters, gradients and optimizer states next to the ZeRO formula."""
        target = self.progress.console if self.progress is not None else self.console
        target.print(f"memory per rank ({layout}), measured after the first step:\n{report}", markup=False)

    def show_sample(self, text: str) -> None:
        self.console.print(Panel(Text(text), title="sample", expand=False))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
