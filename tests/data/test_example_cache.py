"""Tokenized examples are cached like token files: keyed by the rows' files, the tokenizer, the chat
template and data.loss_on; train.seq_len, data.overlong and packing are applied after the cache."""

import json

import numpy as np
import pytest

from shardwise.config.loader import load_config
from shardwise.data import example_cache
from shardwise.data.example_data import prepare_examples

CHAT = [{"messages": [{"role": "user", "content": f"say {k}"}, {"role": "assistant", "content": f"{k} " * (k % 4 + 1)}]}
        for k in range(20)]


@pytest.fixture
def make_cfg(tmp_path):
    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in CHAT))

    def make(**overrides):
        values = {"model.preset": "debug", "data.source": str(rows), "data.format": "chat", "data.vocab_size": 300,
                  "data.cache_dir": str(tmp_path / "cache"), "train.seq_len": 32, "run.dir": str(tmp_path / "run")}
        return load_config(overrides=values | overrides)

    return make


def entries(cfg):
    return sorted(path.name for path in (example_cache.cache_root(cfg.data.cache_dir) / "examples").iterdir())


def test_a_second_run_reads_the_cache_and_a_new_seq_len_does_not_tokenize_again(make_cfg, monkeypatch):
    first = prepare_examples(make_cfg())
    monkeypatch.setattr(example_cache, "tokenize_rows", lambda *a: pytest.fail("tokenized again"))
    again = prepare_examples(make_cfg())
    assert np.array_equal(first.train[0].tokens, again.train[0].tokens)
    assert np.array_equal(first.train[0].loss, again.train[0].loss)
    shorter = prepare_examples(make_cfg(**{"train.seq_len": 8, "data.packing": True}))
    assert shorter.counts.overlong > 0 and len(entries(make_cfg())) == 1


def test_the_template_loss_on_and_the_rows_each_key_the_cache(make_cfg, tmp_path):
    base = prepare_examples(make_cfg())
    templated = prepare_examples(make_cfg(**{"data.chat_template": "{% for m in messages %}{{ m['content'] }}\n"
                                                                   "{% endfor %}"}))
    everything = prepare_examples(make_cfg(**{"data.loss_on": "all"}))
    assert len(entries(make_cfg())) == 3
    assert base.train[0].tokens.tolist() != templated.train[0].tokens.tolist()
    assert base.train[0].loss.sum() < everything.train[0].loss.sum()
    with open(tmp_path / "chat.jsonl", "a") as rows:
        rows.write(json.dumps(CHAT[0]) + "\n")
    assert prepare_examples(make_cfg()).counts.examples == 21 and len(entries(make_cfg())) == 4


def test_a_damaged_entry_is_tokenized_again(make_cfg, capsys):
    first = prepare_examples(make_cfg())
    [name] = entries(make_cfg())
    tokens = example_cache.cache_root(make_cfg().data.cache_dir) / "examples" / name / "tokens.npy"
    damaged = np.load(tokens)
    damaged[5] += 1
    np.save(tokens, damaged)
    capsys.readouterr()
    again = prepare_examples(make_cfg())
    err = capsys.readouterr().err
    assert err.startswith("shardwise: warning: ")
    assert "do not match meta.json (damaged); tokenizing the rows again" in err
    assert np.array_equal(first.train[0].tokens, again.train[0].tokens)


def test_a_bad_row_leaves_no_entry(make_cfg, tmp_path):
    with open(tmp_path / "chat.jsonl", "a") as rows:
        rows.write(json.dumps({"messages": [{"role": "robot", "content": "beep"}]}) + "\n")
    with pytest.raises(ValueError, match="row 21: messages\\[0\\].role = 'robot' is not a role"):
        prepare_examples(make_cfg())
    cache = example_cache.cache_root(make_cfg().data.cache_dir) / "examples"
    assert list(cache.iterdir()) == []


def test_the_set_names_the_template_its_rows_were_rendered_with(make_cfg):
    assert prepare_examples(make_cfg()).chat_template is None  # the plain built-in one
    inline = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    template = prepare_examples(make_cfg(**{"data.chat_template": inline})).chat_template
    assert template.source == inline and template.source_name == "data.chat_template"
    assert template.special_tokens == {"eos_token": "<|endoftext|>"}
