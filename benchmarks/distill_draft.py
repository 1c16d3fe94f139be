"""Training text for a draft model (`--speculate draft:RUN`): the target's own greedy answers.

    python benchmarks/distill_draft.py --target RUN --out DIR [--prompts 1200 --new-tokens 96]
    shardwise train --model.preset debug --train.init_from DRAFT_RUN --data.source DIR \
        --data.tokenizer RUN/tokenizer.json --model.vocab_size V --model.max_seq_len L ...

A draft pays only where it proposes the token the target would have chosen: speculation's gain is set
by that agreement and by the draft's cost (docs/serving.md). A draft trained on the target's corpus
learns the corpus, not the target: the debug draft of the speculation benchmark, trained as long as the
demo target and to the same loss, agreed with its greedy token at about half of the positions. Training
the draft on text the target wrote (sequence-level distillation, as drafts are commonly trained) teaches
it the target's choices instead.

The prompts come from this Python's standard library (the demo corpus): half are windows of source
files, half are code-editing prompts built as benchmarks/speculation.py builds its copy prompts, from
functions that benchmark does not use (its prompts stay held out). Each document written to DIR is a
prompt (its last tokens where it would not leave room for the answer in the target's context) followed
by the target's greedy answer, one .txt file each.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import textwrap
import time
from pathlib import Path

from shardwise.data.sources import stdlib_source_files
from shardwise.generation.engine import generate_all
from shardwise.generation.sampling import SamplingParams
from shardwise.infer.load import open_engine

from speculation import SOURCES, copy_prompt

EDIT_MODULES = ["ast", "bisect", "cmd", "code", "codecs", "colorsys", "configparser", "copy", "dataclasses", "datetime",
                "decimal", "dis", "email.utils", "enum", "filecmp", "fractions", "ftplib", "functools", "getopt",
                "gettext", "glob", "gzip", "heapq", "html", "http.cookies", "imaplib", "inspect", "ipaddress", "json",
                "locale", "logging", "mailbox", "mimetypes", "netrc", "ntpath", "numbers", "operator", "optparse",
                "pathlib", "pickle", "pkgutil", "platform", "plistlib", "poplib", "posixpath", "pprint", "pydoc",
                "queue", "quopri", "random", "reprlib", "sched", "selectors", "smtplib", "socketserver", "ssl",
                "subprocess", "symtable", "tarfile", "tempfile", "threading", "timeit", "tokenize", "trace",
                "traceback", "turtle", "typing", "urllib.parse", "uuid", "warnings", "wave", "weakref", "zipfile"]
"""Modules whose functions make the code-editing prompts: none of benchmarks/speculation.py's SOURCES."""


def edit_prompts(count: int, rng: random.Random) -> list[str]:
    held_out = {name.split(":")[0] for name in SOURCES}
    functions = []
    for name in EDIT_MODULES:
        if name in held_out:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for _, obj in inspect.getmembers(module, inspect.isfunction):
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            try:
                source = textwrap.dedent(inspect.getsource(obj))
            except (OSError, TypeError):
                continue
            if 200 <= len(source) <= 4000:
                functions.append(source)
    rng.shuffle(functions)
    return [copy_prompt(source) for source in functions[:count]]


def window_prompts(count: int, rng: random.Random, chars: tuple[int, int] = (300, 1200)) -> list[str]:
    held_out = {name.split(":")[0] + ".py" for name in SOURCES}
    files = [path for path in stdlib_source_files() if path.name not in held_out]
    prompts = []
    while len(prompts) < count:
        text = rng.choice(files).read_text(errors="replace")
        if len(text) < chars[1] * 2:
            continue
        start = text.find("\n", rng.randrange(0, len(text) - chars[1])) + 1
        prompts.append(text[start:start + rng.randint(*chars)].rsplit("\n", 1)[0] + "\n")
    return prompts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=1200)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    edits = edit_prompts(args.prompts // 2, rng)
    prompts = edits + window_prompts(args.prompts - len(edits), rng)
    cfg, engine, tokenizer = open_engine(args.target, device_name="cpu", max_batch=args.batch)
    room = cfg.model.max_seq_len - args.new_tokens  # a prompt keeps its last tokens that leave room for the answer
    if room < 1:
        parser.error(f"--new-tokens = {args.new_tokens} is invalid: the target's context is "
                     f"{cfg.model.max_seq_len} tokens; ask for fewer")
    args.out.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0)
    start, written, tokens = time.perf_counter(), 0, 0
    for first in range(0, len(prompts), 8 * args.batch):
        chunk = prompts[first:first + 8 * args.batch]
        prompt_ids = [tokenizer.encode(prompt).ids[-room:] for prompt in chunk]
        seqs = generate_all(engine, prompt_ids, params)
        for ids, seq in zip(prompt_ids, seqs):
            (args.out / f"{written:05d}.txt").write_text(tokenizer.decode(ids + seq.output_ids))
            written, tokens = written + 1, tokens + len(seq.output_ids)
        print(f"{written}/{len(prompts)} documents, {tokens / (time.perf_counter() - start):.0f} generated tok/s",
              flush=True)
    print(json.dumps({"documents": written, "edit_prompts": len(edits), "generated_tokens": tokens,
                      "seconds": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
