"""The query-aware selectors: qcfuse (probe + rank), its full-context ablations, CacheBlend."""

from __future__ import annotations

import time
from abc import abstractmethod
from dataclasses import dataclass, field

import torch

from qcfuse_core.model.adapter import ModelAdapter, to_device
from qcfuse_core.model.fusion import FusedPrompt, LayerState
from qcfuse_core.model.windows import exact_rows
from qcfuse_core.selection import profiles as critical_layers
from qcfuse_core.selection.anchors import ensure_anchors, repeat_prompt_ids
from qcfuse_core.selection.base import SelectionContext, Selector, get_selector, register
from qcfuse_core.selection.options import DEVIATION_LAYER, QCFuseOptions
from qcfuse_core.selection.probe import (
    ProbeItem,
    ProbeResult,
    context_keys_at,
    gather_context,
    query_mass,
    run_probe,
)
from qcfuse_core.selection.scoring import AdaptiveBudget, adaptive_count, chunk_quotas, covered_share, rank, top_budget
from qcfuse_core.types import SelectionResult

# ----------------------------------------------------------------------------- query-aware methods
# qcfuse / qcall / qclast probe the query and rank chunk tokens by the attention mass they
# receive (probe.py); cacheblend ranks them by V deviation at layer 1 inside the fused
# prefill. Their options come from SelectionContext.options, parsed into QCFuseOptions.


@dataclass
class ProbeRequest:
    """A probing selector's request before its probe: the probe to run and what the
    selection reads afterwards (its context, parsed options, details so far)."""

    ctx: SelectionContext
    item: ProbeItem
    opts: QCFuseOptions
    details: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # a subclass's own (the adaptive budget's target)


def rechoose(ctx: SelectionContext, sel: SelectionResult) -> SelectionResult | None:
    """A probing selection `sel` again at `ctx.ratio`, ranked from its own scores: the rows
    `select` at that ratio picks (the probe does not depend on the ratio), without probing
    again - what the quality guard's ladder reuses. None where that cannot be done: a
    selector without per-token scores, or one whose budget is adaptive."""
    selector = get_selector(sel.method)
    if not isinstance(selector, QueryAwareSelector) or sel.scores is None or selector.adaptive_budget:
        return None
    opts = QCFuseOptions.from_options(ctx.options)
    if opts.budget != "fixed":
        return None
    prompt = ctx.prompt
    mass = torch.zeros(prompt.num_tokens)
    mass[torch.nonzero(prompt.mask("chunk", "text")).flatten()] = sel.scores.float().cpu()
    keep = ("critical_layers", "layers_source", "anchor_method", "anchor_share", "anchors_per_layer")
    return selector.choose(ctx, opts, mass, {k: sel.details[k] for k in keep if k in sel.details})


def v_deviation(state: LayerState) -> torch.Tensor:
    """(R,) host: how far each current row's fresh V is from its cached V (sum of squares over
    heads and dims) - CacheBlend's staleness signal, also read by qcfuse's `deviation_pool`."""
    return (state.v_fresh.float() - state.v_cached[state.rows].float()).pow(2).sum(dim=(1, 2)).cpu()


class QueryAwareSelector(Selector):
    """Shared tail of qcfuse / qcall / qclast: per-position scores -> rows + details.

    query_aware: the selection reads the suffix (the last segment) as the query.
    """

    query_aware = True

    def probe_request(self, ctx: SelectionContext) -> ProbeRequest | None:
        """What to probe for this request (its query, context and layers) and what the
        selection needs afterwards; None for a selector that probes its own way in `select`."""
        return None

    def from_probe(self, req: ProbeRequest, probe: ProbeResult) -> SelectionResult:
        """The selection from this request's probe."""
        raise NotImplementedError(f"{self.name} selects in select()")

    def select(self, ctx: SelectionContext) -> SelectionResult:
        req = self.probe_request(ctx)
        if req is None:
            raise NotImplementedError(f"{self.name} implements neither select nor probe_request")
        it = req.item
        return self.from_probe(req, run_probe(ctx.adapter, it.ids, it.positions, it.context, keep=it.keep))

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
            quotas = chunk_quotas([float(mass[s:e].clamp_min(0).sum()) for s, e in spans], [e - s for s, e in spans], n)
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
            budget_mode=opts.budget,
            budget=int(n),
            positions=chosen,
            selected_scores=mass[chosen],
            mass_covered=covered,
            spread=opts.spread,
            allocation=opts.allocation,
            query_rows=opts.query_rows,
            deviation_pool=opts.deviation_pool,
            position_prior=opts.position_prior,
            prior_depth=opts.prior_depth,
            chunk_sinks=opts.chunk_sinks,
        )
        ctx_pos = torch.nonzero(prompt.mask("chunk", "text")).flatten()
        if opts.deviation_pool:
            return self._deviation_rerank(ctx, opts, mass.cpu(), rank_by.cpu(), cand, int(n), details, ctx_pos)
        return ctx.finalize(self.name, chosen, scores=_at(mass, ctx_pos), details=details)

    def _deviation_rerank(
        self,
        ctx: SelectionContext,
        opts: QCFuseOptions,
        mass: torch.Tensor,
        rank_by: torch.Tensor,
        cand: torch.Tensor,
        n: int,
        details: dict,
        ctx_pos: torch.Tensor,
    ) -> SelectionResult:
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
            details.update(
                positions=chosen,
                selected_scores=mass[chosen],
                deviation=dev[keep][torch.searchsorted(cur[keep], chosen)],
                mass_covered=_covered(mass, cand, chosen),
            )
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
            m = query_mass(
                probe.q[layer],
                k_ctx,
                probe.k[layer],
                adapter.scale,
                last=query_rows,  # (N,) on the device
                window=adapter.windows[layer],
                ctx_pos=pos_dev,
                q_start=ctx.prompt.starts[-1],
            )
            acc = m if acc is None else acc + m
        assert acc is not None  # `layers` is not empty (keys[0] above)
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


def chunk_position_prior(
    prompt: FusedPrompt, a: float, device: torch.device | str = "cpu", depth: int = 0
) -> torch.Tensor:
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
    probes = True
    profiled = True
    guarded = True

    def probe_request(self, ctx: SelectionContext) -> ProbeRequest:
        """Anchors (computed now only for chunks stored without them) and the probe's context:
        everything before the probe, which a batch runs for many requests at once."""
        opts = QCFuseOptions.from_options(ctx.options)
        if opts.critical_layers is not None:
            layers, source = list(opts.critical_layers), "option"
        else:
            layers, source = critical_layers.lookup(ctx.adapter)
        depth = max(layers) + 1
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
        context = gather_context(ctx.prompt, depth, lambda seg: anchors[id(seg)])
        ids, pos = self.suffix(ctx)
        anchor_pos = (
            torch.cat(
                [
                    got[0] + st
                    for s, st in zip(ctx.prompt.segments, ctx.prompt.starts)
                    if (got := anchors.get(id(s))) is not None
                ]
            )
            if anchors
            else torch.empty(0, dtype=torch.int64)
        )
        details = dict(
            critical_layers=layers,
            layers_source=source,
            anchor_method=acfg.method,
            anchor_share=acfg.share,
            anchors_per_layer=int(sum(a.shape[1] for a in anchors.values())),
            anchors_computed=fresh,
            anchor_positions_layer0=anchor_pos,
            anchor_ms=anchor_ms,
        )
        return ProbeRequest(ctx, ProbeItem(ids, pos, context, layers), opts, details)

    def from_probe(self, req: ProbeRequest, probe: ProbeResult) -> SelectionResult:
        """Score at the critical layers, then select."""
        ctx, layers = req.ctx, list(req.item.keep)
        mass, score_ms = self.score(ctx, probe, layers, req.opts.query_rows)
        details = dict(
            req.details,
            probe_layer_ms=probe.layer_ms,
            probe_ms=probe.elapsed_ms,
            probe_graphed=probe.graphed,
            probe_batch=probe.batch,
            probe_context=probe.context_sizes,
            score_ms=score_ms,
        )
        return self.choose(ctx, req.opts, mass, details)


class _FullContextProbe(QueryAwareSelector):
    """Probe against every cached context token (no anchors) through `layers`."""

    @abstractmethod
    def layers(self, adapter) -> list[int]:
        """The layers probed against the full context cache."""

    def probe_request(self, ctx: SelectionContext) -> ProbeRequest:
        layers = self.layers(ctx.adapter)
        context = gather_context(ctx.prompt, max(layers) + 1, None)
        ids, pos = self.suffix(ctx)
        return ProbeRequest(ctx, ProbeItem(ids, pos, context, layers), QCFuseOptions.from_options(ctx.options), {})

    def from_probe(self, req: ProbeRequest, probe: ProbeResult) -> SelectionResult:
        layers = list(req.item.keep)
        mass, score_ms = self.score(req.ctx, probe, layers, req.opts.query_rows)
        details = dict(
            critical_layers=layers,
            probe_layer_ms=probe.layer_ms,
            probe_ms=probe.elapsed_ms,
            probe_graphed=probe.graphed,
            probe_batch=probe.batch,
            score_ms=score_ms,
        )
        return self.choose(req.ctx, req.opts, mass, details)


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
    planner_full_layers = check_layer + 1  # layers 0-1 run for every token

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
            sel.details.update(
                positions=chosen, selected_scores=full_dev[chosen], budget=ctx.budget, full_layers=self.check_layer + 1
            )
            sel.rows = res.rows
            return res.rows

        sel.on_layer_end = on_layer_end
        return sel
