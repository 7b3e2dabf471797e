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
`recomputed_tokens` the engine counts. `explanation` (why_recomputed) says in plain words
and per chunk what the selection read and which of its rows sit where a chunk's cache is
most stale (the chunk's first tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qcfuse_core.selection.anchors import AnchorConfig
from qcfuse_core.types import FusionResult

START_WINDOW = AnchorConfig().sinks  # a chunk's first tokens: its own attention sinks when cached alone
SCORE_KINDS = {
    "qcfuse": "attention mass",
    "qcall": "attention mass",
    "qclast": "attention mass",
    "cacheblend": "V deviation",
}
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
        pieces.append(text[len(emitted) :])
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
        assert sel is not None and sel.scores is not None  # score_kind is only set when there are scores
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
            tokens.append(
                {
                    "pos": p,
                    "text": pieces[p],
                    "seg": si,
                    "depth": int(depth[p]),
                    "score": None if v != v else round(v, 6),
                    "anchor": bool(anchors[p]),
                }
            )
    recomputed = [t["pos"] for t in tokens if t["depth"] == num_layers]
    row_sets = []
    sets = [(0, None)] if method == "full" or sel is None else (sel.details.get("row_sets") or [(0, sel.rows)])
    for i, (first, rows) in enumerate(sets):
        end = sets[i + 1][0] if i + 1 < len(sets) else num_layers
        n_ctx = (
            sum(s.end - s.start for s in spans)
            if rows is None
            else sum(1 for r in rows.tolist() if any(s.start <= r < s.end for s in spans))
        )
        row_sets.append({"from_layer": int(first), "to_layer": int(end), "context_rows": int(n_ctx)})
    details = sel.details if sel is not None else {}
    segments = [
        {"index": i, "kind": s.kind, "start": s.start, "end": s.end, "node_id": s.node_id, "cache_hit": s.cache_hit}
        for i, s in enumerate(spans)
    ]
    crit = [int(x) for x in details.get("critical_layers", [])] if method == "qcfuse" else []
    return {
        "method": method,
        "num_layers": num_layers,
        "critical_layers": crit,
        "row_sets": row_sets,
        "score_kind": score_kind,
        "segments": segments,
        "tokens": tokens,
        "recomputed_positions": recomputed,
        "anchor_positions": [t["pos"] for t in tokens if t["anchor"]],
        "explanation": why_recomputed(method, score_kind, crit, segments, tokens, num_layers),
    }


def _is_filler(text: str) -> bool:
    """Whitespace, punctuation or a short function word: the kind of token that soaks up
    attention (a sink) without carrying the answer."""
    t = text.strip().lower()
    return not t or all(not c.isalnum() for c in t) or t in FILLER_WORDS


FILLER_WORDS = frozenset({"the", "a", "an", "of", "and", "in", "to", "is", "was", "it", "on", "at", "by", "for", "as"})


def why_recomputed(
    method: str,
    score_kind: str | None,
    critical_layers: Sequence[int],
    segments: Sequence[dict],
    tokens: Sequence[dict],
    num_layers: int,
) -> dict:
    """Plain words and per-chunk numbers for why these rows were recomputed.

    Per chunk segment: its share of the method's score (qcfuse: the probe's attention mass
    summed over the chunk / over all context tokens), its recomputed tokens, how many of them
    sit in the chunk's first START_WINDOW positions and how many are filler (punctuation,
    whitespace, "the"...). A chunk's cache was computed alone, at positions 0..n-1: its
    first tokens were that chunk's attention sinks, so in the fused prompt they are the
    most stale; and the tokens the question attends to most are often such sinks.

        chunk:    [s0 s1 s2 s3 | t4 t5 ... t(n-1)]
                   ^ first START_WINDOW positions: stale sinks
    """
    per_chunk = []
    total_score = sum(t["score"] for t in tokens if t["score"] is not None and t["score"] > 0)
    for seg in segments:
        if seg["kind"] != "chunk":
            continue
        toks = [t for t in tokens if t["seg"] == seg["index"]]
        rec = [t for t in toks if t["depth"] == num_layers]
        mass = sum(t["score"] for t in toks if t["score"] is not None and t["score"] > 0)
        per_chunk.append(
            {
                "segment": seg["index"],
                "node_id": seg["node_id"],
                "tokens": len(toks),
                "score_share": round(mass / total_score, 4) if score_kind and total_score > 0 else None,
                "recomputed": len(rec),
                "recomputed_at_start": sum(1 for t in rec if t["pos"] - seg["start"] < START_WINDOW),
                "recomputed_filler": sum(1 for t in rec if _is_filler(t["text"])),
                "anchors": sum(1 for t in toks if t["anchor"]),
            }
        )
    rec_chunk = sum(c["recomputed"] for c in per_chunk)
    at_start = sum(c["recomputed_at_start"] for c in per_chunk)
    filler = sum(c["recomputed_filler"] for c in per_chunk)
    glue = sum(1 for t in tokens if segments[t["seg"]]["kind"] != "chunk")
    text: list[str] = []
    if method == "full":
        text.append(
            "Full prefill computes every token at every layer: nothing is reused, nothing is stale. "
            "It is the reference the other modes are measured against."
        )
    elif method == "naive":
        text.append(
            "Naive concatenation reuses every chunk token from its cache as it is; only the glue between "
            "chunks and the question are computed. Each chunk was cached alone, so it never saw the "
            "chunks before it."
        )
    else:
        text.append(
            "Each chunk's cache was computed alone, at positions 0 onwards. In the fused prompt it sits "
            "after other text, so its cached keys and values are stale: they never attended to what "
            "comes before. Recomputing a few rows repairs the staleness that matters most."
        )
        if score_kind == "attention mass":
            crit = ", ".join(str(x) for x in sorted(critical_layers))
            anchors = sum(c["anchors"] for c in per_chunk)
            text.append(
                f"The probe ran the question over the prompt's prefix and {anchors} anchor tokens of the "
                f"chunks (their first {START_WINDOW} tokens and the ones that attend most) and read the "
                f"question's attention at layer{'s' if len(critical_layers) != 1 else ''} {crit}. The "
                "tokens it attends to most are recomputed at every layer."
            )
        elif score_kind == "V deviation":
            text.append(
                "CacheBlend recomputes every token at the first layers, then keeps the rows whose values "
                "deviated most from the cached ones."
            )
        if rec_chunk:
            text.append(
                f"{at_start} of the {rec_chunk} recomputed chunk tokens are among a chunk's first "
                f"{START_WINDOW} positions, where a chunk cached alone put its attention sinks: those rows "
                f"are the most stale. {filler} of them are punctuation, whitespace or words like 'the': "
                "tokens that soak up attention (sinks) whatever the chunk is about, so they are picked "
                "even in chunks unrelated to the answer; repairing them repairs what every later token "
                "reads."
            )
        if glue:
            text.append(
                f"The {glue} glue token{'s' if glue != 1 else ''} between chunks "
                f"{'have' if glue != 1 else 'has'} no cache and {'are' if glue != 1 else 'is'} always computed."
            )
    return {
        "text": text,
        "start_window": START_WINDOW,
        "chunks": per_chunk,
        "recomputed_chunk_tokens": rec_chunk,
        "recomputed_at_start": at_start,
        "recomputed_filler": filler,
        "glue_tokens": glue,
    }


def waterfall(result: FusionResult) -> list[dict]:
    """The request's stages from its start to the first token, as consecutive bars
    (start_ms, ms); they add up to the stage clock's total, i.e. the TTFT.

        queue | lookup | load (plan + start loading) | probe | select | fuse | first token

    `probe` is the part of the select stage the query probe took (anchors + probe forward),
    as the selector timed it; `fuse` is the fused prefill (HF's forward for full)."""
    t = result.timings_ms
    sel = result.selection.details if result.selection is not None else {}
    select_ms = t.get("select_ms", 0.0)
    probe_ms = min(select_ms, float(sel.get("anchor_ms", 0.0)) + float(sel.get("probe_ms", 0.0)))
    parts = [
        ("queue", t.get("queue_ms", 0.0)),  # waiting for the engine's scheduler to admit it
        ("lookup", t.get("lookup_ms", 0.0)),
        ("load", t.get("plan_ms", 0.0) + t.get("load_start_ms", 0.0)),
        ("probe", probe_ms),
        ("select", select_ms - probe_ms),
        ("fuse", t.get("prefill_ms", 0.0)),
        ("first token", t.get("first_token_ms", 0.0)),
    ]
    out, start = [], 0.0
    for name, ms in parts:
        out.append({"name": name, "start_ms": round(start, 3), "ms": round(ms, 3)})
        start += ms
    return out
