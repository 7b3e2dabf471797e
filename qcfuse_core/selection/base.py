"""Recompute-set selection strategies, looked up by name.

Every selector sees a `SelectionContext` and returns a `SelectionResult` whose `rows` are the
sorted positions to recompute. Rules every selector keeps (enforced by `finalize`):

    prefix  never selected (its cache is exact)
    chunks  the method's choice, at most `budget` tokens
    glue    always (no cache exists)
    suffix  always (the question is computed fresh)

The engine runs `full` as an ordinary HF prefill; the others go through fused prefill.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.model.fusion import FusedPrompt
from qcfuse_core.types import SelectionResult


@dataclass
class SelectionContext:
    adapter: ModelAdapter
    prompt: FusedPrompt
    ratio: float
    seed: int = 0
    options: dict = field(default_factory=dict)

    @property
    def budget(self) -> int:
        """Number of chunk tokens a fixed-ratio method may recompute: round(ratio x context)."""
        return min(int(round(self.ratio * self.prompt.context_tokens)), int(self.prompt.mask("chunk").sum()))

    def finalize(self, method: str, chosen: torch.Tensor, scores: torch.Tensor | None = None, **kw) -> SelectionResult:
        """chosen: chunk positions picked by the method -> rows with glue + suffix added, prefix removed."""
        T = self.prompt.num_tokens
        keep = torch.zeros(T, dtype=torch.bool)
        if chosen.numel():
            keep[chosen.to(torch.int64).cpu()] = True
        keep &= self.prompt.mask("chunk")
        keep |= self.prompt.uncached_mask()
        keep[T - 1] = True
        return SelectionResult(method=method, rows=torch.nonzero(keep).flatten(), scores=scores, **kw)


class Selector(ABC):
    """A recompute-set strategy, registered by `name`."""

    name = ""
    uses_ratio = True  # the budget is a share of the context (`ratio`)
    fused = True  # False: HF's own forward over the whole prompt, no chunk cache used
    probes = False  # reads the query against anchors at the critical layers (sidecars, profile)
    profiled = False  # takes the model profile's ranking options along with its layers
    adaptive_budget = False  # its budget is adaptive: the profile's fixed-budget options are left out
    planner_full_layers = 0  # layers it recomputes whole (the planner's cost model)
    guarded = False  # the quality guard watches it (its threshold is calibrated on such a selector)

    @abstractmethod
    def select(self, ctx: SelectionContext) -> SelectionResult: ...


SELECTORS: dict[str, type[Selector]] = {}
"""Registered selectors by name. `qcfuse_core.selection` registers the shipped ones when it is
imported (every module of the package imports it first); `eval` registers the oracle."""


def register(cls: type[Selector]) -> type[Selector]:
    """Class decorator: make `cls` available by its `name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    SELECTORS[cls.name] = cls
    return cls


def get_selector(name: str) -> Selector:
    if name not in SELECTORS:
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(sorted(SELECTORS))}")
    return SELECTORS[name]()
