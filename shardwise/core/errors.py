"""The one-line errors of config validation: the field, the value, and the fix."""

from __future__ import annotations

import dataclasses
import math

INT64_LIMIT = 2**63
"""Integers at or past this do not fit an int64: TOML cannot write them, torch and numpy cannot hold them."""


def invalid(name: str, value, fix: str) -> ValueError:
    """The one-line error every validation raises: field, value, fix."""
    return ValueError(f"{name} = {value!r} is invalid: {fix}")


def require_positive(section: str, obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise invalid(f"{section}.{name}", value, "use a positive integer")


def require_representable(section: str, obj) -> None:
    """Every number of a config dataclass is one a run can use: floats finite (a NaN compares false
    with every bound, so range checks alone would let it through and it would silently disable what
    it sets), integers within int64. Checked before each section's own ranges."""
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise invalid(f"{section}.{field.name}", value, "use a finite number (NaN and infinities take no effect)")
        if isinstance(value, int) and not isinstance(value, bool) and not -INT64_LIMIT <= value < INT64_LIMIT:
            raise invalid(f"{section}.{field.name}", value, f"use a value of magnitude below 2**63 ({INT64_LIMIT:,})")
