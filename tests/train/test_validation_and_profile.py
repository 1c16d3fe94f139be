"""What a run shows of itself, one process: the validation split and its evaluations, the piped
log's one line per step, and the profiler's trace and table (run.profile_steps)."""

import io
import json
import re

import numpy as np
import pytest
import torch
from rich.console import Console

from shardwise.config.loader import load_config
from shardwise.data.prepare import build_dataset
from shardwise.data.splits import build_loaders, split_tokens
from shardwise.train.trainer import train


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_validation_split_is_the_end_of_the_stream_and_the_same_for_every_data_parallel_rank(tiny_config):
    cfg = tiny_config(**{"data.val_fraction": 0.1})
    tokens = build_dataset(cfg.data).tokens
    train_tokens, val_tokens = split_tokens(tokens, 0.1)
    assert train_tokens.num_tokens + val_tokens.num_tokens == tokens.num_tokens
    assert val_tokens.num_tokens == round(0.1 * tokens.num_tokens)
    np.testing.assert_array_equal(val_tokens.tokens, tokens.tokens[train_tokens.num_tokens:])
    # Two data-parallel ranks' validation batches, concatenated, are one process's.
    _, whole = build_loaders(cfg, tokens)
    halves = [build_loaders(cfg, tokens, dp_rank=r, dp_size=2)[1] for r in range(2)]
    for step in range(cfg.train.eval_batches):
        one = np.concatenate([x.numpy() for x, _ in whole.batch_of_step(step)])
        two = np.concatenate([x.numpy() for half in halves for x, _ in half.batch_of_step(step)])
        np.testing.assert_array_equal(one, two)
    assert build_loaders(tiny_config(), tokens)[1] is None


def test_evaluation_is_logged_at_its_steps_and_does_not_change_training(tiny_config, tmp_path):
    plain = train(tiny_config(**{"run.dir": str(tmp_path / "plain"), "data.val_fraction": 0.1}))
    cfg = tiny_config(**{"run.dir": str(tmp_path / "evaluated"), "data.val_fraction": 0.1, "train.eval_every": 4,
                         "train.eval_batches": 2})
    evaluated = train(cfg)
    assert evaluated.losses == plain.losses  # evaluation neither trains nor moves the training data
    assert sorted(evaluated.val_losses) == [4, 6]  # every 4 steps and after the last
    by_step = {r["step"]: r for r in records(tmp_path / "evaluated")}
    for step, record in by_step.items():
        assert ("val_loss" in record) == (step in (4, 6))
    assert by_step[6]["val_loss"] == pytest.approx(evaluated.val_losses[6])
    assert by_step[6]["val_ppl"] == pytest.approx(np.exp(by_step[6]["val_loss"]))
    # It is a loss on held-out text: near the training loss at this stage, not zero or a copy of it.
    assert 0.5 * by_step[6]["loss"] < by_step[6]["val_loss"] < 2 * by_step[6]["loss"]
    assert by_step[6]["val_loss"] != by_step[6]["loss"]


def test_a_resumed_run_evaluates_the_same_split_as_an_uninterrupted_one(tiny_config, tmp_path):
    settings = {"data.val_fraction": 0.1, "train.eval_every": 3}
    whole = train(tiny_config(**settings, **{"run.dir": str(tmp_path / "whole")}))
    first = train(tiny_config(**settings, **{"run.dir": str(tmp_path / "split"), "train.stop_at_step": 3}))
    rest = train(tiny_config(**settings, **{"run.dir": str(tmp_path / "split")}))
    assert rest.first_step == 4
    assert {**first.val_losses, **rest.val_losses} == pytest.approx(whole.val_losses, rel=1e-6)
    assert sorted(whole.val_losses) == [3, 6]


def test_resume_with_another_validation_fraction_is_refused(tiny_config, tmp_path):
    train(tiny_config(**{"train.steps": 2, "data.val_fraction": 0.1}))
    with pytest.raises(ValueError, match=r"num_tokens = .* data.val_fraction"):
        train(tiny_config(**{"train.steps": 4, "data.val_fraction": 0.2}))


@pytest.mark.parametrize("overrides, message", [
    ({"train.eval_every": 2}, r"train.eval_every = 2 is invalid: evaluation needs a validation split"),
    ({"data.val_fraction": 0.01, "train.eval_batches": 50},
     r"train.eval_batches = 50 needs 200 sequences .* use train.eval_batches <= \d+ or a larger data.val_fraction"),
    ({"data.val_fraction": 1e-6}, r"data.val_fraction = 1e-06 holds out no token"),
    ({"run.profile_steps": "5-3"}, r"run.profile_steps = '5-3' is invalid: use 1 <= A <= B"),
    ({"run.profile_steps": "2-9"}, r"run.profile_steps = '2-9' is invalid: profile steps within train.steps \(6\)"),
    ({"run.profile_steps": "x"}, r"run.profile_steps = 'x' is invalid: use \"A-B\""),
])
def test_bad_validation_and_profile_settings_stop_before_any_work(tiny_config, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        train(tiny_config(**overrides))
    assert not (tmp_path / "run").exists()


def test_a_piped_log_has_one_unwrapped_line_per_logged_step(tiny_config, tmp_path):
    run_dir = tmp_path / ("a-run-directory-whose-name-is-long-enough-to-wrap-an-eighty-column-line" * 2)
    out = io.StringIO()
    console = Console(file=out, width=80)  # what rich picks for a pipe: not a terminal, 80 columns
    train(tiny_config(**{"run.dir": str(run_dir), "train.log_every": 2, "data.val_fraction": 0.1,
                         "train.eval_every": 3}), console=console)
    lines = out.getvalue().splitlines()
    step_lines = [line for line in lines if line.startswith("step ")]
    assert [int(line.split()[1].split("/")[0]) for line in step_lines] == [1, 2, 3, 4, 6]  # log_every, evals, last
    for line in step_lines:
        assert re.search(r"mfu \d+\.\d%", line), line
    # The evaluation lines run past 80 columns and stay whole: rich would have folded them.
    assert all(re.search(r"val_loss \d\.\d{4}  val_ppl \d+\.\d\d$", step_lines[i]) for i in (2, 4))
    assert min(len(step_lines[2]), len(step_lines[4])) > 80
    assert any(line.startswith("shardwise") and line.endswith(str(run_dir)) for line in lines)


def test_profile_steps_write_a_chrome_trace_and_a_table(tiny_config, tmp_path):
    out = io.StringIO()
    train(tiny_config(**{"run.profile_steps": "2-3"}), console=Console(file=out, width=200))
    trace = json.loads((tmp_path / "run" / "profile" / "rank0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names and any("Optimizer.step" in str(name) for name in names)
    table = (tmp_path / "run" / "profile" / "rank0.txt").read_text()
    assert "profile of steps 2..3" in table and "aten::mm" in table and "collectives: none" in table
    assert "top operators" in out.getvalue()


def test_the_step_line_is_plain_text():
    from shardwise.train.progress import step_line

    record = {"step": 3, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1234.0, "mfu": 0.25,
              "val_loss": 2.5, "val_ppl": 12.18}
    assert step_line(record, 10) == ("step      3/10  loss 2.0000  lr 1.00e-03  grad_norm 0.500  1,234 tok/s  "
                                     "mfu 25.0%  val_loss 2.5000  val_ppl 12.18")


def train_quietly(overrides: dict) -> None:
    train(load_config(overrides=overrides), console=Console(file=io.StringIO()))


def test_every_rank_writes_its_profile_and_memory(pool2, tiny_config, tmp_path):
    overrides = {"model.preset": "debug", "data.source": "stdlib", "data.vocab_size": 512,
                 "data.max_corpus_bytes": 200_000, "data.cache_dir": tiny_config().data.cache_dir,
                 "train.steps": 3, "train.global_batch_size": 4, "train.micro_batch_size": 2, "train.seq_len": 32,
                 "train.sample_tokens": 0, "train.device": "cpu", "parallel.zero": 1, "run.progress": False,
                 "run.profile_steps": "2-3", "run.dir": str(tmp_path / "dp2")}
    pool2.run(train_quietly, overrides)
    for rank in range(2):
        table = (tmp_path / "dp2" / "profile" / f"rank{rank}.txt").read_text()
        assert f"rank {rank}" in table and re.search(r"c10d::(allreduce_|_reduce_scatter_base_|reduce_scatter)", table)
        assert json.loads((tmp_path / "dp2" / "profile" / f"rank{rank}.json").read_text())["traceEvents"]
        memory = json.loads((tmp_path / "dp2" / "memory" / f"rank{rank}.json").read_text())
        assert memory["rank"] == rank and memory["layout"] == "dp2 zero1"
        # ZeRO-1: each rank holds half the optimizer states, all the parameters.
        assert memory["measured"]["optimizer"] < 0.6 * 2 * memory["measured"]["params"]
        assert memory["formula"]["optimizer"] == memory["formula"]["params"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA memory snapshot needs a CUDA device")
def test_on_cuda_the_profile_also_holds_a_memory_snapshot(tiny_config, tmp_path):
    import pickle

    train(tiny_config(**{"run.profile_steps": "2-3", "train.device": "cuda"}), console=Console(file=io.StringIO()))
    with open(tmp_path / "run" / "profile" / "rank0_memory.pickle", "rb") as snapshot:
        memory = pickle.load(snapshot)  # what pytorch.org/memory_viz reads
    assert memory["segments"] and any(memory["device_traces"])
    table = (tmp_path / "run" / "profile" / "rank0.txt").read_text()
    assert "self device time" in table
