"""data.document_mask: a text stream's windows get document ids (a new document after each end-of-text
token), the targets unchanged."""

import torch

from shardwise.config.loader import load_config
from shardwise.data.document_ids import document_ids_of
from shardwise.data.training_data import build_run_loaders, prepare_data

EOS = 0


def test_a_new_document_starts_after_each_end_of_text_token():
    inputs = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8], [EOS, 1, 2, 3, 4, 5, 6]])
    assert document_ids_of(inputs, EOS).tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]


def test_text_loader_windows_carry_document_ids_and_the_same_targets(tmp_path):
    (tmp_path / "docs").mkdir()
    for k in range(30):
        (tmp_path / "docs" / f"{k:02d}.txt").write_text(f"document {k} says " + "words " * (k % 5 + 1))
    values = {"model.preset": "debug", "data.source": str(tmp_path / "docs"), "data.cache_dir": str(tmp_path / "cache"),
              "data.vocab_size": 300, "train.seq_len": 16, "train.global_batch_size": 4, "train.micro_batch_size": 2,
              "run.dir": str(tmp_path / "run")}
    plain_cfg = load_config(overrides=values)
    masked_cfg = load_config(overrides=values | {"data.document_mask": True})
    data = prepare_data(plain_cfg)
    plain, _ = build_run_loaders(plain_cfg, data)
    masked, _ = build_run_loaders(masked_cfg, data)
    eos = data.tokens.meta["eos_id"]
    for step in range(3):
        for (inputs, targets), (m_inputs, m_targets, documents) in zip(plain.batch_of_step(step),
                                                                      masked.batch_of_step(step)):
            assert torch.equal(inputs, m_inputs) and torch.equal(targets, m_targets)
            assert documents.dtype == torch.int64 and documents.shape == inputs.shape
            assert (documents[:, 0] == 0).all()
            steps_up = documents[:, 1:] - documents[:, :-1]
            assert torch.equal(steps_up, (inputs[:, :-1] == eos).long())  # +1 right after each end-of-text
    assert masked.state_dict() == plain.state_dict()  # the same data position: a resume may switch it on
