"""Preference rows (data.format = "preference") to token pairs for DPO: the function a DPO loader builds on.

A row holds `prompt`, `chosen` and `rejected` (data/example_rows.py checks them), each a string or a
list of messages, as TRL's preference datasets are:

    strings   prompt = the user's turn, chosen / rejected = the assistant's reply; rendered through the
              chat template as [user, assistant] when there is one (data.chat_template or the
              tokenizer's), else prompt + reply + end-of-text (data/chat_masks.py)
    messages  prompt = the turns so far, chosen / rejected = the reply's turns; rendered through the
              chat template (the plain built-in one when there is none). A string on one side and
              messages on the other: the string is the user's turn (prompt) or the assistant's (reply).

Each row gives two examples, prompt + chosen and prompt + rejected, and each its completion mask:
the reply's tokens and its end-of-turn (or end-of-text) token carry the loss, the prompt's do not.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.data.chat_masks import ChatEncoder, Encoded
from shardwise.data.example_rows import Row, check_row
from shardwise.data.row_encoding import encode_replies


@dataclass(frozen=True)
class PreferencePair:
    chosen: Encoded
    """prompt + chosen: token ids and the completion mask (`Encoded.loss`: token k is a target with loss)."""
    rejected: Encoded
    """prompt + rejected, the same way."""
    where: str
    """The row it came from (`<file> row <n>`)."""


def tokenize_preference_rows(rows: list[Row], encoder: ChatEncoder) -> list[PreferencePair]:
    """The (prompt + chosen, prompt + rejected) token pairs of `rows`, each with its completion mask,
    in row order. `encoder` (`chat_masks.build_encoder(data_cfg, tokenizer, tokenizer_path, "completion")`)
    holds the tokenizer and the chat template. A row without `chosen` (or another field), with an
    unknown role or an empty reply, or one the template cannot render, raises a one-line ValueError
    naming the row."""
    for row in rows:
        check_row(row, "preference", needs_assistant=True)
    chosen = encode_replies(rows, "chosen", encoder)
    rejected = encode_replies(rows, "rejected", encoder)
    return [PreferencePair(chosen=c, rejected=r, where=row.where) for c, r, row in zip(chosen, rejected, rows)]
