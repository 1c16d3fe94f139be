"""Where training text comes from: the demo corpus or the user's files, as a stream of documents.

The demo corpus is the running interpreter's own standard library: it is on every machine
that can run shardwise, so the demo needs no download. `resolve_source_files` turns
`data.source` into a sorted file list (the cache key is built from it); `iter_documents`
reads those files as one string per document.
"""

from __future__ import annotations

import json
import os
import random
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

STDLIB = "stdlib"
DOCUMENT_SUFFIXES = (".txt", ".py", ".md", ".jsonl", ".parquet")
# Installed packages are not the standard library, and the test suites are mostly
# repetitive fixtures that would crowd out ordinary code in a capped corpus.
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
# Generated at build time with this machine's paths: it would make the corpus machine-dependent.
STDLIB_EXCLUDED_PREFIXES = ("_sysconfigdata",)
# Fixed so a capped corpus is the same subset on every run and machine.
SPREAD_SEED = 0


def stdlib_source_files() -> list[Path]:
    """The standard library's .py files (no installed packages, no tests), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        path for path in walk_files(root, (".py",), STDLIB_EXCLUDED_DIRS)
        if not path.name.startswith(STDLIB_EXCLUDED_PREFIXES)
    ]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def walk_files(root: Path, suffixes: Sequence[str], excluded_dirs=frozenset()) -> list[Path]:
    """Files under `root` with one of `suffixes`, sorted by relative path; hidden and excluded dirs are skipped."""
    found = []
    for dir_path, dir_names, file_names in os.walk(root):
        # Pruning in place stops os.walk from descending (site-packages alone is huge).
        dir_names[:] = [name for name in dir_names if name not in excluded_dirs and not name.startswith(".")]
        found.extend(Path(dir_path) / name for name in file_names if name.endswith(tuple(suffixes)))
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def resolve_source_files(source: str) -> list[Path]:
    """`data.source` as a file list: "stdlib", or comma-separated files/directories (walked recursively)."""
    files: list[Path] = []
    for part in (piece.strip() for piece in source.split(",")):
        if part:
            files.extend(files_of_source_part(part))
    files = list(dict.fromkeys(files))  # a file named twice (directly and via its directory) is read once
    if not files:
        raise ValueError(
            f"data.source: no {'/'.join(DOCUMENT_SUFFIXES)} files found in {source!r}; "
            'point it at text files or directories, or use "stdlib"'
        )
    return files


def files_of_source_part(part: str) -> list[Path]:
    if part == STDLIB:
        return stdlib_source_files()
    path = Path(part).expanduser()
    if not path.exists():
        raise ValueError(f"data.source: path '{path}' does not exist; fix the path or use \"stdlib\"")
    if path.is_dir():
        return walk_files(path.resolve(), DOCUMENT_SUFFIXES)
    if path.suffix not in DOCUMENT_SUFFIXES:
        raise ValueError(
            f"data.source: '{path}' has an unsupported type '{path.suffix}'; use {', '.join(DOCUMENT_SUFFIXES)} files"
        )
    return [path.resolve()]


def iter_documents(files: Sequence[Path], *, text_field: str = "text", max_bytes: int = 0) -> Iterator[str]:
    """One string per document; stops after `max_bytes` UTF-8 bytes (0 = no cap), cutting the last one.

    With a cap the files are read in a fixed-seed shuffled order, so a capped corpus samples
    the whole source instead of its alphabetical beginning (the stdlib's first 4 MB would be
    mostly asyncio and ctypes). Empty documents are skipped.
    """
    ordered = spread_order(files) if max_bytes else list(files)
    remaining = max_bytes
    for path in ordered:
        for text in documents_of_file(Path(path), text_field):
            if not text:
                continue
            if max_bytes:
                text, remaining = cut_to_budget(text, remaining)
            yield text
            if max_bytes and remaining <= 0:
                return


def spread_order(files: Sequence[Path]) -> list[Path]:
    shuffled = list(files)
    random.Random(SPREAD_SEED).shuffle(shuffled)
    return shuffled


def cut_to_budget(text: str, remaining: int) -> tuple[str, int]:
    """`text` cut to at most `remaining` UTF-8 bytes (never inside a character), and the budget left."""
    encoded = text.encode("utf-8")
    if len(encoded) > remaining:
        encoded = encoded[:remaining]
        text = encoded.decode("utf-8", errors="ignore")
    return text, remaining - len(encoded)


def documents_of_file(path: Path, text_field: str) -> Iterator[str]:
    if path.suffix == ".jsonl":
        yield from jsonl_documents(path, text_field)
    elif path.suffix == ".parquet":
        yield from parquet_documents(path, text_field)
    else:
        # errors="replace": one badly encoded file should cost a few characters, not the run.
        text = path.read_text(encoding="utf-8", errors="replace")
        nul = text.find("\x00")  # text never holds NUL bytes (git's test for a binary file, too)
        if nul >= 0:
            raise ValueError(f"data.source: {path} is a binary file (a NUL byte at character {nul}), not text; "
                             "remove it from data.source or convert it to UTF-8 text")
        yield text


def jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line_number, line in enumerate(lines, start=1):
            if line.strip():
                yield text_of_json_line(line, text_field, f"{path}:{line_number}")


def text_of_json_line(line: str, text_field: str, where: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"data.source: {where} is not valid JSON ({err.msg}); write one JSON object per line") from None
    if not isinstance(record, dict) or text_field not in record:
        raise ValueError(
            f"data.source: {where} has no field {text_field!r}; set data.text_field to the field that holds the text"
        )
    text = record[text_field]
    if text is not None and not isinstance(text, str):
        raise ValueError(
            f"data.source: {where} field {text_field!r} is a {type(text).__name__}, not text; "
            "set data.text_field to a string field"
        )
    return text or ""


def parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq  # optional: only parquet sources need it
    except ImportError:
        raise ValueError(
            f"data.source: {path} is a .parquet file but pyarrow is not installed; "
            "install it (pip install 'shardwise[parquet]') or convert the file to .jsonl"
        ) from None
    parquet_file = pq.ParquetFile(path)
    if text_field not in parquet_file.schema_arrow.names:
        raise ValueError(
            f"data.source: {path} has no column {text_field!r} (columns: {', '.join(parquet_file.schema_arrow.names)}); "
            "set data.text_field to the column that holds the text"
        )
    for batch in parquet_file.iter_batches(columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise ValueError(
                    f"data.source: {path} column {text_field!r} holds {type(text).__name__}, not text; "
                    "set data.text_field to a string column"
                )
            yield text or ""
