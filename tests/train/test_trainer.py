import json
import math

import pytest
import torch

import shardwise.checkpoint.store as checkpoint_module
from shardwise.config.schema import TrainConfig
from shardwise.checkpoint.store import checkpoint_dirs, latest_checkpoint
from shardwise.train.optim import lr_at
from shardwise.train.trainer import train

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_memory_gib", "step_time_s"}


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_loss_falls_and_metrics_are_logged(tiny_config):
    result = train(tiny_config(**{"train.steps": 30, "train.sample_tokens": 8}))
    assert result.losses[0] > math.log(512) - 0.5
    # From uniform (log 512 = 6.24) to at least the unigram statistics of the text.
    assert result.losses[-1] < result.losses[0] - 0.5
    records = read_metrics(result.run_dir)
    assert [r["step"] for r in records] == list(range(1, 31))
    assert all(METRIC_KEYS <= r.keys() for r in records)
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] for r in records)
    assert result.sample.startswith("def ")
    for name in ("config.json", "tokenizer.json", "run.json"):
        assert (result.run_dir / name).is_file()


def test_a_closing_sample_past_the_context_stops_there_and_says_so(tiny_config, capsys):
    """The config cannot know the prompt's length in tokens: a train.sample_tokens past what the
    context leaves is cut on purpose, with one warning naming the field, not refused nor silent."""
    result = train(tiny_config(**{"train.steps": 1, "model.max_seq_len": 32, "train.sample_tokens": 64,
                                  "train.sample_temperature": 0}))
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shardwise: warning:")]
    assert len(warnings) == 1 and "of train.sample_tokens = 64 tokens" in warnings[0], warnings
    room = int(warnings[0].split("stops after ")[1].split()[0])
    assert result.sample.startswith("def ") and 0 < room < 32


def test_resume_reproduces_uninterrupted_run_exactly(tiny_config, tmp_path):
    full = train(tiny_config(**{"train.steps": 8, "run.dir": str(tmp_path / "full")}))
    stopped = tiny_config(**{"train.steps": 8, "train.stop_at_step": 4, "run.dir": str(tmp_path / "resumed")})
    first = train(stopped)
    assert latest_checkpoint(first.run_dir).name == "step_00000004"
    second = train(tiny_config(**{"train.steps": 8, "run.dir": str(tmp_path / "resumed")}))
    assert second.first_step == 5
    assert first.losses + second.losses == full.losses  # bitwise: same data, weights, optimizer, RNG
    assert [r["step"] for r in read_metrics(second.run_dir)] == list(range(1, 9))


def test_gradient_accumulation_matches_one_big_batch(tiny_config, tmp_path):
    one = train(tiny_config(**{"train.micro_batch_size": 4, "run.dir": str(tmp_path / "a")}))
    accumulated = train(tiny_config(**{"train.micro_batch_size": 1, "run.dir": str(tmp_path / "b")}))
    # Same global batch; only the summation order differs (4 micro-batch means vs one mean).
    torch.testing.assert_close(torch.tensor(accumulated.losses), torch.tensor(one.losses), rtol=1e-5, atol=1e-5)


def test_bf16_autocast_trains(tiny_config):
    result = train(tiny_config(**{"train.autocast_dtype": "bfloat16", "train.steps": 10}))
    assert all(math.isfinite(x) for x in result.losses)
    assert result.losses[-1] < result.losses[0]


def test_checkpoints_keep_the_newest(tiny_config):
    result = train(tiny_config(**{"checkpoint.every": 2, "checkpoint.keep": 2}))
    assert [p.name for p in checkpoint_dirs(result.run_dir)] == ["step_00000004", "step_00000006"]
    files = {p.name for p in latest_checkpoint(result.run_dir).iterdir()}
    assert files == {"__0_0.distcp", ".metadata", "state.json", "manifest.json"}  # DCP: one data file per rank


def test_crash_while_saving_keeps_previous_checkpoint(tiny_config, monkeypatch):
    cfg = tiny_config(**{"train.steps": 4, "checkpoint.every": 2})
    real_save = checkpoint_module.dcp.save

    def failing_save(tensors, storage_writer, **kwargs):
        if "step_00000004" in str(storage_writer.path):
            raise OSError("disk full")
        return real_save(tensors, storage_writer=storage_writer, **kwargs)

    monkeypatch.setattr(checkpoint_module.dcp, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        train(cfg)
    run_dir = cfg.run.dir
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step_00000002"]
    leftovers = [p.name for p in latest_checkpoint(run_dir).parent.iterdir()]
    assert leftovers == ["step_00000002"]  # the half-written temp dir is gone


def test_tokenizer_larger_than_model_vocab_stops_before_training(tiny_config, tmp_path):
    trained = train(tiny_config(**{"train.steps": 1}))
    cfg = tiny_config(**{"data.tokenizer": str(trained.run_dir / "tokenizer.json"), "model.vocab_size": 300,
                         "run.dir": str(tmp_path / "small")})
    with pytest.raises(ValueError, match=r"model.vocab_size = 300 is invalid: the tokenizer has 512 tokens"):
        train(cfg)
    assert not (tmp_path / "small").exists()


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(99, cfg) == pytest.approx(0.1)
    values = [lr_at(s, cfg) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(values, values[1:]))
