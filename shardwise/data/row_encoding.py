"""Checked rows to token ids and loss masks, by data.format (data/chat_masks.py does the tokenizing):

    chat               the row's messages, rendered with the chat template (the plain one if none)
    prompt_completion  [user: prompt, assistant: completion] through the chat template when there is
                       one (data.chat_template or the tokenizer's), else prompt + completion + end-of-text
    preference         data/preference.py: each row's prompt + chosen and prompt + rejected
"""

from __future__ import annotations

from shardwise.data.chat_masks import ChatEncoder, Conversation, Encoded
from shardwise.data.example_rows import Row, check_row

ENCODE_BATCH_ROWS = 256
"""Rows rendered and tokenized together: `encode_batch` shares them over the tokenizer's threads."""


def tokenize_rows(rows: list[Row], data_format: str, encoder: ChatEncoder) -> list[Encoded]:
    """One example per row of a chat or prompt_completion source, in row order (rows checked first)."""
    for row in rows:
        check_row(row, data_format, needs_assistant=encoder.loss_on != "all")
    if data_format == "chat":
        return encode_in_batches(encoder, [Conversation(row.fields["messages"], 0, row.where) for row in rows])
    return encode_replies(rows, "completion", encoder)


def encode_in_batches(encoder: ChatEncoder, conversations: list[Conversation]) -> list[Encoded]:
    encoded: list[Encoded] = []
    for start in range(0, len(conversations), ENCODE_BATCH_ROWS):
        encoded += encoder.encode_conversations(conversations[start:start + ENCODE_BATCH_ROWS])
    return encoded


def encode_replies(rows: list[Row], reply_field: str, encoder: ChatEncoder) -> list[Encoded]:
    """Each row's `prompt` followed by its `reply_field`, only the reply carrying the loss: text pairs
    without a chat template concatenated, everything else rendered as a conversation."""
    as_text = [encoder.template is None and isinstance(row.fields["prompt"], str)
               and isinstance(row.fields[reply_field], str) for row in rows]
    rendered = iter(encode_in_batches(encoder, [conversation_of(row, reply_field)
                                                for row, text in zip(rows, as_text) if not text]))
    return [encoder.encode_pair(row.fields["prompt"], row.fields[reply_field]) if text else next(rendered)
            for row, text in zip(rows, as_text)]


def conversation_of(row: Row, reply_field: str) -> Conversation:
    """The prompt's turns (a string: one user turn) then the reply's (a string: one assistant turn);
    only the reply's assistant turns carry the loss."""
    prompt, reply = row.fields["prompt"], row.fields[reply_field]
    prompt_turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    reply_turns = [{"role": "assistant", "content": reply}] if isinstance(reply, str) else list(reply)
    where = row.where if reply_field == "completion" else f"{row.where} ({reply_field})"
    return Conversation([*prompt_turns, *reply_turns], first_reply=len(prompt_turns), where=where)
