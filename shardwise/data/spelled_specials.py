"""Special tokens written in text: a user types T5's sentinels (`<extra_id_0>`) and BERT's `<mask>`
where the model should fill something in. The trained tokenizer encodes a special token's spelling
inside text as ordinary text (`encode_special_tokens`: documents may contain such strings), so text
that means them is split at their spellings and the pieces encoded apart.

`EncoderInputTokenizer` is what an encoder-decoder (T5) is served with (`shardwise generate`,
`shardwise serve`, `shardwise predict`): its encode maps the sentinels' spellings to their ids and
ends the encoder input with the end-of-text token, as T5's training inputs end
(`data/objectives.py`, and HF's T5 tokenizer appends </s>); its decode keeps the sentinels, which
delimit the spans the decoder writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SENTINEL = re.compile(r"(<extra_id_\d+>)")


def encode_with_specials(tokenizer, text: str, pattern: re.Pattern, special_id) -> list[int]:
    """The ids of `text` with each spelling `pattern` matches as `special_id(spelling)`."""
    ids: list[int] = []
    for piece in pattern.split(text):
        if pattern.fullmatch(piece):
            ids.append(special_id(piece))
        elif piece:
            ids.extend(tokenizer.encode(piece).ids)
    return ids


def sentinel_id(tokenizer, spelling: str) -> int:
    token_id = tokenizer.token_to_id(spelling)
    if token_id is None:
        raise ValueError(f"the text names {spelling}, which the run's tokenizer does not have; use <extra_id_0> ...")
    return token_id


@dataclass
class Encoding:
    ids: list[int]


class EncoderInputTokenizer:
    """A trained tokenizer as an encoder-decoder's prompts need it (see the module docstring);
    everything else is the wrapped tokenizer's."""

    def __init__(self, tokenizer, eos_id: int):
        self.tokenizer, self.eos_id = tokenizer, eos_id

    def encode(self, text: str) -> Encoding:
        return Encoding(encode_with_specials(self.tokenizer, text, SENTINEL,
                                             lambda spelling: sentinel_id(self.tokenizer, spelling)) + [self.eos_id])

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)
