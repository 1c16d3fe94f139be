"""What `shardwise serve` serves: the engine, its tokenizer and chat template, and the server's limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardwise.generation.engine import Engine
from shardwise.data.chat_masks import tokenizer_for_templates
from shardwise.infer.chat import ChatTemplate


@dataclass
class Service:
    engine: Engine
    tokenizer: object
    model_name: str
    chat_template: ChatTemplate
    api_key: str | None = None
    max_queue: int = 256
    max_body_bytes: int = 1 << 20
    chat_tokenizer: object = field(init=False)
    """The tokenizer of rendered chat text: the template's special tokens (<|im_start|>, <|endoftext|>)
    read as those tokens, as training read them (data/chat_masks.py), not as their spelling."""

    def __post_init__(self):
        self.chat_tokenizer = tokenizer_for_templates(self.tokenizer)
