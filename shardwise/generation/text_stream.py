"""A sequence's output text as it grows, token by token, with stop strings.

Text is sent to the client only once it is final: a trailing partial UTF-8 character (the
tokenizer decodes it as U+FFFD) waits for its next byte, and a tail that could still become a
stop string waits until it either does (the output ends before the stop string, which is never
sent) or cannot any more.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""     # the final text so far (after a stop: up to the stop string)
        self.sent = 0      # characters of it already handed out
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        for stop in self.stop:
            at = text.find(stop, max(0, self.sent - len(stop)))
            if at != -1 and (not self.stopped or at < len(self.text)):
                self.text, self.stopped = text[:at], True
        if self.stopped:
            return self.flush()
        self.text = text
        ready = len(text) - self.held_back(text)
        delta = text[self.sent:ready] if ready > self.sent else ""
        self.sent = max(self.sent, ready)
        return delta

    def flush(self) -> str:
        """The rest of the final text (the sequence ended)."""
        delta = self.text[self.sent:]
        self.sent = len(self.text)
        return delta

    def held_back(self, text: str) -> int:
        """Characters at the end of `text` that may still change or become a stop string."""
        held = len(text) - len(text.rstrip(REPLACEMENT))
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:length]):
                    held = max(held, length)
                    break
        return held
