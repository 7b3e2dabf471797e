"""Checks of what callers hand the public API, shared by the engine and the integrations.

A string is a sequence of one-character strings, so `engine.answer(q, "some text")` would
otherwise fuse one "document" per character and answer nonsense. Every parameter that takes
a sequence of texts (documents, chunk texts, node ids) or of framework objects goes through
`require_sequence`, which refuses a string there with a TypeError naming the fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def require_sequence(value: Any, what: str, item: type | tuple[type, ...] | None = str, *, one: str = "") -> list:
    """`value` as a list, where it is a list, tuple or other iterable of `item` (None: any
    item). TypeError naming `what` for a string or bytes (`one`: how to pass a single one),
    a mapping, something that is not iterable, or an item of another type (named by its
    index)."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{what} must be a list, not a {type(value).__name__} ({one or 'for one, pass a list of one'})")
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise TypeError(f"{what} must be a list, got {type(value).__name__}")
    items = list(value)
    if item is not None:
        for i, v in enumerate(items):
            if not isinstance(v, item):
                kinds = (item,) if isinstance(item, type) else item
                want = " or ".join("None" if t is type(None) else t.__name__ for t in kinds)
                raise TypeError(f"{what}[{i}] must be a {want}, got {type(v).__name__}")
    return items
