"""Anchor extraction: a small per-chunk, per-layer set of cached entries for the probe.

Anchors stand for a chunk while the query is probed (docs/design.md, the method). Two
methods, both keeping the chunk's first `sinks` tokens (chunk-local attention sinks) and
then the top `share` of the chunk by their own score:

    keynorm   L2 norm of the token's pre-RoPE key at that layer, mean over KV heads
    repeat    forward "Repeat the previous context exactly." after the chunk; each chunk
              token scores the largest attention weight it receives from those prompt
              positions (max over heads and prompt rows) - what the authors' code does

Stored format (what the store persists in its sidecar):

    chunk.anchors[method] = (L', n) int64, sorted local token indices per layer
        L' = layers covered (>= max critical layer + 1), n = anchor_count(T, share, sinks)

The count is fixed per chunk so the tensor is rectangular; `has_anchors` checks that a
stored tensor fits a config (enough layers, the expected count) so a stale one is
recomputed rather than silently used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import qcfuse_kernels as K
from qcfuse_core.model.adapter import ModelAdapter
from qcfuse_core.selection.probe import LayerContext, run_probe
from qcfuse_core.types import KVChunk

ANCHOR_METHODS = ("keynorm", "repeat")
REPEAT_PROMPT = "Repeat the previous context exactly."


@dataclass(frozen=True)
class AnchorConfig:
    method: str = "keynorm"
    share: float = 0.125  # of the chunk's tokens, on top of the sinks
    sinks: int = 4

    def __post_init__(self) -> None:
        if self.method not in ANCHOR_METHODS:
            raise ValueError(f"unknown anchor method {self.method!r}; valid: {', '.join(ANCHOR_METHODS)}")
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"anchor share must be in [0, 1], got {self.share}")
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")


def anchor_count(num_tokens: int, share: float, sinks: int) -> int:
    """Anchors per layer for a chunk of `num_tokens`: sinks + ceil(share x T), at most T."""
    return min(num_tokens, min(sinks, num_tokens) + math.ceil(share * num_tokens))


def top_with_sinks(scores: torch.Tensor, count: int, sinks: int) -> torch.Tensor:
    """scores (L', T) -> (L', count) sorted local indices: tokens 0..sinks-1, then the best.

    Ties break toward the earlier token (stable sort), so the choice is deterministic.
    Anchor indices are host metadata (stored with the chunk), so the result is on the CPU.
    """
    scores = scores.float().cpu()
    Lp, T = scores.shape
    s = min(sinks, T, count)
    rest = scores[:, s:]
    order = torch.sort(-rest, dim=1, stable=True).indices[:, : count - s] + s  # (L', count - s)
    head = torch.arange(s).expand(Lp, s)
    return torch.sort(torch.cat([head, order], dim=1), dim=1).values.to(torch.int64)


def keynorm_scores(chunk: KVChunk, num_layers: int) -> torch.Tensor:
    """(L', T): L2 norm of each token's pre-RoPE key, mean over KV heads."""
    return chunk.k[:num_layers].float().norm(dim=-1).mean(dim=-1)


@torch.inference_mode()
def repeat_scores(adapter: ModelAdapter, chunk: KVChunk, num_layers: int, repeat_ids: torch.Tensor) -> torch.Tensor:
    """(L', T): max attention weight each chunk token gets from the repeat prompt's rows.

    The prompt sits right after the chunk (positions T..T+r-1) and attends to the chunk's
    exact cache, so this is the chunk + prompt prefill restricted to the prompt rows.
    """
    T = chunk.num_tokens
    r = int(repeat_ids.numel())
    pos = torch.arange(T, T + r)
    context = [LayerContext(chunk.k[layer], chunk.v[layer], torch.arange(T)) for layer in range(num_layers)]
    probe = run_probe(adapter, repeat_ids, pos, context, keep=list(range(num_layers)))
    out = torch.empty(num_layers, T)
    ropes = adapter.rope_layers(torch.arange(T))
    for layer in range(num_layers):
        kc = K.apply_rope(chunk.k[layer].to(adapter.device, adapter.dtype), *ropes[layer])  # (T, Hkv, D)
        keys = torch.cat([kc, probe.k[layer]]).float()  # (T + r, Hkv, D)
        q = probe.q[layer].float()  # (r, H, D)
        rep = q.shape[1] // keys.shape[1]
        kf = keys.repeat_interleave(rep, dim=1).transpose(0, 1)  # (H, T + r, D)
        logits = torch.matmul(q.transpose(0, 1), kf.transpose(1, 2)) * adapter.scale  # (H, r, T + r)
        j, p = torch.arange(T + r)[None, :], (T + torch.arange(r))[:, None]
        causal = j <= p  # (r, T + r)
        window = adapter.windows[layer]
        if window is not None:  # a sliding layer: keys p - W < j <= p
            causal &= j > p - window
        probs = logits.masked_fill(~causal.to(logits.device)[None], float("-inf")).softmax(-1)
        out[layer] = probs[:, :, :T].amax(dim=(0, 1)).cpu()
    return out


def extract_anchors(
    adapter: ModelAdapter,
    chunk: KVChunk,
    num_layers: int,
    config: AnchorConfig,
    repeat_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """(num_layers, n) int64 sorted local anchor indices of `chunk` per layer."""
    if not 1 <= num_layers <= chunk.num_layers:
        raise ValueError(f"num_layers must be in [1, {chunk.num_layers}], got {num_layers}")
    if config.method == "keynorm":
        scores = keynorm_scores(chunk, num_layers)
    else:
        if repeat_ids is None:
            repeat_ids = repeat_prompt_ids(adapter)
        scores = repeat_scores(adapter, chunk, num_layers, repeat_ids)
    return top_with_sinks(scores, anchor_count(chunk.num_tokens, config.share, config.sinks), config.sinks)


def repeat_prompt_ids(adapter: ModelAdapter) -> torch.Tensor:
    if adapter.tokenizer is None:
        raise ValueError("repeat-prompt anchors need a tokenizer (or pass repeat_ids)")
    ids = adapter.tokenizer(" " + REPEAT_PROMPT, add_special_tokens=False).input_ids
    return torch.tensor(ids, dtype=torch.int64)


def has_anchors(chunk: KVChunk, num_layers: int, config: AnchorConfig) -> bool:
    """True when chunk.anchors holds a tensor for config.method fit for `num_layers` layers."""
    a = chunk.anchors.get(config.method)
    return (
        isinstance(a, torch.Tensor)
        and a.dim() == 2
        and a.shape[0] >= num_layers
        and a.shape[1] == anchor_count(chunk.num_tokens, config.share, config.sinks)
    )


def ensure_anchors(
    adapter: ModelAdapter,
    chunk: KVChunk,
    num_layers: int,
    config: AnchorConfig,
    repeat_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, bool]:
    """The chunk's anchors for `config`, computed and stored in chunk.anchors if missing.

    -> (anchors (L', n), computed_now).
    """
    if has_anchors(chunk, num_layers, config):
        return chunk.anchors[config.method], False
    a = extract_anchors(adapter, chunk, num_layers, config, repeat_ids)
    chunk.anchors[config.method] = a
    return a, True
