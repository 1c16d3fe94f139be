"""A fault-injection soak: a `shardwise train --nproc 2` run under random faults sent from outside, whose
losses must equal an undisturbed run's, then `shardwise serve` under good and hostile requests mixed.

    python benchmarks/fault_soak.py [--seed 0] [--faults 16] [--minutes 3] [--steps 600] [--requests 400]

Training (the debug model, a save every 10 steps, train.stall_timeout_s 5, restarts without limit): an
undisturbed run first, then the same command in another directory while this process, from a seeded RNG,
waits a random 0.2-2.5 s after the ranks make progress and then does one of (each kind once per round, in
random order): SIGKILL a rank, SIGSTOP a rank (a stall the launcher's watchdog must name and restart), SIGTERM
the launcher (pre-emption: exit 75, and this script reruns the command, as a scheduler would). After a
pre-emption (the 1st, 3rd, ...) it flips bytes in the newest checkpoint (the rerun must name it and fall back to the previous
one). Faults stop after `--faults` or `--minutes`; the run then goes to its end. Checked: each step's loss in
metrics.jsonl (a resume cuts the file back to its checkpoint, so a redone step's is the last) equals the
undisturbed run's exactly, as tests/train/test_faults.py compares them (`==`: a resume restores weights, optimizer, RNG and data position, and gloo's sums on CPU
are deterministic, so a redone step repeats every bit); each fault got its one line from the launcher; no
rank outlived its launcher.

Serving: `shardwise serve` on the undisturbed run; `--threads` clients send good requests (completions,
chat, streamed or not; each must be 200 with text) and bad ones (token ids outside the vocabulary or
negative, a max_tokens past the context, bad n, malformed JSON, wrong types...: each must be a 4xx, never a
5xx) and some leave a stream after its first chunk; /health is polled throughout and must stay 200.

Prints one JSON object (faults by kind, restarts, steps redone, requests sent and failed, wall time, pass);
exits 1 when a check failed. Run directories go to a temporary folder (`--workdir` keeps them).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from shardwise.checkpoint.integrity import checkpoint_status
from shardwise.checkpoint.store import checkpoint_dirs
from shardwise.core import exit_status
from shardwise.runtime.launch import child_pids

ROOT = Path(__file__).resolve().parents[1]
SHARDWISE = [sys.executable, "-c", "import sys; from shardwise.cli.main import main; sys.exit(main())"]
KINDS = ("kill_rank", "stop_rank", "term_launcher")
DELAY_S = (0.2, 2.5)
"""How long after the ranks' progress a fault comes: the debug run makes about 15 steps a second here."""
ATTEMPT_TIMEOUT_S = 600.0
TRAIN_FLAGS = ["--config", str(ROOT / "configs/debug.toml"), "--checkpoint.every=10", "--checkpoint.keep=3",
               "--train.sample_tokens=0", "--run.progress=false", "--train.stall_timeout_s=5",
               "--train.max_restarts=1000", "--nproc=2"]


def train_command(run_dir: Path, steps: int) -> list[str]:
    return ["train", *TRAIN_FLAGS, f"--run.dir={run_dir}", f"--train.steps={steps}"]


def clean_env() -> dict[str, str]:
    """This environment without a launcher's word or injected faults: the faults here come from outside."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SHARDWISE_FAULT")
    return {key: value for key, value in os.environ.items() if key not in drop}


# ------------------------------------------------------------------ the training under faults

@dataclass
class Soak:
    """The faults still to come and what each attempt (one launch of the command) ended with."""

    rng: random.Random
    faults_left: int
    deadline: float
    fired: Counter = field(default_factory=Counter)
    bag: list[str] = field(default_factory=list)
    attempts: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def may_fire(self) -> bool:
        return self.faults_left > 0 and time.monotonic() < self.deadline

    def next_kind(self) -> str:
        """The kinds in seeded random order, each once per round, so that a short soak meets every kind."""
        if not self.bag:
            self.bag = self.rng.sample(KINDS, k=len(KINDS))
        return self.bag.pop()


def metrics_lines(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_bytes().count(b"\n")
    except OSError:
        return 0


class StepsTrained(threading.Thread):
    """Follows metrics.jsonl's last step every 20 ms and adds up the steps trained, redone ones included: a
    resume first cuts the file back to its checkpoint's step (train/metrics.py's `drop_after`), where it
    stays for the seconds the new ranks take to start, so every rise is seen from where it began."""

    def __init__(self, run_dir: Path):
        super().__init__(daemon=True)
        self.path, self.last, self.trained, self.done = run_dir / "metrics.jsonl", 0, 0, threading.Event()
        self.empty_looks = 0

    def run(self) -> None:
        while not self.done.wait(0.02):
            self.look()
        self.look()

    def look(self) -> None:
        try:
            step = last_logged_step(self.path)
        except ValueError:  # a line being replaced: look again next time
            return
        if step is None:  # no line: believed on the second look (a resume's rewrite empties the file for a moment)
            self.empty_looks += 1
            self.last = 0 if self.empty_looks > 1 else self.last
            return
        self.empty_looks = 0
        self.trained += max(0, step - self.last)
        self.last = step


def last_logged_step(path: Path) -> int | None:
    """The step of the file's last whole line (None when none)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - 4096))
            lines = handle.read().split(b"\n")[:-1]  # a line still being written has no newline yet
    except OSError:
        return None
    return int(json.loads(lines[-1])["step"]) if lines else None


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """The launcher's children by their RANK (read from /proc/PID/environ: psutil is not needed)."""
    ranks = {}
    for pid in child_pids(launcher_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"RANK="):
                ranks[int(entry[5:])] = pid
    return ranks


def wait_for_progress(launcher: subprocess.Popen, run_dir: Path, old_pids: set[int]) -> dict[int, int] | None:
    """Wait until ranks other than `old_pids` (the ones a fault hit) log a new step; their pids, or None
    once the launcher ended."""
    baseline = None
    while launcher.poll() is None:
        ranks = rank_pids(launcher.pid)
        fresh = len(ranks) == 2 and not set(ranks.values()) & old_pids
        if fresh and baseline is None:
            baseline = metrics_lines(run_dir)
        elif fresh and metrics_lines(run_dir) > baseline:
            return ranks
        elif not fresh:
            baseline = None
        time.sleep(0.05)
    return None


def fire(kind: str, launcher: subprocess.Popen, ranks: dict[int, int], rng: random.Random) -> int | None:
    """Send one fault; the rank it hit (None: the launcher)."""
    if kind == "term_launcher":
        launcher.send_signal(signal.SIGTERM)
        return None
    rank = rng.choice(sorted(ranks))
    os.kill(ranks[rank], signal.SIGKILL if kind == "kill_rank" else signal.SIGSTOP)
    return rank


def drive(launcher: subprocess.Popen, run_dir: Path, soak: Soak) -> list[tuple[str, int | None]]:
    """Inject faults into one attempt while it runs; each fault's kind and the rank it hit, in order."""
    fired, hit = [], set()
    while launcher.poll() is None and soak.may_fire():
        ranks = wait_for_progress(launcher, run_dir, hit)
        if ranks is None:
            break
        time.sleep(soak.rng.uniform(*DELAY_S))
        if launcher.poll() is not None:
            break
        kind = soak.next_kind()
        try:
            rank = fire(kind, launcher, ranks, soak.rng)
        except ProcessLookupError:  # the rank ended meanwhile (the run finished): no fault
            continue
        fired.append((kind, rank))
        soak.fired[kind] += 1
        soak.faults_left -= 1
        hit = set(ranks.values())
        if kind == "term_launcher":
            break
    return fired


def ranks_left(run_dir: Path) -> list[int]:
    """Processes of this run directory's training still alive (a launcher's ranks must die with it)."""
    mark = f"--run.dir={run_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if mark in cmdline and b"shardwise.train" in cmdline:
                found.append(int(entry.name))
    return found


def wait_for_no_ranks(run_dir: Path, within_s: float = 10.0) -> list[int]:
    until = time.monotonic() + within_s
    while (left := ranks_left(run_dir)) and time.monotonic() < until:
        time.sleep(0.1)
    return left


def run_attempt(run_dir: Path, steps: int, soak: Soak | None, log_dir: Path) -> dict:
    """Launch the command once (injecting faults when `soak` is given) and wait for its end."""
    number = len(soak.attempts) if soak else 0
    out_path, err_path = (log_dir / f"{run_dir.name}-{number}.{kind}" for kind in ("out", "err"))
    counter = StepsTrained(run_dir)
    counter.look()  # where a rerun starts (the pre-empted attempt's last step)
    counter.trained = 0
    counter.start()
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        launcher = subprocess.Popen([*SHARDWISE, *train_command(run_dir, steps)], stdout=out, stderr=err,
                                    env=clean_env(), cwd=ROOT, start_new_session=True)
        try:
            fired = drive(launcher, run_dir, soak) if soak else []
            code = launcher.wait(timeout=ATTEMPT_TIMEOUT_S)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
            counter.done.set()
            counter.join()
    lines = [line for line in err_path.read_text(errors="replace").splitlines() if line.startswith("shardwise:")]
    starts = [int(first) for first in re.findall(r"steps (\d+)\.\.\d+, ", out_path.read_text(errors="replace"))]
    return {"code": code, "faults": fired, "lines": lines, "orphans": wait_for_no_ranks(run_dir),
            "finished": last_logged_step(run_dir / "metrics.jsonl") == steps,
            "trained": counter.trained, "resumed_after": [first - 1 for first in starts]}


def corrupt_newest(run_dir: Path, rng: random.Random) -> Path | None:
    """Flip bytes in the newest checkpoint's largest file (its size unchanged) when an older whole one is
    there to fall back on; the checkpoint damaged, or None."""
    whole = [path for path in checkpoint_dirs(run_dir) if checkpoint_status(path)[0] == "ok"]
    if len(whole) < 2 or whole[-1] != checkpoint_dirs(run_dir)[-1]:
        return None
    target = max((path for path in whole[-1].iterdir() if path.is_file()), key=lambda path: path.stat().st_size)
    data = bytearray(target.read_bytes())
    for offset in rng.sample(range(len(data)), k=min(16, len(data))):
        data[offset] ^= 0xFF
    target.write_bytes(bytes(data))
    return whole[-1]


KILLED = re.compile(r"shardwise: rank (\d+) was killed by signal SIGKILL during step \d+;.*\(restart \d+ of \d+\)$")
STALLED = re.compile(r"shardwise: rank (\d+) stalled \(process not responding\).*\(restart \d+ of \d+\)$")
PREEMPTED = re.compile(r"shardwise: pre-empted by SIGTERM( \(received by rank \d+\))? after step \d+: saved checkpoint ")
UNSAVED = re.compile(r"shardwise: stopped by SIGTERM.* before the ranks could save")
TORN_METRICS = "dropped its last line, cut short by a crash"
STOPPED_BY_SIGTERM = {exit_status.PREEMPTED: "75: saved", 128 + signal.SIGTERM: "143: before the ranks could save",
                      -signal.SIGTERM: "killed by SIGTERM: the ranks were done, the launcher ending"}
"""A pre-empted attempt's exit statuses, after which the command is run again."""
MAX_ATTEMPTS = 100


def attempt_problems(number: int, attempt: dict, corrupted: Path | None) -> list[str]:
    """What in one attempt's end or lines no promise explains: a fault without its line (or naming another
    rank), a line without its fault (a stall nobody caused), a corrupt checkpoint not skipped, an exit status
    other than 0 or a pre-emption's, a rank that outlived its launcher."""
    problems, reported, unexplained = [], [], []
    skipped = f"shardwise: warning: skipping checkpoint {corrupted}: corrupt" if corrupted else None
    for line in attempt["lines"]:
        if match := KILLED.match(line) or STALLED.match(line):
            reported.append(("kill_rank" if match.re is KILLED else "stop_rank", int(match[1])))
        elif not (PREEMPTED.match(line) or UNSAVED.match(line) or TORN_METRICS in line
                  or (skipped and line.startswith(skipped))):
            unexplained.append(line)
    restarting = [fault for fault in attempt["faults"] if fault[0] != "term_launcher"]
    if reported != restarting:
        problems.append(f"attempt {number}: faults {restarting}, but the launcher reported {reported}")
    if unexplained:
        problems.append(f"attempt {number}: lines no fault explains: {unexplained}")
    if skipped and not any(line.startswith(skipped) for line in attempt["lines"]):
        problems.append(f"attempt {number}: the damaged {corrupted} was not named as skipped")
    allowed = {0}
    if attempt["faults"][-1:] == [("term_launcher", None)]:  # saved (75), or no step yet to save (143); or
        allowed |= {exit_status.PREEMPTED, 128 + signal.SIGTERM}  # the ranks were done and the launcher ending:
        allowed |= {-signal.SIGTERM} if attempt["finished"] else set()  # the default handler is back
    if attempt["code"] not in allowed:
        problems.append(f"attempt {number}: exit status {attempt['code']} (expected one of {sorted(allowed)}); "
                        f"last line {attempt['lines'][-1:]}")
    if attempt["orphans"]:
        problems.append(f"attempt {number}: ranks {attempt['orphans']} outlived their launcher by 10 s")
    return problems


def soak_training(run_dir: Path, steps: int, soak: Soak, log_dir: Path) -> None:
    """Run the command under faults until it ends with status 0, rerunning it after each pre-emption."""
    corrupted = None
    while len(soak.attempts) < MAX_ATTEMPTS:
        attempt = run_attempt(run_dir, steps, soak, log_dir)
        soak.attempts.append(attempt)
        soak.problems += attempt_problems(len(soak.attempts) - 1, attempt, corrupted)
        corrupted = None
        if attempt["code"] not in STOPPED_BY_SIGTERM:
            return  # done (0) or failed (a problem already)
        if soak.may_fire() and soak.fired["term_launcher"] % 2:  # after the 1st, 3rd, ... pre-emption
            corrupted = corrupt_newest(run_dir, soak.rng)
            if corrupted:
                soak.fired["corrupt_checkpoint"] += 1
                soak.faults_left -= 1
    soak.problems.append(f"the run did not end after {MAX_ATTEMPTS} attempts")


def logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every line of metrics.jsonl, redone steps as often as they were logged."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(record["step"], record["loss"]) for record in map(json.loads, lines)]


def compare_losses(reference_dir: Path, soaked_dir: Path) -> dict:
    """Each step's last logged loss, compared exactly (as tests/train/test_faults.py's
    `final_losses(...) == plain`)."""
    reference, soaked = dict(logged_losses(reference_dir)), dict(logged_losses(soaked_dir))
    return {"steps": len(reference), "steps_missing": sorted(set(reference) - set(soaked)),
            "steps_extra": sorted(set(soaked) - set(reference)),
            "steps_differing": [step for step in sorted(reference) if step in soaked and soaked[step] != reference[step]]}


def train_section(args, work: Path) -> tuple[dict, list[str], Path]:
    """The undisturbed run, then the soak; the figures, the problems, and the reference run's directory."""
    log_dir = work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    reference = run_attempt(work / "reference", args.steps, None, log_dir)
    reference_s = time.monotonic() - started
    problems = [f"the undisturbed run: {line}" for line in attempt_problems(0, reference, None)]
    if reference["trained"] != args.steps:  # the counter's own check
        problems.append(f"the undisturbed run was counted as {reference['trained']} steps, not {args.steps}")
    soak = Soak(random.Random(args.seed), faults_left=args.faults, deadline=time.monotonic() + 60 * args.minutes)
    started = time.monotonic()
    soak_training(work / "soaked", args.steps, soak, log_dir)
    soaked_s = time.monotonic() - started
    losses = compare_losses(work / "reference", work / "soaked") if not problems else {}
    if losses and (losses["steps_missing"] or losses["steps_extra"] or losses["steps_differing"]):
        problems.append(f"losses differ from the undisturbed run's: {losses}")
    lines = [line for attempt in soak.attempts for line in attempt["lines"]]
    figures = {
        "command": "shardwise " + " ".join(train_command(Path("RUN"), args.steps)),
        "faults": dict(sorted(soak.fired.items())), "faults_total": sum(soak.fired.values()),
        "restarts": sum("restarting from the newest checkpoint" in line for line in lines),
        "reruns": len(soak.attempts) - 1,
        "sigterm_outcomes": dict(Counter(STOPPED_BY_SIGTERM[attempt["code"]] for attempt in soak.attempts
                                         if attempt["code"] in STOPPED_BY_SIGTERM)),
        "torn_metrics_lines_dropped": sum(TORN_METRICS in line for line in lines),
        "steps_trained": sum(attempt["trained"] for attempt in soak.attempts),
        "steps_redone": sum(attempt["trained"] for attempt in soak.attempts) - args.steps,
        "resumed_after": [step for attempt in soak.attempts for step in attempt["resumed_after"]],
        **losses, "reference_wall_s": round(reference_s, 1), "soak_wall_s": round(soaked_s, 1),
    }
    return figures, problems + soak.problems, work / "reference"


# ------------------------------------------------------------------ the server under hostile requests

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def good_cases(model: str) -> list[tuple[str, str, bytes]]:
    """Requests that must be answered 200 with text (ignore_eos: the tiny model's text is never empty)."""
    completion = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}
    chat = {"model": model, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8,
            "ignore_eos": True}
    cases = [("completion", COMPLETIONS, completion),
             ("completion-token-ids", COMPLETIONS, {**completion, "prompt": [1, 2, 3, 4]}),
             ("completion-n2-seeded", COMPLETIONS, {**completion, "n": 2, "temperature": 0.8, "seed": 7}),
             ("completion-stream", COMPLETIONS, {**completion, "stream": True}),
             ("chat", CHAT, chat),
             ("chat-stream", CHAT, {**chat, "stream": True})]
    return [(name, path, json.dumps(body).encode()) for name, path, body in cases]


def bad_cases(model: str) -> list[tuple[str, str, bytes]]:
    """Requests that must be refused with a 4xx (never a 5xx): each breaks one rule."""
    base = {"model": model, "prompt": "hi", "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    changed = {
        "token-id-past-vocabulary": {"prompt": [1, 2, 10**6]}, "token-id-equal-to-vocabulary": {"prompt": [512]},
        "negative-token-id": {"prompt": [1, -3]}, "bad-id-in-a-batch": {"prompt": [[1, 2], [9999]]},
        "token-id-past-int64": {"prompt": [10**30]}, "empty-prompt": {"prompt": []},
        "huge-max-tokens": {"max_tokens": 10**9}, "max-tokens-past-context": {"max_tokens": 300},
        "zero-max-tokens": {"max_tokens": 0}, "n-zero": {"n": 0}, "n-too-many": {"n": 1000},
        "n-a-word": {"n": "two"}, "prompt-a-number": {"prompt": 5}, "temperature-a-word": {"temperature": "hot"},
        "temperature-negative": {"temperature": -1}, "top-p-past-one": {"top_p": 5}, "top-k-negative": {"top_k": -4},
        "logprobs-too-many": {"logprobs": 1000}, "stop-token-id-negative": {"stop_token_ids": [-1]},
        "logit-bias-past-vocabulary": {"logit_bias": {"99999": 1}}, "seed-past-int64": {"seed": 10**23},
        "unknown-model": {"model": "no-such-model"}, "best-of-unsupported": {"best_of": 3},
    }
    chat_changed = {
        "chat-messages-a-string": {"messages": "hello"}, "chat-no-messages": {"messages": []},
        "chat-unknown-role": {"messages": [{"role": "wizard", "content": "x"}]},
        "chat-image-part": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "chat-max-completion-tokens-past-context": {"max_completion_tokens": 100_000},
    }
    raw = {"malformed-json": b'{"model": "%s", "prompt": "hi"' % model.encode(), "not-utf8": b"\xff\xfe\x00",
           "body-a-list": b"[]", "body-null": b"null", "temperature-nan": b'{"model": "%s", "prompt": "hi", '
           b'"temperature": NaN}' % model.encode(), "deeply-nested": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000
           + b"}", "body-past-a-megabyte": json.dumps({**base, "prompt": "word " * 300_000}).encode()}
    return ([(name, COMPLETIONS, json.dumps({**base, **change}).encode()) for name, change in changed.items()]
            + [(name, CHAT, json.dumps({**chat, **change}).encode()) for name, change in chat_changed.items()]
            + [(name, COMPLETIONS, body) for name, body in raw.items()])


def leaving_case(model: str) -> tuple[str, str, bytes]:
    """A client that reads the first chunk of a long stream and hangs up."""
    body = {"model": model, "prompt": "Once", "max_tokens": 200, "ignore_eos": True, "stream": True}
    return "leave-mid-stream", COMPLETIONS, json.dumps(body).encode()


def post(port: int, path: str, body: bytes, *, leave: bool = False) -> tuple[int, bytes]:
    """POST `body`; the status and the answer (a stream read to its end, or to its first chunk if `leave`)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        answer = response.read1(4096) if leave else response.read()
        return response.status, answer
    finally:
        connection.close()  # when leaving: mid-stream


def answered_with_text(answer: bytes) -> bool:
    """A 200's body holds generated text: a JSON answer's choices, or a stream's chunks ending [DONE]."""
    text = answer.decode(errors="replace")
    if text.startswith("data: "):
        chunks = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if chunks[-1:] != ["[DONE]"]:
            return False
        parts = [choice.get("text") or choice.get("delta", {}).get("content") or ""
                 for chunk in chunks[:-1] for choice in json.loads(chunk).get("choices", [])]
        return bool("".join(parts))
    choices = json.loads(text)["choices"]
    return bool(choices) and all((choice.get("text") or choice.get("message", {}).get("content")) for choice in choices)


def send(port: int, kind: str, name: str, path: str, body: bytes) -> dict:
    """One request; whether its answer is what its kind must get."""
    try:
        status, answer = post(port, path, body, leave=kind == "leave")
        ok = {"good": lambda: status == 200 and answered_with_text(answer),
              "bad": lambda: 400 <= status < 500, "leave": lambda: status == 200}[kind]()
    except (OSError, http.client.HTTPException, ValueError, KeyError) as error:
        status, ok = f"{type(error).__name__}: {error}", False
    return {"kind": kind, "name": name, "status": status, "ok": ok}


def get(port: int, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


class HealthWatch(threading.Thread):
    """GET /health every 50 ms while the requests run; counts the polls not answered 200."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.polls, self.failed, self.done = port, 0, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            self.polls += 1
            try:
                self.failed += get(self.port, "/health")[0] != 200
            except (OSError, http.client.HTTPException):
                self.failed += 1


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_healthy(port: int, server: subprocess.Popen, within_s: float = 180.0) -> None:
    until = time.monotonic() + within_s
    while time.monotonic() < until and server.poll() is None:
        try:
            if get(port, "/health")[0] == 200:
                return
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"shardwise serve did not become healthy on port {port} (exit status {server.poll()})")


def request_mix(model: str, count: int, rng: random.Random) -> list[tuple[str, str, str, bytes]]:
    """`count` requests, about 45% good, 45% bad, 10% leaving mid-stream, in a seeded order."""
    pools = {"good": good_cases(model), "bad": bad_cases(model), "leave": [leaving_case(model)]}
    kinds = rng.choices(list(pools), weights=[45, 45, 10], k=count)
    return [(kind, *rng.choice(pools[kind])) for kind in kinds]


def exercise_server(port: int, args) -> tuple[list[dict], HealthWatch, int]:
    """The request mix from `args.threads` clients under the health watch; the results, the watch and
    the final /health status."""
    model = json.loads(get(port, "/v1/models")[1])["data"][0]["id"]
    requests = request_mix(model, args.requests, random.Random(args.seed + 1))
    watch = HealthWatch(port)
    watch.start()
    with ThreadPoolExecutor(args.threads) as pool:
        results = list(pool.map(lambda request: send(port, *request), requests))
    watch.done.set()
    watch.join()
    return results, watch, get(port, "/health")[0]


def serve_section(args, run_dir: Path, work: Path) -> tuple[dict, list[str]]:
    """`shardwise serve` on the undisturbed run under the request mix; its figures and problems."""
    port, log_path, started = free_port(), work / "logs" / "serve.log", time.monotonic()
    with open(log_path, "wb") as log:
        server = subprocess.Popen([*SHARDWISE, "serve", f"--run={run_dir}", f"--port={port}", "--max-batch=4"],
                                  stdout=log, stderr=log, env=clean_env(), cwd=ROOT, start_new_session=True)
        try:
            wait_until_healthy(port, server)
            results, watch, final_health = exercise_server(port, args)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                code = server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                code = server.wait()
    failed = Counter(f"{r['kind']} {r['name']}: {r['status']}" for r in results if not r["ok"])
    figures = {"requests": {kind: {"sent": sum(r["kind"] == kind for r in results),
                                   "failed": sum(r["kind"] == kind and not r["ok"] for r in results)}
                            for kind in ("good", "bad", "leave")},
               "statuses": dict(sorted(Counter(str(r["status"]) for r in results).items())),
               "health_polls": watch.polls, "health_not_200": watch.failed, "final_health": final_health,
               "server_exit_status": code, "tracebacks_in_server_log": log_path.read_text(errors="replace").count(
                   "Traceback"), "wall_s": round(time.monotonic() - started, 1)}
    problems = [f"{count} x {what}" for what, count in sorted(failed.items())]
    if watch.failed or final_health != 200:
        problems.append(f"/health: {watch.failed} of {watch.polls} polls not 200, {final_health} at the end")
    if figures["tracebacks_in_server_log"] or code != 0:
        problems.append(f"the server's log holds {figures['tracebacks_in_server_log']} tracebacks; "
                        f"it exited with status {code} on SIGTERM")
    return figures, problems


# ------------------------------------------------------------------ the whole soak

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="the faults' and the requests' RNG")
    parser.add_argument("--faults", type=int, default=16, help="faults to inject at most (default 16)")
    parser.add_argument("--minutes", type=float, default=3.0,
                        help="inject faults for at most this long; the run then goes to its end (default 3)")
    parser.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    parser.add_argument("--requests", type=int, default=400, help="requests sent to the server (default 400)")
    parser.add_argument("--threads", type=int, default=4, help="clients sending them at once (default 4)")
    parser.add_argument("--workdir", help="keep the run directories and logs here (default: a temporary "
                                          "folder, removed when the soak passes)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="shardwise-soak-")).resolve()
    training, problems, reference = train_section(args, work)
    serving, serve_problems = serve_section(args, reference, work)
    passed = not problems and not serve_problems
    print(json.dumps({"seed": args.seed, "training": training, "serving": serving,
                      "problems": problems + serve_problems, "wall_s": round(time.monotonic() - started, 1),
                      "pass": passed, "workdir": str(work) if args.workdir or not passed else None}, indent=1))
    if passed and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
