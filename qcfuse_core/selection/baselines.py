"""The baselines: full prefill, naive concatenation, EPIC's chunk heads, a random floor."""

from __future__ import annotations

import math

import torch

from qcfuse_core.selection.base import SelectionContext, Selector, register
from qcfuse_core.types import SelectionResult


@register
class FullSelector(Selector):
    """Everything (ordinary prefill) - the quality reference."""

    name = "full"
    uses_ratio = False
    fused = False

    def select(self, ctx: SelectionContext) -> SelectionResult:
        return SelectionResult(method=self.name, rows=torch.arange(ctx.prompt.num_tokens))


@register
class NaiveSelector(Selector):
    """Nothing but glue and suffix: plain concatenation of chunk caches."""

    name = "naive"
    uses_ratio = False

    def select(self, ctx: SelectionContext) -> SelectionResult:
        return ctx.finalize(self.name, torch.empty(0, dtype=torch.int64))


@register
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


@register
class RandomSelector(Selector):
    """Uniformly random chunk tokens at the same budget (a floor)."""

    name = "random"

    def select(self, ctx: SelectionContext) -> SelectionResult:
        pool = torch.nonzero(ctx.prompt.mask("chunk")).flatten()
        g = torch.Generator().manual_seed(ctx.seed)
        pick = pool[torch.randperm(pool.numel(), generator=g)[: ctx.budget]]
        return ctx.finalize(self.name, pick)
