"""A run's examples from file to loaders (prompt_completion and chat): the validation split (the last
examples, whole), data.overlong and its counts in the run's log, packed or padded rows."""

import json

import pytest

from shardwise.config.loader import load_config
from shardwise.data.training_data import build_run_loaders, prepare_data

PAIRS = [{"prompt": f"def f{k}(x):\n", "completion": "    return x" + " + 1" * (k % 7) + "\n"} for k in range(60)]


@pytest.fixture
def rows_file(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PAIRS))
    return path


def config(tmp_path, rows_file, **overrides):
    values = {"model.preset": "debug", "data.source": str(rows_file), "data.format": "prompt_completion",
              "data.cache_dir": str(tmp_path / "cache"), "data.vocab_size": 300, "train.seq_len": 32,
              "train.global_batch_size": 4, "train.micro_batch_size": 2, "train.eval_batches": 1,
              "run.dir": str(tmp_path / "run")} | overrides
    return load_config(overrides=values)


def test_pairs_become_prompt_then_completion_then_end_of_text(tmp_path, rows_file):
    data = prepare_data(config(tmp_path, rows_file))
    tokenizer, eos = data.tokenizer, data.pad_id
    ids, loss = data.train[0].example(3)
    prompt = tokenizer.encode(PAIRS[3]["prompt"]).ids
    assert ids.tolist() == prompt + tokenizer.encode(PAIRS[3]["completion"]).ids + [eos]
    assert loss.tolist() == [False] * len(prompt) + [True] * (len(ids) - len(prompt))
    everything = prepare_data(config(tmp_path, rows_file, **{"data.loss_on": "all"}))
    assert everything.train[0].example(3)[1].tolist() == [False] + [True] * (len(ids) - 1)


def test_the_validation_split_is_the_last_examples_whole(tmp_path, rows_file):
    data = prepare_data(config(tmp_path, rows_file, **{"data.val_fraction": 0.1}))
    assert data.train[0].num_examples == 54 and data.val[0].num_examples == 6
    assert [data.val[0].where(k) for k in range(6)] == [f"{rows_file} row {n}" for n in range(55, 61)]
    train, val = build_run_loaders(config(tmp_path, rows_file, **{"data.val_fraction": 0.1}), data)
    assert train.num_windows == 54 and val.num_windows == 6


@pytest.mark.parametrize("action", ["truncate", "drop"])
def test_overlong_examples_are_counted_in_the_log(tmp_path, rows_file, action, capsys):
    lengths = prepare_data(config(tmp_path, rows_file)).train[0].lengths
    overlong = int((lengths > 21).sum())
    assert 0 < overlong < 30
    capsys.readouterr()
    data = prepare_data(config(tmp_path, rows_file, **{"train.seq_len": 20, "data.overlong": action}))
    out = capsys.readouterr().out
    assert data.counts.examples == 60 and data.counts.overlong == overlong
    assert (data.train[0].lengths <= 21).all()
    kept = 60 if action == "truncate" else 60 - overlong
    prefix = (f"data: 60 prompt_completion examples ({kept} training); {overlong} longer than train.seq_len + 1 = "
              "21 tokens: ")
    if action == "truncate":
        assert data.train[0].num_examples == 60 and data.counts.truncated == overlong
        assert f"{prefix}{overlong} truncated (data.overlong = truncate)" in out
    else:
        assert data.train[0].num_examples == 60 - overlong and data.counts.dropped == overlong
        assert f"{prefix}{overlong} dropped (data.overlong = drop)" in out


def test_an_overlong_example_stops_the_run_with_data_overlong_error(tmp_path, rows_file):
    lengths = prepare_data(config(tmp_path, rows_file)).train[0].lengths
    first = int((lengths > 21).argmax())
    with pytest.raises(ValueError, match=rf"data.overlong = 'error': {rows_file} row {first + 1} is {lengths[first]} "
                                         r"tokens, more than one sequence holds \(train.seq_len \+ 1 = 21\)"):
        prepare_data(config(tmp_path, rows_file, **{"train.seq_len": 20, "data.overlong": "error"}))


def test_packed_rows_need_fewer_sequences_than_padded_ones(tmp_path, rows_file, capsys):
    padded = prepare_data(config(tmp_path, rows_file))
    packed = prepare_data(config(tmp_path, rows_file, **{"data.packing": True}))
    assert padded.train_rows is None and len(packed.train_rows) < 0.7 * 60
    out = capsys.readouterr().out
    assert "60 training rows of 32 (padded" in out and f"{len(packed.train_rows)} training rows of 32 (packed" in out
    [(inputs, targets, documents), _] = build_run_loaders(config(tmp_path, rows_file, **{"data.packing": True}),
                                                          packed)[0].next_step()
    assert inputs.shape == targets.shape == documents.shape == (2, 32)
