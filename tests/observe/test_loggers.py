"""Metric loggers: every numeric metric of a metrics.jsonl record reaches TensorBoard and W&B,
read back from their files; a resumed run replaces (TensorBoard) or continues (W&B) the steps
after its checkpoint; a missing package is a one-line error naming the pip extra.

W&B runs offline only (WANDB_MODE=offline, everything under tmp_path) and starts twice in this
file (a fresh run and its resume, in one test): each start costs about a second."""

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from shardwise.observe.loggers import WANDB_ID_FILE, TensorBoardLogger, WandbLogger, flatten_metrics, open_loggers


def make_record(step: int, *, evaluated: bool = False) -> dict:
    """A record as run_log writes it for a MoE run (moe_stats.MoEStepStats.metrics), with values
    that change per step, plus a few non-numeric fields that loggers must skip."""
    record = {
        "step": step, "loss": 8.3 - step, "lr": 1e-4 * step, "grad_norm": 2.1 + step, "step_time_s": 0.4,
        "tokens_per_s": 5000.0 + step, "mfu": 0.12, "peak_memory_gib": 0.9, "tokens_seen": 2048 * step,
        "params_bytes": 1, "grads_bytes": 2, "optimizer_bytes": 3,
        "comm": {"all_reduce": {"calls": 3, "bytes": 1000 * step, "bus_bytes": 1000.0},
                 "all_to_all_single": {"calls": 4, "bytes": 64, "bus_bytes": 32.0}},
        "skipped_steps": 0, "lm_loss": 8.0 - step, "moe_aux_loss": 0.01 * step, "moe_z_loss": 0.001,
        "moe_dropped_fraction": 0.25, "moe_tokens_per_expert": {"1": [5 + step, 3], "3": [4, 4 + step]},
        "note": "not a metric", "flagged": True, "missing": None,
    }
    if evaluated:
        record |= {"val_loss": 7.5 - step, "val_ppl": 1800.0 - step}
    return record


RECORDS = [make_record(1), make_record(2, evaluated=True), make_record(3)]


def expected_per_tag(records) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of every numeric metric the records hold."""
    expected = defaultdict(list)
    for record in records:
        for tag, value in flatten_metrics(record).items():
            expected[tag].append((record["step"], value))
    return dict(expected)


def test_flatten_keeps_every_numeric_leaf_under_a_slash_joined_tag():
    flat = flatten_metrics(make_record(2, evaluated=True))
    assert flat == pytest.approx({
        "loss": 6.3, "lr": 2e-4, "grad_norm": 4.1, "step_time_s": 0.4, "tokens_per_s": 5002.0, "mfu": 0.12,
        "peak_memory_gib": 0.9, "tokens_seen": 4096.0, "params_bytes": 1.0, "grads_bytes": 2.0,
        "optimizer_bytes": 3.0,
        "comm/all_reduce/calls": 3.0, "comm/all_reduce/bytes": 2000.0, "comm/all_reduce/bus_bytes": 1000.0,
        "comm/all_to_all_single/calls": 4.0, "comm/all_to_all_single/bytes": 64.0,
        "comm/all_to_all_single/bus_bytes": 32.0,
        "skipped_steps": 0.0, "lm_loss": 6.0, "moe_aux_loss": 0.02, "moe_z_loss": 0.001,
        "moe_dropped_fraction": 0.25,
        "moe_tokens_per_expert/1/0": 7.0, "moe_tokens_per_expert/1/1": 3.0,
        "moe_tokens_per_expert/3/0": 4.0, "moe_tokens_per_expert/3/1": 6.0,
        "val_loss": 5.5, "val_ppl": 1798.0,
    })
    assert all(type(value) is float for value in flat.values())


def test_flatten_leaves_out_the_step_and_non_numeric_values():
    assert flatten_metrics({"step": 7, "ok": True, "none": None, "text": "a", "empty": {}, "nested": {"step": 2}}) \
        == {"nested/step": 2.0}


def test_only_jsonl_opens_no_logger(tmp_path):
    assert open_loggers(["jsonl"], tmp_path, run_name="r", project="p", config={}, resume_step=0) == []
    assert list(tmp_path.iterdir()) == []


# --- TensorBoard ------------------------------------------------------------------------------


def read_tensorboard(run_dir) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard shows them (earlier files' purged steps removed)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})  # 0: keep all
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def assert_same_metrics(found: dict, expected: dict, *, rel: float) -> None:
    assert sorted(found) == sorted(expected)
    for tag, points in expected.items():
        assert [step for step, _ in found[tag]] == [step for step, _ in points], tag
        assert [value for _, value in found[tag]] == pytest.approx([value for _, value in points], rel=rel), tag


def test_tensorboard_receives_every_metric_of_every_step(tmp_path):
    logger = TensorBoardLogger(tmp_path, resume_step=0)
    for record in RECORDS:
        logger.log(record)
    logger.close()
    found = read_tensorboard(tmp_path)
    assert {"comm/all_reduce/bytes", "moe_tokens_per_expert/3/1", "val_loss"} <= set(found)
    assert found["val_loss"] == [(2, 5.5)]  # logged on the evaluation step only
    # TensorBoard stores scalars as float32: equal to ~7 significant digits.
    assert_same_metrics(found, expected_per_tag(RECORDS), rel=1e-6)


def log_steps(run_dir, resume_step: int, steps, offset: float) -> None:
    logger = TensorBoardLogger(run_dir, resume_step=resume_step)
    for step in steps:
        logger.log({"step": step, "loss": step + offset, "comm": {"all_reduce": {"bytes": 10 * step + offset}}})
    logger.close()


def test_tensorboard_resume_replaces_the_steps_after_the_checkpoint(tmp_path):
    log_steps(tmp_path, 0, [1, 2, 3, 4], offset=0)
    log_steps(tmp_path, 2, [3, 4], offset=100)  # resumed from the checkpoint of step 2
    assert read_tensorboard(tmp_path) == {
        "loss": [(1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0)],
        "comm/all_reduce/bytes": [(1, 10.0), (2, 20.0), (3, 130.0), (4, 140.0)],
    }
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2  # each start writes its own event file


def test_tensorboard_fresh_run_replaces_an_earlier_run_in_the_same_folder(tmp_path):
    log_steps(tmp_path, 0, [1, 2, 3], offset=0)
    log_steps(tmp_path, 0, [1, 2], offset=1000)
    assert read_tensorboard(tmp_path)["loss"] == [(1, 1001.0), (2, 1002.0)]


# --- Weights & Biases -------------------------------------------------------------------------


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline and silent, its own files under tmp_path (none in the home directory)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for variable, folder in [("WANDB_DIR", "wandb-dir"), ("WANDB_CONFIG_DIR", "wandb-config"),
                             ("WANDB_CACHE_DIR", "wandb-cache"), ("WANDB_DATA_DIR", "wandb-data")]:
        monkeypatch.setenv(variable, str(tmp_path / folder))
    return tmp_path / "run"


def read_wandb_run(run_file) -> list[dict]:
    """The records of an offline run's .wandb transaction log, as `wandb leet inspect --json`
    (the installed wandb's reader of that log) prints them: one JSON object a line."""
    result = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"reading the run back needs `wandb leet inspect --json` (wandb 0.31 has it): " \
                                   f"{result.stderr}"
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def wandb_history(records) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of the logged metrics (W&B's own "_step", "_runtime", ... left out)."""
    history = defaultdict(list)
    for record in records:
        if record["type"] == "history":
            step = record["history"]["step"]["num"]
            for key, value in record["history"]["item"].items():
                if not key.startswith("_"):
                    history[key].append((step, value))
    return dict(history)


def the_run(records) -> dict:
    (run,) = [record["run"] for record in records if record["type"] == "run"]
    return run


def new_offline_run_file(run_dir, seen: set):
    """The .wandb log of the one offline run started since `seen` was taken."""
    (run_file,) = set((run_dir / "wandb").glob("offline-run-*/run-*.wandb")) - seen
    return run_file


def test_wandb_offline_receives_every_metric_and_a_resume_continues_the_run(offline_wandb):
    run_dir = offline_wandb
    config = {"model": {"dim": 8, "n_layers": 2}, "run": {"name": "tiny"}}
    (logger,) = open_loggers(["jsonl", "wandb"], run_dir, run_name="tiny", project="shardwise-test",
                             config=config, resume_step=0)
    assert isinstance(logger, WandbLogger)
    for record in RECORDS:
        logger.log(record)
    logger.close()

    first_file = new_offline_run_file(run_dir, set())
    records = read_wandb_run(first_file)
    history = wandb_history(records)
    assert {"comm/all_reduce/bytes", "moe_tokens_per_expert/3/1", "val_loss"} <= set(history)
    assert_same_metrics(history, expected_per_tag(RECORDS), rel=1e-12)  # JSON keeps float64 exactly
    run = the_run(records)
    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    assert run["run_id"] == run_id and run["display_name"] == "tiny" and run["project"] == "shardwise-test"
    assert run["config"]["update"]["model"] == {"dim": 8, "n_layers": 2}

    # Resumed from the checkpoint of step 2: the same W&B run goes on from step 3.
    resumed = WandbLogger(run_dir, project="shardwise-test", name="tiny", config=config, resume_step=2)
    resumed.log(make_record(3) | {"loss": 42.0})
    resumed.close()
    records = read_wandb_run(new_offline_run_file(run_dir, {first_file}))
    assert the_run(records)["run_id"] == run_id
    assert (run_dir / WANDB_ID_FILE).read_text().strip() == run_id
    assert wandb_history(records)["loss"] == [(3, 42.0)]


def test_wandb_fresh_run_gets_a_new_id(tmp_path):
    from shardwise.observe.loggers import wandb_run_id

    first = wandb_run_id(tmp_path, resume_step=0)
    assert wandb_run_id(tmp_path, resume_step=5) == first
    assert wandb_run_id(tmp_path, resume_step=0) != first  # a fresh run in the same folder is a new W&B run
    # W&B ids are lowercase letters and digits; token_hex gives all digits one time in ~280 (islower() is False for it)
    assert first and set(first) <= set("abcdefghijklmnopqrstuvwxyz0123456789")


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["tensorboard", "wandb"])
def test_a_missing_package_is_a_one_line_error_naming_the_pip_extra(tmp_path, monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # `import <missing>` now fails
    names = ["jsonl", "tensorboard", "wandb"]
    with pytest.raises(ModuleNotFoundError) as raised:
        open_loggers(names, tmp_path, run_name="r", project="p", config={}, resume_step=0)
    assert str(raised.value) == (f"run.loggers = {names!r} names {missing}, which needs the {missing} package: "
                                 f"pip install 'shardwise[{missing}]'")
    assert list(tmp_path.iterdir()) == []  # checked before any logger opened: nothing written


def test_an_unknown_logger_is_a_one_line_error(tmp_path):
    with pytest.raises(ValueError, match=r"^run.loggers = \['jsonl', 'mlflow'\] is invalid: use a list of jsonl, "
                                         r"tensorboard, wandb$"):
        open_loggers(["jsonl", "mlflow"], tmp_path, run_name="r", project="p", config={}, resume_step=0)


def test_a_missing_package_stops_the_config_before_any_work(monkeypatch, tiny_config):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ValueError, match=r"^run.loggers = \['jsonl', 'tensorboard'\] is invalid: tensorboard needs "
                                         r"the tensorboard package: pip install 'shardwise\[tensorboard\]'$"):
        tiny_config(**{"run.loggers": ["jsonl", "tensorboard"]})


# --- a real run -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_two_rank_run_sends_every_metric_to_each_logger_from_rank_0_only(offline_wandb, data_cache):
    """`shardwise train --nproc 2` with both loggers and evaluations: TensorBoard and W&B each hold
    every metric of every metrics.jsonl line (validation included), written once (by rank 0)."""
    run_dir = offline_wandb
    command = [sys.executable, "-m", "shardwise.cli.main", "train", "--nproc", "2", "--model.preset", "debug",
               "--data.vocab_size", "512", "--data.max_corpus_bytes", "200000", "--data.cache_dir", data_cache,
               "--data.val_fraction", "0.1", "--train.eval_every", "2", "--train.eval_batches", "2",
               "--train.steps", "3", "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
               "--train.seq_len", "32", "--train.sample_tokens", "0", "--parallel.zero", "1",
               "--run.loggers", "jsonl,tensorboard,wandb", "--run.name", "two-ranks", "--run.dir", str(run_dir)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3] and "val_loss" in lines[1] and "val_loss" in lines[2]
    expected = expected_per_tag(lines)
    assert {"val_loss", "val_ppl", "comm/all_reduce/bytes"} <= set(expected)
    assert len(list((run_dir / "tensorboard").iterdir())) == 1  # one event file: rank 0's
    assert_same_metrics(read_tensorboard(run_dir), expected, rel=1e-6)
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")  # one W&B run: rank 0's
    records = read_wandb_run(run_file)
    assert_same_metrics(wandb_history(records), expected, rel=1e-12)
    assert the_run(records)["display_name"] == "two-ranks"
