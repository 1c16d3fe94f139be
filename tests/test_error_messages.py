"""Every error a user can meet names its subject (issue 37, item 6).

An AST walk over shardwise/ finds each `raise` of the errors the command line turns into its one
line (`shardwise: error: ...`: ValueError, FileNotFoundError and their relatives, and the package's
own subclasses of them) and reads the message's literal text: it must name a field (`train.lr`,
`model.{name}`), a flag (`--devices`), a file or directory (`config.json`, `{path}`, RUN_DIR), a
parameter (`dp={dp}`) or hold the `<subject> = <value>` form. The few that do not, on purpose, are
listed below with the reason; an entry that no longer matches a raise fails the test, so the list
cannot go stale.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import shardwise

PACKAGE = Path(shardwise.__file__).parent
USER_FACING = {"ValueError", "FileNotFoundError", "NotADirectoryError", "IsADirectoryError", "FileExistsError",
               "PermissionError", "OSError"}
"""What cli/main.py reports as one line (OSError's family: the unreadable/unwritable paths)."""

SUBJECT = re.compile(
    r"--[a-z]"                              # a flag
    r"|\b[a-z_][a-z_0-9]*\.(?:[a-z_]|\{)"   # a dotted field or file name: train.lr, model.{name}, config.json
    r"|\b[A-Z]+_[A-Z_]+\b"                  # a metavar: RUN_DIR, HF_DIR
    r"|\b[a-z_]+=\{"                        # a parameter: dp={dp}
    r"|[\w}\]] = \{"                         # "<subject> = <value>": keep = {keep}, {name} = {value!r}
)
SUBJECT_EXPRESSION = re.compile(r"path|file|dir|key|field|flag|param|name", re.IGNORECASE)
"""A placeholder whose expression is a path, a key or a name is the subject (`{path}`, `{key}`)."""

ALLOWED = {
    ("runtime/node_check.py", "{refused}"):
        "the head relays the line a refused node raised (`compare_with_head`, which names the node and the field)",
    ("checkpoint/integrity.py", "bad entries"):
        "caught three lines below and reported as '<manifest file> is unreadable'",
    ("data/loader.py", "data loader state: missing"):
        "a checkpoint's data-loader state; checkpoint/store.resume, which knows the checkpoint's path, does not "
        "pass it down (only a checkpoint not written by shardwise lacks these keys)",
    ("data/spelled_specials.py", "the text names"):
        "the subject is the prompt the user gave (--text, --prompt, a request's prompt), which the message quotes",
    ("distributed/tensor_parallel.py", "unknown tensor-parallel role"):
        "an internal invariant of a model family's plan.py, not user input",
    ("models/t5/model.py", "T5 needs decoder_input_ids_BT"):
        "an internal invariant: a caller of the T5 forward, not user input",
    ("generation/engine.py", "prompt is empty"):
        "the subject is the prompt (--prompt, a request's prompt), the message's first word",
    ("observe/block_memory.py", "mode {mode} is not one of"):
        "an internal argument: `shardwise rules --memory` passes only the modes it lists",
    ("data/chat_template.py", "messages rejected by the chat template"):
        "the subject is the request parameter `messages`, the message's first word",
    ("infer/commands.py", "shardwise serve needs the serving packages"):
        "the subject is the command (shardwise serve) and the packages it names",
}


def user_facing_types() -> set[str]:
    """USER_FACING and the package's own subclasses of them (e.g. generation's InvalidRequest)."""
    names = set(USER_FACING)
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(getattr(base, "id", None) in names for base in node.bases):
                names.add(node.name)
    return names


def literal_text(node) -> tuple[str | None, list[str]]:
    """(the message with each placeholder as {expression}, the expressions); None if not literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, []
    if isinstance(node, ast.JoinedStr):
        parts, expressions = [], []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(value.value)
            else:
                expressions.append(ast.unparse(value.value))
                parts.append("{" + expressions[-1] + "}")
        return "".join(parts), expressions
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        (left, left_exprs), (right, right_exprs) = literal_text(node.left), literal_text(node.right)
        return (None, []) if left is None or right is None else (left + right, left_exprs + right_exprs)
    return None, []


def messages_of(node: ast.expr) -> list[tuple[str | None, list[str]]]:
    """The messages a raise's first argument can have (both branches of `a if c else b`)."""
    if isinstance(node, ast.IfExp):
        return messages_of(node.body) + messages_of(node.orelse)
    return [literal_text(node)]


@functools.cache
def raised_messages() -> tuple:
    """(file relative to the package, line, message or None, placeholder expressions) of every raise."""
    return tuple(walk_raises())


def walk_raises():
    types = user_facing_types()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            func = node.exc.func
            if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) not in types:
                continue
            where = path.relative_to(PACKAGE).as_posix()
            if not node.exc.args:
                yield where, node.lineno, "", []
                continue
            for text, expressions in messages_of(node.exc.args[0]):
                yield where, node.lineno, text, expressions


def names_subject(text: str, expressions: list[str]) -> bool:
    return bool(SUBJECT.search(text)) or any(SUBJECT_EXPRESSION.search(e) for e in expressions)


def allowed_entry(where: str, text: str):
    return next((key for key in ALLOWED if key[0] == where and text.startswith(key[1])), None)


def test_every_error_message_names_its_subject():
    unnamed, used = [], set()
    for where, line, text, expressions in raised_messages():
        if text is None:
            unnamed.append(f"{where}:{line}: a message built elsewhere: give the raise a literal message")
        elif not names_subject(text, expressions):
            entry = allowed_entry(where, text)
            if entry:
                used.add(entry)
            else:
                unnamed.append(f"{where}:{line}: {text[:100]!r}")
    assert not unnamed, ("these errors do not name the field, flag, file or parameter they are about:\n"
                         + "\n".join(unnamed))
    assert not set(ALLOWED) - used, f"allow-list entries that match no raise any more: {set(ALLOWED) - used}"


def test_the_walk_finds_the_errors_it_judges():
    """The walk reads the raises it should (guards against a walk that finds nothing and passes)."""
    found = {(where, text) for where, _, text, _ in raised_messages()}
    assert len(found) > 150
    assert any(where == "config/loader.py" and text and text.startswith("--config {") for where, text in found)
    assert not names_subject("invalid value", [])
    assert not names_subject("{value} is invalid", ["value"])
    assert all(names_subject(text, []) for text in ("train.lr = {x} is invalid", "--devices = {n}", "RUN_DIR = {d}",
                                                    "zero={zero}: expected", "model.{missing[0]} is missing"))
