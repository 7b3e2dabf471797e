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
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields

import torch

from qcfuse_core import critical_layers
from qcfuse_core.anchors import AnchorConfig, ensure_anchors, repeat_prompt_ids
from qcfuse_core.fusion import FusedPrompt, LayerState
from qcfuse_core.model import ModelAdapter, to_device
from qcfuse_core.probe import ProbeResult, context_keys_at, gather_context, query_mass, run_probe
from qcfuse_core.scoring import (
    ALLOCATIONS, BUDGET_MODES, AdaptiveBudget, adaptive_count, chunk_quotas, covered_share, rank, top_budget,
)
from qcfuse_core.types import SelectionResult
from qcfuse_core.windows import exact_rows


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
    uses_ratio = True

    @abstractmethod
    def select(self, ctx: SelectionContext) -> SelectionResult: ...


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


# ----------------------------------------------------------------------------- query-aware methods
# qcfuse / qcall / qclast probe the query and rank chunk tokens by the attention mass they
# receive (probe.py); cacheblend ranks them by V deviation at layer 1 inside the fused
# prefill. Their options come from SelectionContext.options, parsed into QCFuseOptions.


def v_deviation(state: LayerState) -> torch.Tensor:
    """(R,) host: how far each current row's fresh V is from its cached V (sum of squares over
    heads and dims) - CacheBlend's staleness signal, also read by qcfuse's `deviation_pool`."""
    return (state.v_fresh.float() - state.v_cached[state.rows].float()).pow(2).sum(dim=(1, 2)).cpu()


PROBING_METHODS = frozenset({"qcfuse", "adaptive", "oracle"})
"""Methods that probe the query against anchors at the critical layers (the engine loads
their chunks' probe sidecars and resolves the critical layers for them)."""

DEVIATION_LAYER = 1  # the layer whose fresh-vs-cached V deviation `deviation_pool` reads (as CacheBlend)
QUERY_ROWS = 0
"""Default suffix rows scored: 0 = every suffix row, as the paper averages. The last 8 rows
(for the engine's prompt: the answer cue "short sentence." and the chat markers, whose last
row yields the first token) were tried on the calibration split musique_train: first-token KL
at 0.3 fell 20% on 24 questions but rose 6% on 24 others, and agreement with full's answer
fell (docs/quality-history.md, "Scoring variants") - so the option stays an off-by-default ablation."""
FIXED_BUDGET_OPTIONS = ("chunk_sinks", "deviation_pool")
"""Options only a fixed budget takes (QCFuseOptions refuses them with the adaptive one): a
model profile's are left out where the budget is adaptive."""


@dataclass(frozen=True)
class QCFuseOptions:
    critical_layers: tuple[int, ...] | None = None  # None: critical_layers.lookup(model)
    anchor_method: str = "keynorm"
    anchor_share: float = 0.125
    sinks: int = 4
    budget: str = "fixed"  # fixed (ratio x context) | adaptive (cover target mass)
    target_mass: float = 0.8
    floor: float = 0.05
    ceiling: float = 0.5
    spread: int = 0  # rank by 0.5 x mass + 0.5 x the max mass within +-spread positions (0: off)
    allocation: str = "global"  # global top-k (the paper) | chunk: budget split by chunk mass, top-k inside
    # score with the attention of the suffix's last N rows only (an ablation: the answer cue,
    # whose final row yields the first token); 0: every suffix row, as the paper averages
    query_rows: int = QUERY_ROWS
    # 0: off (the paper). k > 0: layers 0-1 run for the top k x budget chunk tokens by mass;
    # after layer 1 the budget keeps those with the largest mass x V deviation (fresh layer-1 V
    # vs cached: CacheBlend's staleness signal) - attended and stale
    deviation_pool: float = 0.0
    # 0: off (the paper). a > 0: rank chunk tokens by mass x (1 + position inside the chunk)^-a.
    # A chunk cached alone is stalest at its start (its first tokens never saw what precedes
    # them in the prompt; measured staleness falls ~ (1 + position)^-0.8): a prior for how
    # much recomputing an attended token changes, known without computing anything. With the
    # adaptive budget the target is a share of these weighted scores (what calibrate-budget
    # measures with the same option)
    position_prior: float = 0.0
    # 0: off. d > 0: the position prior stops falling at position d inside a chunk (every
    # deeper token weighs (1 + d)^-a). Measured staleness flattens after a chunk's first
    # ~128 tokens (Gemma-3-270M, docs/benchmarks.md "Long chunks"), while (1 + position)^-a
    # keeps falling: on long chunks a steep prior would leave the deep attended tokens stale
    prior_depth: int = 0
    # 0: off. k > 0: the first k tokens of every chunk are recomputed before any ranked token
    # (within the same budget). A chunk cached alone began at position 0, where a model puts
    # its attention sink; in the fused prompt those cached entries are the stalest of all, and
    # the query's attention does not point at them (Gemma-3-270M, hotpotqa q0, 0.3: adding
    # each chunk's first 4 tokens to qcfuse's rows took the first-token KL from 0.065 to 0.020)
    chunk_sinks: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.spread, int) or self.spread < 0:
            raise ValueError(f"spread must be a non-negative int, got {self.spread!r}")
        if isinstance(self.query_rows, bool) or not isinstance(self.query_rows, int) or self.query_rows < 0:
            raise ValueError(f"query_rows must be a non-negative int (0: every suffix row), got {self.query_rows!r}")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"unknown allocation {self.allocation!r}; valid: {', '.join(ALLOCATIONS)}")
        if not isinstance(self.deviation_pool, (int, float)) or isinstance(self.deviation_pool, bool) or not (
                self.deviation_pool == 0 or self.deviation_pool >= 1):
            raise ValueError(f"deviation_pool must be 0 (off) or >= 1, got {self.deviation_pool!r}")
        if self.deviation_pool and (self.budget != "fixed" or self.allocation != "global"):
            raise ValueError("deviation_pool re-ranks a fixed global budget; use budget='fixed', allocation='global'")
        if not isinstance(self.position_prior, (int, float)) or isinstance(self.position_prior, bool) or not (
                0 <= self.position_prior <= 4):
            raise ValueError(f"position_prior must be a number in [0, 4] (0: off), got {self.position_prior!r}")
        if isinstance(self.prior_depth, bool) or not isinstance(self.prior_depth, int) or self.prior_depth < 0:
            raise ValueError(f"prior_depth must be a non-negative int (0: off), got {self.prior_depth!r}")
        if self.prior_depth and not self.position_prior:
            raise ValueError("prior_depth bounds the position prior; set position_prior too")
        if isinstance(self.chunk_sinks, bool) or not isinstance(self.chunk_sinks, int) or self.chunk_sinks < 0:
            raise ValueError(f"chunk_sinks must be a non-negative int (0: off), got {self.chunk_sinks!r}")
        if self.chunk_sinks and self.budget != "fixed":
            raise ValueError("chunk_sinks comes out of a fixed budget; use budget='fixed'")
        if self.allocation != "global" and self.budget != "fixed":
            raise ValueError("allocation 'chunk' splits a fixed budget; use it with budget='fixed'")
        if self.budget not in BUDGET_MODES:
            raise ValueError(f"unknown budget mode {self.budget!r}; valid: {', '.join(BUDGET_MODES)}")
        AnchorConfig(self.anchor_method, self.anchor_share, self.sinks)  # validates
        AdaptiveBudget(self.target_mass, self.floor, self.ceiling)
        if self.critical_layers is not None and not self.critical_layers:
            raise ValueError("critical_layers must be non-empty (or None to look them up)")

    @classmethod
    def from_options(cls, options: dict) -> "QCFuseOptions":
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in options.items() if k in known}
        if kw.get("critical_layers") is not None:
            kw["critical_layers"] = tuple(int(x) for x in kw["critical_layers"])
        return cls(**kw)

    @property
    def anchors(self) -> AnchorConfig:
        return AnchorConfig(self.anchor_method, self.anchor_share, self.sinks)


def parse_selection_options(text: str) -> dict:
    """'KEY=VALUE[,KEY=VALUE]' -> QCFuseOptions keywords (validated). Values are JSON when they
    parse (2, 0.5, true, [1, 2]), strings otherwise. Raises ValueError naming what is wrong."""
    import json
    import re

    opts: dict = {}
    for item in re.split(r",(?=\s*[A-Za-z_]\w*=)", text):  # a comma inside a JSON value ([3,5]) stays
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{item!r} is not KEY=VALUE")
        try:
            opts[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            opts[key.strip()] = value
    unknown = set(opts) - {f.name for f in fields(QCFuseOptions)}
    if unknown:
        raise ValueError(f"unknown selection options {sorted(unknown)}; valid: "
                         f"{', '.join(f.name for f in fields(QCFuseOptions))}")
    try:
        QCFuseOptions.from_options(opts)
    except TypeError as e:
        raise ValueError(str(e)) from e
    return opts


class QueryAwareSelector(Selector):
    """Shared tail of qcfuse / qcall / qclast: per-position scores -> rows + details.

    query_aware: the selection reads the suffix (the last segment) as the query.
    """

    query_aware = True

    def choose(self, ctx: SelectionContext, opts: QCFuseOptions, mass: torch.Tensor, details: dict) -> SelectionResult:
        """mass (T,) fp32 over prompt positions, on any device -> SelectionResult (chunk tokens ranked).

        A fixed budget is ranked where the mass lives (on a GPU: no host sort of ~10K scores
        while the GPU idles); the chosen positions and the scores come back in one copy.
        """
        prompt = ctx.prompt
        cand = candidates(ctx.adapter, prompt)
        rank_by = ranking_scores(prompt, mass, opts)
        if opts.allocation == "chunk":  # an ablation: each chunk gets budget x its share of the mass
            n = ctx.budget
            mass, rank_by = mass.cpu(), rank_by.cpu()
            spans = prompt.chunk_spans()
            quotas = chunk_quotas([float(mass[s:e].clamp_min(0).sum()) for s, e in spans],
                                  [e - s for s, e in spans], n)
            picked = [top_budget(torch.arange(s, e), rank_by[s:e], q) for (s, e), q in zip(spans, quotas)]
            chosen = torch.cat(picked) if picked else torch.empty(0, dtype=torch.int64)
            covered = _covered(mass, cand, chosen)
        elif opts.budget == "fixed":
            n = ctx.budget
            cand_d = to_device(cand, mass.device)
            order = rank(rank_by[cand_d])[: max(0, min(int(n), cand.numel()))]
            cand_mass = mass[cand_d]
            shares = torch.stack([cand_mass[order].clamp_min(0).sum(), cand_mass.clamp_min(0).sum()])
            chosen = torch.sort(cand_d[order]).values
            chosen, mass, shares = chosen.cpu(), mass.cpu(), shares.cpu()
            covered = float(shares[0] / shares[1]) if float(shares[1]) > 0 else 0.0
        else:
            mass, rank_by = mass.cpu(), rank_by.cpu()
            cand_scores = rank_by[cand]
            ab = AdaptiveBudget(opts.target_mass, opts.floor, opts.ceiling)
            ctx_n = prompt.context_tokens
            n = adaptive_count(cand_scores, ab.target, int(round(ab.floor * ctx_n)), int(round(ab.ceiling * ctx_n)))
            chosen = top_budget(cand, cand_scores, n)
            covered = _covered(mass, cand, chosen)  # of the mass, also when ranked by spread
        details.update(
            budget_mode=opts.budget, budget=int(n), positions=chosen, selected_scores=mass[chosen],
            mass_covered=covered, spread=opts.spread, allocation=opts.allocation, query_rows=opts.query_rows,
            deviation_pool=opts.deviation_pool, position_prior=opts.position_prior, prior_depth=opts.prior_depth,
            chunk_sinks=opts.chunk_sinks,
        )
        ctx_pos = torch.nonzero(prompt.mask("chunk", "text")).flatten()
        if opts.deviation_pool:
            return self._deviation_rerank(ctx, opts, mass.cpu(), rank_by.cpu(), cand, int(n), details, ctx_pos)
        return ctx.finalize(self.name, chosen, scores=_at(mass, ctx_pos), details=details)

    def _deviation_rerank(self, ctx: SelectionContext, opts: QCFuseOptions, mass: torch.Tensor, rank_by: torch.Tensor,
                          cand: torch.Tensor, n: int, details: dict, ctx_pos: torch.Tensor) -> SelectionResult:
        """Layers 0-1 for the top pool x n candidates by mass; after layer 1 keep the n with the
        largest mass x V deviation (host tensors in, rows narrowed by the hook)."""
        pool = top_budget(cand, rank_by[cand], int(round(opts.deviation_pool * n)))
        sel = ctx.finalize(self.name, pool, scores=_at(mass, ctx_pos), details=details)
        chunk_mask = ctx.prompt.mask("chunk")
        details.update(pool=pool)

        def on_layer_end(state: LayerState) -> torch.Tensor | None:
            if state.layer != DEVIATION_LAYER:
                return None
            cur = state.rows.cpu()  # may run past the prompt (rows a caller appended after it)
            keep = torch.zeros_like(cur, dtype=torch.bool)
            inside = cur < chunk_mask.numel()
            keep[inside] = chunk_mask[cur[inside]]
            dev = v_deviation(state)  # (R,)
            chosen = top_budget(cur[keep], mass[cur[keep]] * dev[keep], n)
            details.update(positions=chosen, selected_scores=mass[chosen],
                           deviation=dev[keep][torch.searchsorted(cur[keep], chosen)],
                           mass_covered=_covered(mass, cand, chosen))
            sel.rows = ctx.finalize(self.name, chosen).rows
            return sel.rows

        sel.on_layer_end = on_layer_end
        return sel

    @staticmethod
    def suffix(ctx: SelectionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Suffix ids and absolute positions (S,) each."""
        seg, start = ctx.prompt.segments[-1], ctx.prompt.starts[-1]
        return seg.token_ids, torch.arange(start, start + len(seg))

    @staticmethod
    def score(ctx: SelectionContext, probe: ProbeResult, layers, query_rows: int = 0) -> tuple[torch.Tensor, float]:
        """Mean over `layers` of the context mass from the last `query_rows` suffix rows (0: all)
        -> ((T,) fp32 over positions on the model's device, elapsed ms)."""
        t0 = time.perf_counter()
        adapter = ctx.adapter
        acc = None
        keys = context_keys_at(adapter, ctx.prompt, layers)
        pos = keys[0][1]  # the same positions at every layer
        pos_dev = to_device(pos, adapter.device)
        for layer, (k_ctx, _) in zip(layers, keys):
            m = query_mass(probe.q[layer], k_ctx, probe.k[layer], adapter.scale, last=query_rows,  # (N,) on the device
                           window=adapter.windows[layer], ctx_pos=pos_dev, q_start=ctx.prompt.starts[-1])
            acc = m if acc is None else acc + m
        mass = torch.zeros(ctx.prompt.num_tokens, device=acc.device)
        mass[pos_dev] = acc / len(layers)
        return mass, (time.perf_counter() - t0) * 1e3


def candidates(adapter: ModelAdapter, prompt: FusedPrompt) -> torch.Tensor:
    """(M,) host positions a selection may recompute: chunk tokens whose cache is not already
    exact (windows.py: deep inside a chunk, in models whose first layers are windowed)."""
    return torch.nonzero(prompt.mask("chunk") & ~exact_rows(adapter, prompt)).flatten()


def ranking_scores(prompt: FusedPrompt, mass: torch.Tensor, opts: QCFuseOptions) -> torch.Tensor:
    """(T,) probed mass -> what a budget ranks by (and the adaptive budget counts its target
    mass on): the mass, spread to neighbours, weighted by the position prior, with each
    chunk's first `chunk_sinks` tokens first (a fixed budget only)."""
    rank_by = spread_scores(mass, opts.spread)  # the mass itself unless spread > 0
    if opts.position_prior:
        rank_by = rank_by * chunk_position_prior(prompt, opts.position_prior, rank_by.device, opts.prior_depth)
    if opts.chunk_sinks:  # each chunk's first tokens rank before every scored token
        rank_by = rank_by.masked_fill(to_device(chunk_heads(prompt, opts.chunk_sinks), rank_by.device), float("inf"))
    return rank_by


def _at(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """values[positions] for sorted host positions; a contiguous run (the context between
    prefix and suffix, as the engine lays prompts out) is sliced, not gathered - indexing
    ~10K host scores took ~0.3-0.6 ms on the H200's host."""
    n = positions.numel()
    if n and int(positions[-1]) - int(positions[0]) + 1 == n:
        return values[int(positions[0]) : int(positions[-1]) + 1]
    return values[positions]


def _covered(mass: torch.Tensor, cand: torch.Tensor, chosen: torch.Tensor) -> float:
    """Share of the candidates' mass (host tensors) held by `chosen`, a sorted subset of `cand`."""
    chosen_mask = torch.zeros_like(cand, dtype=torch.bool)
    chosen_mask[torch.searchsorted(cand, chosen)] = True
    return covered_share(mass[cand], chosen_mask)


def chunk_heads(prompt: FusedPrompt, k: int) -> torch.Tensor:
    """(T,) bool on the host: the first k tokens of every chunk."""
    out = torch.zeros(prompt.num_tokens, dtype=torch.bool)
    for s, e in prompt.chunk_spans():
        out[s : min(e, s + k)] = True
    return out


def chunk_position_prior(prompt: FusedPrompt, a: float, device: torch.device | str = "cpu",
                         depth: int = 0) -> torch.Tensor:
    """(T,) fp32 on `device`: (1 + position inside the chunk)^-a on chunk tokens, 1 elsewhere;
    with depth d > 0 the position is taken as min(position, d).

    Built where it is used: a host tensor copied to a GPU from pageable memory would wait for
    the probe's kernels (a stream sync) before the ranking could start."""
    prior = torch.ones(prompt.num_tokens, device=device)
    for s, e in prompt.chunk_spans():
        pos = torch.arange(1, e - s + 1, dtype=torch.float32, device=device)
        prior[s:e] = (pos.clamp(max=depth + 1) if depth else pos) ** -a
    return prior


def spread_scores(mass: torch.Tensor, spread: int) -> torch.Tensor:
    """(T,) -> 0.5 x mass + 0.5 x (max of mass within +-spread positions); mass when spread == 0.

    A token next to a strongly attended one gets half of its neighbour's score, so spans
    around what the question points at (an entity and the fact beside it) are recomputed
    together; the attended token itself still ranks first.
    """
    if spread == 0:
        return mass
    pooled = torch.nn.functional.max_pool1d(mass[None, None].float(), 2 * spread + 1, stride=1, padding=spread)[0, 0]
    return 0.5 * mass + 0.5 * pooled


@register
class QCFuseSelector(QueryAwareSelector):
    """Probe the query against prefix + anchors up to the deepest critical layer; rank
    chunk tokens by the mass they receive at the critical layers (full K there)."""

    name = "qcfuse"

    def select(self, ctx: SelectionContext) -> SelectionResult:
        opts = QCFuseOptions.from_options(ctx.options)
        if opts.critical_layers is not None:
            layers, source = list(opts.critical_layers), "option"
        else:
            layers, source = critical_layers.lookup(ctx.adapter)
        depth = max(layers) + 1
        # 1. anchors (computed now only for chunks stored without them)
        t0 = time.perf_counter()
        acfg = opts.anchors
        repeat_ids = repeat_prompt_ids(ctx.adapter) if acfg.method == "repeat" else None
        anchors, fresh = {}, 0
        for seg in ctx.prompt.segments:
            if seg.kind == "chunk" and seg.chunk is not None:
                a, now = ensure_anchors(ctx.adapter, seg.chunk, depth, acfg, repeat_ids)
                anchors[id(seg)] = a
                fresh += now
        anchor_ms = (time.perf_counter() - t0) * 1e3
        # 2. probe the suffix against prefix + anchors
        context = gather_context(ctx.prompt, depth, lambda seg: anchors[id(seg)])
        ids, pos = self.suffix(ctx)
        probe = run_probe(ctx.adapter, ids, pos, context, keep=layers)
        # 3. score at the critical layers, 4. select
        mass, score_ms = self.score(ctx, probe, layers, opts.query_rows)
        anchor_pos = torch.cat([a[0] + st for s, st in zip(ctx.prompt.segments, ctx.prompt.starts)
                                if (a := anchors.get(id(s))) is not None]) if anchors else torch.empty(0, dtype=torch.int64)
        details = dict(
            critical_layers=layers, layers_source=source, anchor_method=acfg.method, anchor_share=acfg.share,
            anchors_per_layer=int(sum(a.shape[1] for a in anchors.values())), anchors_computed=fresh,
            anchor_positions_layer0=anchor_pos, anchor_ms=anchor_ms, probe_layer_ms=probe.layer_ms,
            probe_ms=probe.elapsed_ms, probe_graphed=probe.graphed, probe_context=probe.context_sizes,
            score_ms=score_ms,
        )
        return self.choose(ctx, opts, mass, details)


class _FullContextProbe(QueryAwareSelector):
    """Probe against every cached context token (no anchors) through `layers`."""

    @abstractmethod
    def layers(self, adapter) -> list[int]:
        """The layers probed against the full context cache."""

    def select(self, ctx: SelectionContext) -> SelectionResult:
        opts = QCFuseOptions.from_options(ctx.options)
        layers = self.layers(ctx.adapter)
        context = gather_context(ctx.prompt, max(layers) + 1, None)
        ids, pos = self.suffix(ctx)
        probe = run_probe(ctx.adapter, ids, pos, context, keep=layers)
        mass, score_ms = self.score(ctx, probe, layers, opts.query_rows)
        details = dict(critical_layers=layers, probe_layer_ms=probe.layer_ms, probe_ms=probe.elapsed_ms,
                       probe_graphed=probe.graphed, score_ms=score_ms)
        return self.choose(ctx, opts, mass, details)


@register
class QCAllSelector(_FullContextProbe):
    """Query attention at every layer against the full context cache (no anchors)."""

    name = "qcall"

    def layers(self, adapter) -> list[int]:
        return list(range(adapter.num_layers))


@register
class QCLastSelector(_FullContextProbe):
    """Query attention at the last layer only, against the full context cache."""

    name = "qclast"

    def layers(self, adapter) -> list[int]:
        return [adapter.num_layers - 1]


@register
class CacheBlendSelector(Selector):
    """Layers 0-1 for every token; after layer 1 keep the chunk tokens whose fresh V
    deviates most from the cached V (sum of squares over heads and dims)."""

    name = "cacheblend"
    check_layer = 1

    def select(self, ctx: SelectionContext) -> SelectionResult:
        base = ctx.finalize(self.name, torch.empty(0, dtype=torch.int64))  # glue + suffix
        sel = SelectionResult(method=self.name, rows=base.rows, full_layers=self.check_layer + 1)
        chunk_mask = ctx.prompt.mask("chunk")

        def on_layer_end(state: LayerState) -> torch.Tensor | None:
            if state.layer != self.check_layer:
                return None
            cur = state.rows.cpu()  # (T,) every row at this layer (and rows a caller appended after it)
            dev = v_deviation(state)  # (T,)
            inside = cur < chunk_mask.numel()
            is_chunk = torch.zeros_like(inside)
            is_chunk[inside] = chunk_mask[cur[inside]]
            cand = cur[is_chunk]
            chosen = top_budget(cand, dev[is_chunk], ctx.budget)
            res = ctx.finalize(self.name, chosen)
            ctx_pos = torch.nonzero(ctx.prompt.mask("chunk", "text")).flatten()
            full_dev = torch.zeros(ctx.prompt.num_tokens)
            full_dev[cur[inside]] = dev[inside]
            sel.scores = full_dev[ctx_pos]
            sel.details.update(positions=chosen, selected_scores=full_dev[chosen], budget=ctx.budget,
                               full_layers=self.check_layer + 1)
            sel.rows = res.rows
            return res.rows

        sel.on_layer_end = on_layer_end
        return sel


# the selection bound and the calibrated adaptive budget live in their own modules; importing
# them registers `oracle` and `adaptive`
from qcfuse_core import adaptive as _adaptive  # noqa: E402,F401
from qcfuse_core import oracle as _oracle  # noqa: E402,F401
