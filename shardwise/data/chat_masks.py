"""Conversations and prompt/completion pairs to token ids and a loss mask, found by rendering and tokenizing.

A conversation is rendered whole with the chat template (data/chat_template.py) and tokenized once,
its special tokens' spellings read as the special tokens (as transformers' `apply_chat_template`
tokenizes). The loss mask of data.loss_on = "assistant" marks the tokens of each assistant turn's
reply: its content and the end-of-turn text the template writes after it (<|eot_id|>, <|im_end|>,
</s>, ...), up to the next turn's text, trailing whitespace left out. The span of reply i is found by
rendering again, not from `{% generation %}` markers:

    start  the conversation up to reply i, with a sentinel as the reply's content, rendered: where the
           sentinel lands (the text before it must be the whole rendering's beginning)
    end    the conversation through reply i rendered: its length (it must be the whole rendering's
           beginning), less trailing whitespace

and the reply's content must be what the template wrote at `start` (as given or stripped). A template
that breaks any of these (it rewrites or drops content, or renders a turn differently by what follows)
is refused with one error naming data.chat_template: never a silent all-ones mask. A token is in the
mask when its characters overlap the span.

With loss masks each reply is tokenized from its first character on, apart from the text before it
(`pieces_at_replies`), as TRL tokenizes a prompt and its completion: the tokens before a reply are then
exactly those `serve` gives the model (the conversation rendered up to the reply with the generation
prompt, tokenized alone), and the reply's first token is one the model will have to write. Tokenized
whole, a byte-level BPE merges the generation prompt's last newline with a reply's leading indentation
into one token ("\n    "), which serving never shows the model: a model trained so answered Python
signatures with end-of-text at once.

A prompt/completion pair without a chat template is the prompt's tokens (with the tokenizer's own
begin-of-text, if it adds one), then the completion's and end-of-text, tokenized apart: the
completion's mask is exact.

`loss[k]` says whether token k is a target that carries the loss (token 0 never is: nothing predicts it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Tokenizer

from shardwise.data.chat_template import PLAIN_TEMPLATE, ChatTemplate, resolve_chat_template
from shardwise.data.tokenizer import eos_id

SENTINEL = "\x00<<0>>\x00"
"""Stands in for a reply's content while its start is found: no template writes it on its own, and it has
no letters or outer whitespace, so `upper`, `trim` and the like leave it as it is (the content check then
names what they did)."""


@dataclass(frozen=True)
class Encoded:
    ids: np.ndarray
    """int64 [n], the example's tokens."""
    loss: np.ndarray
    """bool [n]: token k is a target that carries the loss."""


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    first_reply: int
    """Only assistant turns from this message on carry the loss (a preference row's prompt turns do not)."""
    where: str


class SpanNotFound(Exception):
    """Why an assistant turn's tokens cannot be located in the rendered conversation."""


class ChatEncoder:
    """Tokenizes conversations with the chat template and pairs with or without it (module docstring)."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None, *, loss_on: str):
        self.text_tokenizer = tokenizer  # a special token's spelling inside text stays text
        self.template_tokenizer = tokenizer_for_templates(tokenizer)
        self.eos_id = eos_id(tokenizer)
        eos_text = tokenizer.id_to_token(self.eos_id)
        self.template = template
        if template is not None and "eos_token" not in template.special_tokens:
            template.special_tokens["eos_token"] = eos_text
        self.chat_template = template or ChatTemplate(PLAIN_TEMPLATE, special_tokens={"eos_token": eos_text},
                                                      plain=True, source_name="the built-in plain template")
        self.loss_on = loss_on

    def encode_conversations(self, conversations: list[Conversation]) -> list[Encoded]:
        rendered = [self.rendered(conversation) for conversation in conversations]
        pieces = [pieces_at_replies(text, spans) for text, spans in rendered]
        encodings = iter(self.template_tokenizer.encode_batch([text[begin:end] for (text, _), cuts in
                                                                zip(rendered, pieces) for begin, end in cuts],
                                                               add_special_tokens=False))
        encoded = []
        for (_, spans), cuts in zip(rendered, pieces):
            ids, offsets = [], []
            for begin, _ in cuts:
                encoding = next(encodings)
                ids += encoding.ids
                offsets += [(first + begin, last + begin) for first, last in encoding.offsets]
            encoded.append(Encoded(np.asarray(ids, dtype=np.int64), self.loss_mask(offsets, spans)))
        return encoded

    def loss_mask(self, offsets, spans: list[tuple[int, int]]) -> np.ndarray:
        if self.loss_on == "all":
            return np.arange(len(offsets)) > 0
        bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        loss = np.zeros(len(bounds), dtype=bool)
        for start, end in spans:
            loss |= (bounds[:, 0] < end) & (bounds[:, 1] > start)
        return loss

    def rendered(self, conversation: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans of its replies that carry the loss."""
        import jinja2

        messages = conversation.messages
        try:
            text = self.chat_template.render(messages, add_generation_prompt=False)
            if self.loss_on == "all":
                return text, []
            return text, [self.reply_span(messages, index, text) for index, message in enumerate(messages)
                          if message["role"] == "assistant" and index >= conversation.first_reply]
        except SpanNotFound as reason:
            raise ValueError(
                f"data.chat_template: the assistant turns of {conversation.where} cannot be located in what "
                f"{self.chat_template.source_name} renders ({reason}), so data.loss_on = {self.loss_on!r} cannot "
                "mask them; use a template that writes each message's content as given, in order, or "
                'data.loss_on = "all"') from None
        except (ValueError, TypeError, jinja2.TemplateError) as err:  # its raise_exception, or a jinja error
            raise ValueError(f"data.source: {conversation.where}: the chat template "
                             f"({self.chat_template.source_name}) cannot render its messages ({err}); fix the row "
                             "or data.chat_template") from None

    def reply_span(self, messages: list[dict], index: int, text: str) -> tuple[int, int]:
        content = messages[index]["content"]
        stand_in = [*messages[:index], {**messages[index], "content": SENTINEL}]
        with_sentinel = self.chat_template.render(stand_in, add_generation_prompt=False)
        start = with_sentinel.find(SENTINEL)
        if start < 0:
            raise SpanNotFound(f"messages[{index}]: the template does not write an assistant turn's content")
        if with_sentinel[:start] != text[:start]:
            raise SpanNotFound(f"messages[{index}]: the turns before it render differently without what follows")
        through = self.chat_template.render(messages[:index + 1], add_generation_prompt=False)
        if not text.startswith(through):
            raise SpanNotFound(f"messages[{index}]: the turns through it render differently without what follows")
        written = text[start:len(through)]
        content = content if written.startswith(content) else content.strip()
        if not written.startswith(content):
            raise SpanNotFound(f"messages[{index}]: the template changes the content it writes")
        return start, start + max(len(written.rstrip()), len(content))

    def encode_pair(self, prompt: str, completion: str) -> Encoded:
        """prompt + completion + end-of-text without a template (module docstring)."""
        prompt_ids = self.text_tokenizer.encode(prompt, add_special_tokens=True).ids
        completion_ids = [*self.text_tokenizer.encode(completion, add_special_tokens=False).ids, self.eos_id]
        ids = np.asarray([*prompt_ids, *completion_ids], dtype=np.int64)
        if self.loss_on == "all":
            return Encoded(ids, np.arange(len(ids)) > 0)
        return Encoded(ids, np.arange(len(ids)) >= max(len(prompt_ids), 1))


def pieces_at_replies(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`text` cut where each reply starts, as (begin, end) character ranges, each tokenized apart."""
    cuts = sorted({0, *(start for start, _ in spans), len(text)})
    return [(begin, end) for begin, end in zip(cuts, cuts[1:])]


def tokenizer_for_templates(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of `tokenizer` that reads special tokens' spellings as the special tokens, as rendered chat
    text needs (`<|im_start|>` is one token); load_tokenizer's reads them as text (documents may spell them)."""
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.encode_special_tokens = False
    return copy


def build_encoder(data_cfg, tokenizer: Tokenizer, tokenizer_path, loss_on: str) -> ChatEncoder:
    """The encoder of a run's data: data.chat_template, else the one beside the tokenizer, else none (the
    plain template for conversations, concatenation for pairs)."""
    return ChatEncoder(tokenizer, resolve_chat_template(data_cfg.chat_template, tokenizer_path), loss_on=loss_on)
