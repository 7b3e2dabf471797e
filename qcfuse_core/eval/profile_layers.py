"""Critical-layer profiling: rank layers by how well selecting from each preserves full prefill.

For each calibration example:

    1. build the prompt (chunk caches alone) and the full-prefill reference logits
    2. probe the query once against prefix + anchors through every layer (the same probe
       QCFuse runs, only deeper), scoring the context at every layer l
    3. for each layer l: recompute the top `ratio` chunk tokens by layer l's mass alone;
       fused prefill -> first-token KL(full || fused) and top-1 agreement

Layers are ranked by mean KL (lower is better); the top `k` become the model's critical
layers - or, with `search="greedy"`, the set grown from the best layer by adding whichever
layer lowers the set's mean KL most (the selector averages its layers' mass, and a layer that
ranks poorly alone can complete a set well). The profile is saved where
`critical_layers.lookup` finds it (by fingerprint), or to an explicit path (e.g. the
packaged table's neighbour for a shipped preset).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from qcfuse_core.engine.api import QCFuseEngine
from qcfuse_core.eval import metrics as M
from qcfuse_core.eval.datasets import load_dataset
from qcfuse_core.eval.hooks import internals
from qcfuse_core.model.fusion import FusedPrompt, fused_prefill
from qcfuse_core.selection.anchors import AnchorConfig, ensure_anchors, repeat_prompt_ids
from qcfuse_core.selection.base import SelectionContext
from qcfuse_core.selection.options import QCFuseOptions
from qcfuse_core.selection.probe import context_keys_at, gather_context, query_mass, run_probe
from qcfuse_core.selection.profiles import checked_options
from qcfuse_core.selection.scoring import top_budget
from qcfuse_core.selection.selectors import candidates, ranking_scores
from qcfuse_core.store import MemoryStore

log = logging.getLogger(__name__)


@dataclass
class PreparedExample:
    """One calibration example, ready to score any layer set: the prompt (chunk caches alone),
    full prefill's last-position logits, and the probed mass of every profiled layer."""

    prompt: FusedPrompt
    ref: torch.Tensor
    mass: dict[int, torch.Tensor]  # layer -> (T,) fp32 over prompt positions


def prepare_example(
    engine: QCFuseEngine, question: str, passages, anchors: AnchorConfig, layers: list[int]
) -> PreparedExample:
    """Prompt, full-prefill reference and one probe through every layer in `layers`."""
    adapter = engine.adapter
    engine = internals(engine).replace(store=MemoryStore())
    prompt, _, _ = internals(engine).steps.fuse_pieces(engine.frame.rag_pieces(question, list(passages)))
    ref, _ = adapter.hf_forward(prompt.token_ids, keep=1)
    depth = max(layers) + 1
    repeat_ids = repeat_prompt_ids(adapter) if anchors.method == "repeat" else None
    picks = {}
    for seg in prompt.segments:
        if seg.kind == "chunk" and seg.chunk is not None:
            picks[id(seg)] = ensure_anchors(adapter, seg.chunk, depth, anchors, repeat_ids)[0]
    seg, start = prompt.segments[-1], prompt.starts[-1]
    probe = run_probe(
        adapter,
        seg.token_ids,
        torch.arange(start, start + len(seg)),
        gather_context(prompt, depth, lambda s: picks[id(s)]),
        keep=layers,
    )
    mass = {}
    for layer, (k_ctx, pos) in zip(layers, context_keys_at(adapter, prompt, layers)):
        m = torch.zeros(prompt.num_tokens)
        m[pos] = query_mass(
            probe.q[layer],
            k_ctx,
            probe.k[layer],
            adapter.scale,
            window=adapter.windows[layer],
            ctx_pos=pos,
            q_start=start,
        ).cpu()
        mass[layer] = m
    return PreparedExample(prompt, ref[-1], mass)


def score_set(
    engine: QCFuseEngine, ex: PreparedExample, layer_set, ratio: float, options: dict | None = None
) -> tuple[float, float]:
    """Recompute the top `ratio` chunk tokens by the mean mass of `layer_set`, ranked as the
    qcfuse selector ranks with those critical layers and `options` (a profile's
    PROFILE_OPTIONS), fused by the engine's own step -> (first-token KL(full || fused), top-1
    agreement)."""
    prompt = ex.prompt
    mass = cast(torch.Tensor, sum(ex.mass[layer] for layer in layer_set)) / len(layer_set)
    ctx = SelectionContext(engine.adapter, prompt, ratio)
    cand = candidates(engine.adapter, prompt)
    rank_by = ranking_scores(prompt, mass, QCFuseOptions(**(options or {})))
    sel = ctx.finalize("profile", top_budget(cand, rank_by[cand], ctx.budget))
    logits = fused_prefill(engine.adapter, prompt, sel.rows).logits[-1]
    return M.kl_divergence(ex.ref, logits), float(int(logits.argmax()) == int(ex.ref.argmax()))


def profile_example(
    engine: QCFuseEngine, question: str, passages, ratio: float, anchors: AnchorConfig, layers: list[int]
) -> dict[int, tuple[float, float]]:
    """-> {layer: (first-token KL, top-1 agreement)} for one example."""
    ex = prepare_example(engine, question, passages, anchors, layers)
    return {layer: score_set(engine, ex, [layer], ratio) for layer in layers}


SEARCHES = ("singles", "greedy")


def profile_layers(
    engine: QCFuseEngine,
    dataset: str,
    *,
    limit: int = 8,
    ratio: float = 0.15,
    top_k: int = 3,
    anchors: AnchorConfig | None = None,
    layers: list[int] | None = None,
    search: str = "singles",
    options: dict | None = None,
) -> dict:
    """Rank layers on a calibration set -> profile dict (see critical_layers.py for the format).

    search "singles": the profile keeps the `top_k` best layers by their own mean KL (one
    example in memory at a time). "greedy": starts from the best single layer and adds, one
    at a time, the layer whose addition gives the set the lowest mean KL, while that lowers
    it, up to `top_k` layers. A layer that ranks poorly alone can complete a set well (the
    selector averages the layers' mass), which single ranks cannot see; greedy keeps every
    example's prompt and caches in memory and runs ~top_k times as many fused prefills.

    options: ranking options (critical_layers.PROFILE_OPTIONS, e.g. a position prior) that
    every layer is scored with; they are saved in the profile and applied with its layers.
    """
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {', '.join(SEARCHES)}, got {search!r}")
    options = checked_options(options or {}, "profile-layers")
    anchors = anchors or AnchorConfig()
    adapter = engine.adapter
    layers = layers or list(range(1, adapter.num_layers))
    sums = {layer: [0.0, 0.0] for layer in layers}
    examples = load_dataset(dataset, limit=limit)
    if not examples:
        raise ValueError(f"no examples in {dataset}")
    prepared = []
    t0 = time.perf_counter()
    for i, ex in enumerate(examples):
        prep = prepare_example(engine, ex.question, ex.passages, anchors, layers)
        for layer in layers:
            kl, agree = score_set(engine, prep, [layer], ratio, options)
            sums[layer][0] += kl
            sums[layer][1] += agree
        if search == "greedy":
            prepared.append(prep)
        log.info("profiled example %d/%d (%.0f s)", i + 1, len(examples), time.perf_counter() - t0)
    n = len(examples)
    ranking: list[dict[str, Any]] = sorted(
        ({"layer": layer, "kl": s[0] / n, "top1_agree": s[1] / n} for layer, s in sums.items()),
        key=lambda r: (r["kl"], -r["top1_agree"], r["layer"]),
    )
    profile: dict[str, Any] = {
        "model": adapter.name,
        "fingerprints": [adapter.fingerprint()],
        "match": [],
        "layers": [r["layer"] for r in ranking[:top_k]],
        "ratio": ratio,
        "n": n,
        "search": search,
        "anchor_method": anchors.method,
        "anchor_share": anchors.share,
        "source": f"qcfuse profile-layers --dataset {Path(dataset).name} --limit {n} --ratio {ratio} --search {search}",
        "ranking": ranking,
    }
    if options:
        profile["options"] = options
        profile["source"] += "".join(f" --option {k}={v}" for k, v in options.items())
    if search == "greedy":
        best = ranking[0]
        chosen: list[int] = [best["layer"]]
        steps: list[dict[str, Any]] = [{"layers": chosen, "kl": best["kl"], "top1_agree": best["top1_agree"]}]
        while len(chosen) < top_k:
            trials: list[dict[str, Any]] = []
            for layer in layers:
                if layer in chosen:
                    continue
                scores = [score_set(engine, prep, chosen + [layer], ratio, options) for prep in prepared]
                trials.append(
                    {
                        "layers": chosen + [layer],
                        "kl": sum(s[0] for s in scores) / n,
                        "top1_agree": sum(s[1] for s in scores) / n,
                    }
                )
            if not trials:
                break
            nxt = min(trials, key=lambda r: (r["kl"], -r["top1_agree"], r["layers"][-1]))
            log.info(
                "greedy step %d: %s mean KL %.4f (%.0f s)",
                len(chosen) + 1,
                nxt["layers"],
                nxt["kl"],
                time.perf_counter() - t0,
            )
            if nxt["kl"] >= steps[-1]["kl"]:
                break  # no layer lowers the set's KL
            chosen = nxt["layers"]
            steps.append(nxt)
        profile["layers"], profile["steps"] = chosen, steps
    return profile


def format_ranking(profile: dict) -> str:
    lines = ["rank  layer  kl_first_token  top1_agree"]
    for i, r in enumerate(profile["ranking"], 1):
        lines.append(f"{i:>4}  {r['layer']:>5}  {r['kl']:>14.4f}  {r['top1_agree']:>10.2f}")
    if profile.get("steps"):
        lines.append("greedy set                 kl_first_token  top1_agree")
        for r in profile["steps"]:
            lines.append(f"{str(r['layers']):<26} {r['kl']:>14.4f}  {r['top1_agree']:>10.2f}")
    return "\n".join(lines)
