"""argparse `type=` functions of the numeric flags: a value no command can use (NaN, an infinity,
a count below its least, an integer past int64) stops while the command line is parsed, in one line
naming the flag (`shardwise: error: --devices = 0 is invalid: use a positive integer`;
`OneLineErrors.error` in cli/main.py puts the flag in front of the message these raise)."""

from __future__ import annotations

import argparse
import math

from shardwise.core.errors import INT64_LIMIT

SUBJECT_FIRST = "= "
"""How the messages below start: the parser's error puts the flag before them."""


def bad_flag_value(text: str, fix: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{SUBJECT_FIRST}{text} is invalid: {fix}")


def integer_at_least(least: int, fix: str):
    """The parser of an integer flag whose values start at `least` (e.g. 1 for a count)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise bad_flag_value(text, f"not an integer; {fix}") from None
        if not least <= value < INT64_LIMIT:
            raise bad_flag_value(text, fix)
        return value
    return parse


def finite_above(bound: float, fix: str, *, at_most: float = math.inf):
    """The parser of a float flag that must be finite, above `bound` (e.g. a size above 0) and at most `at_most`."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise bad_flag_value(text, f"not a number; {fix}") from None
        if not (math.isfinite(value) and bound < value <= at_most):
            raise bad_flag_value(text, fix)
        return value
    return parse


def probability_below_one(fix: str):
    """The parser of a float flag in [0, 1), e.g. a dropout probability."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise bad_flag_value(text, f"not a number; {fix}") from None
        if not 0.0 <= value < 1.0:  # NaN fails both comparisons
            raise bad_flag_value(text, fix)
        return value
    return parse


positive_int = integer_at_least(1, "use a positive integer")
"""Counts: devices, rows, tokens, processes."""
