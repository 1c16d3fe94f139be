"""Chat messages to prompt text for `shardwise serve`: the renderer training data uses too, in
shardwise/data/chat_template.py (its docstring says how a template is found and rendered)."""

from __future__ import annotations

from shardwise.data.chat_template import (PLAIN_STOP, PLAIN_TEMPLATE, TEMPLATE_FILES, ChatTemplate,
                                          load_chat_template, token_text)

__all__ = ["PLAIN_STOP", "PLAIN_TEMPLATE", "TEMPLATE_FILES", "ChatTemplate", "load_chat_template", "token_text"]
