"""Recompute-set selection: which chunk tokens a request recomputes.

Strategies are looked up by name (`get_selector`); each declares what it needs (`Selector`:
a ratio, a probe, the model profile, layers computed whole), so the engine never switches
on a method's name. Importing the package registers the shipped strategies.
"""

from qcfuse_core.selection import adaptive, baselines, selectors  # noqa: F401  (registration)
from qcfuse_core.selection.base import SELECTORS, SelectionContext, Selector, get_selector, register
from qcfuse_core.selection.options import QCFuseOptions, parse_selection_options

__all__ = [
    "SELECTORS",
    "QCFuseOptions",
    "SelectionContext",
    "Selector",
    "get_selector",
    "parse_selection_options",
    "register",
]
