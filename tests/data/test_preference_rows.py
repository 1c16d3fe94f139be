"""tokenize_preference_rows: each preference row as (prompt + chosen, prompt + rejected) token sequences,
each with its completion mask (the reply and its end token carry the loss, the prompt does not)."""

import pytest

from chat_fixtures import encoder, word_tokenizer
from shardwise.data.chat_masks import ChatEncoder
from shardwise.data.example_rows import Row
from shardwise.data.preference import tokenize_preference_rows

TOKENIZER_TEXT = "What is two plus two? Four. Five. Be brief.\n"


def row(prompt, chosen, rejected, number=1):
    return Row({"prompt": prompt, "chosen": chosen, "rejected": rejected}, "prefs.jsonl", number)


def words(chat_encoder, encoded):
    tokenizer = chat_encoder.text_tokenizer
    return [("+" if loss else "") + tokenizer.id_to_token(int(t)) for t, loss in zip(encoded.ids, encoded.loss)]


def test_string_pairs_without_a_template_are_prompt_reply_end_of_text():
    plain = ChatEncoder(word_tokenizer(["<|endoftext|>"], TOKENIZER_TEXT), None, loss_on="completion")
    [pair] = tokenize_preference_rows([row("What is two plus two?", " Four.", " Five.")], plain)
    prompt = ["What", " ", "is", " ", "two", " ", "plus", " ", "two", "?"]
    assert words(plain, pair.chosen) == [*prompt, "+ ", "+Four", "+.", "+<|endoftext|>"]
    assert words(plain, pair.rejected) == [*prompt, "+ ", "+Five", "+.", "+<|endoftext|>"]
    assert pair.where == "prefs.jsonl row 1"


def test_string_pairs_with_a_template_are_a_user_turn_and_an_assistant_turn():
    chatml = encoder("chatml", loss_on="completion")
    [pair] = tokenize_preference_rows([row("What is two plus two?", "Four.", "Five.")], chatml)
    loss = [token for token in words(chatml, pair.chosen) if token.startswith("+")]
    assert loss == ["+Four", "+.", "+<|im_end|>"]
    assert words(chatml, pair.chosen)[:-4] == words(chatml, pair.rejected)[:-4]  # the same prompt


def test_message_rows_mask_only_the_reply_s_turns():
    llama3 = encoder("llama3", loss_on="completion")
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"},
              {"role": "assistant", "content": "Five."}, {"role": "user", "content": "What is two plus two?"}]
    pairs = tokenize_preference_rows([row(prompt, [{"role": "assistant", "content": "Four."}], "Five.", 1),
                                      row("What is two plus two?", "Four.", "Five.", 2)], llama3)
    chosen = [token for token in words(llama3, pairs[0].chosen) if token.startswith("+")]
    rejected = [token for token in words(llama3, pairs[0].rejected) if token.startswith("+")]
    assert chosen == ["+Four", "+.", "+<|eot_id|>"] and rejected == ["+Five", "+.", "+<|eot_id|>"]
    assert [pair.where for pair in pairs] == ["prefs.jsonl row 1", "prefs.jsonl row 2"]


def test_a_row_without_chosen_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"^data.source: prefs.jsonl row 4 has no 'chosen'"):
        tokenize_preference_rows([Row({"prompt": "p", "rejected": "r"}, "prefs.jsonl", 4)],
                                 encoder("chatml", loss_on="completion"))
