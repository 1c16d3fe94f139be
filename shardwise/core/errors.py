"""The one-line errors of config validation: the field, the value, and the fix."""

from __future__ import annotations


def invalid(name: str, value, fix: str) -> ValueError:
    """The one-line error every validation raises: field, value, fix."""
    return ValueError(f"{name} = {value!r} is invalid: {fix}")


def require_positive(section: str, obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise invalid(f"{section}.{name}", value, "use a positive integer")
