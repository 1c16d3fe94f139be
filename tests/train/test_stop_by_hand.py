"""Stopping by hand: Ctrl-C saves the step in flight and ends with one line and status 130,
a second Ctrl-C stops at once, and no rank outlives its launcher, however the launcher ends.

The launched cases run the real command in a session of its own (so the test can signal its process
group, as a terminal does, and clean up), wait for the ranks to train or serve, and then signal it.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from shardwise.checkpoint.integrity import checkpoint_status
from shardwise.checkpoint.store import checkpoint_dirs
from shardwise.cli import train as cli_train_module
from shardwise.cli.main import main
from shardwise.core import exit_status
from shardwise.runtime import faults, launch, preemption
from shardwise.runtime.launch import Launch, child_pids
from shardwise.train.trainer import train

RANKS_GONE_WITHIN_S = 10.0


# ------------------------------------------------------------------ in this process (fast)

def test_ctrl_c_in_one_process_saves_the_step_in_flight_in_one_line_and_the_rerun_resumes(tiny_config, tmp_path,
                                                                                           monkeypatch, capsys):
    """`shardwise train --nproc=1` runs in this process, so Ctrl-C (the `int` fault: a real SIGINT to this
    process as step 3 starts) and the rerun are calls of `main`, as in the pre-emption test of
    tests/train/test_faults.py; a KeyboardInterrupt escaping `main` (what the command printed as a
    traceback before) fails it."""
    cfg = tiny_config(**{"train.steps": 5, "checkpoint.every": 100, "train.preempt_signals": ""})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    command = ["train", f"--config={tmp_path / 'config.json'}", f"--run.dir={tmp_path / 'run'}", "--nproc=1"]
    monkeypatch.setenv(faults.ENV, "int@3")
    capsys.readouterr()
    assert main(command) == exit_status.INTERRUPTED == 130
    saved = tmp_path / "run" / "checkpoints" / "step_00000003"
    assert [line for line in capsys.readouterr().err.splitlines() if line.strip()] == [
        f"shardwise: stopped by Ctrl-C (SIGINT) after step 3: saved checkpoint {saved}; rerun the same command to "
        "resume from it"]
    assert checkpoint_dirs(tmp_path / "run") == [saved] and checkpoint_status(saved) == ("ok", "")
    monkeypatch.delenv(faults.ENV)
    assert main(command) == 0
    assert "trained steps 4..5" in capsys.readouterr().out


@pytest.mark.parametrize("agreed", ["SIGINT", "SIGINT (received by rank 0)", "SIGINT (received by rank 1)"])
def test_a_ctrl_c_reads_the_same_whichever_rank_had_it_when_the_ranks_agreed(agreed):
    """The launcher passes a Ctrl-C on to every rank; one rank's copy may land after the ranks agreed
    on the step. The person who pressed it reads one line, the same every time."""
    stopped = preemption.Preempted(agreed, 7, "RUN/checkpoints/step_00000007")
    assert str(stopped) == ("stopped by Ctrl-C (SIGINT) after step 7: saved checkpoint RUN/checkpoints/step_00000007; "
                            "rerun the same command to resume from it")
    assert stopped.exit_status == exit_status.INTERRUPTED
    assert str(preemption.Preempted("SIGTERM (received by rank 1)", 7, "c")).startswith(
        "pre-empted by SIGTERM (received by rank 1) after step 7")


def test_a_second_ctrl_c_stops_at_once_with_one_line(monkeypatch, capsys):
    """The second Ctrl-C (or one after a pre-emption signal) does not wait for the step: `os._exit(130)`."""
    monkeypatch.setattr(preemption.os, "_exit", lambda status: (_ for _ in ()).throw(SystemExit(status)))
    for first in (signal.SIGINT, signal.SIGTERM):
        with preemption.StopSignals("SIGTERM") as stop:
            assert signal.getsignal(signal.SIGINT) == stop.record  # taken whatever train.preempt_signals lists
            stop.record(first, None)
            assert stop.received == first.name
            with pytest.raises(SystemExit) as stopped:
                stop.record(signal.SIGINT, None)
        assert stopped.value.code == exit_status.INTERRUPTED
        assert capsys.readouterr().err == ("shardwise: stopped at once by a second Ctrl-C; the step in flight was not "
                                           "saved: rerun the same command to resume from the newest checkpoint\n")


def test_ctrl_c_outside_a_run_is_one_line_and_status_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_train_module, "cmd_train", interrupted)
    monkeypatch.delenv("SHARDWISE_DEBUG", raising=False)
    assert main(["train"]) == exit_status.INTERRUPTED
    assert capsys.readouterr().err == "shardwise: stopped by Ctrl-C (SIGINT)\n"


def test_the_launchers_line_for_a_ctrl_c_its_ranks_could_not_answer(tmp_path):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    (tmp_path / "metrics.jsonl").write_text('{"step": 6}\n')
    ctrl_c = SignalException("got SIGINT", sigval=signal.SIGINT)
    assert launch.outcome(Launch(130, ctrl_c, hurried=True), tmp_path) == (
        "shardwise: stopped at once by a second Ctrl-C during step 7; the step in flight was not saved: rerun the "
        "same command to resume from the newest checkpoint", exit_status.INTERRUPTED)
    assert launch.outcome(Launch(130, ctrl_c), tmp_path) == (
        "shardwise: stopped by Ctrl-C (SIGINT) during step 7 before the ranks could save", 130)
    assert launch.outcome(Launch(130, ctrl_c), None) == ("shardwise: stopped by Ctrl-C (SIGINT)", 130)  # a server's
    term = SignalException("got SIGTERM", sigval=signal.SIGTERM)  # a scheduler stopping a server: no error
    assert launch.outcome(Launch(143, term), None) == ("shardwise: stopped by SIGTERM; all ranks were stopped", 143)
    assert launch.outcome(Launch(143, term), tmp_path) == (
        "stopped by SIGTERM during step 7 before the ranks could save; all ranks were stopped", 143)
    assert "SIGINT" not in launch.handled_signals("SIGTERM,SIGUSR1").split(",")  # `CtrlC` takes it, not elastic


# ------------------------------------------------------------------ the real command (slow)

TRAIN_FLAGS = ["--model.preset=debug", "--data.source=stdlib", "--data.vocab_size=512",
               "--data.max_corpus_bytes=200000", "--train.global_batch_size=4", "--train.micro_batch_size=2",
               "--train.seq_len=32", "--train.warmup_steps=2", "--train.sample_tokens=0", "--run.progress=false"]


def start(argv, fault=""):
    """`shardwise ARGV` in a session of its own, as a terminal's foreground job is."""
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", faults.ENV)}
    return subprocess.Popen([sys.executable, "-m", "shardwise.cli.main", *argv], env={**env, faults.ENV: fault},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def start_training(run_dir, data_cache, *flags, fault=""):
    return start(["train", *TRAIN_FLAGS, f"--data.cache_dir={data_cache}", f"--run.dir={run_dir}", "--train.steps=500",
                  *flags], fault)


def logged_steps(run_dir):
    try:
        return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return []


def wait_until(condition, proc, what, timeout_s=180.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {what}: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            stop(proc)
            raise AssertionError(f"no {what} within {timeout_s} s")
        time.sleep(0.1)


def process_state(pid):
    """The kernel's one-letter state of `pid` (R, S, T stopped, Z ...), or "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def alive_after(pids, seconds):
    """The pids among `pids` still running (not gone, not a zombie) after waiting up to `seconds` for them."""
    deadline = time.monotonic() + seconds
    while True:
        alive = [pid for pid in pids if process_state(pid) not in ("", "Z", "X")]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def stop(proc):
    """Clean up after a failed test: the whole session, ranks and all."""
    for pid in [proc.pid, *child_pids(proc.pid)]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def finished(proc, timeout_s=120):
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise
    return out, err


def shardwise_lines(err):
    return [line for line in err.splitlines() if line.startswith("shardwise:")]


@pytest.mark.slow
def test_ctrl_c_under_nproc_2_saves_the_step_in_flight_then_a_second_ctrl_c_stops_at_once(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    # A terminal's Ctrl-C: SIGINT to the foreground process group (elastic starts each rank in a session of
    # its own, so it reaches the launcher only, which passes it on).
    job = start_training(run_dir, data_cache, "--nproc=2")
    wait_until(lambda: len(logged_steps(run_dir)) >= 2, job, "second step")
    ranks = child_pids(job.pid)
    os.killpg(job.pid, signal.SIGINT)
    _, err = finished(job)
    assert job.returncode == exit_status.INTERRUPTED, err[-3000:]
    step = logged_steps(run_dir)[-1]
    saved = run_dir / "checkpoints" / f"step_{step:08d}"
    assert shardwise_lines(err) == [f"shardwise: stopped by Ctrl-C (SIGINT) after step {step}: saved checkpoint "
                                    f"{saved}; rerun the same command to resume from it"]
    assert "Traceback" not in err
    assert checkpoint_dirs(run_dir) == [saved] and checkpoint_status(saved) == ("ok", "")
    assert len(ranks) == 2 and not alive_after(ranks, 0)

    # The rerun resumes; rank 1 freezes (SIGSTOP) as step + 2 starts, so the ranks cannot finish that step
    # and save: the first Ctrl-C reaches them, the second (to the launcher alone) kills them.
    frozen = step + 2
    job = start_training(run_dir, data_cache, "--nproc=2", fault=f"stop@{frozen}:1")
    wait_until(lambda: "T" in [process_state(pid) for pid in child_pids(job.pid)], job, "frozen rank")
    ranks = child_pids(job.pid)
    os.kill(job.pid, signal.SIGINT)
    time.sleep(0.5)
    os.kill(job.pid, signal.SIGINT)
    _, err = finished(job, timeout_s=RANKS_GONE_WITHIN_S)  # not elastic's 30 s wait for the ranks
    assert job.returncode == exit_status.INTERRUPTED
    assert shardwise_lines(err) == [f"shardwise: stopped at once by a second Ctrl-C during step {frozen}; the step "
                                    "in flight was not saved: rerun the same command to resume from the newest "
                                    "checkpoint"]
    assert "Traceback" not in err
    assert logged_steps(run_dir)[-1] == frozen - 1 and checkpoint_dirs(run_dir) == [saved]
    assert len(ranks) == 2 and not alive_after(ranks, 0)


@pytest.mark.slow
def test_killing_the_training_launcher_stops_its_ranks_and_leaves_only_whole_checkpoints(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    # A save every step: the launcher dies while one is being written, or close to it.
    job = start_training(run_dir, data_cache, "--nproc=2", "--checkpoint.every=1", "--checkpoint.keep=100")
    wait_until(lambda: len(logged_steps(run_dir)) >= 3, job, "third step")
    ranks = child_pids(job.pid)
    job.send_signal(signal.SIGKILL)
    job.wait()
    assert len(ranks) == 2 and not alive_after(ranks, RANKS_GONE_WITHIN_S)
    settled = logged_steps(run_dir)
    time.sleep(1)
    assert logged_steps(run_dir) == settled  # nobody trains on
    assert [checkpoint_status(path) for path in checkpoint_dirs(run_dir)] == [("ok", "")] * len(
        checkpoint_dirs(run_dir))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def health_status(port):
    """The HTTP status /health answers with (any: it may want an API key), or None while nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as refused:
        return refused.code
    except OSError:
        return None


@pytest.mark.slow
def test_killing_the_serve_launcher_stops_its_ranks(tiny_config, tmp_path):
    run_dir = train(tiny_config(**{"train.steps": 2, "run.dir": str(tmp_path / "run")})).run_dir
    port = free_port()
    server = start(["serve", "--run", str(run_dir), "--port", str(port), "--device", "cpu", "--nproc", "2",
                    "--parallel.tp", "2"])
    wait_until(lambda: health_status(port) is not None, server, "answer on /health")
    ranks = child_pids(server.pid)
    server.send_signal(signal.SIGKILL)
    server.wait()
    assert len(ranks) == 2 and not alive_after(ranks, RANKS_GONE_WITHIN_S)
