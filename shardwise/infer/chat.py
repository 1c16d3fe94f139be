"""Chat messages to prompt text: the run's own chat template, else a plain documented one.

A run imported from Hugging Face keeps the model's template (`tokenizer_config.json`'s
"chat_template", or `chat_template.jinja` beside it, as transformers >= 4.43 writes it);
it is rendered with jinja2 the way transformers' `apply_chat_template` does: a sandboxed
environment, `trim_blocks` and `lstrip_blocks`, `raise_exception`, the special tokens, and
`add_generation_prompt=True` so the text ends where the assistant's reply begins.

Without one, PLAIN_TEMPLATE: each message as `<|role|>` on its own line, then its content
and a newline, and `<|assistant|>` and a newline at the end; the reply is cut at the next
`<|` turn marker (PLAIN_STOP).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

PLAIN_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
                  "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PLAIN_STOP = "\n<|"
TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja")


class ChatTemplate:
    def __init__(self, source: str, *, special_tokens: dict[str, str] | None = None, plain: bool = False):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"messages rejected by the chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as err:
            raise ValueError(f"the run's chat template does not parse ({err}); fix chat_template in "
                             "tokenizer_config.json") from None
        self.special_tokens = special_tokens or {}
        self.plain = plain
        self.default_stop = (PLAIN_STOP,) if plain else ()

    def render(self, messages: list[dict]) -> str:
        return self.template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)


def load_chat_template(run_dir: Path) -> ChatTemplate:
    run_dir = Path(run_dir)
    config = {}
    if (run_dir / "tokenizer_config.json").is_file():
        config = json.loads((run_dir / "tokenizer_config.json").read_text())
    source = config.get("chat_template")
    if isinstance(source, list):  # several named templates: the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if source is None and (run_dir / "chat_template.jinja").is_file():
        source = (run_dir / "chat_template.jinja").read_text()
    special = {name: token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    if source is None:
        return ChatTemplate(PLAIN_TEMPLATE, plain=True)
    return ChatTemplate(source, special_tokens={k: v for k, v in special.items() if v is not None})


def token_text(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token
