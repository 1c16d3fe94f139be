"""Rows of chat, instruction and preference data, read and checked: what data.format promises.

    chat               {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
    prompt_completion  {"prompt": "...", "completion": "..."}
    preference         {"prompt": ..., "chosen": ..., "rejected": ...}: strings, or lists of messages
                       (the prompt's turns, then the chosen or rejected reply's), as TRL reads them

Rows come from .jsonl files (one JSON object a line) or .parquet files, or from a named source in
ROW_SOURCES ("stdlib": the demo's instruction pairs). Each row keeps where it came from
(`<file> row <n>`: a JSONL file's line number, a Parquet file's row, 1-based) so a bad row is named
by the one-line error that stops the run before any work.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from shardwise.data.sources import STDLIB, resolve_source_files

ROLES = ("system", "user", "assistant")
ROW_SUFFIXES = (".jsonl", ".parquet")
REQUIRED_FIELDS = {"chat": ("messages",), "prompt_completion": ("prompt", "completion"),
                   "preference": ("prompt", "chosen", "rejected")}


def stdlib_rows(data_cfg) -> list[dict]:
    """The demo's prompt/completion pairs (data/stdlib_functions.py: a documented standard-library
    function's signature and docstring -> its body, module by module)."""
    from shardwise.data.stdlib_functions import stdlib_function_rows

    return stdlib_function_rows()


ROW_SOURCES: dict[str, Callable] = {STDLIB: stdlib_rows}
"""Named row sources: data.source -> a function of the data config returning the rows (dicts) in order.
Which formats each serves is ROW_SOURCE_FORMATS'."""
ROW_SOURCE_FORMATS = {STDLIB: ("prompt_completion",)}


@dataclass(frozen=True)
class Row:
    fields: dict
    source: str
    """The file (or named source) it came from."""
    number: int
    """Its row in `source`, from 1 (a JSONL file's line number)."""
    source_index: int = 0
    """The index of `source` among the sources read (RowSource.names)."""

    @property
    def where(self) -> str:
        """`<file> row <n>`, named by the errors about this row."""
        return f"{self.source} row {self.number}"


@dataclass(frozen=True)
class RowSource:
    """What data.source names for a row format: files, or one of ROW_SOURCES."""

    files: list[Path]
    """The files read (a named source: the files it reads, for the cache key)."""
    named: str = ""

    @property
    def names(self) -> list[str]:
        return [self.named] if self.named else [str(path) for path in self.files]

    def rows(self, data_cfg) -> Iterator[Row]:
        if self.named:
            for number, fields in enumerate(ROW_SOURCES[self.named](data_cfg), start=1):
                yield Row(fields, self.named, number)
            return
        for index, path in enumerate(self.files):
            yield from rows_of_file(path, index)


def row_source(data_cfg) -> RowSource:
    """data.source as rows of data.format; a source that cannot hold them is refused here."""
    source = data_cfg.source.strip()
    if source in ROW_SOURCES:
        if data_cfg.format not in ROW_SOURCE_FORMATS[source]:
            raise ValueError(f"data.source = {source!r} is invalid for data.format = {data_cfg.format!r}: it holds "
                             f"{' and '.join(ROW_SOURCE_FORMATS[source])} rows; point data.source at .jsonl or "
                             ".parquet files of the format")
        return RowSource(files=resolve_source_files(source), named=source)
    files = resolve_source_files(source)
    given = {Path(part.strip()).expanduser().resolve() for part in source.split(",") if part.strip()}
    wrong = [path for path in files if path.suffix not in ROW_SUFFIXES and path in given]
    if wrong:
        raise ValueError(f"data.source: '{wrong[0]}' is a {wrong[0].suffix} file, but data.format = "
                         f"{data_cfg.format!r} reads rows from .jsonl or .parquet files; convert it, or use "
                         'data.format = "text"')
    files = [path for path in files if path.suffix in ROW_SUFFIXES]  # a directory's other files are not rows
    if not files:
        raise ValueError(f"data.source: no .jsonl or .parquet files in {source!r}, and data.format = "
                         f"{data_cfg.format!r} reads rows from them; point data.source at such files")
    return RowSource(files=files)


def rows_of_file(path: Path, source_index: int = 0) -> Iterator[Row]:
    if path.suffix == ".parquet":
        for number, fields in enumerate(parquet_rows(path), start=1):
            yield Row(check_object(fields, f"{path} row {number}"), str(path), number, source_index)
        return
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                fields = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"data.source: {path} row {number} is not valid JSON ({err.msg}); write one JSON "
                                 "object per line") from None
            yield Row(check_object(fields, f"{path} row {number}"), str(path), number, source_index)


def check_object(fields, where: str) -> dict:
    if not isinstance(fields, dict):
        raise ValueError(f"data.source: {where} is a JSON {type(fields).__name__}, not an object; write one "
                         "object per row")
    return fields


def parquet_rows(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq  # optional: only parquet sources need it
    except ImportError:
        raise ValueError(f"data.source: {path} is a .parquet file but pyarrow is not installed; install it "
                         "(pip install 'shardwise[parquet]') or convert the file to .jsonl") from None
    return pq.read_table(path).to_pylist()


# ---- what each format's row must hold ----

def check_row(row: Row, data_format: str, *, needs_assistant: bool) -> None:
    """Refuses a row data.format cannot use, in one line naming the file, the row and the field.
    `needs_assistant`: a chat row must have an assistant turn (data.loss_on = "assistant")."""
    for field in REQUIRED_FIELDS[data_format]:
        if row.fields.get(field) is None:
            raise ValueError(f"data.source: {row.where} has no {field!r} (data.format = {data_format!r} reads "
                             f"rows with {', '.join(REQUIRED_FIELDS[data_format])}); fix the row or data.format")
    if data_format == "chat":
        check_messages(row.fields["messages"], row.where, "messages")
        if needs_assistant and not any(m["role"] == "assistant" for m in row.fields["messages"]):
            raise ValueError(f"data.source: {row.where} has no assistant turn, so nothing to learn with "
                             'data.loss_on = "assistant"; add the reply or leave the row out')
    elif data_format == "prompt_completion":
        check_text(row.fields["prompt"], row.where, "prompt", may_be_empty=True)
        check_text(row.fields["completion"], row.where, "completion")
    else:
        for field in REQUIRED_FIELDS["preference"]:
            value = row.fields[field]
            if not isinstance(value, list):
                check_text(value, row.where, field, may_be_empty=field == "prompt")
                continue
            check_messages(value, row.where, field)
            if field != "prompt" and not any(message["role"] == "assistant" for message in value):
                raise ValueError(f"data.source: {row.where}: {field} has no assistant turn; write the reply as "
                                 '[{"role": "assistant", "content": ...}] or as a string')


def check_text(value, where: str, field: str, *, may_be_empty: bool = False) -> None:
    if value is None:
        raise ValueError(f"data.source: {where} has no {field}; give it text")
    if not isinstance(value, str):
        raise ValueError(f"data.source: {where}: {field} is a {type(value).__name__}, not text; write it as a "
                         "string")
    if not may_be_empty and not value.strip():
        raise ValueError(f"data.source: {where}: {field} = {value!r} is empty; give it text or leave the row out")


def check_messages(messages, where: str, field: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"data.source: {where}: {field} = {str(messages)[:60]!r} is not a list of messages; "
                         'write [{"role": ..., "content": ...}, ...]')
    for index, message in enumerate(messages):
        name = f"{field}[{index}]"
        if not isinstance(message, dict):
            raise ValueError(f"data.source: {where}: {name} is a {type(message).__name__}, not a message; write "
                             '{"role": ..., "content": ...}')
        if message.get("role") not in ROLES:
            raise ValueError(f"data.source: {where}: {name}.role = {message.get('role')!r} is not a role; use "
                             f"{', '.join(ROLES)}")
        content = message.get("content")
        if message["role"] == "assistant" and isinstance(content, str) and not content.strip():
            raise ValueError(f"data.source: {where}: {name} is an empty assistant turn (content = {content!r}); "
                             "give it the reply or leave the turn out")
        check_text(content, where, f"{name}.content", may_be_empty=True)


def texts_of_rows(rows: list[Row]) -> Iterator[str]:
    """Every text a row holds (a tokenizer trained for the rows learns from these)."""
    for row in rows:
        for value in row.fields.values():
            if isinstance(value, str):
                yield value
            elif isinstance(value, list):
                yield from (m["content"] for m in value if isinstance(m, dict) and isinstance(m.get("content"), str))
