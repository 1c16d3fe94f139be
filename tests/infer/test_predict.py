"""`shardwise predict` on trained encoder runs, and their round trip through `shardwise convert`:
a BERT run fills masks, a ViT run classifies its held-out images with the accuracy the trainer's
last evaluation measured on the same images; an exported ViT run is a transformers
ViTForImageClassification with the same logits, and importing it back gives the same answers."""

import pytest
import torch

from shardwise.cli.main import main
from shardwise.data.images import load_images, split_images
from shardwise.infer.load import load_run
from shardwise.train.trainer import train

VIT = {"model.preset": "vit-debug", "data.source": "digits", "train.seq_len": 17, "data.val_fraction": 0.1,
       "train.global_batch_size": 60, "train.micro_batch_size": 60, "train.eval_batches": 3, "train.steps": 30,
       "train.lr": 3e-3}
"""The held-out split is the last 180 images: 3 global batches of 60 evaluate all of them."""


def test_bert_run_fills_masks(tiny_config, capsys):
    cfg = tiny_config(**{"model.preset": "bert-debug"})
    train(cfg)
    assert main(["predict", "--run", cfg.run.dir, "--text", "def <mask>(self, <mask>):", "--top-k", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(" (")[0] for line in lines[-2:]] == ["mask 1", "mask 2"]
    assert all(line.count("%") == 3 for line in lines[-2:])


def test_t5_run_fills_spans_and_exports_to_transformers(tiny_config, tmp_path, capsys):
    """A T5 run trained on span corruption decodes spans greedily (`predict`); exported, it is a
    transformers T5ForConditionalGeneration with the same logits on a span-corrupted batch."""
    transformers = pytest.importorskip("transformers")
    from shardwise.data.training_data import build_run_loaders, prepare_data

    cfg = tiny_config(**{"model.preset": "t5-debug"})
    train(cfg)
    assert main(["predict", "--run", cfg.run.dir, "--text", "def <extra_id_0>(self):", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip()
    loader, _ = build_run_loaders(cfg, prepare_data(cfg))
    inputs, targets = loader.batch_of_step(0)[0]
    assert (targets[:, 0] == targets[0, 0]).all() and targets.shape[1] == 2 * 4 + 1  # <extra_id_0> first, 2 spans
    assert main(["convert", "--to-hf", cfg.run.dir, "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    _, ours, _ = load_run(cfg.run.dir)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=inputs, labels=targets).logits, ours(inputs, targets_BT=None,
                                   decoder_input_ids_BT=hf._shift_right(targets)), rtol=0, atol=1e-5)


def test_predict_refuses_text_without_a_mask_and_decoder_runs_and_generate_refuses_encoders(tiny_config, capsys):
    cfg = tiny_config(**{"model.preset": "bert-debug", "train.steps": 1})
    train(cfg)
    with pytest.raises(SystemExit):
        main(["predict", "--run", cfg.run.dir, "--text", "no mask here"])
    assert "has no <mask>: write <mask> where a token should be filled in" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # and the other way round: an encoder does not generate
        main(["generate", "--run", cfg.run.dir, "--prompt", "def "])
    assert "is a bert model, which does not generate text; `shardwise predict --run" in capsys.readouterr().err
    llama = tiny_config(**{"train.steps": 1, "run.dir": cfg.run.dir + "-llama"})
    train(llama)
    with pytest.raises(SystemExit):
        main(["predict", "--run", llama.run.dir])
    assert "which generates text: use `shardwise generate" in capsys.readouterr().err


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory, data_cache):
    from shardwise.config.loader import load_config

    run_dir = tmp_path_factory.mktemp("vit") / "run"
    overrides = {**VIT, "data.cache_dir": data_cache, "run.dir": str(run_dir), "run.progress": False}
    result = train(load_config(overrides=overrides))
    return run_dir, result


def test_vit_run_classifies_its_held_out_images_as_its_last_evaluation(vit_run, capsys):
    run_dir, result = vit_run
    assert main(["predict", "--run", str(run_dir), "--show", "5"]) == 0
    out = capsys.readouterr().out
    assert "digits images, held-out: 180 classified" in out
    accuracy = float(out.split("accuracy ")[1].split("%")[0]) / 100
    assert accuracy == pytest.approx(result.val_accuracies[30], abs=5e-4)  # printed to 0.1%


def test_vit_run_exports_to_transformers_and_back(vit_run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    run_dir, _ = vit_run
    assert main(["convert", "--to-hf", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    _, ours, _ = load_run(run_dir)
    images = load_images("digits")
    _, held_out = split_images(images, 0.1)
    batch = torch.from_numpy(held_out.images[:32])
    with torch.no_grad():
        torch.testing.assert_close(hf(pixel_values=batch).logits, ours(batch), rtol=0, atol=1e-5)
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    _, back, _ = load_run(tmp_path / "back")
    with torch.no_grad():
        torch.testing.assert_close(back(batch), ours(batch), rtol=0, atol=1e-5)
