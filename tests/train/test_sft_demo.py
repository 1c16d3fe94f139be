"""configs/sft-demo.toml, scaled down: LoRA on a short pretraining run, taught to write standard-library
function bodies from their signatures and docstrings, through the demo's chat template. Its full figures
(the demo model, 120 steps) are in docs/benchmarks.md, measured with the README's commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.config.loader import load_config
from shardwise.infer.chat import load_chat_template
from shardwise.train.trainer import train

ROOT = Path(__file__).resolve().parents[2]
SFT_DEMO = ROOT / "configs" / "sft-demo.toml"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A 40-step debug-model run: the base the demo's LoRA adapters are trained on."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    cfg = load_config(ROOT / "configs" / "debug.toml", overrides={
        "train.steps": 40, "train.seq_len": 128, "train.global_batch_size": 8, "train.micro_batch_size": 8,
        "train.lr": 1e-2, "train.sample_tokens": 0, "run.dir": str(run_dir), "run.progress": False})
    train(cfg)
    return run_dir


@pytest.mark.slow  # reads and tokenizes the standard library's ~6,000 functions (cached after the first run)
def test_the_sft_demo_beats_its_base_on_held_out_modules_and_keeps_its_template(pretrained, tmp_path):
    run_dir = tmp_path / "sft"
    cfg = load_config(SFT_DEMO, overrides={
        "train.init_from": str(pretrained), "train.steps": 24, "train.seq_len": 128, "train.global_batch_size": 8,
        "train.micro_batch_size": 8, "train.warmup_steps": 2, "train.eval_every": 0, "train.eval_batches": 2,
        "run.dir": str(run_dir), "run.progress": False})
    assert cfg.train.lora_rank and cfg.data.packing and cfg.model.dim == 64  # the demo's settings, the base's model
    result = train(cfg)
    assert result.val_losses[24] < result.val_losses[0]  # step 0: the base model, before any update
    assert sum(result.losses[-4:]) < sum(result.losses[:4])
    template = load_chat_template(run_dir)  # what `shardwise serve --run` renders with
    prompt = template.render([{"role": "user", "content": "def f(x):\n"}])
    assert prompt == "<|user|>\ndef f(x):\n<|endoftext|><|assistant|>\n"
