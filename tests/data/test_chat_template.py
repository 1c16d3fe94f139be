"""The one chat-template renderer (data/chat_template.py): what `serve` and training data render with,
and where a training run's template comes from (data.chat_template, else the tokenizer's, else none)."""

import json

import pytest

from shardwise.data.chat_template import (PLAIN_TEMPLATE, ChatTemplate, load_chat_template, save_chat_template,
                                          resolve_chat_template)

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
BRACKETS = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")


def test_add_generation_prompt_is_a_parameter_on_by_default():
    template = ChatTemplate(BRACKETS)
    assert template.render(MESSAGES) == "[user]hi[assistant]hello>"
    assert template.render(MESSAGES, add_generation_prompt=False) == "[user]hi[assistant]hello"


def test_the_plain_template_ends_replies_with_eos_only_where_training_passes_it():
    served = ChatTemplate(PLAIN_TEMPLATE, plain=True)  # serve passes no special tokens: as before
    assert served.render(MESSAGES) == "<|user|>\nhi\n<|assistant|>\nhello\n<|assistant|>\n"
    trained = ChatTemplate(PLAIN_TEMPLATE, special_tokens={"eos_token": "<|endoftext|>"})
    assert trained.render(MESSAGES, add_generation_prompt=False) == "<|user|>\nhi\n<|assistant|>\nhello<|endoftext|>\n"


def test_serve_imports_the_same_renderer():
    import shardwise.data.chat_template as data_chat
    import shardwise.infer.chat as infer_chat

    for name in ("ChatTemplate", "PLAIN_TEMPLATE", "PLAIN_STOP", "TEMPLATE_FILES", "load_chat_template", "token_text"):
        assert getattr(infer_chat, name) is getattr(data_chat, name)


def test_generation_markers_render_their_body():
    template = ChatTemplate("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}<{{ m['content'] }}>"
                            "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}")
    assert template.render(MESSAGES, add_generation_prompt=False) == "hi<hello>"


@pytest.fixture
def tokenizer_dir(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "tokenizer.json").write_text("{}")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ bos_token }}" + BRACKETS, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    return directory


def test_the_tokenizer_s_template_with_its_special_tokens(tokenizer_dir):
    template = resolve_chat_template("", tokenizer_dir / "tokenizer.json")
    assert template.render(MESSAGES) == "<s>[user]hi[assistant]hello>"
    assert template.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}


def test_a_chat_template_jinja_file_beside_the_tokenizer(tmp_path):
    (tmp_path / "chat_template.jinja").write_text(BRACKETS)
    assert resolve_chat_template("", tmp_path / "tokenizer.json").render(MESSAGES) == "[user]hi[assistant]hello>"
    assert resolve_chat_template("", None) is None
    assert resolve_chat_template("", tmp_path / "elsewhere" / "tokenizer.json") is None


def test_data_chat_template_as_text_or_a_file_wins_over_the_tokenizer_s(tokenizer_dir, tmp_path):
    inline = "{{ bos_token }}{% for m in messages %}{{ m['content'] }};{% endfor %}"
    assert resolve_chat_template(inline, tokenizer_dir / "tokenizer.json").render(MESSAGES) == "<s>hi;hello;"
    (tmp_path / "mine.jinja").write_text(inline)
    assert resolve_chat_template(str(tmp_path / "mine.jinja"), None).render(MESSAGES) == "hi;hello;"
    from_config = resolve_chat_template(str(tokenizer_dir / "tokenizer_config.json"), None)
    assert from_config.render(MESSAGES) == "[user]hi[assistant]hello>"  # its template; no special tokens given


@pytest.mark.parametrize("setting, message", [
    ("no/such/template.jinja", "data.chat_template = 'no/such/template.jinja' is invalid: it is neither jinja text "
                               "nor a file"),
    ("{% for m in messages %}", "data.chat_template: the chat template does not parse"),
])
def test_a_bad_data_chat_template_is_one_line_naming_it(setting, message, tmp_path):
    with pytest.raises(ValueError) as caught:
        resolve_chat_template(setting, None)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_a_tokenizer_config_without_a_template_named_by_data_chat_template_is_refused(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer_config.json has no chat_template"):
        resolve_chat_template(str(tmp_path / "tokenizer_config.json"), None)


def test_serve_still_falls_back_to_the_plain_template(tmp_path):
    template = load_chat_template(tmp_path)
    assert template.plain and template.default_stop == ("\n<|",)


def test_a_saved_template_is_what_serve_loads(tmp_path):
    template = ChatTemplate("{{ bos_token }}" + BRACKETS, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    save_chat_template(tmp_path, template)
    served = load_chat_template(tmp_path)
    assert not served.plain and served.render(MESSAGES) == "<s>[user]hi[assistant]hello>"
    assert served.special_tokens == template.special_tokens and list(tmp_path.iterdir()) == [
        tmp_path / "tokenizer_config.json"]
