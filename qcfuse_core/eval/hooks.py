"""The one door eval takes into an engine's internals.

What measures below the engine's public face - `bench quality` (a request's steps one at a
time, teacher forcing), `profile-layers` and `calibrate-budget` (a selection without its
prefill, the options a selector is handed), `bench ttft` (variants' selection options and
the planner's rates switched on one warm engine), `bench load` (the same model under
another config) - reaches it through `internals(engine)`. No other module of
qcfuse_core.eval touches a private member of the engine (tests/test_layout.py checks it),
so what eval depends on is declared here, in one place:

    steps                      the request's steps (engine/pipeline.py `Steps`)
    selection_options(m, o)    the options `Steps.select` hands method m's selector
    replace(store, config, rates)
                               a new engine on the same model and text index
    use(selection, rates)      this engine's selection options and the planner's rates,
                               switched in place between requests
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from qcfuse_core.cache.planner import Rates
from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.engine.config import EngineConfig, as_selection
from qcfuse_core.engine.pipeline import Steps
from qcfuse_core.selection.options import QCFuseOptions
from qcfuse_core.store import ChunkStore


class EngineInternals:
    """What eval may use of one engine beyond its public face (module docstring)."""

    def __init__(self, engine: QCFuseEngine) -> None:
        self.engine = engine

    @property
    def steps(self) -> Steps:
        return self.engine._steps

    def selection_options(self, method: str, options: dict | None = None) -> dict:
        """The options `Steps.select` hands the selector of `method`: `options` (else the
        engine's config), the critical layers filled in, and the model profile's ranking
        options where those layers come from it."""
        return self.engine._steps.selection_options(method, options)

    def replace(
        self,
        *,
        store: ChunkStore | None = None,
        config: EngineConfig | None = None,
        rates: Rates | None | Literal[True] = True,
    ) -> QCFuseEngine:
        """A new engine on the same model and chunk-text index, with another store, config or
        rates (`rates=None`: no planner; the default keeps this engine's)."""
        engine = self.engine
        return QCFuseEngine(
            engine.adapter,
            store=store if store is not None else engine.caches.store,
            config=config if config is not None else engine.config,
            text_index=engine.caches.texts,
            rates=engine._steps.rates if rates is True else rates,
        )

    def use(self, *, selection: QCFuseOptions | dict[str, Any], rates: Rates | None) -> None:
        """Switch this engine's selection options and the planner's rates between requests,
        keeping its caches, memory tiers and scheduler warm (`bench ttft`'s variants)."""
        engine = self.engine
        engine._config = dataclasses.replace(engine._config, selection=as_selection(selection))
        engine._steps.rates = rates


def internals(engine: QCFuseEngine) -> EngineInternals:
    return EngineInternals(engine)
