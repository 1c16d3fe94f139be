"""Training data: sources → byte-level BPE tokenizer → cached token memmap → rank-aware batches."""

from shardwise.data.loader import TokenLoader
from shardwise.data.prepare import Dataset, TokenFile, build_dataset, open_token_file, prepare_tokens
from shardwise.data.sources import iter_documents, resolve_source_files, stdlib_source_files
from shardwise.data.tokenizer import EOS_TOKEN, eos_id, load_tokenizer, train_tokenizer

__all__ = [
    "EOS_TOKEN", "Dataset", "TokenFile", "TokenLoader", "build_dataset", "eos_id", "iter_documents",
    "load_tokenizer", "open_token_file", "prepare_tokens", "resolve_source_files", "stdlib_source_files",
    "train_tokenizer",
]
