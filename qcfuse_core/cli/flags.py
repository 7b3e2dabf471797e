"""Checked argparse types: a number outside its range is refused when the command line is
parsed - `qcfuse: error: argument --learn-after: must be >= 0 (0: learn nothing), got -1`,
exit status 2 - before any model loads or any file is written.

    p.add_argument("--top-k", type=at_least(1), default=4)
    p.add_argument("--ratio", type=share, default=None)
    p.add_argument("--port", type=port, default=8000)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _number(text: str, kind: type) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None
    if kind is float and value != value:  # NaN passes every comparison below
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}")
    return value


def at_least(low: int, note: str = "") -> Callable[[str], int]:
    """An integer >= `low` (`note`: what the lowest value means, shown in the error)."""

    def parse(text: str) -> int:
        value = int(_number(text, int))
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}{f' ({note})' if note else ''}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def above(low: float, *, or_equal: bool = False) -> Callable[[str], float]:
    """A number > `low` (or_equal: >= `low`)."""
    sign = ">=" if or_equal else ">"

    def parse(text: str) -> float:
        value = float(_number(text, float))
        if not (value >= low if or_equal else value > low):
            raise argparse.ArgumentTypeError(f"must be {sign} {low:g}, got {value:g}")
        return value

    parse.__name__ = f"number {sign} {low:g}"
    return parse


def share(text: str) -> float:
    """A share in [0, 1] (a recompute ratio)."""
    value = float(_number(text, float))
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value:g}")
    return value


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    value = int(_number(text, int))
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535] (0: any free one), got {value}")
    return value
