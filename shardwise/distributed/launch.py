"""Start N local training processes for `shardwise train --nproc N`.

One node: the CLI calls `launch_local`, which runs `python -m shardwise.train ARGS` N times
under torch's elastic agent, the same machinery `torchrun --standalone` uses, so a worker
sees exactly what it would see under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT). Many nodes: run `torchrun ... -m shardwise.train ARGS` on every node
(examples/slurm/train.sbatch); `already_launched` then tells the CLI not to launch again.

Nothing here is written by hand that torch has: rendezvous, worker start/stop and failure
collection are `torch.distributed.launcher.api.elastic_launch`. What is ours is the choice
of defaults (rendezvous on port 0, OMP threads per worker), turning elastic's
multi-section failure report into one line, and the restart loop (train.max_restarts).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path

import torch

CPU_DEFAULT_NPROC = 2  # "auto" on a machine without accelerators: enough to exercise every collective


def resolve_nproc(value: str | int) -> int:
    """`--nproc` as a process count: "auto" = one per accelerator (CPU: 2, at most the core count)."""
    if value == "auto":
        if torch.accelerator.is_available():
            count = torch.accelerator.device_count()
            if count >= 1:
                return count
        return max(1, min(CPU_DEFAULT_NPROC, usable_cpu_count()))
    count = None
    if isinstance(value, int) and not isinstance(value, bool):
        count = value
    elif isinstance(value, str) and value.strip().isdigit():
        count = int(value)
    if count is None or count < 1:
        raise ValueError(f"--nproc = {value!r} is invalid: use auto or a positive integer")
    return count


def already_launched() -> bool:
    """True inside a process started by torchrun / the elastic agent (Slurm + torchrun included)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def usable_cpu_count() -> int:
    # sched_getaffinity honours the cpuset Slurm or a container gives us; cpu_count does not.
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def threads_per_worker(nproc: int) -> int:
    """OMP threads per worker so that N workers together use the cores once, not N times."""
    return max(1, usable_cpu_count() // nproc)


def config_argv(args: argparse.Namespace) -> list[str]:
    """The `--config F --section.field V ...` a worker needs to rebuild the same Config.

    Rebuilt from the parsed namespace (not copied from sys.argv) so that launcher-only flags
    such as `--nproc` and abbreviated flags never reach the workers. `--flag=value` keeps a
    value that starts with "-" from being read as a flag.
    """
    argv = [f"--config={args.config}"] if getattr(args, "config", None) else []
    for key, value in vars(args).items():
        if "." in key:  # add_config_arguments names every config field `section.field`
            argv.append(f"--{key}={value}")
    return argv


NO_RESTART_EXITS = (2, 3)
"""Exit statuses a restart would only repeat: bad input (2), a non-finite loss (3)."""


def launch_local(nproc: int, argv: list[str], module: str = "shardwise.train", *, max_restarts: int = 0,
                 run_dir: Path | None = None) -> int:
    """Run `python -m MODULE *argv` as `nproc` ranks on this machine; 0 or the first failed rank's exit status.

    Workers write straight to this console. A failed rank is reported in one line on stderr
    (its own output, traceback included, is above it); the other ranks are stopped. Up to
    `max_restarts` times a failure that is not bad input or a diverged run restarts all ranks,
    which resume from the newest valid checkpoint in `run_dir` (one line says who failed, how,
    in which step, and that it restarts).
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc = {nproc!r} is invalid: use auto or a positive integer")
    restarts = 0
    while True:
        code, failure = launch_once(nproc, argv, module)
        if failure is None:
            return code
        what = describe_failure(failure, when=f" during step {last_logged_step(run_dir) + 1}" if run_dir else "")
        if restarts < max_restarts and code not in NO_RESTART_EXITS:
            restarts += 1
            print(f"shardwise: {what}; restarting from the newest checkpoint (restart {restarts} of {max_restarts})",
                  file=sys.stderr, flush=True)
            continue
        print(f"shardwise: error: {what}", file=sys.stderr, flush=True)
        return code


def last_logged_step(run_dir: Path) -> int:
    """The last step rank 0 wrote to metrics.jsonl (0 before the first)."""
    try:
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def launch_once(nproc: int, argv: list[str], module: str) -> tuple[int, object]:
    """One launch of the ranks: (exit status, None) or (exit status, elastic's ChildFailedError)."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Only the ranks' error files land in error_dir (their output is not redirected); without
    # it LaunchConfig would leave a torchelastic_* directory in /tmp after every run.
    with tempfile.TemporaryDirectory(prefix="shardwise-launch-") as error_dir, worker_threads(nproc), quiet_agent_logs():
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            rdzv_backend="c10d",
            # Port 0: the agent's TCPStore binds a free port itself (as `torchrun --standalone`),
            # so two launches on one machine cannot race for a port picked beforehand.
            rdzv_endpoint="127.0.0.1:0",
            run_id=f"shardwise-{uuid.uuid4().hex[:12]}",
            max_restarts=0,  # restarts are `launch_local`'s loop, which can say who failed and when
            monitor_interval=0.1,
            logs_specs=DefaultLogsSpecs(log_dir=error_dir),
        )
        # -u: unbuffered, so the ranks' lines reach the console as printed (torchrun does the same).
        command = elastic_launch(config, sys.executable)
        try:
            command("-u", "-m", module, *argv)
        except ChildFailedError as err:
            return exit_code_of(err), err
        except SignalException as err:
            print(f"shardwise: error: stopped by {err.sigval.name}; all ranks were stopped", file=sys.stderr)
            return 128 + int(err.sigval), None
    return 0, None


@contextlib.contextmanager
def worker_threads(nproc: int):
    """OMP_NUM_THREADS for the workers, unless the user chose it; restored afterwards."""
    if "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = str(threads_per_worker(nproc))
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


@contextlib.contextmanager
def quiet_agent_logs():
    """Hide the agent's own warnings ("Sending process ... SIGTERM", "failed (exitcode ...)").

    `describe_failure` says the same in one line. SHARDWISE_DEBUG=1 (or LOGLEVEL) keeps them.
    Elastic sets a level on each of its module loggers, so each one is raised and restored.
    """
    if os.environ.get("SHARDWISE_DEBUG") or os.environ.get("LOGLEVEL"):
        yield
        return
    loggers = [logger for name, logger in logging.Logger.manager.loggerDict.items()
               if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def first_failure(err) -> tuple[int, object]:
    """The rank that failed first and its ProcessFailure.

    When one rank fails, the agent stops the others with SIGTERM, and ranks blocked in a
    collective with the dead one exit with a connection error; elastic's own
    `get_first_failure` orders by a whole-second timestamp, so these can tie with, and hide,
    the culprit. So: a rank killed by any signal but SIGTERM (SIGKILL, SIGSEGV, ...: from
    outside) first, then a rank that exited with an error code, then SIGTERM; ties by time, rank.
    """
    def order(item):
        rank, failure = item
        category = 2 if failure.exitcode == -signal.SIGTERM else (0 if failure.exitcode < 0 else 1)
        return (category, failure.timestamp, rank)

    return min(err.failures.items(), key=order)


def describe_failure(err, when: str = "") -> str:
    """One line from elastic's ChildFailedError: the rank that failed, how, `when`, and why."""
    rank, failure = first_failure(err)
    if failure.exitcode < 0:
        signal_name = failure.signal_name()
        hint = "; SIGKILL is often the kernel's out-of-memory killer" if signal_name == "SIGKILL" else ""
        how, detail = f"was killed by signal {signal_name}{when}", hint
    else:
        reason = failure_reason(failure)
        how = f"exited with code {failure.exitcode}{when}"
        detail = f": {reason}" if reason else "; its output above says why"
    others = sorted(r for r, f in err.failures.items() if r != rank and f.exitcode > 0)
    also = f" (ranks {', '.join(map(str, others))} failed too)" if others else ""
    return f"rank {rank} {how}{detail}{also}; the other ranks were stopped"


def failure_reason(failure) -> str:
    """The first line of the error a rank recorded (via @record), or "" if it just exited."""
    reason = failure.message
    if isinstance(reason, dict):  # error file written by @record: {"message": "Type: text", ...}
        reason = reason.get("message", "")
    reason = str(reason or "").strip()
    # elastic's placeholder when the worker left no error file (it exited instead of raising)
    return "" if reason.startswith("To enable traceback") else reason.split("\n", 1)[0]


def exit_code_of(err) -> int:
    """The failed rank's exit status (2 stays 2: bad input), or 128+N for signal N."""
    code = first_failure(err)[1].exitcode
    return code if 0 < code < 256 else (128 - code if code < 0 else 1)
