import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from shardwise.config.schema import DataConfig
from shardwise.data import prepare
from shardwise.data.prepare import build_dataset, open_token_file, prepare_tokens
from shardwise.data.tokenizer import save_tokenizer, train_tokenizer

DOCUMENTS = ["def add(a, b):\n    return a + b\n", "héllo wörld\n", "x = [i * i for i in range(10)]\n"]


class NumberTokenizer:
    """Stand-in tokenizer: a document is space-separated token ids; EOS is id 0."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def token_to_id(self, token):
        return 0

    def encode_batch(self, texts):
        return [SimpleNamespace(ids=[int(word) for word in text.split()]) for text in texts]

    def to_str(self) -> str:
        return json.dumps({"vocab_size": self.vocab_size})


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(DOCUMENTS * 5, vocab_size=300)


def test_prepare_writes_tokens_and_meta_and_nothing_else(tokenizer, tmp_path):
    token_file = prepare_tokens(DOCUMENTS + [""], tokenizer, tmp_path / "out", sources="three snippets")
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["meta.json", "tokens.bin"]
    expected = []
    for text in DOCUMENTS:
        expected += tokenizer.encode(text).ids + [0]
    assert token_file.tokens.tolist() == expected
    assert token_file.tokens.dtype == np.uint16
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta == token_file.meta
    assert meta["num_tokens"] == len(expected) and meta["num_documents"] == 3
    assert meta["max_token_id"] == max(expected) and meta["vocab_size"] == tokenizer.get_vocab_size()
    assert meta["dtype"] == "uint16" and meta["sources"] == "three snippets" and meta["format_version"] == 1
    assert meta["sha256"] == prepare.file_sha256(tmp_path / "out" / "tokens.bin")
    assert len(meta["tokenizer_sha256"]) == 64
    assert tokenizer.decode(token_file.tokens[: expected.index(0)].tolist()) == DOCUMENTS[0]


def test_open_checks_size_and_checksum(tokenizer, tmp_path):
    prepare_tokens(DOCUMENTS, tokenizer, tmp_path)
    assert open_token_file(tmp_path, verify=True).num_tokens > 0
    tokens_path = tmp_path / "tokens.bin"
    data = bytearray(tokens_path.read_bytes())
    data[0] ^= 0xFF
    tokens_path.write_bytes(bytes(data))
    open_token_file(tmp_path)  # same size: only verify notices
    with pytest.raises(ValueError, match="sha256 does not match meta.json .* prepare the data again"):
        open_token_file(tmp_path, verify=True)
    tokens_path.write_bytes(bytes(data[:-2]))
    with pytest.raises(ValueError, match=r"tokens.bin: \d+ bytes but meta.json says \d+ uint16 tokens"):
        open_token_file(tmp_path)


def test_open_without_meta_is_not_a_token_directory(tmp_path):
    with pytest.raises(ValueError, match="no meta.json, so it is not a complete token directory"):
        open_token_file(tmp_path)


def test_empty_corpus_is_an_error_and_leaves_nothing(tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"data.source: the corpus is empty \(.*\); point data.source at files"):
        prepare_tokens(["", ""], tokenizer, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_token_id_outside_the_vocabulary_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"token id 300 is outside the tokenizer's own vocabulary \(300\)"):
        prepare_tokens(["5 300 7"], NumberTokenizer(300), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_large_vocabulary_uses_uint32(tmp_path):
    token_file = prepare_tokens(["70000 3"], NumberTokenizer(70_001), tmp_path)
    assert token_file.tokens.dtype == np.uint32 and token_file.tokens.tolist() == [70000, 3, 0]


def corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    for index, text in enumerate(DOCUMENTS * 4):
        (root / f"doc{index:02d}.txt").write_text(text, encoding="utf-8")
    return root


def data_config(tmp_path: Path, **overrides) -> DataConfig:
    settings = dict(source=str(corpus(tmp_path)), vocab_size=300, max_corpus_bytes=0, cache_dir=str(tmp_path / "cache"))
    return DataConfig(**(settings | overrides))


def fail(*args, **kwargs):
    raise AssertionError("the cache should have been used")


def test_build_dataset_then_reuses_the_cache(tmp_path, monkeypatch):
    cfg = data_config(tmp_path)
    first = build_dataset(cfg)
    entries = list((tmp_path / "cache" / "datasets").iterdir())
    assert entries == [first.tokens.path]  # no staging directory left behind
    assert first.tokenizer_path == first.tokens.path / "tokenizer.json"
    text = first.tokenizer.decode(first.tokens.tokens.tolist(), skip_special_tokens=True)
    assert text == "".join(DOCUMENTS * 4)
    assert first.tokens.meta["tokenizer_sha256"] == prepare.file_sha256(first.tokenizer_path)

    monkeypatch.setattr(prepare, "train_tokenizer", fail)
    monkeypatch.setattr(prepare, "prepare_tokens", fail)
    second = build_dataset(cfg)
    assert second.tokens.path == first.tokens.path
    assert second.tokens.tokens.tolist() == first.tokens.tokens.tolist()


def test_editing_a_source_file_makes_a_new_entry(tmp_path):
    cfg = data_config(tmp_path)
    first = build_dataset(cfg)
    (Path(cfg.source) / "doc00.txt").write_text("changed text that is longer\n", encoding="utf-8")
    second = build_dataset(cfg)
    assert second.tokens.path != first.tokens.path


def test_given_tokenizer_is_used_not_trained(tmp_path, monkeypatch, tokenizer):
    path = tmp_path / "given.json"
    save_tokenizer(tokenizer, path)
    monkeypatch.setattr(prepare, "train_tokenizer", fail)
    dataset = build_dataset(data_config(tmp_path, tokenizer=str(path)))
    assert dataset.tokenizer.to_str() == tokenizer.to_str()
    assert dataset.tokens.tokens[:5].tolist() == tokenizer.encode(DOCUMENTS[0]).ids[:5]


def test_cache_dir_defaults_to_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path / "env_cache"))
    dataset = build_dataset(data_config(tmp_path, cache_dir=""))
    assert dataset.tokens.path.parent == tmp_path / "env_cache" / "datasets"


def test_a_crash_leaves_no_cache_entry(tmp_path, monkeypatch):
    cfg = data_config(tmp_path)
    monkeypatch.setattr(prepare, "prepare_tokens", fail)
    with pytest.raises(AssertionError):
        build_dataset(cfg)
    assert list((tmp_path / "cache" / "datasets").iterdir()) == []
    monkeypatch.undo()
    assert build_dataset(cfg).tokens.num_tokens > 0


def test_empty_source_files_are_an_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    cfg = DataConfig(source=str(tmp_path / "empty.txt"), vocab_size=300, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="data.source: the corpus is empty"):
        build_dataset(cfg)
    assert list((tmp_path / "cache" / "datasets").iterdir()) == []
