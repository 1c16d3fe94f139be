"""Chat messages to text: one renderer for training data (data/chat_masks.py) and `shardwise serve`.

A model's template (`tokenizer_config.json`'s "chat_template", or `chat_template.jinja` beside it,
as transformers >= 4.43 writes it) is rendered with jinja2 the way transformers'
`apply_chat_template` does: a sandboxed environment, `trim_blocks` and `lstrip_blocks`,
`raise_exception`, `strftime_now`, the special tokens (bos_token, eos_token, ...) as variables,
`add_generation_prompt` (True: the text ends where the assistant's reply begins), and the
`{% generation %} ... {% endgeneration %}` markers of training templates, rendered as their body.

Without one, PLAIN_TEMPLATE: each message as `<|role|>` on its own line, then its content and a
newline, and `<|assistant|>` and a newline at the end when a reply is asked for; an assistant
message's content is followed by eos_token, which training passes (so a model learns to end its
turn with end-of-text) and serving leaves undefined (empty). A served reply is cut at the next
`<|` turn marker (PLAIN_STOP).

Where a training run's template comes from (`resolve_chat_template`): data.chat_template (jinja text
or a path to a .jinja or tokenizer_config.json file), else the tokenizer_config.json /
chat_template.jinja beside data.tokenizer (train.init_from's, filled in by the config loader).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

PLAIN_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
                  "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PLAIN_STOP = "\n<|"
TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplate:
    def __init__(self, source: str, *, special_tokens: dict[str, str] | None = None, plain: bool = False,
                 source_name: str = "tokenizer_config.json"):
        """`source_name`: where the template came from, named by the error of one that does not parse."""
        environment = template_environment()
        import jinja2

        try:
            self.template = environment.from_string(source)
        except jinja2.TemplateError as err:
            raise ValueError(f"{source_name}: the chat template does not parse ({err}); fix its chat_template") from None
        self.source = source
        self.source_name = source_name
        self.special_tokens = special_tokens or {}
        self.plain = plain
        self.default_stop = (PLAIN_STOP,) if plain else ()

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    **self.special_tokens)


def template_environment():
    """The sandboxed jinja2 environment transformers renders chat templates in."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError("data.chat_template: chat templates are rendered with jinja2, which is not installed; "
                         "install it (pip install jinja2, or 'shardwise[serve]')") from None

    def raise_exception(message):
        raise ValueError(f"messages rejected by the chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", generation_markers()])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    return env


def generation_markers():
    """The `{% generation %}` block of training templates (transformers' AssistantTracker), rendered
    as its body: assistant spans are found by rendering and tokenizing (data/chat_masks.py), so a
    template with markers and one without are read alike."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationMarkers(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationMarkers


def load_chat_template(run_dir: Path) -> ChatTemplate:
    """The template `shardwise serve` renders a run's chat requests with: the run's own, else the plain one."""
    source, special = template_of_dir(Path(run_dir))
    if source is None:
        return ChatTemplate(PLAIN_TEMPLATE, plain=True)
    return ChatTemplate(source, special_tokens=special)


def save_chat_template(directory: Path, template: ChatTemplate) -> None:
    """Writes `template` as tokenizer_config.json in `directory` (a run's), where `load_chat_template`
    (`shardwise serve`) and `convert --to-hf` find it."""
    config = {"chat_template": template.source, **template.special_tokens}
    path = Path(directory) / "tokenizer_config.json"
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
    staging.replace(path)


def template_of_dir(directory: Path) -> tuple[str | None, dict[str, str]]:
    """(the chat template of a tokenizer's directory or None, its special tokens by variable name)."""
    config = read_tokenizer_config(directory / "tokenizer_config.json")
    source = template_of_config(config)
    if source is None and (directory / "chat_template.jinja").is_file():
        source = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    special = {name: token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    return source, {name: value for name, value in special.items() if value is not None}


def read_tokenizer_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg}); fix or remove the file") from None
    return config if isinstance(config, dict) else {}


def template_of_config(config: dict) -> str | None:
    source = config.get("chat_template")
    if isinstance(source, list):  # several named templates: the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    return source


def token_text(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def resolve_chat_template(chat_template: str, tokenizer_path: Path | None) -> ChatTemplate | None:
    """A training run's template (see the module docstring); None when neither names one."""
    tokenizer_dir = tokenizer_path.parent if tokenizer_path is not None else None
    source, special = template_of_dir(tokenizer_dir) if tokenizer_dir is not None else (None, {})
    source_name = str(tokenizer_dir) if tokenizer_dir is not None else ""
    if chat_template.strip():
        source, source_name = source_of_setting(chat_template), "data.chat_template"
    if source is None:
        return None
    return ChatTemplate(source, special_tokens=special, source_name=source_name)


def source_of_setting(chat_template: str) -> str:
    """data.chat_template's jinja text: the value itself, or the file it names."""
    if "{%" in chat_template or "{{" in chat_template:
        return chat_template
    path = Path(chat_template).expanduser()
    if not path.is_file():
        raise ValueError(f"data.chat_template = {chat_template!r} is invalid: it is neither jinja text nor a file; "
                         "give the template's text or the path of a .jinja or tokenizer_config.json file")
    if path.suffix == ".json":
        source = template_of_config(read_tokenizer_config(path))
        if source is None:
            raise ValueError(f"data.chat_template = {chat_template!r} is invalid: {path} has no chat_template; "
                             "name a tokenizer_config.json that has one, or a .jinja file")
        return source
    return path.read_text(encoding="utf-8")
