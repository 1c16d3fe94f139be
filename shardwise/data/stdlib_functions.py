"""The instruction-tuning demo's data: prompt/completion pairs from this Python's standard library.

Each documented function (or method) of a standard-library module becomes one pair:

    prompt      its signature and docstring, as written (decorators left out, dedented)
    completion  the rest of its body, as written

Like the pretraining demo corpus (data/sources.py) it is on every machine that runs shardwise and
no one wrote it for us. The rows come module by module in the order of their paths, so a
validation split taken from the end of the list (data.val_fraction: the last examples, whole)
holds functions of modules never trained on (a module may straddle the cut), in the same order
on every machine with the same Python version.

Functions whose body is longer than MAX_BODY_LINES, or whose docstring is the whole body, are
left out: the first is too long for a demo's sequence, the second has nothing to complete.
"""

from __future__ import annotations

import ast
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

from shardwise.data.sources import stdlib_source_files

MAX_BODY_LINES = 24
"""Longest body kept (lines): most stdlib helpers fit a 256-token window with their docstring."""
MIN_BODY_LINES = 1


def stdlib_function_rows(max_rows: int = 0) -> list[dict]:
    """{"prompt", "completion", "module"} rows of every documented stdlib function that qualifies,
    module by module in path order; `max_rows` > 0 keeps the first that many."""
    rows: list[dict] = []
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_source_files():
        for row in function_rows_of_file(path, path.relative_to(root).with_suffix("").as_posix()):
            rows.append(row)
            if max_rows and len(rows) >= max_rows:
                return rows
    return rows


def function_rows_of_file(path: Path, module: str) -> Iterator[dict]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):  # a few stdlib files are templates or Python 2 samples
        return
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            row = function_row(node, lines)
            if row is not None:
                yield {**row, "module": module}


def function_row(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> dict | None:
    """The pair of one function: the text up to the end of its docstring, then the rest of the body."""
    docstring = node.body[0] if node.body else None
    if not (isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant)
            and isinstance(docstring.value.value, str)) or len(node.body) < 2:
        return None
    start = node.lineno - 1  # the `def` line (decorators come before it and are left out)
    split = docstring.end_lineno  # the first line after the docstring
    end = node.end_lineno
    if not MIN_BODY_LINES <= end - split <= MAX_BODY_LINES:
        return None
    prompt_and_body = textwrap.dedent("".join(lines[start:end]))
    prompt_lines = prompt_and_body.splitlines(keepends=True)
    cut = split - start
    prompt, completion = "".join(prompt_lines[:cut]), "".join(prompt_lines[cut:])
    if not completion.strip() or "\t" in prompt_and_body:  # tabs: a handful of old modules mix them in
        return None
    return {"prompt": prompt, "completion": completion}
