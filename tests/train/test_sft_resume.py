"""A packed LoRA instruction-tuning run keeps what runs already had: a stopped run resumes to exactly
the uninterrupted run's losses (adapters, their AdamW state and the packed loader's position all come
back, after a stop and after a kill), and `shardwise report` draws it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardwise.cli.main import main
from shardwise.runtime import faults
from shardwise.config.loader import load_config
from shardwise.train.trainer import train

PAIRS = [{"prompt": f"def add_{k}(x):\n", "completion": f"    return x + {k}\n"} for k in range(48)]


def sft_config(tmp_path, run: str, **more):
    rows = tmp_path / "pairs.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in PAIRS))
    return load_config(overrides={
        "model.preset": "debug", "data.source": str(rows), "data.format": "prompt_completion",
        "data.packing": True, "data.vocab_size": 300, "data.cache_dir": str(tmp_path / "cache"),
        "train.lora_rank": 4, "train.seq_len": 64, "train.steps": 6, "train.global_batch_size": 4,
        "train.micro_batch_size": 2, "train.lr": 1e-2, "train.warmup_steps": 1, "train.sample_tokens": 0,
        "checkpoint.every": 1, "run.dir": str(tmp_path / run), "run.progress": False, **more})


def test_a_stopped_packed_lora_run_resumes_to_the_uninterrupted_losses_and_reports(tmp_path):
    whole = train(sft_config(tmp_path, "whole")).losses
    first = train(sft_config(tmp_path, "stopped", **{"train.stop_at_step": 3})).losses
    rest = train(sft_config(tmp_path, "stopped")).losses
    assert len(first) == 3 and len(rest) == 3
    assert first + rest == whole  # bit for bit: same adapters, optimizer state and packed rows
    assert main(["report", str(tmp_path / "stopped")]) == 0
    assert (tmp_path / "stopped" / "report.html").is_file()


@pytest.mark.slow  # a killed process
def test_a_killed_packed_lora_run_reruns_to_the_uninterrupted_losses(tmp_path):
    whole = train(sft_config(tmp_path, "whole")).losses
    cfg = sft_config(tmp_path, "killed")
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(cfg.to_dict()))
    command = [sys.executable, "-m", "shardwise.train", f"--config={config_file}", "--nproc=1"]
    killed = subprocess.run(command, env={**os.environ, faults.ENV: "kill@5:0"}, capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]  # SIGKILL as step 5 starts: step 4 is saved
    rest = train(sft_config(tmp_path, "killed")).losses
    assert rest == whole[4:]  # bit for bit
