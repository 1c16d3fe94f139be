"""Byte-level BPE tokenizer, trained with HF `tokenizers` (the Rust library: seconds, not minutes).

Byte-level means the 256 byte values are all in the vocabulary, so any string encodes
without an unknown token and `decode(encode(s)) == s`. The end-of-text marker is a special
token with id 0; `encode_special_tokens` is switched on so that a literal "<|endoftext|>"
inside a document is encoded as ordinary text: only `prepare` puts real document
boundaries into the token stream.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
# End-of-text spellings of common pretrained tokenizers, tried when EOS_TOKEN is absent.
OTHER_EOS_TOKENS = ("<|end_of_text|>", "</s>", "<eos>")
MIN_VOCAB_SIZE = 257  # 256 byte tokens + EOS


def train_tokenizer(documents: Iterable[str], vocab_size: int, special_tokens: tuple[str, ...] = ()) -> Tokenizer:
    """A byte-level BPE with `vocab_size` entries at most (fewer if the corpus runs out of merges);
    end-of-text is id 0, the `special_tokens` (a masked LM's mask) ids 1, 2, ..."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"data.vocab_size = {vocab_size} is too small for a byte-level tokenizer; use at least {MIN_VOCAB_SIZE}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, *special_tokens],  # EOS first, so it gets id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    tokenizer.encode_special_tokens = True
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A tokenizer.json written by `save_tokenizer` or any HF `tokenizers` tokenizer file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"data.tokenizer: '{path}' does not exist; fix the path or leave it empty to train one")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # the Rust side raises plain Exception with a multi-line message
        reason = " ".join(str(err).split())
        raise ValueError(
            f"data.tokenizer: '{path}' is not a tokenizers JSON file ({reason}); point it at a tokenizer.json"
        ) from None
    # Not stored in tokenizer.json, so it is set again on every load.
    tokenizer.encode_special_tokens = True
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    """Writes the compact JSON whose hash is `tokenizer_sha256`, so the file and the hash agree."""
    Path(path).write_text(tokenizer.to_str(), encoding="utf-8")


def tokenizer_sha256(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


def eos_id(tokenizer: Tokenizer) -> int:
    """Id of the end-of-text token appended after every document."""
    for token in (EOS_TOKEN, *OTHER_EOS_TOKENS):
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    raise ValueError(
        f"data.tokenizer: the tokenizer has no end-of-text token ({', '.join((EOS_TOKEN, *OTHER_EOS_TOKENS))}); "
        f"add {EOS_TOKEN!r} as a special token or leave data.tokenizer empty to train one"
    )
