"""Critical-layer profiling: rank layers by how well selecting from each preserves full prefill.

For each calibration example:

    1. build the prompt (chunk caches alone) and the full-prefill reference logits
    2. probe the query once against prefix + anchors through every layer (the same probe
       QCFuse runs, only deeper), scoring the context at every layer l
    3. for each layer l: recompute the top `ratio` chunk tokens by layer l's mass alone;
       fused prefill -> first-token KL(full || fused) and top-1 agreement

Layers are ranked by mean KL (lower is better); the top `k` become the model's critical
layers. The profile is saved where `critical_layers.lookup` finds it (by fingerprint), or to
an explicit path (e.g. the packaged table's neighbour for a shipped preset).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from qcfuse_core import metrics as M
from qcfuse_core.anchors import AnchorConfig, ensure_anchors, repeat_prompt_ids
from qcfuse_core.datasets import load_dataset
from qcfuse_core.engine import QCFuseEngine
from qcfuse_core.fusion import fused_prefill
from qcfuse_core.probe import context_keys, gather_context, query_mass, run_probe
from qcfuse_core.scoring import top_budget
from qcfuse_core.selectors import SelectionContext
from qcfuse_core.store import MemoryStore

log = logging.getLogger(__name__)


def profile_example(engine: QCFuseEngine, question: str, passages, ratio: float, anchors: AnchorConfig,
                    layers: list[int]) -> dict[int, tuple[float, float]]:
    """-> {layer: (first-token KL, top-1 agreement)} for one example."""
    adapter = engine.adapter
    engine.store = MemoryStore()
    prompt, _, _ = engine.fuse_pieces(engine.rag_pieces(question, list(passages)))
    ref, _ = adapter.hf_forward(prompt.token_ids)
    ref = ref[-1]
    depth = max(layers) + 1
    repeat_ids = repeat_prompt_ids(adapter) if anchors.method == "repeat" else None
    picks = {}
    for seg in prompt.segments:
        if seg.kind == "chunk" and seg.chunk is not None:
            picks[id(seg)] = ensure_anchors(adapter, seg.chunk, depth, anchors, repeat_ids)[0]
    seg, start = prompt.segments[-1], prompt.starts[-1]
    probe = run_probe(adapter, seg.token_ids, torch.arange(start, start + len(seg)),
                      gather_context(prompt, depth, lambda s: picks[id(s)]), keep=layers)
    ctx = SelectionContext(adapter, prompt, ratio)
    cand = torch.nonzero(prompt.mask("chunk")).flatten()
    out = {}
    for layer in layers:
        k_ctx, pos = context_keys(adapter, prompt, layer)
        mass = torch.zeros(prompt.num_tokens)
        mass[pos] = query_mass(probe.q[layer], k_ctx, probe.k[layer], adapter.scale).cpu()
        rows = ctx.finalize("profile", top_budget(cand, mass[cand], ctx.budget)).rows
        logits = fused_prefill(adapter, prompt, rows).logits[-1]
        out[layer] = (M.kl_divergence(ref, logits), float(int(logits.argmax()) == int(ref.argmax())))
    return out


def profile_layers(engine: QCFuseEngine, dataset: str, *, limit: int = 8, ratio: float = 0.15, top_k: int = 3,
                   anchors: AnchorConfig | None = None, layers: list[int] | None = None) -> dict:
    """Rank layers on a calibration set -> profile dict (see critical_layers.py for the format)."""
    anchors = anchors or AnchorConfig()
    adapter = engine.adapter
    layers = layers or list(range(1, adapter.num_layers))
    sums = {layer: [0.0, 0.0] for layer in layers}
    examples = load_dataset(dataset, limit=limit)
    t0 = time.perf_counter()
    for i, ex in enumerate(examples):
        res = profile_example(engine, ex.question, ex.passages, ratio, anchors, layers)
        for layer, (kl, agree) in res.items():
            sums[layer][0] += kl
            sums[layer][1] += agree
        log.info("profiled example %d/%d (%.0f s)", i + 1, len(examples), time.perf_counter() - t0)
    n = len(examples)
    ranking = sorted(({"layer": layer, "kl": s[0] / n, "top1_agree": s[1] / n} for layer, s in sums.items()),
                     key=lambda r: (r["kl"], -r["top1_agree"], r["layer"]))
    return {
        "model": adapter.name, "fingerprints": [adapter.fingerprint()], "match": [],
        "layers": [r["layer"] for r in ranking[:top_k]], "ratio": ratio, "n": n,
        "anchor_method": anchors.method, "anchor_share": anchors.share,
        "source": f"qcfuse profile-layers --dataset {Path(dataset).name} --limit {n} --ratio {ratio}",
        "ranking": ranking,
    }


def format_ranking(profile: dict) -> str:
    lines = ["rank  layer  kl_first_token  top1_agree"]
    for i, r in enumerate(profile["ranking"], 1):
        lines.append(f"{i:>4}  {r['layer']:>5}  {r['kl']:>14.4f}  {r['top1_agree']:>10.2f}")
    return "\n".join(lines)
