"""The demo's instruction pairs: a documented function's signature and docstring -> its body."""

from __future__ import annotations

from shardwise.data.stdlib_functions import MAX_BODY_LINES, function_rows_of_file

SOURCE = '''
import functools


@functools.cache
def add(a, b=1):
    """Add b to a."""
    total = a + b
    return total


class Box:
    def size(self):
        """How much it holds."""
        return len(self.items)

    def undocumented(self):
        return 1

    def only_a_docstring(self):
        """Nothing to complete."""


def long(x):
    """Too long for the demo."""
''' + "    x += 1\n" * (MAX_BODY_LINES + 1) + "    return x\n"


def test_rows_split_each_documented_function_after_its_docstring(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text(SOURCE)
    rows = sorted(function_rows_of_file(path, "pkg/mod"), key=lambda row: row["prompt"])
    assert rows == [
        {"prompt": 'def add(a, b=1):\n    """Add b to a."""\n', "completion": "    total = a + b\n    return total\n",
         "module": "pkg/mod"},
        {"prompt": 'def size(self):\n    """How much it holds."""\n', "completion": "    return len(self.items)\n",
         "module": "pkg/mod"},
    ]


def test_a_file_that_does_not_parse_gives_no_rows(tmp_path):
    path = tmp_path / "py2.py"
    path.write_text("print 'hello'\n")
    assert list(function_rows_of_file(path, "py2")) == []
