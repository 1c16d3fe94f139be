"""`shardwise train` on chat and prompt_completion rows, padded and packed: the run trains from the
rows' batches, its log carries the data summary (data.overlong's counts), and its loss falls."""

import json

import pytest

from shardwise.cli.main import main
from shardwise.train.metrics import read_metrics_log

ROWS = [{"messages": [{"role": "system", "content": "Answer with the number."},
                      {"role": "user", "content": f"What is {k} plus {k}?"},
                      {"role": "assistant", "content": f"{2 * k}"}]} for k in range(40)]
PAIRS = [{"prompt": f"def double_{k}(x):\n", "completion": f"    return x * 2  # {k}\n"} for k in range(40)]


@pytest.mark.parametrize("data_format, packing", [("chat", "false"), ("chat", "true"), ("prompt_completion", "false"),
                                                  ("prompt_completion", "true")])
def test_train_runs_on_rows(tmp_path, data_format, packing, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in (ROWS if data_format == "chat" else PAIRS)))
    argv = ["train", "--nproc", "1", "--model.preset", "debug", "--data.source", str(rows), "--data.format",
            data_format, "--data.packing", packing, "--data.vocab_size", "300", "--data.cache_dir",
            str(tmp_path / "cache"), "--train.seq_len", "96", "--train.steps", "8", "--train.global_batch_size", "4",
            "--train.micro_batch_size", "2", "--train.lr", "3e-3", "--train.warmup_steps", "1",
            "--train.sample_tokens", "0", "--run.progress", "false", "--run.dir", str(tmp_path / "run")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"data: 40 {data_format} examples (40 training); none longer than train.seq_len + 1 = 97 tokens;" in out
    assert ("packed" if packing == "true" else "padded") in out
    losses = [record["loss"] for _, record in read_metrics_log(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 8 and losses[-1] < losses[0]
