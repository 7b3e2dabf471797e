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
    ModelRunner.launch(caches, tokens, feed)
                                         device-side sampling: the step's greedy tokens are
                                         chosen on the device (in the graph), a row of
                                         `feed` takes its input from the previous step's
                                         token on the device, and the tokens' copy to the
                                         host is under way when it returns (`Launched`): the
                                         caller launches the next step before it reads them,
                                         so the host never waits between steps

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
from qcfuse_core.model.graphs import CaptureError, GraphDecoder, feed_ids

log = logging.getLogger(__name__)


class Launched:
    """One decode step launched by `ModelRunner.launch`: its logits (B, vocab) fp32 and greedy
    tokens (B,) int64 on the device, the tokens' copy to the host under way; `tokens()`
    waits for it."""

    def __init__(self, logits: torch.Tensor, greedy: torch.Tensor) -> None:
        self.logits, self.greedy = logits, greedy
        self._event = None
        if greedy.device.type == "cuda":
            self._host = torch.empty(greedy.shape, dtype=torch.int64, pin_memory=True)
            self._host.copy_(greedy, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = greedy

    def tokens(self) -> list[int]:
        """The step's greedy tokens, row by row (waits for the step on a GPU)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


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
        self._last: torch.Tensor | None = None  # the last step's greedy tokens, if it was a launch

    @property
    def graphs(self) -> bool:
        """Whether the steps are replayed from CUDA graphs (known after the first step)."""
        return self._graphs is not None

    def decode(self, caches: Sequence[KVCache], tokens: Sequence[int]) -> torch.Tensor:
        """One decode step of every sequence: token i appended to caches[i] -> logits (B, vocab)
        fp32; raises what the step raised."""
        return self._step(caches, tokens, None)[0]

    def launch(self, caches: Sequence[KVCache], tokens: Sequence[int], feed: Sequence[int] | None = None) -> Launched:
        """One decode step with device-side sampling (module docstring): row i's input is
        tokens[i], or where feed[i] >= 0 the greedy token of row feed[i] of the previous step,
        which must have been a `launch` of this runner. -> the step, its tokens' read-back
        under way. Raises what the step raised (nothing then read back)."""
        if feed is not None and self._last is None:
            raise ValueError("feed needs the previous step to have been a launch of this runner")
        logits, greedy = self._step(caches, tokens, feed)
        self._last = greedy
        return Launched(logits, greedy)

    def _step(
        self, caches: Sequence[KVCache], tokens: Sequence[int], feed: Sequence[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, greedy tokens where a launch needs them) of one step; `_last` cleared (a
        step that is not a launch feeds nobody)."""
        adapter, last = self.adapter, self._last
        self._last = None
        if not self._graphs_checked:
            self._graphs_checked = True
            if self.cuda_graphs and adapter.device.type == "cuda":
                try:
                    self._graphs = GraphDecoder(adapter, deterministic=self.deterministic, kv_fp8=caches[0].fp8)
                except ValueError as e:
                    log.warning("decoding without CUDA graphs: %s", e)
        if self._graphs is not None:
            try:
                return self._graphs.step_greedy(caches, tokens, feed)
            except CaptureError as e:  # nothing was written to the requests' caches
                log.warning("decoding without CUDA graphs from now on: %s", e)
                self._graphs = None
        if feed is not None:  # eager: the fed rows' tokens come to the host here
            assert last is not None
            ids = torch.tensor([int(t) for t in tokens], dtype=torch.int64, device=last.device)
            tokens = feed_ids(ids, torch.tensor(list(feed), dtype=torch.int64, device=last.device), last).tolist()
        logits = decode_batch(adapter, caches, tokens, tile=self.tile)
        return logits, logits.argmax(-1)

    @staticmethod
    def argmax(rows: Sequence[torch.Tensor]) -> list[int]:
        """The argmax of each logits row (vocab,), taken together on the device: one read-back."""
        return torch.stack(list(rows)).argmax(-1).tolist()
