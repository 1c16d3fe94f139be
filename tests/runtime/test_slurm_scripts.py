"""examples/slurm/*.sbatch as Slurm runs them (issue 39, item 5).

With a real Slurm (root, Debian's slurm-wlm and munge installed), tests/runtime/slurm_cluster.sh starts a
one-node cluster on this host and the scripts are submitted with sbatch as a user submits them: training is
pre-empted by Slurm's signal, requeued and finished; serving answers and scancel stops it. Without one those
skip, saying why, and serve.sbatch runs under a recorded Slurm environment instead, as train.sbatch always
does: what srun gave the task of a one-node job, with a stand-in `srun` that runs its command. `--nnodes auto`
outside Slurm is one line.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from shardwise.checkpoint.store import checkpoint_dirs
from shardwise.config.loader import load_config
from shardwise.core import exit_status

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "examples" / "slurm"
CLUSTER = Path(__file__).with_name("slurm_cluster.sh")
NODE = socket.gethostname().split(".")[0]

# What srun gave the task of `sbatch --nodes=1 examples/slurm/train.sbatch` (slurm-wlm 22.05.8 on this host,
# tests/runtime/slurm_cluster.sh), less the ports, process ids and paths of that one job.
RECORDED_STEP_ENVIRONMENT = {
    "SLURMD_NODENAME": NODE, "SLURM_CLUSTER_NAME": "shardwise-test", "SLURM_CPUS_ON_NODE": "2",
    "SLURM_DISTRIBUTION": "cyclic", "SLURM_GTIDS": "0", "SLURM_JOBID": "4242", "SLURM_JOB_CPUS_PER_NODE": "2",
    "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "shardwise-train", "SLURM_JOB_NODELIST": NODE,
    "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_PARTITION": "debug", "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1",
    "SLURM_LOCALID": "0", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NODELIST": NODE, "SLURM_NPROCS": "1",
    "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_STEPID": "0", "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": NODE, "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_SUBMIT_HOST": NODE, "SLURM_TASKS_PER_NODE": "1",
    "SLURM_TOPOLOGY_ADDR": NODE, "SLURM_TOPOLOGY_ADDR_PATTERN": "node",
}

STAND_IN_SRUN = """#!/bin/sh
# srun for one node and one task: drop srun's own options (the scripts write them --name=value) and run the rest.
while [ "${1#-}" != "$1" ]; do shift; done
exec "$@"
"""


def tiny_config(path: Path, data_cache: str, **overrides) -> Path:
    values = {"model.preset": "debug", "model.tie_embeddings": False, "data.source": "stdlib",
              "data.vocab_size": 512, "data.max_corpus_bytes": 200_000, "data.cache_dir": data_cache,
              "train.steps": 4, "train.global_batch_size": 4, "train.micro_batch_size": 2, "train.seq_len": 32,
              "train.warmup_steps": 2, "train.lr": 1e-2, "train.sample_tokens": 0, "run.progress": False,
              "checkpoint.every": 2, **overrides}
    path.write_text(json.dumps(load_config(overrides=values).to_dict()))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_environment(**extra) -> dict[str, str]:
    """This process's environment without Slurm's or a launcher's variables, the shardwise command on PATH."""
    kept = {key: value for key, value in os.environ.items()
            if not key.startswith(("SLURM_", "SHARDWISE_")) and key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    kept["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{kept.get('PATH', '')}"
    return {**kept, **extra}


def trained_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ always: a recorded Slurm environment

def recorded_slurm_step(directory: Path, **extra) -> dict[str, str]:
    """The recorded environment, with the stand-in srun (written into `directory`) first on PATH."""
    (directory / "bin").mkdir(exist_ok=True)
    (directory / "bin" / "srun").write_text(STAND_IN_SRUN)
    (directory / "bin" / "srun").chmod(0o755)
    env = clean_environment(**RECORDED_STEP_ENVIRONMENT, **extra)
    env["PATH"] = f"{directory / 'bin'}{os.pathsep}{env['PATH']}"
    return env


@pytest.fixture(scope="module")
def recorded_train(tmp_path_factory, data_cache):
    """train.sbatch as srun runs it on the one node of a job, trained to the end once for the tests below."""
    root = tmp_path_factory.mktemp("slurm-recorded")
    env = recorded_slurm_step(root, SHARDWISE_NPROC="2",
                              SHARDWISE_CONFIG=str(tiny_config(root / "config.json", data_cache)))
    # A free port, not the default 29500: other runs on this host may hold that one.
    done = subprocess.run(["bash", str(SCRIPTS / "train.sbatch"), f"--run.dir={root / 'run'}",
                           f"--rdzv-endpoint=127.0.0.1:{free_port()}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    return root, done


def test_train_sbatch_under_a_recorded_slurm_environment_trains_and_checkpoints(recorded_train):
    root, done = recorded_train
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dp2 zero3" in done.stdout  # the script's HSDP layout over the node's 2 ranks (dp_replicate = 1 node)
    assert "trained steps 1..4" in done.stdout
    assert trained_steps(root / "run") == [1, 2, 3, 4]
    assert [path.name for path in checkpoint_dirs(root / "run")] == ["step_00000002", "step_00000004"]


def test_nnodes_auto_outside_slurm_is_one_line_and_writes_nothing(tmp_path, data_cache):
    config = tiny_config(tmp_path / "config.json", data_cache)
    done = subprocess.run([sys.executable, "-m", "shardwise.cli.main", "train", "--nnodes", "auto", "--nproc", "2",
                           f"--config={config}", f"--run.dir={tmp_path / 'run'}"], env=clean_environment(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == exit_status.BAD_INPUT
    assert done.stderr.splitlines() == [
        "shardwise: error: --nnodes = auto is invalid here: it reads the nodes from Slurm's environment and "
        "SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST is not set; run it inside a Slurm job step (srun), or "
        "give --nnodes N --node-rank R --rdzv-endpoint HOST:PORT"]
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ a real Slurm on this host

@pytest.fixture(scope="module")
def slurm_or_why_not(tmp_path_factory):
    """A one-node Slurm cluster for this module (the variables that point sbatch at it), or the one line that
    says why there is none: not root, slurm-wlm or munge not installed, a daemon that did not start."""
    directory = tmp_path_factory.mktemp("slurm-cluster")
    started = subprocess.run(["bash", str(CLUSTER), "start", str(directory)], capture_output=True, text=True,
                             timeout=120)
    if started.returncode != 0:
        subprocess.run(["bash", str(CLUSTER), "stop", str(directory)], capture_output=True, timeout=60)
        why = started.stderr.strip().splitlines() or [f"slurm_cluster.sh exited {started.returncode}"]
        yield f"no Slurm on this host: {why[-1]}"
        return
    yield {"SLURM_CONF": str(directory / "slurm.conf")}
    subprocess.run(["bash", str(CLUSTER), "stop", str(directory)], capture_output=True, timeout=60)


@pytest.fixture
def slurm(slurm_or_why_not):
    if isinstance(slurm_or_why_not, str):
        pytest.skip(slurm_or_why_not)
    return slurm_or_why_not


def submit(env: dict[str, str], script: str, log: Path, *args: str) -> str:
    """sbatch SCRIPT ARGS on the cluster's one node, its output in `log`; the job id."""
    done = subprocess.run(["sbatch", "--parsable", "--nodes=1", f"--output={log}", str(SCRIPTS / script), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip().split(";")[0]


def rendezvous_unless_default_is_free() -> list[str]:
    """No flag: the script's default rendezvous, the head node's port 29500, as on a cluster. Another job on
    this host may hold that port (the suite runs files side by side); then a free one on the same head."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store binds it
        try:
            sock.bind(("", 29500))
            return []
        except OSError:
            return [f"--rdzv-endpoint={NODE}:{free_port()}"]


def job_fields(env: dict[str, str], job: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", "--oneliner", job], env=env, capture_output=True, text=True,
                           timeout=30)
    return dict(item.split("=", 1) for item in shown.stdout.split() if "=" in item)


def final_state(env: dict[str, str], job: str) -> str | None:
    """COMPLETED, FAILED, CANCELLED, ... once the job has ended; None while it waits or runs."""
    state = job_fields(env, job).get("JobState")
    return None if state in (None, "PENDING", "RUNNING", "REQUEUED", "COMPLETING") else state


def wait_for(condition, timeout_s: float, what: str, log: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout_s:.0f} s; the job's log:\n"
                         f"{log.read_text()[-3000:] if log.exists() else '(none)'}")


@pytest.mark.slow
def test_train_sbatch_under_real_slurm_is_preempted_requeued_and_finishes(slurm, tmp_path, data_cache):
    """Slurm's signal before the time limit (--signal=USR1@120, sent here at once by scancel --signal) saves a
    checkpoint; the script requeues the job, which resumes from it and trains to the end."""
    config = tiny_config(tmp_path / "config.json", data_cache, **{"train.steps": 40, "checkpoint.every": 100})
    env = clean_environment(**slurm, SHARDWISE_NPROC="2", SHARDWISE_CONFIG=str(config))
    run, log = tmp_path / "run", tmp_path / "train.log"
    job = submit(env, "train.sbatch", log, f"--run.dir={run}", *rendezvous_unless_default_is_free())
    wait_for(lambda: (run / "metrics.jsonl").exists() and trained_steps(run), 120, "a first step", log)
    subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True, timeout=30)
    requeued = lambda: job_fields(env, job).items() >= {"Restarts": "1", "JobState": "PENDING"}.items()
    wait_for(requeued, 120, "the requeue", log)
    # A requeued job waits 2 minutes before it may start again; here it starts at once, but in a later second
    # than the requeue's kill: slurmd refuses a job credential issued in the same second as the kill that
    # revoked the old one ("Job credential revoked": its times are whole seconds), and the job fails.
    time.sleep(1.5)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True, timeout=30)
    state = wait_for(lambda: final_state(env, job), 240, "the end of the job", log)
    text = log.read_text()
    assert state == "COMPLETED", text[-3000:]
    # scancel signals the whole step: the launcher or one of its ranks may be the first to take it (the line
    # then names that rank), as with kill -USR1 on a process group
    saved = [line for line in text.splitlines()
             if re.match(r"shardwise: pre-empted by SIGUSR1( \(received by rank \d+\))? after step \d+:", line)]
    assert len(saved) == 1, text[-3000:]
    step = int(saved[0].split("after step ")[1].split(":")[0])
    assert f"shardwise: requeueing job {job} to resume from the checkpoint just saved" in text
    assert f"trained steps {step + 1}..40" in text  # resumed after the saved step, not from the start
    assert [path.name for path in checkpoint_dirs(run)] == [f"step_{step:08d}", "step_00000040"]
    assert "Traceback" not in text


def answers_http(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
            return True
    except OSError:
        return False


def completion(port: int) -> dict:
    """A greedy 4-token completion from the server's one model."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as response:
        model = json.loads(response.read())["data"][0]["id"]
    body = {"model": model, "prompt": "The", "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_serve_sbatch_under_real_slurm_answers_and_scancel_stops_it(slurm, recorded_train, tmp_path):
    """Tensor-parallel over the node's 2 ranks; scancel ends the job and every process of it."""
    port = free_port()
    env = clean_environment(**slurm, SHARDWISE_NPROC="2", SHARDWISE_RUN=str(recorded_train[0] / "run"),
                            SHARDWISE_PORT=str(port))
    log = tmp_path / "serve.log"
    job = submit(env, "serve.sbatch", log)
    ended = lambda: final_state(env, job)
    wait_for(lambda: answers_http(port) or ended(), 180, "the server", log)
    assert not ended(), log.read_text()[-3000:]
    answer = completion(port)
    assert answer["usage"]["completion_tokens"] in range(1, 5) and answer["choices"][0]["text"]
    subprocess.run(["scancel", job], env=env, check=True, timeout=30)
    wait_for(ended, 60, "the end of the job", log)
    assert not answers_http(port)
    assert f"shardwise: clients reach the server at http://{socket.gethostname()}:{port}/v1" in log.read_text()


@pytest.mark.slow
def test_serve_sbatch_under_a_recorded_slurm_environment_answers_and_sigterm_stops_it(recorded_train, tmp_path,
                                                                                     slurm_or_why_not):
    """Where no Slurm can be started: serve.sbatch with the stand-in srun; SIGTERM to the job's processes
    (what scancel sends) stops it."""
    if not isinstance(slurm_or_why_not, str):
        pytest.skip("a real Slurm ran serve.sbatch (test_serve_sbatch_under_real_slurm_answers_and_scancel_stops_it)")
    port = free_port()
    env = recorded_slurm_step(tmp_path, SHARDWISE_NPROC="2", SHARDWISE_RUN=str(recorded_train[0] / "run"),
                              SHARDWISE_PORT=str(port))
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        job = subprocess.Popen(["bash", str(SCRIPTS / "serve.sbatch"), f"--rdzv-endpoint=127.0.0.1:{free_port()}"],
                               cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: answers_http(port) or job.poll() is not None, 180, "the server", log)
        assert job.poll() is None, log.read_text()[-3000:]
        answer = completion(port)
        assert answer["usage"]["completion_tokens"] in range(1, 5) and answer["choices"][0]["text"]
        os.killpg(job.pid, signal.SIGTERM)
        job.wait(timeout=60)
        # The batch shell ends at once; the launcher passes SIGTERM on to the ranks, and rank 0 stops serving.
        wait_for(lambda: not answers_http(port) and "shardwise: server stopped" in log.read_text(), 60,
                 "the server's stop", log)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert f"shardwise: clients reach the server at http://{socket.gethostname()}:{port}/v1" in log.read_text()
