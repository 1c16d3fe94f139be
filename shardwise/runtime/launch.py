"""Start N local training processes for `shardwise train --nproc N`.

One node: the CLI calls `launch_local`, which runs `python -m shardwise.train ARGS` N times
under torch's elastic agent, the same machinery `torchrun --standalone` uses, so a worker
sees exactly what it would see under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT). Many nodes: run `torchrun ... -m shardwise.train ARGS` on every node
(examples/slurm/train.sbatch); `already_launched` then tells the CLI not to launch again.

Nothing here is written by hand that torch has: rendezvous, worker start/stop, failure
collection and passing signals on to the workers are `torch.distributed.launcher.api.elastic_launch`.
What is ours is the choice of defaults (rendezvous on port 0, OMP threads per worker, the
pre-emption signals added to those elastic passes on), turning elastic's multi-section failure
report into one line (or printing the line a rank left, once), the stall watchdog
(train.stall_timeout_s, runtime/heartbeat.py) and the restart loop (train.max_restarts).

Ctrl-C and the launcher's death: elastic starts each rank in a session of its own, so a terminal's
Ctrl-C reaches the launcher only. The launcher takes SIGINT itself (`CtrlC`): the first is passed on to
the ranks as elastic passes on a pre-emption signal (they finish the step, agree, save and stop:
runtime/preemption.py); a second SIGKILLs every rank at once. Each rank asks the kernel for SIGKILL
when the launcher dies (`die_with_launcher`, Linux's PR_SET_PDEATHSIG), so killing the launcher any
way at all, SIGKILL included, stops its ranks too: a checkpoint they were writing stays invisible
(checkpoints appear by rename, checkpoint/store.py), and nobody is left to train on.

After a stall or a failed rank, each rank's last collectives (observe/flight_recorder.py, left
beside the heartbeats) are copied into `RUN/collectives/` with a `summary.txt`
(`collective_files.save_collectives`); on CUDA, NCCL's own flight recorder is asked to dump there too.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardwise.core import exit_status
from shardwise.config.schema import signals_named
from shardwise.runtime import collective_files, faults, heartbeat
from shardwise.runtime.nodes import node_name

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


@dataclass(frozen=True)
class RankEnvironment:
    """What a launcher tells a rank through its environment: torchrun's RANK, WORLD_SIZE and LOCAL_RANK,
    and what `launch_once` adds (the heartbeat directory and interval; SHARDWISE_FAULT for drills).
    The defaults are a plain one-process run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    heartbeat_dir: Path | None = None
    """Where this rank's heartbeat goes (`shardwise train --nproc` with train.stall_timeout_s > 0), else None."""
    heartbeat_interval_s: float = 1.0
    faults: str = ""
    """Faults to inject (runtime/faults.py), as written in SHARDWISE_FAULT."""
    recorder_capacity: str = ""
    """How many collectives each rank's flight recorder keeps, as written in SHARDWISE_FR_BUFFER_SIZE (torch's
    TORCH_FR_BUFFER_SIZE for shardwise's recorder; parsed by observe/flight_recorder.py); "" = its default."""
    node_rank: int | None = None
    """In a job on several nodes: this node's --node-rank (SHARDWISE_NODE_RANK), else None."""

    @property
    def node_name(self) -> str | None:
        """This node's name in a job on several nodes (where its ranks' collectives go), else None."""
        return node_name(self.node_rank) if self.node_rank is not None else None

    @property
    def node_local(self) -> str:
        """"n<NODE>.<LOCAL RANK>" in a job on several nodes (how faults may name a rank there), else ""."""
        return f"n{self.node_rank}.{self.local_rank}" if self.node_rank is not None else ""


def rank_environment(environ: Mapping[str, str] = os.environ) -> RankEnvironment:
    """The launcher's word to this process, read here and nowhere else below the CLI: the run context
    (train/context.py) and `process_group.init_distributed` take it as an argument. torch's
    `init_process_group` still reads MASTER_ADDR/MASTER_PORT (and RANK, WORLD_SIZE) itself: its env://
    rendezvous is how a launched rank finds the others."""
    heartbeat_dir = environ.get(heartbeat.DIR_ENV)
    return RankEnvironment(rank=int(environ.get("RANK", "0")), world_size=int(environ.get("WORLD_SIZE", "1")),
                           local_rank=int(environ.get("LOCAL_RANK", "0")),
                           heartbeat_dir=Path(heartbeat_dir) if heartbeat_dir else None,
                           heartbeat_interval_s=float(environ.get(heartbeat.INTERVAL_ENV, "1")),
                           faults=environ.get(faults.ENV, ""),
                           recorder_capacity=environ.get(RECORDER_CAPACITY_ENV, ""),
                           node_rank=int(environ[NODE_RANK_ENV]) if environ.get(NODE_RANK_ENV) else None)


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
            argv.append(f"--{key}={','.join(value) if isinstance(value, list) else value}")  # lists: "a,b"
    return argv


NODE_RANK_ENV = "SHARDWISE_NODE_RANK"
RECORDER_CAPACITY_ENV = "SHARDWISE_FR_BUFFER_SIZE"
"""A job on several nodes: the --node-rank of the node a rank runs on (runtime/launch_nodes.py sets it)."""
MESSAGE_DIR_ENV = "SHARDWISE_MESSAGE_DIR"
"""Where each rank leaves its one-line outcome for the launcher to print once (cli.report)."""
ELASTIC_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""The signals torch's elastic agent passes on to the ranks by default (TORCHELASTIC_SIGNALS_TO_HANDLE)."""
LAUNCHER_PID_ENV = "SHARDWISE_LAUNCHER_PID"
"""The launcher's pid, for each rank to die with it (`die_with_launcher`)."""


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one launch meet (torch's c10d rendezvous) and with how many nodes."""

    endpoint: str
    run_id: str
    min_nodes: int = 1
    max_nodes: int = 1
    configs: dict = field(default_factory=dict)
    """c10d's settings: is_host, join_timeout, last_call_timeout."""
    node_name: str | None = None
    """On several nodes: this node's name, under which its ranks' collectives are saved."""

    @classmethod
    def one_machine(cls) -> Rendezvous:
        # Port 0: the agent's TCPStore binds a free port itself (as `torchrun --standalone`),
        # so two launches on one machine cannot race for a port picked beforehand.
        return cls(endpoint="127.0.0.1:0", run_id=f"shardwise-{uuid.uuid4().hex[:12]}")

    def collectives_dir(self, run_dir: Path) -> Path | None:
        """RUN/collectives/<node>/ on several nodes; None (RUN/collectives/) on one."""
        return Path(run_dir) / collective_files.COLLECTIVES_DIR / self.node_name if self.node_name else None


@dataclass
class Launch:
    """What one launch of the ranks ended with."""

    code: int
    failure: object = None
    """elastic's ChildFailedError (a rank failed) or SignalException (this process was signalled)."""
    messages: dict[int, str] = field(default_factory=dict)
    """The one-line outcome each rank left (cli.report), by rank."""
    stall: str | None = None
    """The watchdog's verdict when it stopped a stalled job."""
    hurried: bool = False
    """A second Ctrl-C killed the ranks before they could save."""


def launch_local(nproc: int, argv: list[str], module: str = "shardwise.train", *, max_restarts: int = 0,
                 run_dir: Path | None = None, stop_signals: str = "", stall_timeout_s: float = 0.0) -> int:
    """Run `python -m MODULE *argv` as `nproc` ranks on this machine; 0 or the first failed rank's exit status.

    Workers write straight to this console. A failed rank is reported in one line on stderr: the
    line it left (bad input, a non-finite stop, a pre-emption save), else who failed and how
    (its own traceback is above it); the other ranks are stopped quietly. `stop_signals` sent to
    this process are passed on to the ranks (train.preempt_signals: they save and stop). With
    `stall_timeout_s`, a job where no rank made progress for that long is stopped. Up to
    `max_restarts` times a failure that is not bad input, a diverged run or a pre-emption
    restarts all ranks, which resume from the newest valid checkpoint in `run_dir`.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc = {nproc!r} is invalid: use auto or a positive integer")
    restarts = 0
    while True:
        launch = launch_once(nproc, argv, module, stop_signals=stop_signals, stall_timeout_s=stall_timeout_s,
                             run_dir=run_dir)
        if launch.failure is None:
            return launch.code
        line, code = outcome(launch, run_dir)
        if restarts < max_restarts and code not in exit_status.NO_RESTART and not is_signal_to_launcher(launch):
            restarts += 1
            print(f"shardwise: {line}; restarting from the newest checkpoint (restart {restarts} of {max_restarts})",
                  file=sys.stderr, flush=True)
            continue
        print(line if line.startswith("shardwise:") else f"shardwise: error: {line}", file=sys.stderr, flush=True)
        return code


def is_signal_to_launcher(launch: Launch) -> bool:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return isinstance(launch.failure, SignalException)


def outcome(launch: Launch, run_dir: Path | None) -> tuple[str, int]:
    """The one line to print for a failed launch, and the exit status to end with."""
    when = f" during step {last_logged_step(run_dir) + 1}" if run_dir else ""
    if launch.stall:
        return launch.stall, exit_status.STALLED
    left = next(iter(launch.messages.values()), None)  # a rank's own line (lowest rank first)
    if is_signal_to_launcher(launch):
        name = launch.failure.sigval.name
        if launch.hurried:  # a person's stop is no error: "shardwise:" alone
            return (f"shardwise: stopped at once by a second Ctrl-C{when}; the step in flight was not saved: rerun "
                    "the same command to resume from the newest checkpoint", exit_status.INTERRUPTED)
        if left:  # the ranks saved (pre-emption) or reported why they stopped
            return left, exit_status.PREEMPTED if "pre-empted" in left else launch.code
        if name == signal.SIGINT.name:  # a training run's ranks save on Ctrl-C; a server's have nothing to save
            unsaved = " before the ranks could save" if run_dir else ""
            return f"shardwise: stopped by Ctrl-C (SIGINT){when}{unsaved}", launch.code
        if not run_dir:  # a server's ranks: stopping is how it ends, not an error, and nothing was to be saved
            return f"shardwise: stopped by {name}; all ranks were stopped", launch.code
        return f"stopped by {name}{when} before the ranks could save; all ranks were stopped", launch.code
    rank, failure = first_failure(launch.failure)
    if 0 < failure.exitcode and (launch.messages.get(rank) or left):
        return launch.messages.get(rank) or left, launch.code
    return describe_failure(launch.failure, when=when), launch.code


def last_logged_step(run_dir: Path) -> int:
    """The last step rank 0 wrote to metrics.jsonl (0 before the first)."""
    try:
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def launch_once(nproc: int, argv: list[str], module: str, *, stop_signals: str = "",
                stall_timeout_s: float = 0.0, run_dir: Path | None = None, rendezvous: Rendezvous | None = None,
                watch=None, extra_env: dict[str, str] | None = None) -> Launch:
    """One launch of the ranks, under the stall watchdog when `stall_timeout_s` > 0; after a stall or a
    failed rank, the ranks' last collectives are saved in `run_dir`/collectives.

    On several nodes (runtime/launch_nodes.py): `rendezvous` says where and with whom, `watch(heartbeat_dir)`
    is the job-wide watchdog that replaces this machine's, and `extra_env` goes to the ranks."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Only the ranks' error files land in error_dir (their output is not redirected); without
    # it LaunchConfig would leave a torchelastic_* directory in /tmp after every run.
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="shardwise-launch-") as error_dir:
        messages, beats = Path(error_dir) / "messages", Path(error_dir) / "heartbeats"
        messages.mkdir()
        beats.mkdir()
        interval = min(1.0, stall_timeout_s / 5) if stall_timeout_s else 1.0
        env = ranks_env(nproc, messages, stop_signals, run_dir)
        if stall_timeout_s or watch is not None:  # several nodes: beats also show whose ranks run
            env.update({heartbeat.DIR_ENV: str(beats), heartbeat.INTERVAL_ENV: str(interval)})
        env.update(extra_env or {})
        rendezvous = rendezvous or Rendezvous.one_machine()
        config = LaunchConfig(
            min_nodes=rendezvous.min_nodes,
            max_nodes=rendezvous.max_nodes,
            nproc_per_node=nproc,
            rdzv_backend="c10d",
            rdzv_endpoint=rendezvous.endpoint,
            rdzv_configs=rendezvous.configs,
            run_id=rendezvous.run_id,
            max_restarts=0,  # restarts are `launch_local`'s loop, which can say who failed and when
            monitor_interval=0.1,
            logs_specs=DefaultLogsSpecs(log_dir=error_dir),
            # elastic sets TORCHELASTIC_SIGNALS_TO_HANDLE from this, over what `env` says
            signals_to_handle=env["TORCHELASTIC_SIGNALS_TO_HANDLE"],
        )
        # -u: unbuffered, so the ranks' lines reach the console as printed (torchrun does the same).
        command = elastic_launch(config, sys.executable)
        if watch is not None:
            watchdog = watch(beats, interval)
        else:
            watchdog = heartbeat.Watchdog(beats, nproc, stall_timeout_s, interval, run_dir) if stall_timeout_s else None
        ctrl_c = CtrlC()
        with environment(env), quiet_agent_logs(), watchdog or contextlib.nullcontext(), \
                launcher_signals(ctrl_c, env["TORCHELASTIC_SIGNALS_TO_HANDLE"]):
            try:
                command("-u", "-m", module, *argv)
                return Launch(0)
            except ChildFailedError as err:
                stall = getattr(watchdog, "verdict", None)  # the watchdog saved the collectives already
                if not stall and run_dir is not None and exit_code_of(err) not in exit_status.NO_RESTART:
                    save_failed_ranks_collectives(beats, run_dir, nproc, err, since=started,
                                                  into=rendezvous.collectives_dir(run_dir))
                return Launch(exit_code_of(err), err, rank_messages(messages), stall)
            except SignalException as err:
                kill_ranks()  # only after a second Ctrl-C (and before their directory goes) can one be left
                return Launch(128 + int(err.sigval), err, rank_messages(messages), hurried=ctrl_c.count > 1)


def ranks_env(nproc: int, messages: Path, stop_signals: str, run_dir: Path | None) -> dict[str, str]:
    """What every launch tells its ranks through the environment."""
    env = {MESSAGE_DIR_ENV: str(messages), "TORCHELASTIC_SIGNALS_TO_HANDLE": handled_signals(stop_signals),
           LAUNCHER_PID_ENV: str(os.getpid())}
    if "OMP_NUM_THREADS" not in os.environ:  # the user's choice stands
        env["OMP_NUM_THREADS"] = str(threads_per_worker(nproc))
    env.update(nccl_flight_recorder_env(run_dir))
    return env


def save_failed_ranks_collectives(beats: Path, run_dir: Path, nproc: int, err, *, since: float,
                                  into: Path | None = None) -> None:
    """A rank died or failed: every rank's last collectives into RUN/collectives (bad input, a diverged
    run and a pre-emption are no hang to explain, and save nothing)."""
    # Killed from outside (not the agent's SIGTERM to the survivors): their records end at their last beat.
    killed = {rank: f"killed by {failure.signal_name()}" for rank, failure in err.failures.items()
              if failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM}
    try:
        ranks = sorted(heartbeat.read_beats(beats)) if into is not None else nproc  # a node's: global ranks
        collective_files.save_collectives(beats, run_dir, ranks, f"failure: {describe_failure(err)}", since=since,
                                          stopped=killed, into=into)
    except OSError as error:  # the failure's own line matters more than this copy
        print(f"shardwise: warning: could not save the ranks' last collectives in {run_dir}: {error}",
              file=sys.stderr, flush=True)


NCCL_TRACE_ENTRIES = "2000"
"""NCCL flight recorder entries per rank: a few steps of a large layout, a few MB of host memory."""


def nccl_flight_recorder_env(run_dir: Path | None) -> dict[str, str]:
    """Optional, on CUDA only: NCCL's own flight recorder, dumped into RUN/collectives/nccl_trace_rank_<R>
    when NCCL's watchdog times out or sees an error. It records on the device side, which ours cannot
    (a blocking NCCL call returns once queued). The user's own settings stand. Not tested here: CI has no
    GPU. NCCL's timeout (10 minutes by default) may come after train.stall_timeout_s, whose watchdog kills
    the ranks first; then only ours is written."""
    if run_dir is None or not torch.cuda.is_available():
        return {}
    prefix = str(Path(run_dir) / collective_files.COLLECTIVES_DIR / "nccl_trace_rank_")  # NCCL appends the rank
    wanted = {"TORCH_FR_BUFFER_SIZE": NCCL_TRACE_ENTRIES, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_FR_DUMP_TEMP_FILE": prefix,
              # the older names of the same settings, which older torch reads
              "TORCH_NCCL_TRACE_BUFFER_SIZE": NCCL_TRACE_ENTRIES, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}
    if any(os.environ.get(name) for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")):
        return {}  # the user set the recorder up: leave every part of it to them
    (Path(run_dir) / collective_files.COLLECTIVES_DIR).mkdir(parents=True, exist_ok=True)  # NCCL does not create it
    return wanted


def handled_signals(stop_signals: str) -> str:
    """elastic's default signals plus the pre-emption ones, which it then passes on to the ranks; SIGINT
    aside, which `CtrlC` takes."""
    extra = [sig.name for sig in signals_named("train.preempt_signals", stop_signals)]
    names = dict.fromkeys([*ELASTIC_SIGNALS.split(","), *extra])
    return ",".join(name for name in names if name != signal.SIGINT.name)


class CtrlC:
    """The launcher's SIGINT handler. The first Ctrl-C is raised as elastic's own SignalException, so the
    agent passes SIGINT on to every rank and waits for them (they save the step in flight and stop); a
    second, which interrupts that wait, kills the ranks at once."""

    def __init__(self):
        self.count = 0

    def __call__(self, signum, frame) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        self.count += 1
        if self.count > 1:
            kill_ranks()
            return  # the agent's wait for the ranks ends, and it raises the first Ctrl-C's exception
        raise SignalException(f"Process {os.getpid()} got signal: SIGINT", sigval=signal.SIGINT)


@contextlib.contextmanager
def launcher_signals(ctrl_c: CtrlC, elastic_signals: str):
    """`ctrl_c` takes SIGINT during a launch (and after it, once a Ctrl-C came: the launcher is ending); the
    handlers elastic installs for `elastic_signals` are put back as they were afterwards, so that a signal
    between two launches (a restart) is this process's own again, not an uncaught SignalException."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal works there only
        yield
        return
    names = {signal.SIGINT.name, *elastic_signals.split(",")}
    taken = [getattr(signal, name) for name in sorted(names) if hasattr(signal, name)]
    before = {sig: signal.getsignal(sig) for sig in taken}
    signal.signal(signal.SIGINT, ctrl_c)
    try:
        yield
    finally:
        if ctrl_c.count:  # this process is ending on a Ctrl-C: one more must not interrupt its last line
            del before[signal.SIGINT]
        for sig, handler in before.items():
            signal.signal(sig, handler)


def kill_ranks() -> None:
    """SIGKILL every rank still running, with whatever it started (elastic makes each rank a process group
    leader, and stops ranks the same way)."""
    for pid in child_pids(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)


def child_pids(parent: int) -> list[int]:
    """The pids of `parent`'s live children (Linux /proc; [] elsewhere): a launcher's are its ranks."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:  # it ended meanwhile
                continue
            # "pid (command) state ppid ...": the command may hold spaces and parentheses
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == parent and state not in "ZX":
                found.append(int(entry.name))
    return found


PR_SET_PDEATHSIG = 1
"""prctl(2)'s option: the signal the kernel sends this process when its parent ends."""


def die_with_launcher(environ: Mapping[str, str] = os.environ) -> None:
    """In a rank started by `launch_local` (Linux): the kernel SIGKILLs this process when the launcher ends,
    however it ends, so no rank trains on without a launcher to report or restart it.

    The parent in PR_SET_PDEATHSIG is the thread that started the rank: elastic's agent does, with
    subprocess.Popen, in the thread that called `launch_local` (the CLI's main thread), which ends with the
    launcher. A launcher that ended before this call is caught by comparing the parent with its pid."""
    launcher = environ.get(LAUNCHER_PID_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # refused (a seccomp sandbox): the launcher's own stop still ends the ranks
    if os.getppid() != int(launcher):
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel would have done, had it known in time


def rank_messages(directory: Path) -> dict[int, str]:
    found = {}
    for path in sorted(Path(directory).glob("rank*.txt"), key=lambda p: int(p.stem.removeprefix("rank"))):
        text = path.read_text().strip()
        if text:
            found[int(path.stem.removeprefix("rank"))] = text.splitlines()[0]
    return found


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """Set environment variables for the ranks (they inherit this process's); restored afterwards."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


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
