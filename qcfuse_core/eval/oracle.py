"""The selection bound: `oracle`, a ranking built from what only full prefill knows.

**A bound for benchmarks, never a serving method**: to rank, it runs full prefill of the
whole prompt first (every row recomputed, through the engine's own layer loop), which costs
more than the answer it would speed up. `bench quality` runs it beside qcfuse so each table
shows how far qcfuse's fidelity is from the best ranking constructed so far.

Per chunk token t the oracle scores

    score(t) = mass(t) x staleness(t)

    mass(t)       qcfuse's probed attention mass: the question's attention to t under the
                  fused (stale) cache, at the critical layers, as the shipped probe measures it
    staleness(t)  sum over layers l of |dK_l(t)|^2 / mean_chunk |dK_l|^2 + |dV_l(t)|^2 / mean_chunk |dV_l|^2
                  with dK, dV = the token's fresh (in-context, full prefill) pre-RoPE K and V
                  minus its cached (chunk computed alone) K and V

and recomputes the top `ratio x context` chunk tokens (glue and suffix always, prefix never,
as every selector). Of the privileged rankings tried on the calibration split (true
attention alone, staleness alone, true attention x staleness, probed mass x staleness, ...;
compared with one-off diagnostics kept in the project history), this one gave the lowest first-token KL: attention has to be
measured *under the stale cache* (full prefill's own attention ignores the alone caches'
spurious sinks, which the fused prompt does attend to), and a token is worth recomputing
when it is both attended and stale.

The staleness of a prompt is computed once and kept on the prompt object (a request's own
state), so the oracle at several ratios of one prompt pays for one full prefill.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.model.fusion import FusedPrompt, LayerState, fused_prefill
from qcfuse_core.selection.base import SelectionContext, register
from qcfuse_core.selection.options import QCFuseOptions
from qcfuse_core.selection.selectors import QCFuseSelector, QueryAwareSelector
from qcfuse_core.types import KVChunk, SelectionResult

_MEMO = "_oracle_staleness"  # attribute of the FusedPrompt holding its (T,) staleness
# qcfuse options that re-rank, re-size or pre-place the probed mass: the oracle replaces the
# ranking (a profile's prior_depth without its position_prior would not even validate)
_RANKING_OPTIONS = ("deviation_pool", "position_prior", "prior_depth", "spread", "allocation", "chunk_sinks")


def deviations(adapter: ModelAdapter, prompt: FusedPrompt) -> tuple[torch.Tensor, torch.Tensor]:
    """Full prefill of `prompt` (every row) -> (dk, dv), each (L, T) fp32 on the host:
    |fresh pre-RoPE K - cached K|^2 and |fresh V - cached V|^2 summed over heads and dims
    (uncached rows: against zeros; only chunk rows are read)."""
    bad = [i for i, s in enumerate(prompt.segments) if s.chunk is not None and not isinstance(s.chunk, KVChunk)]
    if bad:
        raise ValueError(
            "the oracle needs every chunk cache in memory (segments "
            f"{bad} are lazy views); it is a benchmark bound - look up with streaming=False"
        )
    dk, dv = [], []

    def on_layer_end(state: LayerState) -> None:
        dk.append((state.k_pre_fresh.float() - state.k_pre_cached.float()).pow(2).sum((1, 2)).cpu())
        dv.append((state.v_fresh.float() - state.v_cached.float()).pow(2).sum((1, 2)).cpu())
        return None

    fused_prefill(adapter, prompt, torch.arange(prompt.num_tokens), on_layer_end=on_layer_end, logits_last=1)
    return torch.stack(dk), torch.stack(dv)


def staleness(dk: torch.Tensor, dv: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
    """(L, T) deviations, (T,) bool chunk mask -> (T,) staleness: per layer each of dK and dV
    divided by its mean over chunk tokens (so every layer weighs the same), summed over layers.
    A layer whose chunk mean is 0 (e.g. layer 0, where a token's K/V do not depend on its
    context) contributes 0."""

    def norm(d: torch.Tensor) -> torch.Tensor:
        mean = d[:, chunk].mean(1, keepdim=True)
        return torch.where(mean > 0, d / mean.clamp_min(1e-30), torch.zeros_like(d))

    return (norm(dk.float()) + norm(dv.float())).sum(0)


def prompt_staleness(adapter: ModelAdapter, prompt: FusedPrompt) -> tuple[torch.Tensor, float, bool]:
    """(T,) staleness of `prompt` (computed once per prompt) -> (staleness, ms, reused)."""
    memo = getattr(prompt, _MEMO, None)
    if memo is not None:
        return memo, 0.0, True
    t0 = time.perf_counter()
    dk, dv = deviations(adapter, prompt)
    s = staleness(dk, dv, prompt.mask("chunk"))
    setattr(prompt, _MEMO, s)
    return s, (time.perf_counter() - t0) * 1e3, False


@register
class OracleSelector(QueryAwareSelector):
    """Probed attention mass x true staleness (from full prefill): the selection bound.

    Needs full prefill before selecting - a benchmark bound, never a serving method. Budget
    options (fixed / adaptive) apply as for qcfuse; re-ranking options do not."""

    name = "oracle"
    probes = True

    def select(self, ctx: SelectionContext) -> SelectionResult:
        opts = QCFuseOptions.from_options(ctx.options)
        probe_opts = {k: v for k, v in ctx.options.items() if k not in _RANKING_OPTIONS}
        probe_opts["budget"] = "fixed"
        probed = QCFuseSelector().select(SelectionContext(ctx.adapter, ctx.prompt, ctx.ratio, ctx.seed, probe_opts))
        prompt = ctx.prompt
        mass = torch.zeros(prompt.num_tokens)
        assert probed.scores is not None  # qcfuse scores every context token
        mass[torch.nonzero(prompt.mask("chunk", "text")).flatten()] = probed.scores.float().cpu()
        stale, stale_ms, reused = prompt_staleness(ctx.adapter, prompt)
        details: dict[str, Any] = {
            k: probed.details[k] for k in ("critical_layers", "layers_source", "probe_ms") if k in probed.details
        }
        details.update(oracle_ms=stale_ms, oracle_reused=reused, probed_mass=mass)
        plain = QCFuseOptions(
            critical_layers=opts.critical_layers,
            anchor_method=opts.anchor_method,
            anchor_share=opts.anchor_share,
            sinks=opts.sinks,
            budget=opts.budget,
            target_mass=opts.target_mass,
            floor=opts.floor,
            ceiling=opts.ceiling,
        )
        return self.choose(ctx, plain, mass * stale, details)
