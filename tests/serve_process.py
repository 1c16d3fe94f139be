"""`shardwise serve` as a real process, for the tests that start one (tests/infer, tests/runtime): on a free
port, answering HTTP, stopped as a user stops it; and one greedy completion through the OpenAI client."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers_http(port: int) -> bool:
    """Whether an HTTP server answers on the port (any status: /health may want the API key)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def start_server(run_dir, *flags, timeout_s=120, tries=3):
    """The server on a free port. The port is free when chosen, but a `--nproc` launch's rendezvous
    also takes an ephemeral port and can take that one first (seen once in CI: the test's request
    reached the rendezvous store, which reset the connection). So listening is not enough: the
    port must answer HTTP; a server that could not listen there is started again on another."""
    for attempt in range(tries):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "shardwise.cli.main", "serve", "--run", str(run_dir), "--port",
                                 str(port), "--device", "cpu", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                err = proc.stderr.read()
                if "could not listen there" in err and attempt + 1 < tries:
                    break
                raise AssertionError(f"serve exited {proc.returncode}: {err}")
            if answers_http(port):
                return proc, f"http://127.0.0.1:{port}/v1"
            time.sleep(0.2)
        else:
            proc.kill()
            raise AssertionError("serve did not start listening")
    raise AssertionError(f"serve could not listen on {tries} free ports")


def stop_server(proc, signals=1) -> str:
    for n in range(signals):
        if n:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return err


def greedy(url, key="unused"):
    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
    out = client.completions.create(model="tiny", prompt="def main():\n    ", max_tokens=16, temperature=0)
    return out.choices[0].text
