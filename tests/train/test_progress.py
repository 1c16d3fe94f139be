"""The live progress bar: drawn by the step loop, with no thread of its own (train/progress.py says why)."""

import io
import threading

from rich.console import Console

from shardwise.train.progress import StepReporter


def test_the_live_bar_is_drawn_by_the_step_loop_without_a_thread_of_its_own(tiny_config):
    out = io.StringIO()
    threads_before = threading.active_count()
    reporter = StepReporter(tiny_config(**{"train.steps": 3, "run.progress": True}), first_step=1, last_step=3,
                            console=Console(file=out, force_terminal=True, width=120))
    assert reporter.progress is not None
    for step in (1, 2, 3):
        reporter.update({"step": step, "loss": 2.0 + step, "tokens_per_s": 1000.0 * step})
        assert threading.active_count() == threads_before
    assert "3/3" in out.getvalue() and "3,000 tok/s" in out.getvalue()  # the last step is drawn at once
    reporter.close()
