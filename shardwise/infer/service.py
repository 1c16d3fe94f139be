"""What `shardwise serve` serves: the engine, its tokenizer and chat template, and the server's limits."""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.generation.engine import Engine
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
