"""The token cache is checked against the SHA-256 in its meta.json on first use in a run: a damaged
tokens.bin (or tokenizer.json) is rebuilt from the sources with one warning naming it, or refused
with one line when the cache cannot be rewritten."""

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

import shardwise.data.prepare as prepare
from shardwise.config.schema import DataConfig
from shardwise.data.prepare import VERIFIED_FILE, build_dataset

TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x = 0\n    y = 0\n", "for i in range(3):\n    print(i)\n"]


def data_config(tmp_path: Path) -> DataConfig:
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    for index, text in enumerate(TEXTS * 4):
        (corpus / f"doc{index:02d}.txt").write_text(text, encoding="utf-8")
    return DataConfig(source=str(corpus), vocab_size=300, max_corpus_bytes=0, cache_dir=str(tmp_path / "cache"))


def tree_digest(root: Path) -> dict[str, str | None]:
    return {p.relative_to(root).as_posix(): None if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def garble(path: Path) -> None:
    """Garbage of the same size: token ids far outside the vocabulary, as the issue's report had."""
    path.write_bytes(np.full(path.stat().st_size // 2, 65535, dtype=np.uint16).tobytes())


def not_called(*args, **kwargs):
    raise AssertionError("must not be called here")


def test_garbage_of_the_same_size_is_rebuilt_with_one_warning_and_the_same_tokens(tmp_path, monkeypatch, capsys):
    cfg = data_config(tmp_path)
    first = build_dataset(cfg)
    original = first.tokens.tokens.tolist()
    tokens_path = first.tokens.path / "tokens.bin"
    garble(tokens_path)
    capsys.readouterr()
    monkeypatch.setattr(prepare, "train_tokenizer", not_called)  # the entry's own tokenizer is reused
    rebuilt = build_dataset(cfg)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardwise: warning: ") and str(tokens_path) in lines[0]
    assert "SHA-256" in lines[0] and "rebuilding" in lines[0]
    assert rebuilt.tokens.path == first.tokens.path and rebuilt.tokens.tokens.tolist() == original
    assert [p.name for p in (tmp_path / "cache" / "datasets").iterdir()] == [first.tokens.path.name]  # none aside


def test_a_damaged_tokenizer_in_the_entry_is_rebuilt_too(tmp_path, capsys):
    cfg = data_config(tmp_path)
    first = build_dataset(cfg)
    original = first.tokens.tokens.tolist()
    (first.tokens.path / "tokenizer.json").write_text("{}", encoding="utf-8")
    capsys.readouterr()
    rebuilt = build_dataset(cfg)
    (line,) = capsys.readouterr().err.splitlines()
    assert "tokenizer.json" in line and line.startswith("shardwise: warning: ")
    assert rebuilt.tokens.tokens.tolist() == original  # a retrained tokenizer: training is deterministic


def test_without_rehash_an_unchanged_file_is_not_read_again_and_a_changed_one_is(tmp_path, monkeypatch, capsys):
    cfg = data_config(tmp_path)
    entry = build_dataset(cfg).tokens.path
    build_dataset(cfg)  # the run's first use: hashed, and what the file looked like recorded
    assert (entry / VERIFIED_FILE).is_file()
    real_sha256 = prepare.file_sha256
    with monkeypatch.context() as patch:
        patch.setattr(prepare, "file_sha256", lambda path: real_sha256(path) if path.name != "tokens.bin"
                      else not_called())
        build_dataset(cfg, verify=False)  # a launched rank: the launcher hashed it moments ago
    garble(entry / "tokens.bin")
    os.utime(entry / "tokens.bin", ns=(0, 0))  # an older mtime cannot hide a write: the ctime moved
    capsys.readouterr()
    build_dataset(cfg, verify=False)
    assert "tokens.bin" in capsys.readouterr().err


def test_damage_that_cannot_be_rebuilt_is_one_line_and_changes_nothing(tmp_path, monkeypatch):
    cfg = data_config(tmp_path)
    entry = build_dataset(cfg).tokens.path
    garble(entry / "tokens.bin")
    before = tree_digest(tmp_path)

    def read_only(source, target):
        raise PermissionError(13, "Permission denied", str(source))

    monkeypatch.setattr(prepare.os, "rename", read_only)
    with pytest.raises(ValueError) as err:
        build_dataset(cfg)
    message = str(err.value)
    assert "\n" not in message and str(entry / "tokens.bin") in message and "cannot be rebuilt" in message
    assert f"delete {entry}" in message
    assert tree_digest(tmp_path) == before


@pytest.mark.slow  # trains 1 step of the debug model through the command (~4 s)
def test_training_on_a_garbled_cache_warns_once_and_trains(tmp_path, capsys):
    from shardwise.cli.main import main

    root = Path(__file__).resolve().parents[2]
    argv = ["train", "--nproc", "1", "--config", str(root / "configs/debug.toml"), "--train.seq_len", "32",
            "--train.sample_tokens", "0", "--run.progress", "false", "--data.source", str(tmp_path / "corpus"),
            "--data.vocab_size", "300", "--data.max_corpus_bytes", "0", "--data.cache_dir", str(tmp_path / "cache"),
            "--train.global_batch_size", "2", "--train.micro_batch_size", "2", "--train.steps", "1",
            "--run.dir", str(tmp_path / "run")]
    (entry,) = build_dataset(data_config(tmp_path)).tokens.path.parent.iterdir()
    garble(entry / "tokens.bin")
    capsys.readouterr()
    assert main(argv) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shardwise:")]
    assert len(warnings) == 1 and str(entry / "tokens.bin") in warnings[0]


def test_a_new_or_rebuilt_entry_is_recorded_as_verified(tmp_path, monkeypatch):
    cfg = data_config(tmp_path)
    entry = build_dataset(cfg).tokens.path
    real_sha256 = prepare.file_sha256
    monkeypatch.setattr(prepare, "file_sha256", lambda path: real_sha256(path) if path.name != "tokens.bin"
                        else not_called())
    build_dataset(cfg, verify=False)  # the ranks after the launcher built the cache
    monkeypatch.undo()
    garble(entry / "tokens.bin")
    build_dataset(cfg)
    assert prepare.read_verified(entry) == prepare.file_identity(entry / "tokens.bin", prepare.read_meta(entry)["sha256"])
