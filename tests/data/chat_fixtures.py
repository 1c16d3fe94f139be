"""Chat templates as their models ship them (tokenizer_config.json's chat_template), and tiny word-level
tokenizers holding each model's special tokens, for the tests of chat data."""

from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from shardwise.data.chat_masks import ChatEncoder, Conversation
from shardwise.data.chat_template import ChatTemplate

LLAMA3 = (  # Meta-Llama-3-8B-Instruct
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA3_SPECIALS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}

CHATML = (  # Qwen2-7B-Instruct
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}")
CHATML_SPECIALS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

MISTRAL = (  # Mistral-7B-Instruct-v0.2/v0.3 ([INST] and [/INST] are control tokens of the v0.3 tokenizer)
    "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n{%- else %}\n    {%- set loop_messages = messages %}\n{%- endif %}\n\n"
    "{{- bos_token }}\n{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}\n    {%- endif %}\n    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.first and system_message is defined %}\n"
    "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "        {%- else %}\n            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n        {{- ' ' + message['content'] + eos_token}}\n"
    "    {%- else %}\n        {{- raise_exception('Only user and assistant roles are supported, with the exception "
    "of an initial optional system message!') }}\n    {%- endif %}\n{%- endfor %}\n")
MISTRAL_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}

SPECIAL_TOKENS = {
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "chatml": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "mistral": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
}
WORDS = ("system user assistant You are a helpful assistant. Be brief. What is two plus two? Four. Five. And three? "
         "Six, as two times three. Thanks! Hi there.\nOK\n\n")
SPLIT = Regex(r"\s+|\w+|[^\w\s]")
"""Whitespace runs, words and punctuation marks: each its own token, so expected masks read as words."""


def word_tokenizer(specials: list[str], text: str = WORDS) -> Tokenizer:
    """A word-level tokenizer of `text`'s pieces, holding `specials` as special tokens (ids 0, 1, ...),
    loaded as shardwise loads any tokenizer (a special token's spelling inside text is text)."""
    pre_tokenizer = pre_tokenizers.Split(SPLIT, behavior="isolated")
    pieces = sorted({piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)})
    vocab = {token: index for index, token in enumerate([*specials, "[UNK]", *pieces])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.add_special_tokens(specials)
    tokenizer.encode_special_tokens = True  # as data/tokenizer.py's load_tokenizer leaves it
    return tokenizer


def encoder(name: str, loss_on: str = "assistant") -> ChatEncoder:
    source, specials = {"llama3": (LLAMA3, LLAMA3_SPECIALS), "chatml": (CHATML, CHATML_SPECIALS),
                        "mistral": (MISTRAL, MISTRAL_SPECIALS)}[name]
    return ChatEncoder(word_tokenizer(SPECIAL_TOKENS[name]), ChatTemplate(source, special_tokens=dict(specials)),
                       loss_on=loss_on)


def marked(chat_encoder: ChatEncoder, messages: list[dict], first_reply: int = 0) -> list[str]:
    """The conversation's tokens, each that carries the loss marked with a leading '+'."""
    [example] = chat_encoder.encode_conversations([Conversation(messages, first_reply, "chat.jsonl row 1")])
    tokenizer = chat_encoder.text_tokenizer
    return [("+" if loss else "") + tokenizer.id_to_token(int(token)) for token, loss in zip(example.ids, example.loss)]
