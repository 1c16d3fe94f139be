"""`shardwise serve` as users start it: a real process, its flags, its shutdown; and tensor-parallel
serving over `--nproc 2` equal to one process."""

import os
import signal
import socket
import time

import openai
import pytest

from serve_process import free_port, greedy, start_server, stop_server
from shardwise.config.loader import load_config
from shardwise.train.trainer import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_cache):
    run = tmp_path_factory.mktemp("serve-cmd") / "run"
    train(load_config(overrides={
        "model.preset": "debug", "model.tie_embeddings": False, "model.max_seq_len": 128, "data.source": "stdlib",
        "data.vocab_size": 512, "data.max_corpus_bytes": 200_000, "data.cache_dir": data_cache, "train.steps": 100,
        "train.global_batch_size": 8, "train.micro_batch_size": 8, "train.seq_len": 64, "train.lr": 1e-2,
        "train.warmup_steps": 2, "train.sample_tokens": 0, "run.dir": str(run), "run.progress": False,
    }))
    return run


@pytest.mark.slow
def test_serve_command_with_api_key_then_tensor_parallel_equals_one_process(run_dir):
    proc, url = start_server(run_dir, "--api-key", "sesame", "--model-name", "tiny")
    try:
        with pytest.raises(openai.AuthenticationError):
            greedy(url)
        single = greedy(url, key="sesame")
    finally:
        err = stop_server(proc)
    assert "serving 'tiny' on http://127.0.0.1:" in err and "Traceback" not in err
    assert proc.returncode == 0, err

    proc, url = start_server(run_dir, "--model-name", "tiny", "--nproc", "2", "--parallel.tp", "2")
    try:
        assert greedy(url) == single
    finally:
        err = stop_server(proc)
    assert "tensor parallel over 2 processes" in err and "Traceback" not in err, err
    assert len(single) > 4


@pytest.mark.parametrize("flags, message", [
    (["--port", "70000"], "--port = 70000 is invalid"),
    (["--max-batch", "0"], "--max-batch = 0 is invalid"),
    (["--max-queue", "0"], "--max-queue = 0 is invalid"),
    (["--prefill-chunk", "0"], "--prefill-chunk = 0 is invalid"),
    (["--context-len", "1"], "--context-len = 1 is invalid"),
    (["--nproc", "2"], "--parallel.tp = 1 is invalid"),
    (["--nproc", "2", "--parallel.tp", "2", "--compile"], "--compile is invalid with --parallel.tp = 2"),
])
def test_bad_serve_flags_are_one_line_errors(run_dir, flags, message, capsys):
    from shardwise.cli.main import main

    with pytest.raises(SystemExit) as caught:
        main(["serve", "--run", str(run_dir), "--device", "cpu", *flags])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and message in err and err.count("\n") == 1, err


def test_a_port_in_use_is_a_one_line_error(run_dir, capsys):
    """uvicorn runs in a thread of its own (the engine steps in the main one): its failure to listen
    must still end the command, not leave an engine serving nobody."""
    from shardwise.cli.main import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as caught:
            main(["serve", "--run", str(run_dir), "--device", "cpu", "--port", str(port)])
    err = capsys.readouterr().err
    assert caught.value.code != 0 and f"--port {port}: the server could not listen there" in err, err


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(run_dir):
    """The engine steps in the main thread and uvicorn in another: the first SIGINT drains, a second
    forces the stop, and neither prints a traceback."""
    proc, url = start_server(run_dir, "--model-name", "tiny")
    try:
        assert greedy(url)
    finally:
        err = stop_server(proc, signals=2)
    assert proc.returncode == 0 and "Traceback" not in err and "server stopped" in err, err


def test_after_an_engine_failure_the_command_answers_503_until_stopped(run_dir, monkeypatch, capsys):
    """The engine steps in the command's main thread: when a step fails, serving ends there, but the
    HTTP server stays up and says so (/health 503) until a signal stops it."""
    import threading

    import httpx

    from shardwise.cli.main import main
    from shardwise.generation.engine import Engine

    def failing_step(self):
        raise RuntimeError("a broken step")

    monkeypatch.setattr(Engine, "step", failing_step)
    port, seen = free_port(), {}

    def client():
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        seen["completion"] = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "def ",
                                                                        "max_tokens": 4}, timeout=60).status_code
        time.sleep(1.0)  # the engine has returned from serving by now; the server must still answer
        seen["health"] = httpx.get(f"{url}/health").status_code
        seen["still_serving"] = not returned.is_set()
        if seen["still_serving"]:  # (else the signal would reach pytest's own handler)
            os.kill(os.getpid(), signal.SIGINT)

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    returned = threading.Event()
    helper = threading.Thread(target=client)
    helper.start()
    try:
        main(["serve", "--run", str(run_dir), "--device", "cpu", "--port", str(port), "--model-name", "tiny"])
    finally:
        returned.set()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        helper.join()
    assert seen == {"completion": 500, "health": 503, "still_serving": True}, seen
    assert "server stopped" in capsys.readouterr().err
