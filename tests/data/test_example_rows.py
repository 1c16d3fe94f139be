"""Rows of chat, prompt_completion and preference data: read from JSONL or Parquet, and a row a format
cannot use refused in one line naming the file, the row and the field."""

import json
from types import SimpleNamespace

import pytest

from shardwise.data.example_rows import RowSource, check_row, row_source, texts_of_rows

CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello."}]}


def data_cfg(source, data_format="chat"):
    return SimpleNamespace(source=str(source), format=data_format)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def rows_of(path, data_format="chat"):
    return list(row_source(data_cfg(path, data_format)).rows(data_cfg(path, data_format)))


def test_jsonl_and_parquet_rows_read_alike_each_named_by_file_and_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_jsonl(tmp_path / "chat.jsonl", [CHAT, CHAT])
    pq.write_table(pa.Table.from_pylist([CHAT, CHAT]), tmp_path / "chat.parquet")
    from_json, from_parquet = rows_of(jsonl), rows_of(tmp_path / "chat.parquet")
    assert [row.fields for row in from_json] == [row.fields for row in from_parquet] == [CHAT, CHAT]
    assert [row.where for row in from_parquet] == [f"{tmp_path / 'chat.parquet'} row {n}" for n in (1, 2)]


def test_a_directory_gives_its_row_files_in_order(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [CHAT])
    write_jsonl(tmp_path / "a.jsonl", [CHAT])
    (tmp_path / "notes.txt").write_text("not rows")
    source = row_source(data_cfg(tmp_path))
    assert [path.name for path in source.files] == ["a.jsonl", "b.jsonl"] and source.names[0].endswith("a.jsonl")


@pytest.mark.parametrize("source, data_format, message", [
    ("notes.txt", "chat", "notes.txt' is a .txt file, but data.format = 'chat' reads rows from .jsonl or .parquet"),
    ("stdlib", "chat", "data.source = 'stdlib' is invalid for data.format = 'chat': it holds prompt_completion rows"),
])
def test_a_source_that_holds_no_rows_of_the_format_is_refused(tmp_path, source, data_format, message):
    (tmp_path / "notes.txt").write_text("text")
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        row_source(data_cfg(tmp_path / source if source != "stdlib" else source, data_format))


def test_stdlib_names_the_demo_pairs_for_prompt_completion():
    source = row_source(data_cfg("stdlib", "prompt_completion"))
    assert isinstance(source, RowSource) and source.named == "stdlib" and source.names == ["stdlib"]


BAD_ROWS = [
    ("chat", {"text": "hi"}, "row 2 has no 'messages' (data.format = 'chat' reads rows with messages)"),
    ("chat", {"messages": "hi"}, "row 2: messages = 'hi' is not a list of messages"),
    ("chat", {"messages": [{"role": "bot", "content": "hi"}]}, "row 2: messages[0].role = 'bot' is not a role; use "
                                                               "system, user, assistant"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]},
     "row 2: messages[1] is an empty assistant turn (content = ' ')"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "row 2: messages[0].content is a int, not text"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}]}, "row 2 has no assistant turn, so nothing to learn"),
    ("prompt_completion", {"prompt": "def f():"}, "row 2 has no 'completion' (data.format = 'prompt_completion' "
                                                  "reads rows with prompt, completion)"),
    ("prompt_completion", {"prompt": "def f():", "completion": ""}, "row 2: completion = '' is empty"),
    ("preference", {"prompt": "p", "rejected": "r"}, "row 2 has no 'chosen' (data.format = 'preference' reads rows "
                                                     "with prompt, chosen, rejected)"),
    ("preference", {"prompt": "p", "chosen": [{"role": "user", "content": "c"}], "rejected": "r"},
     "row 2: chosen has no assistant turn"),
]


@pytest.mark.parametrize("data_format, bad, message", BAD_ROWS, ids=[m.split(" ", 3)[-1][:30] for _, _, m in BAD_ROWS])
def test_a_bad_row_is_one_line_naming_file_row_and_field(tmp_path, data_format, bad, message):
    good = {"chat": CHAT, "prompt_completion": {"prompt": "p", "completion": "c"},
            "preference": {"prompt": "p", "chosen": "c", "rejected": "r"}}[data_format]
    path = write_jsonl(tmp_path / "rows.jsonl", [good, bad])
    rows = rows_of(path, data_format)
    check_row(rows[0], data_format, needs_assistant=True)
    with pytest.raises(ValueError) as caught:
        check_row(rows[1], data_format, needs_assistant=True)
    assert str(caught.value).startswith(f"data.source: {path} {message}"), str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_line_that_is_not_a_json_object_is_named(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(CHAT) + "\n\n[1, 2]\n")
    with pytest.raises(ValueError, match=rf"data.source: {path} row 3 is a JSON list, not an object"):
        rows_of(path)


def test_a_tokenizer_trained_for_rows_learns_every_text_they_hold(tmp_path):
    rows = rows_of(write_jsonl(tmp_path / "rows.jsonl", [CHAT]))
    assert list(texts_of_rows(rows)) == ["Be brief.", "Hi", "Hello."]
