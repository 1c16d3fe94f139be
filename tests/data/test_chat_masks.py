"""data.loss_on = "assistant": exactly each assistant turn's tokens carry the loss, its end-of-turn token
included, found by rendering and tokenizing (Llama 3, ChatML/Qwen and Mistral templates as they ship,
none with {% generation %} markers); a template whose turns cannot be located is one clear error."""

import numpy as np
import pytest

from chat_fixtures import (CHATML, SPECIAL_TOKENS, encoder, marked, word_tokenizer)
from shardwise.data.chat_masks import ChatEncoder, Conversation
from shardwise.data.chat_template import PLAIN_TEMPLATE, ChatTemplate
from shardwise.data.tokenizer import train_tokenizer

SYSTEM = {"role": "system", "content": "Be brief."}
ASK = {"role": "user", "content": "What is two plus two?"}
ANSWER = {"role": "assistant", "content": "Four."}
ASK_AGAIN = {"role": "user", "content": "And three?"}
ANSWER_AGAIN = {"role": "assistant", "content": "Six, as two times three."}
TWO_TURNS = [SYSTEM, ASK, ANSWER, ASK_AGAIN, ANSWER_AGAIN]

SECOND_REPLY = ["+Six", "+,", "+ ", "+as", "+ ", "+two", "+ ", "+times", "+ ", "+three", "+."]
"""'Six, as two times three.' token by token, each carrying the loss ('+')."""
QUESTION = ["What", " ", "is", " ", "two", " ", "plus", " ", "two", "?"]


def test_llama3_each_reply_and_its_eot_id_carry_the_loss():
    header = ["<|start_header_id|>", "assistant", "<|end_header_id|>", "\n\n"]
    assert marked(encoder("llama3"), TWO_TURNS) == [
        "<|begin_of_text|>", "<|start_header_id|>", "system", "<|end_header_id|>", "\n\n", "Be", " ", "brief", ".",
        "<|eot_id|>", "<|start_header_id|>", "user", "<|end_header_id|>", "\n\n", *QUESTION, "<|eot_id|>",
        *header, "+Four", "+.", "+<|eot_id|>",
        "<|start_header_id|>", "user", "<|end_header_id|>", "\n\n", "And", " ", "three", "?", "<|eot_id|>",
        *header, *SECOND_REPLY, "+<|eot_id|>"]


def test_chatml_each_reply_and_its_im_end_carry_the_loss_not_the_newline_after():
    # without a system turn, Qwen's template writes its default one
    assert marked(encoder("chatml"), TWO_TURNS[1:]) == [
        "<|im_start|>", "system", "\n", "You", " ", "are", " ", "a", " ", "helpful", " ", "assistant", ".", "<|im_end|>",
        "\n", "<|im_start|>", "user", "\n", *QUESTION, "<|im_end|>", "\n",
        "<|im_start|>", "assistant", "\n", "+Four", "+.", "+<|im_end|>", "\n",
        "<|im_start|>", "user", "\n", "And", " ", "three", "?", "<|im_end|>", "\n",
        "<|im_start|>", "assistant", "\n", *SECOND_REPLY, "+<|im_end|>", "\n"]


def test_mistral_each_reply_and_its_eos_carry_the_loss_the_system_turn_inside_the_first_inst():
    assert marked(encoder("mistral"), TWO_TURNS) == [
        "<s>", " ", "[INST]", " ", "Be", " ", "brief", ".", "\n\n", *QUESTION, " ", "[/INST]",
        " ", "+Four", "+.", "+</s>",
        " ", "[INST]", " ", "And", " ", "three", "?", " ", "[/INST]", " ", *SECOND_REPLY, "+</s>"]


def test_a_system_turn_carries_no_loss_and_a_reply_after_it_does():
    for name in ("llama3", "chatml", "mistral"):
        tokens = marked(encoder(name), [SYSTEM, ASK, ANSWER])
        loss = [token[1:] for token in tokens if token.startswith("+")]
        assert loss[:2] == ["Four", "."] and loss[2] in ("<|eot_id|>", "<|im_end|>", "</s>") and len(loss) == 3


def test_loss_on_all_puts_the_loss_on_every_token_but_the_first():
    tokens = marked(encoder("llama3", loss_on="all"), TWO_TURNS)
    assert tokens[0] == "<|begin_of_text|>" and all(token.startswith("+") for token in tokens[1:])


def test_only_the_replies_from_first_reply_on_carry_the_loss():
    """A preference row's prompt may hold assistant turns: only the chosen/rejected reply's carry the loss."""
    loss = [token for token in marked(encoder("chatml"), TWO_TURNS, first_reply=4) if token.startswith("+")]
    assert loss == [*SECOND_REPLY, "+<|im_end|>"]


def test_special_tokens_written_by_the_template_are_single_tokens():
    # load_tokenizer leaves encode_special_tokens on (text may spell them); the template's are special
    tokens = marked(encoder("chatml"), [ASK, ANSWER])
    assert tokens.count("<|im_start|>") == 3 and "<" not in tokens and "|" not in tokens


def refused(template: str, messages=None, **specials) -> str:
    chat_encoder = ChatEncoder(word_tokenizer(SPECIAL_TOKENS["chatml"]), ChatTemplate(
        template, special_tokens=specials, source_name="data.chat_template"), loss_on="assistant")
    with pytest.raises(ValueError) as caught:
        chat_encoder.encode_conversations([Conversation(messages or TWO_TURNS, 0, "chat.jsonl row 3")])
    message = str(caught.value)
    assert message.startswith("data.chat_template: the assistant turns of chat.jsonl row 3 cannot be located in what "
                              "data.chat_template renders (") and "\n" not in message, message
    return message


def test_a_template_that_rewrites_the_content_is_refused():
    assert "the template changes the content it writes" in refused(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}<|im_end|>\n{% endfor %}")


def test_a_template_that_leaves_the_replies_out_is_refused():
    assert "does not write an assistant turn's content" in refused(
        "{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>{{ m['content'] }}<|im_end|>{% endif %}"
        "{% endfor %}")


def test_a_template_that_writes_a_turn_by_what_follows_it_is_refused():
    # writes a reply's reasoning header only on the last turn, as some reasoning models' templates do
    assert "render differently without what follows" in refused(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if loop.last %}Thanks!\n{% endif %}{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}")


def test_a_template_without_generation_markers_and_one_with_them_give_the_same_mask():
    marked_template = CHATML.replace("message['content'] + '<|im_end|>' + '\\n'}}",
                                     "'' }}{% if message['role'] == 'assistant' %}{% generation %}"
                                     "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
                                     "{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}")
    assert "generation" in marked_template
    plain = encoder("chatml")
    with_markers = ChatEncoder(plain.text_tokenizer, ChatTemplate(marked_template), loss_on="assistant")
    assert marked(with_markers, TWO_TURNS[1:]) == marked(plain, TWO_TURNS[1:])


def test_the_mask_equals_transformers_assistant_mask_of_the_marked_template():
    """transformers' apply_chat_template(return_assistant_tokens_mask=True) reads {% generation %} markers:
    on a template whose markers hold each reply and its <|im_end|>, its mask is ours."""
    from transformers import PreTrainedTokenizerFast

    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}"
                "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
                "{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}")
    ours = ChatEncoder(word_tokenizer(SPECIAL_TOKENS["chatml"]), ChatTemplate(template), loss_on="assistant")
    [example] = ours.encode_conversations([Conversation(TWO_TURNS, 0, "chat.jsonl row 1")])
    theirs = PreTrainedTokenizerFast(tokenizer_object=ours.template_tokenizer, eos_token="<|im_end|>")
    reference = theirs.apply_chat_template(TWO_TURNS, chat_template=template, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
    assert example.ids.tolist() == reference["input_ids"]
    assert example.loss.astype(int).tolist() == reference["assistant_masks"]


def test_a_byte_level_tokenizer_masks_exactly_each_reply_and_end_of_text_with_the_plain_template():
    replies = ["héllo wörld — ünïcode ✓", "def f(x):\n    return x  # twice"]
    messages = [{"role": "user", "content": "say it"}, {"role": "assistant", "content": replies[0]},
                {"role": "user", "content": "and code"}, {"role": "assistant", "content": replies[1]}]
    tokenizer = train_tokenizer([r for r in replies] * 3 + ["<|user|>\nsay it\n<|assistant|>\n"], vocab_size=300)
    tokenizer.encode_special_tokens = True
    chat_encoder = ChatEncoder(tokenizer, None, loss_on="assistant")  # no template: the plain built-in one
    assert chat_encoder.chat_template.source == PLAIN_TEMPLATE
    [example] = chat_encoder.encode_conversations([Conversation(messages, 0, "chat.jsonl row 1")])
    starts = np.flatnonzero(np.diff(np.concatenate([[0], example.loss.astype(int)])) == 1)
    ends = np.flatnonzero(np.diff(np.concatenate([example.loss.astype(int), [0]])) == -1) + 1
    spans = [tokenizer.decode(example.ids[a:b].tolist(), skip_special_tokens=False) for a, b in zip(starts, ends)]
    assert spans == [reply + "<|endoftext|>" for reply in replies]


def test_a_row_the_template_refuses_is_named():
    with pytest.raises(ValueError, match=r"^data.source: chat.jsonl row 1: the chat template \(.*\) cannot render its "
                                         r"messages \(messages rejected by the chat template: After the optional "
                                         r"system message, conversation roles must alternate"):
        marked(encoder("mistral"), [ASK, ASK_AGAIN, ANSWER])
