import pytest
from tokenizers import Tokenizer, models

from shardwise.data.tokenizer import EOS_TOKEN, eos_id, load_tokenizer, save_tokenizer, train_tokenizer

CORPUS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n", "héllo wörld 😀\n"] * 20


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=300)


@pytest.mark.parametrize("text", [
    "def f(x):\n\treturn x  # ok\r\n",
    "  leading and trailing spaces  ",
    "unicode: ünïcödé 中文 😀 \u200b",
    "\x00\x01\x7f bytes",
    f"a literal {EOS_TOKEN} inside text",
    "",
])
def test_any_text_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_eos_is_id_zero_and_literal_eos_is_not_a_boundary(tokenizer):
    assert eos_id(tokenizer) == 0 == tokenizer.token_to_id(EOS_TOKEN)
    assert 0 not in tokenizer.encode(f"x{EOS_TOKEN}y").ids


def test_vocabulary_holds_all_bytes_and_respects_size(tokenizer):
    assert 257 <= tokenizer.get_vocab_size() <= 300
    every_byte = bytes(range(256)).decode("latin-1")
    assert tokenizer.decode(tokenizer.encode(every_byte).ids) == every_byte


def test_save_and_load_give_the_same_encoding(tokenizer, tmp_path):
    path = tmp_path / "tokenizer.json"
    save_tokenizer(tokenizer, path)
    loaded = load_tokenizer(path)
    text = f"class Point: {EOS_TOKEN}"
    assert loaded.encode(text).ids == tokenizer.encode(text).ids


def test_load_missing_or_broken_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="data.tokenizer: '.*nope.json' does not exist; fix the path"):
        load_tokenizer(tmp_path / "nope.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="is not a tokenizers JSON file") as caught:
        load_tokenizer(broken)
    assert "\n" not in str(caught.value)


def test_too_small_vocabulary_is_rejected():
    with pytest.raises(ValueError, match="data.vocab_size = 100 is too small .* use at least 257"):
        train_tokenizer(CORPUS, vocab_size=100)


def test_tokenizer_without_eos_is_a_clear_error():
    with pytest.raises(ValueError, match="the tokenizer has no end-of-text token"):
        eos_id(Tokenizer(models.BPE()))
