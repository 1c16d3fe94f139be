"""Text → one flat token file on disk (memory-mapped when read), cached by what produced it.

Layout of a token directory:
    tokens.bin      every document's token ids followed by EOS, back to back (uint16, or
                    uint32 when the vocabulary does not fit in 16 bits)
    meta.json       format_version, dtype, num_tokens, sha256 of tokens.bin, vocab_size,
                    max_token_id, tokenizer_sha256, num_documents, sources
    tokenizer.json  (cache entries only) the tokenizer that produced tokens.bin
    verified.json   (cache entries only) tokens.bin's inode, size, mtime and ctime when it last
                    matched its sha256: `verify_cache_entry`

meta.json is written last, each file through a temp name and `os.replace`, so a directory
with meta.json is complete. `build_dataset` goes further: it builds a cache entry in a
staging directory and renames the whole directory into place, so concurrent runs or a
crash never leave a half-built entry under its key.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer

from shardwise.data.sources import STDLIB, iter_documents, resolve_source_files
from shardwise.data.tokenizer import eos_id, load_tokenizer, save_tokenizer, train_tokenizer, tokenizer_sha256

if TYPE_CHECKING:
    from shardwise.config.schema import DataConfig

FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
VERIFIED_FILE = "verified.json"
META_KEYS = ("format_version", "dtype", "num_tokens", "sha256", "vocab_size", "max_token_id",
             "tokenizer_sha256", "num_documents", "sources")
# Documents handed to one `encode_batch` call: enough for its threads to share, small enough
# that one batch of ids stays a few MB.
ENCODE_BATCH_DOCUMENTS = 128
HASH_CHUNK_BYTES = 1 << 20


@dataclass
class TokenFile:
    path: Path
    """The token directory (holds tokens.bin and meta.json)."""
    tokens: np.memmap
    """All token ids, read-only."""
    meta: dict

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class Dataset:
    tokenizer: Tokenizer
    tokenizer_path: Path
    tokens: TokenFile


@dataclass
class StreamStats:
    num_tokens: int = 0
    num_documents: int = 0
    max_token_id: int = -1


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max else np.uint32)


def prepare_tokens(documents: Iterable[str], tokenizer: Tokenizer, out_dir: str | Path, *,
                   sources: str = "") -> TokenFile:
    """Tokenizes `documents` (EOS after each) into `out_dir`/tokens.bin and meta.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = tokenizer.get_vocab_size()
    dtype = token_dtype(vocab_size)
    hasher = hashlib.sha256()
    with staged_path(out_dir / TOKENS_FILE) as staging:
        with open(staging, "wb") as out:
            stats = write_token_stream(out, documents, tokenizer, dtype, hasher)
            out.flush()
            os.fsync(out.fileno())
        if stats.num_tokens == 0:
            raise ValueError(
                "data.source: the corpus is empty (no document has any text); point data.source at files with text"
            )
        # A meta.json left from an earlier run must never describe the new tokens.bin.
        (out_dir / META_FILE).unlink(missing_ok=True)
        os.replace(staging, out_dir / TOKENS_FILE)
    meta = {
        "format_version": FORMAT_VERSION,
        "dtype": dtype.name,
        "num_tokens": stats.num_tokens,
        "sha256": hasher.hexdigest(),
        "vocab_size": vocab_size,
        "max_token_id": stats.max_token_id,
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "num_documents": stats.num_documents,
        "sources": sources,
        "eos_id": eos_id(tokenizer),
    }
    write_json_atomically(out_dir / META_FILE, meta)
    return open_token_file(out_dir)


def write_token_stream(out, documents: Iterable[str], tokenizer: Tokenizer, dtype: np.dtype,
                       hasher) -> StreamStats:
    stats = StreamStats()
    vocab_size = tokenizer.get_vocab_size()
    eos = eos_id(tokenizer)
    for batch in batched((text for text in documents if text), ENCODE_BATCH_DOCUMENTS):
        ids = ids_with_eos(tokenizer.encode_batch(batch), eos)
        batch_max = int(ids.max())
        if batch_max >= vocab_size:
            raise ValueError(
                f"data.tokenizer: token id {batch_max} is outside the tokenizer's own vocabulary ({vocab_size}); "
                "the tokenizer file is inconsistent, fix it or leave data.tokenizer empty to train one"
            )
        chunk = ids.astype(dtype).tobytes()
        out.write(chunk)
        hasher.update(chunk)
        stats.num_tokens += len(ids)
        stats.num_documents += len(batch)
        stats.max_token_id = max(stats.max_token_id, batch_max)
    return stats


def ids_with_eos(encodings, eos: int) -> np.ndarray:
    pieces = itertools.chain.from_iterable((encoding.ids, (eos,)) for encoding in encodings)
    return np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int64)


def batched(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def open_token_file(path: str | Path, *, verify: bool = False) -> TokenFile:
    """The token directory at `path`, memory-mapped read-only; `verify` also checks the sha256."""
    path = Path(path)
    meta = read_meta(path)
    dtype = np.dtype(meta["dtype"])
    tokens_path = path / TOKENS_FILE
    expected_bytes = meta["num_tokens"] * dtype.itemsize
    actual_bytes = tokens_path.stat().st_size if tokens_path.is_file() else None
    if actual_bytes != expected_bytes:
        raise ValueError(
            f"{tokens_path}: {'missing' if actual_bytes is None else f'{actual_bytes} bytes'} but meta.json says "
            f"{meta['num_tokens']} {dtype.name} tokens ({expected_bytes} bytes); delete {path} and prepare the data again"
        )
    if verify and file_sha256(tokens_path) != meta["sha256"]:
        raise ValueError(
            f"{tokens_path}: sha256 does not match meta.json (the file is damaged); delete {path} and prepare the data again"
        )
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(meta["num_tokens"],))
    return TokenFile(path=path, tokens=tokens, meta=meta)


def read_meta(path: Path) -> dict:
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise ValueError(
            f"{path}: no {META_FILE}, so it is not a complete token directory; prepare the data again"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{meta_path}: not valid JSON ({err.msg}); delete {path} and prepare the data again") from None
    missing = [key for key in META_KEYS if key not in meta]
    if missing:
        raise ValueError(f"{meta_path}: missing {', '.join(missing)}; delete {path} and prepare the data again")
    if meta["format_version"] != FORMAT_VERSION:
        raise ValueError(
            f"{meta_path}: format_version = {meta['format_version']} but this shardwise reads {FORMAT_VERSION}; "
            "prepare the data again"
        )
    if meta["dtype"] not in ("uint16", "uint32"):
        raise ValueError(f"{meta_path}: dtype = {meta['dtype']!r} is not uint16 or uint32; prepare the data again")
    return meta


@contextmanager
def staged_path(final: Path) -> Iterator[Path]:
    """A temp name beside `final` (same filesystem, so `os.replace` is atomic); removed if still there on exit."""
    descriptor, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(descriptor)
    staging = Path(name)
    try:
        yield staging
    finally:
        staging.unlink(missing_ok=True)


def write_json_atomically(path: Path, data: dict) -> None:
    with staged_path(path) as staging:
        with open(staging, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=2)
            out.flush()
            os.fsync(out.fileno())
        os.replace(staging, path)


def file_sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(HASH_CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.hexdigest()


# ---- the cached dataset a training run uses ----

def build_dataset(cfg: DataConfig, *, special_tokens: tuple[str, ...] = (), verify: bool = True) -> Dataset:
    """Tokenizer + token file for `cfg`, from the cache when the same inputs were prepared before.
    `special_tokens`: what a tokenizer trained here adds after end-of-text (a masked LM's mask).
    A cached tokens.bin is checked against its meta.json (`verify_cache_entry`): hashed whole when
    `verify`, else only compared with what its last hash saw; a damaged one is rebuilt."""
    files = resolve_source_files(cfg.source)
    given_tokenizer = Path(cfg.tokenizer).expanduser() if cfg.tokenizer else None
    if given_tokenizer is not None:
        load_tokenizer(given_tokenizer)  # fails early, with the data.tokenizer message, if it is unusable
    entry = cache_root(cfg.cache_dir) / "datasets" / dataset_cache_key(cfg, files, given_tokenizer, special_tokens)
    if not (entry / META_FILE).is_file():
        create_cache_entry(entry, cfg, files, given_tokenizer, special_tokens)
        record_verified(entry)  # hashed as it was written: the ranks need not read it again
    elif (damage := verify_cache_entry(entry, rehash=verify)) is not None:
        rebuild_cache_entry(entry, damage, cfg, files, given_tokenizer, special_tokens)
        record_verified(entry)
    return open_dataset(entry)


def verify_cache_entry(entry: Path, *, rehash: bool) -> str | None:
    """Why the entry's tokens.bin is damaged (None: it matches meta.json). `rehash`: hash it whole and
    record what the file looked like then (VERIFIED_FILE); else hash only if it changed since that record
    (inode, size, mtime and ctime, which any write moves): the ranks of a launched run, whose launcher
    hashed it moments before, do not each read the whole file again."""
    try:
        token_file = open_token_file(entry)
    except ValueError as err:
        return str(err)
    tokens_path = entry / TOKENS_FILE
    if not intact_tokenizer(entry):
        return f"{entry / TOKENIZER_FILE}: its SHA-256 does not match meta.json (the file is damaged)"
    if not rehash and read_verified(entry) == file_identity(tokens_path, token_file.meta["sha256"]):
        return None
    if file_sha256(tokens_path) != token_file.meta["sha256"]:
        return f"{tokens_path}: its SHA-256 does not match meta.json (the file is damaged)"
    record_verified(entry)
    return None


def record_verified(entry: Path) -> None:
    """What tokens.bin looks like now that it matched its meta.json (VERIFIED_FILE)."""
    try:
        sha256 = read_meta(entry)["sha256"]
        write_json_atomically(entry / VERIFIED_FILE, file_identity(entry / TOKENS_FILE, sha256))
    except (OSError, ValueError):
        pass  # a read-only shared cache (or another run's rebuild under way): the next check hashes again


def intact_tokenizer(entry: Path) -> bool:
    """Whether the entry's tokenizer.json is the one its meta.json names (a small file: always hashed)."""
    try:
        meta = read_meta(entry)
        return file_sha256(entry / TOKENIZER_FILE) == meta["tokenizer_sha256"]
    except (OSError, ValueError):
        return False


def file_identity(path: Path, sha256: str) -> dict:
    stat = path.stat()
    return {"sha256": sha256, "device": stat.st_dev, "inode": stat.st_ino, "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns}


def read_verified(entry: Path) -> dict | None:
    try:
        return json.loads((entry / VERIFIED_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def rebuild_cache_entry(entry: Path, damage: str, cfg: DataConfig, files: list[Path], given_tokenizer: Path | None,
                        special_tokens: tuple[str, ...]) -> None:
    """Tokenize the sources again into a damaged entry's place, with the entry's own tokenizer when it
    still loads (a checkpoint's data position names the tokens it was trained on), with one warning."""
    print(f"shardwise: warning: {damage}; rebuilding it from data.source", file=sys.stderr, flush=True)
    aside = entry.with_name(f".{entry.name}.damaged-{os.getpid()}")
    try:
        os.rename(entry, aside)
    except OSError as err:
        raise ValueError(f"{damage}, and it cannot be rebuilt: {entry} cannot be moved ({err.strerror}); "
                         f"delete {entry}, or use a writable data.cache_dir") from None
    try:
        tokenizer = aside / TOKENIZER_FILE if intact_tokenizer(aside) else given_tokenizer
        create_cache_entry(entry, cfg, files, tokenizer, special_tokens)
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def cache_root(cache_dir: str) -> Path:
    return Path(cache_dir or os.environ.get("SHARDWISE_CACHE") or "~/.cache/shardwise").expanduser()


def dataset_cache_key(cfg: DataConfig, files: list[Path], given_tokenizer: Path | None,
                      special_tokens: tuple[str, ...] = ()) -> str:
    """Changes whenever anything that shapes the tokens does (a file edited, the cap, the tokenizer)."""
    inputs = {
        "format_version": FORMAT_VERSION,
        "files": [[str(path), path.stat().st_size, path.stat().st_mtime_ns] for path in files],
        "max_corpus_bytes": cfg.max_corpus_bytes,
        "text_field": cfg.text_field,
        "vocab_size": cfg.vocab_size,
        "tokenizer_sha256": file_sha256(given_tokenizer) if given_tokenizer else "",
    }
    if special_tokens and not given_tokenizer:  # only then: the keys of earlier caches stay valid
        inputs["special_tokens"] = list(special_tokens)
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode("utf-8")).hexdigest()[:32]


def create_cache_entry(entry: Path, cfg: DataConfig, files: list[Path], given_tokenizer: Path | None,
                       special_tokens: tuple[str, ...] = ()) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", suffix=".tmp", dir=entry.parent))
    try:
        def documents() -> Iterator[str]:
            # Read twice (training, then tokenizing) rather than held in memory: sources may be large.
            return iter_documents(files, text_field=cfg.text_field, max_bytes=cfg.max_corpus_bytes)

        if given_tokenizer is not None:
            tokenizer = load_tokenizer(given_tokenizer)
        else:
            tokenizer = train_tokenizer(documents(), cfg.vocab_size, special_tokens)
        save_tokenizer(tokenizer, staging / TOKENIZER_FILE)
        prepare_tokens(documents(), tokenizer, staging, sources=describe_sources(cfg, files))
        staging.chmod(0o755)  # mkdtemp makes it private; a shared $SHARDWISE_CACHE should be readable
        publish_entry(staging, entry)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def publish_entry(staging: Path, entry: Path) -> None:
    """Renames the finished staging dir to its key; if another run got there first, keeps theirs."""
    if entry.exists() and not (entry / META_FILE).is_file():
        shutil.rmtree(entry)  # incomplete (made by hand or an older version): nothing can be using it
    try:
        os.rename(staging, entry)
    except OSError:
        if not (entry / META_FILE).is_file():
            raise


def open_dataset(entry: Path) -> Dataset:
    tokenizer_path = entry / TOKENIZER_FILE
    return Dataset(tokenizer=load_tokenizer(tokenizer_path), tokenizer_path=tokenizer_path,
                   tokens=open_token_file(entry))


def describe_sources(cfg: DataConfig, files: list[Path]) -> str:
    source = cfg.source.strip()
    if source == STDLIB:
        source = f"stdlib of Python {sys.version_info.major}.{sys.version_info.minor}"
    cap = f", capped at {cfg.max_corpus_bytes} bytes" if cfg.max_corpus_bytes else ""
    description = f"{source} ({len(files)} files{cap})"
    return description if len(description) <= 200 else description[:197] + "..."
