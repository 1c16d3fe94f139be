"""Faults (issue 17): corrupt and incomplete checkpoints, a kill during a save, non-finite steps.

Each case asserts its outcome (recovered / warned and continued / one-line error) and that
nothing written before was damaged. Faults are injected with SHARDWISE_FAULT
(shardwise/runtime/faults.py) or by damaging files on disk.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from shardwise.core import exit_status
from shardwise.cli.main import main
from shardwise.config.loader import load_config
from shardwise.runtime import heartbeat
from shardwise.runtime import collective_files
from shardwise.runtime import faults
from shardwise.checkpoint.store import checkpoint_dirs, save_checkpoint, step_dirs
from shardwise.checkpoint.integrity import MANIFEST_FILE, checkpoint_status, checkpoints_table
from shardwise.runtime.preemption import Preempted
from shardwise.train.trainer import train


def saved(tmp_path, step=1):
    return save_checkpoint(tmp_path, step, tensors={"w": torch.arange(64.0)}, state={}, keep=5)


def data_file(path):
    return next(path.glob("__0_*.distcp"))


def test_fresh_checkpoint_is_ok_and_its_manifest_lists_every_file(tmp_path):
    path = saved(tmp_path)
    files = json.loads((path / MANIFEST_FILE).read_text())["files"]
    assert sorted(files) == sorted(p.name for p in path.iterdir() if p.name != MANIFEST_FILE)
    assert checkpoint_status(path) == ("ok", "")


@pytest.mark.parametrize("damage, status, reason", [
    (lambda p: data_file(p).write_bytes(data_file(p).read_bytes()[:-10]), "corrupt", "bytes, its manifest says"),
    (lambda p: data_file(p).write_bytes(bytes(reversed(data_file(p).read_bytes()))), "corrupt", "SHA-256"),
    (lambda p: data_file(p).unlink(), "incomplete", "is missing"),
    (lambda p: (p / MANIFEST_FILE).unlink(), "incomplete", "did not finish"),
    (lambda p: (p / MANIFEST_FILE).write_text("{not json"), "corrupt", "unreadable"),
], ids=["truncated", "same-size-garbled", "file-deleted", "no-manifest", "manifest-garbled"])
def test_damaged_checkpoint_is_named_with_its_status(tmp_path, damage, status, reason):
    path = saved(tmp_path)
    damage(path)
    found, why = checkpoint_status(path)
    assert found == status and reason in why


def test_shardwise_checkpoints_lists_steps_and_statuses(tmp_path, capsys):
    for step in (2, 4, 6):
        saved(tmp_path, step)
    newest = tmp_path / "checkpoints" / "step_00000006"
    data_file(newest).write_bytes(b"")
    assert main(["checkpoints", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[:2] for line in lines] == [["2", "ok"], ["4", "ok"], ["6", "corrupt"]]
    assert "resume loads this" in lines[1] and "resume" not in lines[0]
    assert checkpoints_table(tmp_path / "none", step_dirs(tmp_path / "none")).endswith("no checkpoints")


def test_corrupt_newest_checkpoint_is_skipped_and_the_run_resumes_from_the_previous(tiny_config, tmp_path, capsys):
    """Steps 5-8 after falling back to step 4 equal those of a run never interrupted."""
    full = train(tiny_config(**{"train.steps": 8, "run.dir": str(tmp_path / "full")}))
    settings = {"train.steps": 8, "checkpoint.every": 2, "checkpoint.keep": 3, "run.dir": str(tmp_path / "run")}
    first = train(tiny_config(**settings, **{"train.stop_at_step": 6}))
    newest = checkpoint_dirs(first.run_dir)[-1]
    assert newest.name == "step_00000006"
    data_file(newest).write_bytes(data_file(newest).read_bytes()[:100])
    capsys.readouterr()
    second = train(tiny_config(**settings))
    warning = capsys.readouterr().err
    assert f"skipping checkpoint {newest}: corrupt" in warning and warning.count("\n") == 1
    assert second.first_step == 5
    assert second.losses == pytest.approx(full.losses[4:], rel=0, abs=0)
    assert checkpoint_status(newest)[0] == "ok"  # step 6 written again, whole


@pytest.mark.slow
def test_kill_during_save_keeps_the_previous_checkpoint_and_the_rerun_resumes_from_it(tiny_config, tmp_path):
    cfg = tiny_config(**{"train.steps": 6, "checkpoint.every": 2, "run.dir": str(tmp_path / "run"),
                         "train.sample_tokens": 0})
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(cfg.to_dict()))
    command = [sys.executable, "-m", "shardwise.train", f"--config={config_file}", "--nproc=1"]
    env = {**os.environ, faults.ENV: "save_kill@4:0"}
    killed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    run_dir = tmp_path / "run"
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step_00000002"]
    assert checkpoint_status(run_dir / "checkpoints" / "step_00000002")[0] == "ok"
    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "trained steps 3..6" in rerun.stdout
    assert [p.name for p in checkpoint_dirs(run_dir)][-1] == "step_00000006"


def test_asynchronous_checkpoints_resume_exactly(tiny_config, tmp_path):
    """A checkpoint written in the background holds the state of its step, not of a later one."""
    full = train(tiny_config(**{"train.steps": 8, "run.dir": str(tmp_path / "full")}))
    settings = {"train.steps": 8, "checkpoint.every": 2, "checkpoint.keep": 5, "checkpoint.async_save": True,
                "run.dir": str(tmp_path / "run")}
    train(tiny_config(**settings, **{"train.stop_at_step": 5, "checkpoint.at_end": False}))
    assert [(p.name, checkpoint_status(p)[0]) for p in checkpoint_dirs(tmp_path / "run")] == [
        ("step_00000002", "ok"), ("step_00000004", "ok")]  # the last background save was finished at the end
    rerun = train(tiny_config(**settings))
    assert rerun.first_step == 5
    assert rerun.losses == pytest.approx(full.losses[4:], rel=0, abs=0)


@pytest.mark.slow
def test_kill_during_an_asynchronous_save_keeps_the_previous_checkpoint(tiny_config, tmp_path):
    cfg = tiny_config(**{"train.steps": 6, "checkpoint.every": 2, "checkpoint.async_save": True,
                         "run.dir": str(tmp_path / "run")})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    killed = cli_train(tmp_path, "run", "--nproc=1", fault="async_save_kill@4:0")
    assert killed.returncode == -9, killed.stderr[-2000:]
    run_dir = tmp_path / "run"
    assert [(p.name, checkpoint_status(p)[0]) for p in checkpoint_dirs(run_dir)] == [("step_00000002", "ok")]
    rerun = cli_train(tmp_path, "run", "--nproc=1", fault="async_save_kill@4:0")
    assert rerun.returncode == 0 and "trained steps 3..6" in rerun.stdout, rerun.stderr[-2000:]
    assert checkpoint_status(checkpoint_dirs(run_dir)[-1]) == ("ok", "")


def test_nonfinite_step_stops_by_default_naming_the_step(tiny_config, monkeypatch, tmp_path):
    monkeypatch.setenv(faults.ENV, "nan@3")
    cfg = tiny_config(**{"train.steps": 5, "checkpoint.every": 2, "run.dir": str(tmp_path / "run")})
    with pytest.raises(FloatingPointError, match="step 3 was not finite"):
        train(cfg)
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step_00000002"]


def test_nonfinite_step_is_skipped_and_counted_with_on_nonfinite_skip(tiny_config, monkeypatch, tmp_path):
    clean = train(tiny_config(**{"train.steps": 2, "run.dir": str(tmp_path / "clean")}))
    monkeypatch.setenv(faults.ENV, "nan@3")
    result = train(tiny_config(**{"train.steps": 5, "train.on_nonfinite": "skip", "run.dir": str(tmp_path / "run")}))
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 1]
    assert result.losses[:2] == clean.losses and all(map(float.__eq__, result.losses[3:], result.losses[3:]))


def test_too_many_nonfinite_steps_in_a_row_stop_even_when_skipping(tiny_config, monkeypatch):
    monkeypatch.setenv(faults.ENV, "nan@2,nan@3")
    cfg = tiny_config(**{"train.steps": 5, "train.on_nonfinite": "skip", "train.max_nonfinite_in_row": 2})
    with pytest.raises(FloatingPointError, match="2 steps in a row"):
        train(cfg)


def test_nonfinite_stop_is_one_line_with_its_exit_status(tiny_config, monkeypatch, capsys):
    monkeypatch.setenv(faults.ENV, "nan@1")
    cfg = tiny_config(**{"train.steps": 2})
    config_file = cfg.run.dir + ".json"
    with open(config_file, "w") as handle:
        json.dump(cfg.to_dict(), handle)
    assert main(["train", f"--config={config_file}", "--nproc=1"]) == exit_status.NONFINITE
    err = capsys.readouterr().err
    assert err.startswith("shardwise: error: step 1 was not finite") and err.count("\n") == 1


@pytest.mark.parametrize("text", ["boom@3", "kill@x", "kill@3:r", "nan"])
def test_bad_fault_spec_is_refused(text):
    with pytest.raises(ValueError, match=faults.ENV):
        faults.parse(text)


def cli_train(tmp_path, name, *flags, fault=""):
    command = [sys.executable, "-c", "import sys; from shardwise.cli.main import main; sys.exit(main())", "train",
               f"--config={tmp_path / 'config.json'}", f"--run.dir={tmp_path / name}", *flags]
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", faults.ENV)}
    return subprocess.run(command, env={**env, faults.ENV: fault}, capture_output=True, text=True, timeout=600)


def final_losses(run_dir):
    """The loss of each step as last logged (a restarted run logs its redone steps again)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record["loss"] for record in records}


# ------------------------------------------------------------------ pre-emption (train.preempt_signals)

def test_a_stop_signal_finishes_the_step_saves_and_the_rerun_resumes_with_the_same_losses(tiny_config, monkeypatch,
                                                                                          tmp_path):
    full = train(tiny_config(**{"train.steps": 6, "run.dir": str(tmp_path / "full")}))
    settings = {"train.steps": 6, "checkpoint.every": 100, "run.dir": str(tmp_path / "run")}
    handler_before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setenv(faults.ENV, "term@3")
    with pytest.raises(Preempted, match="pre-empted by SIGTERM after step 3") as caught:
        train(tiny_config(**settings))
    assert signal.getsignal(signal.SIGTERM) is handler_before  # the trainer's handler is gone again
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step_00000003"]
    assert caught.value.checkpoint == checkpoint_dirs(tmp_path / "run")[0]
    assert checkpoint_status(caught.value.checkpoint) == ("ok", "")
    rerun = train(tiny_config(**settings))
    assert rerun.first_step == 4
    assert rerun.losses == pytest.approx(full.losses[3:], rel=0, abs=0)


def test_a_stop_signal_on_the_step_of_a_regular_save_saves_once(tiny_config, monkeypatch, tmp_path):
    monkeypatch.setenv(faults.ENV, "usr1@2")
    with pytest.raises(Preempted, match="SIGUSR1 after step 2"):
        train(tiny_config(**{"train.steps": 6, "checkpoint.every": 2, "checkpoint.keep": 5}))
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step_00000002"]


@pytest.mark.parametrize("value, fragment", [("SIGKILL", "SIGKILL is not a signal that can be caught"),
                                             ("TERM,SIGFOO", "SIGFOO is not a signal")])
def test_uncatchable_or_unknown_preempt_signals_are_refused(tiny_config, value, fragment):
    with pytest.raises(ValueError, match=f"train.preempt_signals = .*{fragment}"):
        tiny_config(**{"train.preempt_signals": value})


def test_preemption_from_the_command_line_is_one_line_and_exit_status_75(tiny_config, tmp_path, monkeypatch, capsys):
    """`shardwise train --nproc=1` runs in this process (as `main` does under the command), so the stop
    and the rerun are calls of `main`, not launches."""
    cfg = tiny_config(**{"train.steps": 5, "checkpoint.every": 100})
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    command = ["train", f"--config={tmp_path / 'config.json'}", f"--run.dir={tmp_path / 'run'}", "--nproc=1"]
    monkeypatch.setenv(faults.ENV, "usr1@3")
    capsys.readouterr()
    assert main(command) == exit_status.PREEMPTED
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [f"shardwise: pre-empted by SIGUSR1 after step 3: saved checkpoint "
                     f"{tmp_path / 'run' / 'checkpoints' / 'step_00000003'}; rerun the same command to resume from it"]
    monkeypatch.delenv(faults.ENV)
    assert main(command) == 0
    assert "trained steps 4..5" in capsys.readouterr().out


# ------------------------------------------------------------------ stall detection (train.stall_timeout_s)

def beat(rank, step, progress_age, beat_age, now=1000.0, finished=False):
    return heartbeat.RankBeat(rank, pid=100 + rank, step=step, progress_time=now - progress_age,
                              beat_time=now - beat_age, finished=finished)


@pytest.mark.parametrize("beats, expected", [
    ({0: beat(0, 7, 1, 0), 1: beat(1, 7, 1, 0)}, None),  # progressing
    ({0: beat(0, 7, 20, 0), 1: beat(1, 6, 20, 15)},
     "rank 1 stalled (process not responding): no rank made progress for 20 s (train.stall_timeout_s = 10); "
     "last step finished: rank 0 step 7, rank 1 step 6"),
    ({0: beat(0, 7, 20, 0), 1: beat(1, 7, 20, 0)},
     "the ranks are deadlocked (all alive, none progressing): no rank made progress for 20 s "
     "(train.stall_timeout_s = 10); last step finished: rank 0 step 7, rank 1 step 7"),
    ({0: beat(0, 0, 50, 0)}, None),  # rank 1 still starting: the startup allowance applies
    ({0: beat(0, 0, 200, 0)}, "rank 1 stalled (process not responding): no rank made progress for 200 s "
                              "(train.stall_timeout_s = 10); last step finished: rank 0 step 0, rank 1 not started"),
    # rank 1 ended its run (its last beat says so) while rank 0 froze after the last step: rank 0 alone is named
    ({0: beat(0, 9, 20, 15), 1: beat(1, 9, 20, 15, finished=True)},
     "rank 0 stalled (process not responding): no rank made progress for 20 s (train.stall_timeout_s = 10); "
     "last step finished: rank 0 step 9, rank 1 step 9 (finished)"),
    # every rank ended its run and is slow to exit (a busy machine): nothing is stalled
    ({0: beat(0, 9, 20, 15, finished=True), 1: beat(1, 9, 20, 15, finished=True)}, None),
])
def test_the_watchdog_names_the_stalled_rank_and_where_each_rank_was(tmp_path, beats, expected):
    watchdog = heartbeat.Watchdog(tmp_path, nproc=2, timeout=10, interval=1)
    watchdog.started = 1000.0 - 300
    assert watchdog.check(beats, now=1000.0) == expected


def test_heartbeat_files_round_trip(tmp_path):
    beat_writer = heartbeat.Heartbeat(tmp_path, rank=1, interval=1)
    beat_writer.progress(step=9)
    found = heartbeat.read_beats(tmp_path)
    assert list(found) == [1] and found[1].step == 9 and found[1].pid == os.getpid()
    assert not found[1].finished
    beat_writer.start().stop()
    assert heartbeat.read_beats(tmp_path)[1].finished  # its last beat: the rank's run ended, it is not frozen


# ------------------------------------------------------------------ the same under --nproc 2 (slow)

@pytest.fixture(scope="module")
def nproc2_plain(tmp_path_factory, data_cache):
    """One uninterrupted --nproc 2 run of 6 steps, the reference for every fault below."""
    root = tmp_path_factory.mktemp("nproc2")
    cfg = load_config(overrides={
        "model.preset": "debug", "data.source": "stdlib", "data.vocab_size": 512, "data.max_corpus_bytes": 200_000,
        "data.cache_dir": data_cache, "train.steps": 6, "train.global_batch_size": 4, "train.micro_batch_size": 2,
        "train.seq_len": 32, "train.warmup_steps": 2, "train.lr": 1e-2, "train.sample_tokens": 0,
        "run.progress": False, "checkpoint.every": 2})
    (root / "config.json").write_text(json.dumps(cfg.to_dict()))
    plain = cli_train(root, "plain", "--nproc=2")
    assert plain.returncode == 0, plain.stderr[-2000:]
    return root, final_losses(root / "plain")


def shardwise_lines(result):
    return [line for line in result.stderr.splitlines() if line.startswith("shardwise:")]


@pytest.mark.slow
def test_killed_rank_restarts_the_job_from_the_checkpoint_with_the_same_losses(nproc2_plain):
    root, plain = nproc2_plain
    killed = cli_train(root, "killed", "--nproc=2", fault="kill@4:1")
    assert killed.returncode == 0, killed.stderr[-2000:]
    assert shardwise_lines(killed) == [
        "shardwise: rank 1 was killed by signal SIGKILL during step 4; SIGKILL is often the kernel's out-of-memory "
        "killer; the other ranks were stopped; restarting from the newest checkpoint (restart 1 of 1)"], killed.stderr
    assert "Traceback" not in killed.stderr  # rank 0, whose peer vanished, stops quietly
    assert final_losses(root / "killed") == plain


@pytest.mark.slow
def test_without_restarts_left_the_kill_is_reported_once_and_the_job_stops(nproc2_plain):
    root, _ = nproc2_plain
    killed = cli_train(root, "no-restart", "--nproc=2", "--train.max_restarts=0", fault="kill@3:1")
    assert killed.returncode == 128 + 9
    assert shardwise_lines(killed) == ["shardwise: error: rank 1 was killed by signal SIGKILL during step 3; SIGKILL "
                                       "is often the kernel's out-of-memory killer; the other ranks were stopped"]
    assert "Traceback" not in killed.stderr
    # The survivor's collective failed when its peer died: it wrote its own record of it at once.
    collectives = root / "no-restart" / collective_files.COLLECTIVES_DIR
    survivor = json.loads((collectives / "rank0.json").read_text())
    assert survivor["source"] == "dump" and survivor["records"][-1]["state"] == "failed"
    assert survivor["records"][-1]["step"] == 3 and survivor["records"][-1]["error"]
    assert "killed by SIGKILL: later collectives are unseen" in (collectives / "summary.txt").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("fault, how", [("term@3:1", "SIGTERM (received by rank 1)"),  # one rank's signal stops all
                                        ("term_launcher@3:0", "SIGTERM")])  # passed on by the launcher
def test_preempted_job_saves_once_exits_75_and_the_rerun_has_the_same_losses(nproc2_plain, fault, how):
    root, plain = nproc2_plain
    name = fault.split("@")[0]
    stopped = cli_train(root, name, "--nproc=2", fault=fault)
    assert stopped.returncode == exit_status.PREEMPTED, stopped.stderr[-2000:]
    step = int(json.loads((root / name / "metrics.jsonl").read_text().splitlines()[-1])["step"])
    assert shardwise_lines(stopped) == [
        f"shardwise: pre-empted by {how} after step {step}: saved checkpoint "
        f"{root / name / 'checkpoints' / f'step_{step:08d}'}; rerun the same command to resume from it"]
    assert "Traceback" not in stopped.stderr
    assert checkpoint_status(checkpoint_dirs(root / name)[-1]) == ("ok", "")
    rerun = cli_train(root, name, "--nproc=2", fault=fault)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert final_losses(root / name) == plain


@pytest.mark.slow
def test_a_stalled_rank_is_named_and_the_job_restarts_with_the_same_losses(nproc2_plain):
    root, plain = nproc2_plain
    stalled = cli_train(root, "stalled", "--nproc=2", "--train.stall_timeout_s=3", fault="stop@4:1")
    assert stalled.returncode == 0, stalled.stderr[-2000:]
    (line,) = shardwise_lines(stalled)
    assert line.startswith("shardwise: rank 1 stalled (process not responding): no rank made progress for ")
    assert line.endswith("last step finished: rank 0 step 3, rank 1 step 3; restarting from the newest checkpoint "
                         "(restart 1 of 1)")
    assert final_losses(root / "stalled") == plain


@pytest.mark.slow
def test_a_stall_with_no_restart_left_ends_the_job_with_status_124(nproc2_plain):
    root, _ = nproc2_plain
    stalled = cli_train(root, "stalled-once", "--nproc=2", "--train.stall_timeout_s=3", "--train.max_restarts=0",
                        fault="stop@2:0")
    assert stalled.returncode == exit_status.STALLED
    (line,) = shardwise_lines(stalled)
    assert line.startswith("shardwise: error: rank 0 stalled") and "rank 0 step 1, rank 1 step 1" in line


@pytest.mark.slow
def test_an_internal_error_shows_the_failing_ranks_traceback_only(nproc2_plain):
    root, _ = nproc2_plain
    failed = cli_train(root, "raised", "--nproc=2", "--train.max_restarts=0", fault="raise@3:1")
    assert failed.returncode == 1
    assert failed.stderr.count("Traceback") == 1 and "[rank1]: RuntimeError: SHARDWISE_FAULT" in failed.stderr
    assert shardwise_lines(failed) == ["shardwise: error: rank 1 exited with code 1 during step 3: RuntimeError: "
                                       "SHARDWISE_FAULT: injected error at step 3 on rank 1; the other ranks were "
                                       "stopped"]


@pytest.mark.slow
def test_a_user_error_in_one_rank_is_one_line_printed_once_and_not_restarted(nproc2_plain):
    root, _ = nproc2_plain
    failed = cli_train(root, "user-error", "--nproc=2", fault="bad_input@3:1")
    assert failed.returncode == exit_status.BAD_INPUT
    assert "Traceback" not in failed.stderr and "restarting" not in failed.stderr
    assert shardwise_lines(failed) == ["shardwise: error: SHARDWISE_FAULT = bad_input@3 is invalid: an injected "
                                       "user error on rank 1"]


def tree_digest(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("flags, fragment", [
    (["--model.dim=32"], "model.dim = 32 is invalid: run.dir "),
    (["--model.n_layers=3"], "model.n_layers = 3 is invalid: run.dir "),
    (["--data.source=/nonexistent/corpus.txt"], "data.source: path '/nonexistent/corpus.txt' does not exist"),
])
def test_bad_input_under_nproc_is_refused_by_the_launcher_before_any_rank_starts(nproc2_plain, flags, fragment, capfd):
    """The refusal comes from `main` before any launch, so it is called here, in this process; a rank
    started by mistake would write to this process's stdout or stderr, which capfd reads."""
    root, _ = nproc2_plain
    before = tree_digest(root / "plain")
    capfd.readouterr()
    with pytest.raises(SystemExit) as refused:
        main(["train", f"--config={root / 'config.json'}", f"--run.dir={root / 'plain'}", "--nproc=2", "--train.steps=8",
              *flags])
    assert refused.value.code == exit_status.BAD_INPUT
    out, err = capfd.readouterr()
    (line,) = err.splitlines()
    assert line.startswith("shardwise: error: ") and fragment in line
    assert "[rank" not in out + err  # no rank was started
    assert tree_digest(root / "plain") == before


# ------------------------------------------------------------------ each rank's last collectives (issue 19)

@pytest.mark.slow
def test_a_stall_leaves_each_ranks_last_collectives_in_the_run_directory(nproc2_plain):
    """The frozen rank is behind, and the other waits in the collective it never joined. Needs the trainer
    to record (`flight_recorder.recording(...)` around `train`, observe/flight_recorder.py)."""
    root, _ = nproc2_plain
    stalled = cli_train(root, "recorded", "--nproc=2", "--train.stall_timeout_s=3", "--train.max_restarts=0",
                        fault="stop@3:1")
    assert stalled.returncode == exit_status.STALLED, stalled.stderr[-3000:]
    collectives = root / "recorded" / collective_files.COLLECTIVES_DIR
    (line,) = shardwise_lines(stalled)
    assert line.startswith("shardwise: error: rank 1 stalled (process not responding)")
    assert f"; each rank's last collectives: {collectives / 'summary.txt'}; last step finished: " in line

    rank0, rank1 = (json.loads((collectives / f"rank{rank}.json").read_text()) for rank in (0, 1))
    for rank, body in enumerate((rank0, rank1)):
        assert body["rank"] == rank and body["source"] == "heartbeat" and body["reason"].startswith("stall: rank 1")
        for record in body["records"]:
            assert {"op", "shapes", "dtypes", "bytes", "group", "group_ranks", "seq", "global_seq", "step",
                    "state"} <= set(record)
    waiting, last_of_frozen = rank0["records"][-1], rank1["records"][-1]
    assert waiting["state"] == "issued" and waiting["end_time"] is None  # rank 0 hangs in it
    assert waiting["group"] == last_of_frozen["group"] and waiting["group_ranks"] == [0, 1]
    assert waiting["seq"] > last_of_frozen["seq"]
    assert {"gather_object", "broadcast_object_list"} <= {record["op"] for record in rank0["records"]}, \
        "the checkpoint save of step 2, outside any training step, is recorded too"

    summary = (collectives / "summary.txt").read_text()
    assert "its heartbeat went quiet (frozen)" in summary
    assert (f"rank 1 behind at #{last_of_frozen['seq']} at its last heartbeat; rank 0 waiting in {waiting['op']} "
            f"#{waiting['seq']}") in summary
