"""Sub-spans of a stored chunk cache: a re-rendered text served from its original's cache.

A framework retrieves a stored chunk and its prompt formatter pastes the text re-rendered
(truncated, whitespace changed). The rendering's own tokens have no cache yet; the token
runs it shares with the stored chunk are served as token-aligned slices of the stored
cache, and what is left is computed as fresh text:

    stored:     [Port Halden lies on the coast .][\\n\\n][Its harbour is small and busy .]
    rendering:  [Port Halden lies on the coast .][ Its][harbour is small and busy .]
    served:      slice 0..7 (exact)               text   slice 9..15 (approximate)

    rendering:  [Port Halden lies on the co][ast]           (truncated to 26 characters)
    served:      slice 0..6 (exact)          text

Which runs are served, and why:
- A run at the stored chunk's first token (`j == 0`, at least MIN_PREFIX tokens) is exact:
  attention is causal, so the first n tokens of a chunk's alone-cache are exactly the
  alone-cache of those n tokens. It is keyed by its own tokens (that is what it is).
- A run further in (`j > 0`, at least MIN_RUN tokens) is approximate: its K/V were computed
  attending to the stored chunk's earlier tokens, not to the prompt's. Every chunk cache in
  a fused prompt is approximate in that way (it never saw the chunks before it), and the
  selection recomputes the tokens that matter, so such a run is served like any chunk. Its
  key is derived from the stored chunk's key and the offsets, never the key of its tokens,
  so it can never be stored, or found, as their alone-cache. Shorter runs are not worth a
  segment (a whitespace change every word leaves nothing to serve).
Slices are never written to the store; every token of a slice equals the prompt's token at
its place (the runs are matched on token ids, not text), so nothing is mis-attributed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from difflib import SequenceMatcher

import torch

from qcfuse_core.cache.lookup import Part
from qcfuse_core.types import ChunkKey, KVChunk

MIN_PREFIX = 4  # shortest exact prefix slice served (tokens)
MIN_RUN = 16  # shortest slice from inside a stored chunk served (tokens)


@dataclass
class SliceChunk(KVChunk):
    """A token-aligned slice [start, start + n) of the stored chunk `source`."""

    source: ChunkKey | None = None
    start: int = 0

    @property
    def exact(self) -> bool:
        """The slice is its tokens' own alone-cache (it starts at the chunk's first token)."""
        return self.start == 0


def runs(
    ids: torch.Tensor, source_ids: torch.Tensor, *, min_prefix: int | None = None, min_run: int | None = None
) -> list[tuple[int, int, int]]:
    """The token runs of `ids` served from `source_ids`: (i in ids, j in source, n), in order,
    non-overlapping in both; a run at j == 0 needs min_prefix tokens, any other min_run
    (default: the module's MIN_PREFIX, MIN_RUN)."""
    min_prefix = MIN_PREFIX if min_prefix is None else min_prefix
    min_run = MIN_RUN if min_run is None else min_run
    a, b = ids.tolist(), source_ids.tolist()
    out = []
    for i, j, n in SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        if n and (n >= min_run or (j == 0 and n >= min_prefix)):
            out.append((i, j, n))
    return out


def slice_chunk(source: KVChunk, start: int, n: int, fingerprint: str) -> SliceChunk:
    """Tokens [start, start + n) of a stored chunk's cache, keyed as explained above."""
    if not (0 <= start and n > 0 and start + n <= source.num_tokens):
        raise ValueError(f"slice [{start}, {start + n}) outside a chunk of {source.num_tokens} tokens")
    ids = source.token_ids[start : start + n].clone()
    if start == 0:
        key = ChunkKey.for_tokens(fingerprint, ids)
    else:
        tag = f"qcfuse-subspan:{source.key}:{start}:{n}".encode()
        key = ChunkKey(fingerprint, hashlib.sha256(tag).hexdigest())
    return SliceChunk(
        key,
        ids,
        source.k[:, start : start + n].contiguous(),
        source.v[:, start : start + n].contiguous(),
        source=source.key,
        start=start,
    )


def serve(ids: torch.Tensor, node_id: str | None, source: KVChunk, fingerprint: str) -> list[Part] | None:
    """The parts of a chunk rendering `ids` whose runs come from `source`: slices (hits) and
    the tokens between them as fresh text; their ids concatenate to `ids`. None: no run."""
    found = runs(ids, source.token_ids)
    if not found:
        return None
    parts, pos = [], 0
    for i, j, n in found:
        if i > pos:
            parts.append(Part("text", ids[pos:i]))
        c = slice_chunk(source, j, n, fingerprint)
        parts.append(Part("chunk", ids[i : i + n], node_id, c.key, "host", c, True))
        pos = i + n
    if pos < len(ids):
        parts.append(Part("text", ids[pos:]))
    return parts


def served_tokens(segments) -> int:
    """Tokens of a fused prompt served from slices of stored chunks."""
    return sum(len(s) for s in segments if isinstance(s.chunk, SliceChunk))


def count_chunks(items, hit) -> tuple[int, int]:
    """(hits, chunks) over a prompt's parts or segments (`kind`, `chunk`), `hit(item)` telling
    a hit: the slices one re-rendered text was served in (the same source, with only fresh
    text between them) count as one chunk, a hit - a text is counted once however many runs
    of it were served."""
    hits = total = 0
    prev = None  # source of the last counted slice while only text followed it
    for it in items:
        if it.kind != "chunk":
            if it.kind != "text":
                prev = None
            continue
        src = it.chunk.source if isinstance(it.chunk, SliceChunk) else None
        if src is not None and src == prev:
            continue
        prev = src
        total += 1
        hits += bool(hit(it))
    return hits, total
