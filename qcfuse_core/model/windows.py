"""Where a chunk's alone-cache is already exact, in models with sliding-window layers.

A chunk's cache is computed alone, at positions 0..n-1; in a prompt it sits after other
text. Its cached K/V at layer l are functions of the chunk tokens' hidden states entering
layer l, so they equal the full-context K/V exactly when those hidden states do - when
nothing outside the chunk has reached the token through layers 0..l-1:

    layer 0        every token is exact (embeddings only)
    layer m -> m+1 token i stays exact iff layer m lets it see only chunk keys that are
                   themselves exact: a sliding layer of width W_m sees keys i-W_m+1..i, so
                   i >= (W_m - 1) + the offset from which layer m was exact; a full-attention
                   layer sees the whole prompt before the chunk, so no token stays exact

    exact at layer l  <=>  i >= sum over m < l of (W_m - 1), and layers 0..l-1 all windowed

(i is the token's offset inside its chunk; RoPE keeps in-chunk attention independent of
where the chunk sits, and the stored keys are pre-RoPE.) So it is not enough for a token to
lie deeper than one window into its chunk: the window's reach adds up over the layers, and
one full-attention layer ends it. For Gemma-3-270M (W = 512, full attention at layers 5,
11, 17) a token is exact at layers 1..5 only from offset 511 x l on and at no layer after
5; with the 256-token chunks of the benchmarks only layer 0 is exact. A model whose layers
are all windowed (Mistral with a sliding window) keeps the tail of every long chunk exact
at every layer.

Selectors use `exact_rows`: a cached token exact at every layer it would be recomputed at
is never worth recomputing, so it leaves the candidate set and its budget goes to others.
"""

from __future__ import annotations

import torch

from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.model.fusion import FusedPrompt


def exact_from(adapter: ModelAdapter, layer: int) -> int | None:
    """Smallest chunk offset from which a chunk's alone-cache at `layer` equals its cache in
    any context (None: no offset - a full-attention layer lies below `layer`)."""
    if not 0 <= layer < adapter.num_layers:
        raise ValueError(f"layer must lie in [0, {adapter.num_layers}), got {layer}")
    reach = 0
    for w in adapter.windows[:layer]:
        if w is None:
            return None
        reach += w - 1
    return reach


def exact_rows(adapter: ModelAdapter, prompt: FusedPrompt) -> torch.Tensor:
    """(T,) bool: chunk tokens whose cached K/V are exact at every layer (the offset needed
    grows with depth, so the last layer decides; the prefix, cached at its own position, is
    exact anyway and never a candidate)."""
    out = torch.zeros(prompt.num_tokens, dtype=torch.bool)
    offset = exact_from(adapter, adapter.num_layers - 1)
    if offset is None:
        return out
    for seg, start in zip(prompt.segments, prompt.starts):
        if seg.kind == "chunk" and seg.chunk is not None and len(seg) > offset:
            out[start + offset : start + len(seg)] = True
    return out
