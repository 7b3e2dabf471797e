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

import math
from dataclasses import dataclass, field

import torch

from qcfuse_core.fusion import FusedPrompt
from qcfuse_core.model import ModelAdapter
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


class Selector:
    name = ""
    uses_ratio = True

    def select(self, ctx: SelectionContext) -> SelectionResult:
        raise NotImplementedError


class FullSelector(Selector):
    """Everything (ordinary prefill) - the quality reference."""

    name = "full"
    uses_ratio = False

    def select(self, ctx: SelectionContext) -> SelectionResult:
        return SelectionResult(method=self.name, rows=torch.arange(ctx.prompt.num_tokens))


class NaiveSelector(Selector):
    """Nothing but glue and suffix: plain concatenation of chunk caches."""

    name = "naive"
    uses_ratio = False

    def select(self, ctx: SelectionContext) -> SelectionResult:
        return ctx.finalize(self.name, torch.empty(0, dtype=torch.int64))


class EpicSelector(Selector):
    """The first tokens of every chunk (EPIC). Budget-matched: ceil(budget / chunks) per chunk,
    or a fixed `epic_k` when given in options."""

    name = "epic"

    def select(self, ctx: SelectionContext) -> SelectionResult:
        spans = ctx.prompt.chunk_spans()
        if not spans:
            return ctx.finalize(self.name, torch.empty(0, dtype=torch.int64))
        k = ctx.options.get("epic_k") or math.ceil(ctx.budget / len(spans))
        chosen = [torch.arange(s, min(e, s + k)) for s, e in spans]
        return ctx.finalize(self.name, torch.cat(chosen))


class RandomSelector(Selector):
    """Uniformly random chunk tokens at the same budget (a floor)."""

    name = "random"

    def select(self, ctx: SelectionContext) -> SelectionResult:
        pool = torch.nonzero(ctx.prompt.mask("chunk")).flatten()
        g = torch.Generator().manual_seed(ctx.seed)
        pick = pool[torch.randperm(pool.numel(), generator=g)[: ctx.budget]]
        return ctx.finalize(self.name, pick)


SELECTORS: dict[str, type[Selector]] = {
    cls.name: cls for cls in (FullSelector, NaiveSelector, EpicSelector, RandomSelector)
}


def register(cls: type[Selector]) -> type[Selector]:
    SELECTORS[cls.name] = cls
    return cls


def get_selector(name: str) -> Selector:
    if name not in SELECTORS:
        raise ValueError(f"unknown method {name!r}; valid: {', '.join(sorted(SELECTORS))}")
    return SELECTORS[name]()
