"""A reply is tokenized apart from the text before it, so training sees the tokens serving gives the model.

Tokenized whole, a byte-level BPE merges the generation prompt's last newline with a reply's leading
indentation into one token, which `serve` (the prompt rendered with the generation prompt, tokenized
alone, then the model's own tokens) never produces: a model trained so answered with end-of-text at once.
"""

from __future__ import annotations

from shardwise.data.chat_masks import ChatEncoder, Conversation
from shardwise.data.chat_template import ChatTemplate
from shardwise.data.tokenizer import EOS_TOKEN, train_tokenizer

TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|endoftext|>"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PROMPT = 'def double(x):\n    """Twice x."""\n'
REPLY = "    return 2 * x\n"


def test_the_tokens_before_a_reply_are_the_served_prompts_and_the_reply_its_own():
    corpus = [PROMPT + REPLY + "<|assistant|>\n    if x:\n        return x\n"] * 20
    tokenizer = train_tokenizer(corpus, vocab_size=300)
    template = ChatTemplate(TEMPLATE, special_tokens={"eos_token": EOS_TOKEN})
    encoder = ChatEncoder(tokenizer, template, loss_on="assistant")
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": REPLY}]
    whole = encoder.template_tokenizer.encode(template.render(messages, add_generation_prompt=False)).ids
    served = encoder.template_tokenizer.encode(template.render(messages[:1], add_generation_prompt=True)).ids
    reply = [*encoder.template_tokenizer.encode(REPLY).ids, encoder.eos_id]
    assert whole != served + reply  # the case this guards: the whole rendering merges across the boundary

    [encoded] = encoder.encode_conversations([Conversation(messages, first_reply=0, where="row 1")])
    assert encoded.ids.tolist() == served + reply
    assert encoded.loss.tolist() == [False] * len(served) + [True] * len(reply)
