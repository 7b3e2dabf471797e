"""What the page shows of one answer, derived from its `FusionResult` (nothing recomputed).

Per context token (chunk and glue positions, in prompt order):

    text     its piece of the decoded text (the pieces of a segment join to its text)
    depth    how many layers recomputed it: 0 = served from its chunk cache everywhere,
             L = every layer. Row sets only narrow as the layers go up (fusion.py), so a
             token with depth d was recomputed at layers 0..d-1 exactly:

                 layer:    0   1   2   ...   L-1
                 rows:     [---- set 0 ----][---- set 1 (a subset) ----]
                 depth:    tokens of set 1 only-in-set-0 tokens stop here ^

    score    the method's ranking signal where it has one: the probe's attention mass
             (qcfuse, qcall, qclast, mean over the scored layers) or the layer-1 V deviation
             (cacheblend); None otherwise
    anchor   whether it is one of its chunk's layer-0 anchors (qcfuse's probe context)

`recomputed_positions` are the context positions of the final row set - exactly the
`recomputed_tokens` the engine counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qcfuse_core.types import FusionResult

SCORE_KINDS = {"qcfuse": "attention mass", "qcall": "attention mass", "qclast": "attention mass",
               "cacheblend": "V deviation"}
CONTEXT_KINDS = ("chunk", "text")


def token_pieces(tokenizer, ids: Sequence[int]) -> list[str]:
    """The text of each token, decoded as a run: ''.join(pieces) == decode(ids).

    A token that ends inside a multi-byte character gets an empty piece and the character
    goes to the token that completes it; leading-space handling is the tokenizer's own."""
    ids = [int(i) for i in ids]
    pieces: list[str] = []
    emitted = ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if text.endswith("\ufffd") and i + 1 < len(ids):
            pieces.append("")  # incomplete UTF-8: wait for the next token
            continue
        if not text.startswith(emitted):  # the tokenizer rewrote earlier text: keep the join exact
            keep = len(_common_prefix(text, emitted))
            text = emitted + text[keep:]
        pieces.append(text[len(emitted):])
        emitted = text
    return pieces


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def recompute_depth(result: FusionResult, num_layers: int) -> torch.Tensor:
    """(T,) int64: layers that recomputed each prompt position (see the module docstring)."""
    if result.prompt_ids is None:
        raise ValueError("this result carries no prompt layout")
    T = int(result.prompt_ids.numel())
    depth = torch.zeros(T, dtype=torch.int64)
    sel = result.selection
    if result.method == "full" or sel is None or sel.method == "full":  # HF's own forward: everything
        depth[:] = num_layers
        return depth
    sets = sel.details.get("row_sets") or [(0, sel.rows)]
    for i, (first, rows) in enumerate(sets):
        end = sets[i + 1][0] if i + 1 < len(sets) else num_layers
        depth[rows.to(torch.int64).cpu()] = end  # later sets are subsets: they extend their rows
    return depth


def mode_details(result: FusionResult, pieces: Sequence[str], num_layers: int) -> dict:
    """The per-token view of one answer. `pieces`: token_pieces of result.prompt_ids."""
    spans = [s for s in result.spans if s.kind in CONTEXT_KINDS]
    depth = recompute_depth(result, num_layers)
    T = depth.numel()
    if len(pieces) != T:
        raise ValueError(f"{len(pieces)} text pieces for a {T}-token prompt")
    sel = result.selection
    method = result.method
    score = torch.full((T,), float("nan"))
    score_kind = SCORE_KINDS.get(method) if sel is not None and sel.scores is not None else None
    if score_kind is not None:
        ctx_pos = torch.tensor([p for s in spans for p in range(s.start, s.end)], dtype=torch.int64)
        if sel.scores.numel() == ctx_pos.numel():
            score[ctx_pos] = sel.scores.float().cpu()
        else:
            score_kind = None
    anchors = torch.zeros(T, dtype=torch.bool)
    if sel is not None and sel.details.get("anchor_positions_layer0") is not None:
        a = sel.details["anchor_positions_layer0"].to(torch.int64).cpu()
        anchors[a[(a >= 0) & (a < T)]] = True
    tokens = []
    for si, s in enumerate(spans):
        for p in range(s.start, s.end):
            v = float(score[p])
            tokens.append({"pos": p, "text": pieces[p], "seg": si, "depth": int(depth[p]),
                           "score": None if v != v else round(v, 6), "anchor": bool(anchors[p])})
    recomputed = [t["pos"] for t in tokens if t["depth"] == num_layers]
    row_sets = []
    sets = [(0, None)] if method == "full" or sel is None else (sel.details.get("row_sets") or [(0, sel.rows)])
    for i, (first, rows) in enumerate(sets):
        end = sets[i + 1][0] if i + 1 < len(sets) else num_layers
        n_ctx = (sum(s.end - s.start for s in spans) if rows is None
                 else sum(1 for r in rows.tolist() if any(s.start <= r < s.end for s in spans)))
        row_sets.append({"from_layer": int(first), "to_layer": int(end), "context_rows": int(n_ctx)})
    details = sel.details if sel is not None else {}
    return {
        "method": method,
        "num_layers": num_layers,
        "critical_layers": [int(x) for x in details.get("critical_layers", [])] if method == "qcfuse" else [],
        "row_sets": row_sets,
        "score_kind": score_kind,
        "segments": [{"index": i, "kind": s.kind, "start": s.start, "end": s.end, "node_id": s.node_id,
                      "cache_hit": s.cache_hit} for i, s in enumerate(spans)],
        "tokens": tokens,
        "recomputed_positions": recomputed,
        "anchor_positions": [t["pos"] for t in tokens if t["anchor"]],
    }


def waterfall(result: FusionResult) -> list[dict]:
    """The request's stages from its start to the first token, as consecutive bars
    (start_ms, ms); they add up to the stage clock's total, i.e. the TTFT.

        lookup | load (plan + start loading) | probe | select | fuse | first token

    `probe` is the part of the select stage the query probe took (anchors + probe forward),
    as the selector timed it; `fuse` is the fused prefill (HF's forward for full)."""
    t = result.timings_ms
    sel = result.selection.details if result.selection is not None else {}
    select_ms = t.get("select_ms", 0.0)
    probe_ms = min(select_ms, float(sel.get("anchor_ms", 0.0)) + float(sel.get("probe_ms", 0.0)))
    parts = [("lookup", t.get("lookup_ms", 0.0)), ("load", t.get("plan_ms", 0.0) + t.get("load_start_ms", 0.0)),
             ("probe", probe_ms), ("select", select_ms - probe_ms), ("fuse", t.get("prefill_ms", 0.0)),
             ("first token", t.get("first_token_ms", 0.0))]
    out, start = [], 0.0
    for name, ms in parts:
        out.append({"name": name, "start_ms": round(start, 3), "ms": round(ms, 3)})
        start += ms
    return out
