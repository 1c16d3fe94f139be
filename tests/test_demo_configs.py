"""Every shipped config loads and validates, and the ViT demo learns: after a fifth of its steps
its held-out accuracy is far above chance (its full figures, 500 steps, are in docs/benchmarks.md
and the config's header, measured with `shardwise train --config configs/vit-digits.toml`)."""

from pathlib import Path

import pytest

from shardwise.config.loader import load_config
from shardwise.train.trainer import train

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


def test_there_are_demo_configs_for_each_family():
    names = {path.stem for path in CONFIGS}
    assert {"gpt2-demo", "bert-demo", "vit-digits", "t5-demo"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[path.stem for path in CONFIGS])
def test_config_validates(path, tmp_path):
    if "init_from" in path.read_text():  # the SFT demo starts from the demo run: a tiny stand-in for it
        base = tmp_path / "base"
        train(load_config(ROOT / "configs/debug.toml", overrides={
            "train.steps": 1, "train.sample_tokens": 0, "run.dir": str(base), "run.progress": False}))
        cfg = load_config(path, overrides={"train.init_from": str(base)})
        assert cfg.model.dim == 64  # model.* from the source
        return
    load_config(path)


def test_vit_digits_demo_learns(tmp_path):
    cfg = load_config(ROOT / "configs/vit-digits.toml",
                      overrides={"train.steps": 100, "train.eval_every": 0, "run.dir": str(tmp_path / "run"),
                                 "run.progress": False})
    result = train(cfg)
    assert result.losses[-1] < result.losses[0]
    assert result.val_accuracies[100] > 0.5  # chance is 0.1; the full demo reaches 0.93
