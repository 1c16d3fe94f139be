"""Tokenized chat, instruction and preference examples, cached on disk like the token files of text
(data/prepare.py): keyed by what shapes them, built in a staging directory and renamed into place.

Tokenizing is not the cost (the Rust tokenizer does a thousand rows in milliseconds); rendering the
chat template is: each assistant turn is rendered twice more to find its span (data/chat_masks.py).
With the Llama 3 template, a byte-level BPE of 1000 tokens and 2000 rows, a row with a system turn
and one exchange takes 0.31 ms (0.18 ms with data.loss_on = "all"), three exchanges 1.07 ms (0.42 ms)
(2-core Xeon, torch 2.13.0+cpu, commit 6b79cc5, 2026-11-27): a 100k-row chat set, half a minute to
two minutes. The cache makes that
once per data set, and lets the other ranks of a run read what rank 0 (or the launcher) tokenized.
data.overlong and the packing are applied after the cache, so a new train.seq_len costs no re-tokenizing.

Layout of an entry (`<cache>/examples/<key>/`):
    tokens.npy, offsets.npy, loss.npy, origins.npy   one ExampleStore (data/example_store.py); a
                                                     preference set has two, prefixed chosen. / rejected.
    tokenizer.json                                   the tokenizer that made them
    meta.json                                        written last: the entry is complete when it exists
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

from shardwise.config.schema import loss_on_of
from shardwise.data.chat_masks import build_encoder
from shardwise.data.chat_template import resolve_chat_template
from shardwise.data.example_rows import RowSource, row_source, texts_of_rows
from shardwise.data.example_store import ExampleStore, load_store, store_of
from shardwise.data.prepare import (TOKENIZER_FILE, cache_root, file_sha256, publish_entry,
                                    write_json_atomically)
from shardwise.data.preference import tokenize_preference_rows
from shardwise.data.row_encoding import tokenize_rows
from shardwise.data.tokenizer import eos_id, load_tokenizer, save_tokenizer, tokenizer_sha256, train_tokenizer

FORMAT_VERSION = 2
"""2: each reply tokenized apart from the text before it (data/chat_masks.py `pieces_at_replies`)."""
META_FILE = "meta.json"
PREFERENCE_SIDES = ("chosen.", "rejected.")


def cached_examples(data_cfg, *, verify: bool = True) -> Path:
    """The cache entry of data_cfg's examples, tokenized now if no earlier run did; `verify`: hash the
    arrays against meta.json (a damaged entry is rebuilt, with a warning)."""
    source = row_source(data_cfg)
    given_tokenizer = Path(data_cfg.tokenizer).expanduser() if data_cfg.tokenizer else None
    if given_tokenizer is not None:
        load_tokenizer(given_tokenizer)  # fails early, with the data.tokenizer message, if it is unusable
    template = resolve_chat_template(data_cfg.chat_template, given_tokenizer)  # a bad template: refused now
    entry = cache_root(data_cfg.cache_dir) / "examples" / examples_cache_key(data_cfg, source, given_tokenizer,
                                                                             template)
    if (entry / META_FILE).is_file() and verify and (damage := damage_of(entry)) is not None:
        print(f"shardwise: warning: {entry}: {damage}; tokenizing the rows again", file=sys.stderr, flush=True)
        shutil.rmtree(entry, ignore_errors=True)
    if not (entry / META_FILE).is_file():
        create_entry(entry, data_cfg, source, given_tokenizer)
    return entry


def examples_cache_key(data_cfg, source: RowSource, given_tokenizer: Path | None, template) -> str:
    """Changes whenever anything that shapes the examples does (a file, the tokenizer, the template, loss_on)."""
    inputs = {
        "format_version": FORMAT_VERSION,
        "format": data_cfg.format,
        "loss_on": loss_on_of(data_cfg),
        "named_source": source.named,
        "files": [[str(path), path.stat().st_size, path.stat().st_mtime_ns] for path in source.files],
        "tokenizer_sha256": file_sha256(given_tokenizer) if given_tokenizer else "",
        "vocab_size": 0 if given_tokenizer else data_cfg.vocab_size,
        "template": [template.source, template.special_tokens] if template is not None else None,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode("utf-8")).hexdigest()[:32]


def create_entry(entry: Path, data_cfg, source: RowSource, given_tokenizer: Path | None) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", suffix=".tmp", dir=entry.parent))
    try:
        rows = list(source.rows(data_cfg))
        if not rows:
            raise ValueError(f"data.source: {data_cfg.source!r} holds no rows; point it at .jsonl or .parquet files "
                             f"of data.format = {data_cfg.format!r} rows")
        tokenizer = (load_tokenizer(given_tokenizer) if given_tokenizer is not None
                     else train_tokenizer(texts_of_rows(rows), data_cfg.vocab_size))
        encoder = build_encoder(data_cfg, tokenizer, given_tokenizer, loss_on_of(data_cfg))
        stores = tokenized_stores(rows, data_cfg.format, encoder, source.names, tokenizer.get_vocab_size())
        for prefix, store in stores.items():
            store.save(staging, prefix)
        save_tokenizer(tokenizer, staging / TOKENIZER_FILE)
        meta = {"format_version": FORMAT_VERSION, "format": data_cfg.format, "loss_on": encoder.loss_on,
                "num_examples": len(rows), "vocab_size": tokenizer.get_vocab_size(), "eos_id": eos_id(tokenizer),
                "tokenizer_sha256": tokenizer_sha256(tokenizer), "sources": source.names,
                "chat_template": template_record(encoder.template),
                "sha256": {prefix: store.sha256() for prefix, store in stores.items()}}
        write_json_atomically(staging / META_FILE, meta)
        staging.chmod(0o755)  # mkdtemp makes it private; a shared $SHARDWISE_CACHE should be readable
        publish_entry(staging, entry)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def template_record(template) -> dict | None:
    """The chat template the rows were rendered with (None: none, the plain built-in one for conversations),
    so a run can keep it beside its tokenizer for `shardwise serve`."""
    if template is None:
        return None
    return {"name": template.source_name, "source": template.source, "special_tokens": template.special_tokens}


def tokenized_stores(rows, data_format: str, encoder, sources: list[str], vocab_size: int) -> dict[str, ExampleStore]:
    origins = [(row.source_index, row.number) for row in rows]
    if data_format != "preference":
        return {"": store_of(tokenize_rows(rows, data_format, encoder), origins, sources, vocab_size)}
    pairs = tokenize_preference_rows(rows, encoder)
    return {"chosen.": store_of([pair.chosen for pair in pairs], origins, sources, vocab_size),
            "rejected.": store_of([pair.rejected for pair in pairs], origins, sources, vocab_size)}


def read_entry(entry: Path) -> tuple[dict, dict[str, ExampleStore]]:
    """(meta.json, the stores by prefix: "" or chosen./rejected.), memory-mapped."""
    meta = json.loads((entry / META_FILE).read_text(encoding="utf-8"))
    return meta, {prefix: load_store(entry, meta["sources"], prefix) for prefix in meta["sha256"]}


def damage_of(entry: Path) -> str | None:
    """Why the entry cannot be used (None: every array matches meta.json)."""
    try:
        meta, stores = read_entry(entry)
        if meta.get("format_version") != FORMAT_VERSION:
            return f"format_version {meta.get('format_version')} is not {FORMAT_VERSION}"
        if file_sha256(entry / TOKENIZER_FILE) != meta["tokenizer_sha256"] or any(
                store.sha256() != meta["sha256"][prefix] for prefix, store in stores.items()):
            return "its files do not match meta.json (damaged)"
    except (OSError, ValueError, KeyError) as err:
        return f"unreadable ({err})"
    return None
