"""The model runner: one decode step of every running request, on the engine's device.

    ModelRunner.decode(caches, tokens) -> logits (B, vocab) of every sequence
        on a CUDA device (cuda_graphs)   replayed from CUDA graphs (`graphs.GraphDecoder`),
                                         made at the first step; a step that cannot be
                                         captured decodes eagerly from then on
        otherwise                        `batched.decode_batch`; deterministic: its row-wise
                                         work on blocks of `deterministic_tile` rows, so a
                                         sequence's bits do not depend on its batch
        a batched step that raises       the scheduler runs it again one sequence at a time,
                                         to find the one it came from (the failed step wrote
                                         the others' caches at their next position only,
                                         which writing again replaces)
    ModelRunner.argmax(rows)             the tokens of plain greedy rows, taken together on
                                         the device: one read-back per step

The scheduler (engine/scheduler.py) decides which requests run; the runner only runs them.
It is used from one thread at a time (the scheduler's worker).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.model.batched import decode_batch, deterministic_tile
from qcfuse_core.model.fusion import KVCache
from qcfuse_core.model.graphs import CaptureError, GraphDecoder

log = logging.getLogger(__name__)


class ModelRunner:
    """Batched decode steps of one model (module docstring). cuda_graphs: replay the steps
    from CUDA graphs on a CUDA device; deterministic: batch-invariant rows (fixed blocks of
    rows eagerly, one bucket of rows in the graphs)."""

    def __init__(self, adapter: ModelAdapter, *, cuda_graphs: bool = True, deterministic: bool = False) -> None:
        self.adapter = adapter
        self.cuda_graphs, self.deterministic = cuda_graphs, deterministic
        self.tile = deterministic_tile(adapter.device) if deterministic else None
        self._graphs: GraphDecoder | None = None  # made at the first decode step
        self._graphs_checked = False

    def decode(self, caches: Sequence[KVCache], tokens: Sequence[int]) -> torch.Tensor:
        """One decode step of every sequence: token i appended to caches[i] -> logits (B, vocab)
        fp32; raises what the step raised."""
        adapter = self.adapter
        if not self._graphs_checked:
            self._graphs_checked = True
            if self.cuda_graphs and adapter.device.type == "cuda":
                try:
                    self._graphs = GraphDecoder(adapter, deterministic=self.deterministic)
                except ValueError as e:
                    log.warning("decoding without CUDA graphs: %s", e)
        if self._graphs is not None:
            try:
                return self._graphs.step(caches, tokens)
            except CaptureError as e:  # nothing was written to the requests' caches
                log.warning("decoding without CUDA graphs from now on: %s", e)
                self._graphs = None
        return decode_batch(adapter, caches, tokens, tile=self.tile)

    @staticmethod
    def argmax(rows: Sequence[torch.Tensor]) -> list[int]:
        """The argmax of each logits row (vocab,), taken together on the device: one read-back."""
        return torch.stack(list(rows)).argmax(-1).tolist()
