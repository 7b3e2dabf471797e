"""Ids, keys and the named result types that cross module boundaries.

Vocabulary: T tokens, L layers, H heads, Hkv KV heads, D head dim, C chunks.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, NewType

import torch

NodeId = NewType("NodeId", str)
"""What a framework (LlamaIndex node, LangChain document, Chroma record) calls a chunk."""

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


def hash_token_ids(token_ids: list[int] | torch.Tensor) -> str:
    """sha256 (hex) of the exact token ids, as little-endian int64."""
    if isinstance(token_ids, torch.Tensor):
        ids = token_ids.detach().to("cpu", torch.int64).contiguous()
    else:
        ids = torch.tensor(list(token_ids), dtype=torch.int64)
    return hashlib.sha256(ids.numpy().tobytes()).hexdigest()


def chunk_id(source: str, text: str) -> str:
    """A chunk's id from its source name and text (sha256, 32 hex chars): deterministic, so
    ingesting a file again adds nothing. Also what a vector-index row written before
    content hashes were stored is checked against."""
    return hashlib.sha256(f"{source}\x00{text}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class ChunkKey:
    """Content address of one chunk cache: exact token ids x model fingerprint.

    The same text under two node ids maps to one key, so it is stored once; a cache made
    for another model, dtype, tokenizer or storage format has another fingerprint and is
    never found. String form: ``<fingerprint:16 hex>-<token sha256:64 hex>``.
    """

    fingerprint: str
    token_hash: str

    def __post_init__(self) -> None:
        if not _HEX16.match(self.fingerprint):
            raise ValueError(f"fingerprint must be 16 lowercase hex chars, got {self.fingerprint!r}")
        if not _HEX64.match(self.token_hash):
            raise ValueError(f"token_hash must be 64 lowercase hex chars, got {self.token_hash!r}")

    @classmethod
    def for_tokens(cls, fingerprint: str, token_ids: list[int] | torch.Tensor) -> "ChunkKey":
        return cls(fingerprint, hash_token_ids(token_ids))

    def to_string(self) -> str:
        return f"{self.fingerprint}-{self.token_hash}"

    @classmethod
    def from_string(cls, s: str) -> "ChunkKey":
        parts = s.split("-")
        if len(parts) != 2:
            raise ValueError(f"malformed chunk key {s!r}: expected '<fingerprint>-<token hash>'")
        return cls(parts[0], parts[1])

    def __str__(self) -> str:
        return self.to_string()


@dataclass(frozen=True)
class Piece:
    """A piece of prompt text. kind: prefix | chunk | text | suffix; chunks may carry a node id.

    source: the stored chunk text this chunk re-renders (truncated, other whitespace); where
    the chunk's own cache is missing, its token runs are served from the source's cache
    (subspans.py).
    salt: the tenant whose own cache of this piece it is (`ChunkLookup.find` keys it under
    the salt, so no other tenant's request finds it, nor times it); None: the shared cache."""

    kind: str
    text: str
    node_id: str | None = None
    source: str | None = None
    salt: str | None = None


@dataclass
class KVChunk:
    """One chunk's cache, computed alone at positions 0..T-1.

    token_ids (T,) int64; k, v (L, T, Hkv, D). Keys are stored **pre-RoPE** (after the
    q/k norm where the model has one), so they can be rotated to any global offset later.
    `anchors` (filled by the selector's anchor extraction) maps a method name to per-layer
    index tensors of the chunk's anchor tokens.
    """

    key: ChunkKey
    token_ids: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    anchors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        T = self.token_ids.shape[0]
        if self.k.shape != self.v.shape or self.k.dim() != 4 or self.k.shape[1] != T:
            raise ValueError(
                f"KVChunk shapes disagree: token_ids {tuple(self.token_ids.shape)}, "
                f"k {tuple(self.k.shape)}, v {tuple(self.v.shape)}; expected k, v (L, T, Hkv, D)"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.k.shape[0])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


@dataclass
class SelectionResult:
    """Which prompt rows a method recomputes, and why.

    rows: sorted unique absolute positions (always includes the whole suffix, never the
    prefix). scores: per context token score where the method has one (T_ctx,), else None.
    """

    method: str
    rows: torch.Tensor
    scores: torch.Tensor | None = None
    full_layers: int = 0  # layers 0..full_layers-1 recompute every token (cacheblend)
    on_layer_end: Callable[..., Any] | None = None  # may narrow the rows after a layer (fusion.LayerState)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptSpan:
    """One segment of a fused prompt: positions [start, end) of `kind` (prefix | chunk |
    text | suffix); chunks carry their node id and whether their cache existed before."""

    kind: str
    start: int
    end: int
    node_id: str | None = None
    cache_hit: bool = False


GUARD_SIGNAL = "first_token_margin"  # the quality guard's signal (engine/guard.py)


@dataclass
class GuardReport:
    """What the guard saw and did for one request (`FusionResult.guard`).

    signal / value / threshold: the signal's name, its value after the first fused prefill,
    the threshold it was held to. action: `kept` (the fused answer stands), `ratio R` (fused
    again at R), `full` (full prefill), `off` (the guard did not run). reason: why.
    code: the reason in one word - low_margin (escalated), ceiling (the time ceiling held
    back a rung it wanted), margin_ok, off, not_guarded, uncalibrated. rungs: (ratio,
    margin) per escalation run (1.0: full prefill). added_ms: the time the escalations
    took. spent_tokens: context tokens recomputed over every pass."""

    signal: str = GUARD_SIGNAL
    value: float | None = None
    threshold: float | None = None
    action: str = "off"
    reason: str = ""
    code: str = "off"
    rungs: list[tuple[float, float]] = field(default_factory=list)
    added_ms: float = 0.0
    spent_tokens: int = 0
    source: str = ""

    @property
    def escalated(self) -> bool:
        return bool(self.rungs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "signal": self.signal,
            "value": None if self.value is None else round(self.value, 6),
            "threshold": self.threshold,
            "action": self.action,
            "reason": self.reason,
            "code": self.code,
            "escalated": self.escalated,
            "rungs": [[r, round(m, 6)] for r, m in self.rungs],
            "added_ms": round(self.added_ms, 3),
            "spent_tokens": self.spent_tokens,
            "source": self.source,
        }


@dataclass
class FusionResult:
    """Everything about one answer: text, timings, counts, what was recomputed.

    ttft_ms: from the request's start to its first token - the time the caller waited,
    including caches built during the request. Chunk counts: `cache_hits` had a cache
    before the request began; `cache_misses` had none; `cache_built` of those (always <=
    cache_misses) had theirs computed during the request - by the engine's lookup, or by a
    background build the request waited for or is the first to use (the integrations'
    retrieval learner) - so the next request hits them. cache_hits + cache_misses == chunks.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    method: str = ""
    ratio: float | None = None
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    context_tokens: int = 0
    prompt_tokens: int = 0
    recomputed_tokens: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_built: int = 0  # misses whose cache was computed during this request
    chunks: int = 0
    finish_reason: str = ""
    timings_ms: dict[str, float] = field(default_factory=dict)
    selection: SelectionResult | None = None
    store_stats: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)  # load/recompute decision (planner.Plan.to_dict())
    load: dict[str, Any] = field(default_factory=dict)  # layer-wise loading (prefetch.PrefetchReport.to_dict())
    threads: int = 0  # torch intra-op threads the request ran with (its device's count on a GPU)
    prompt_ids: torch.Tensor | None = None  # (T,) int64: the fused prompt's tokens (positions of `selection`)
    spans: tuple[PromptSpan, ...] = ()  # its segments, in order, covering 0..T-1
    subspan_tokens: int = 0  # chunk tokens served from slices of stored chunks (subspans.py)
    first_logits: torch.Tensor | None = None  # (vocab,) fp32 on the host: the logits the first token came from
    guard: GuardReport | None = None  # what the quality guard saw and did (engine/guard.py)
    # what was asked, where the guard escalated and `method` / `ratio` say what answered
    # (None: nothing escalated, or an engine that reports only what was asked)
    requested_method: str | None = None
    requested_ratio: float | None = None
    # the configuration used and this deployment's measured fidelity of it (engine/audit.py:
    # target, config, status, reason, measured {n, agree, agree_ci}, samples); None: not reported
    fidelity: dict[str, Any] | None = None

    @property
    def recompute_share(self) -> float:
        return self.recomputed_tokens / self.context_tokens if self.context_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "answer": self.text,
            "ttft_ms": round(self.ttft_ms, 3),
            "total_ms": round(self.total_ms, 3),
            "method": self.method,
            "ratio": self.ratio,
            "requested_method": self.requested_method,
            "requested_ratio": self.requested_ratio,
            "answered": self.what_answered(),
            "context_tokens": self.context_tokens,
            "prompt_tokens": self.prompt_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "recompute_share": round(self.recompute_share, 4),
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "cache_built": self.cache_built,
            "chunks": self.chunks,
            "subspan_tokens": self.subspan_tokens,
            "new_tokens": len(self.token_ids),
            "finish_reason": self.finish_reason,
            "threads": self.threads,
            "timings_ms": {k: round(v, 3) for k, v in self.timings_ms.items()},
            "store": self.store_stats,
            **({"plan": self.plan} if self.plan else {}),
            **({"guard": self.guard.to_dict()} if self.guard is not None else {}),
            **({"fidelity": self.fidelity} if self.fidelity is not None else {}),
        }

    def what_answered(self) -> str:
        """What answered and what the guard did, in one line:

            qcfuse @ 0.15 · guard: kept (margin 0.41 ≥ 0.13)
            full (escalated by the guard from qcfuse @ 0.15: margin 0.05 < 0.13)
            epic · guard: off (method epic is not guarded)

        After an escalation the answering rung is `method` / `ratio` where the engine sets
        `requested_method` (the asked ones are `requested_*`), else the guard's last rung
        (the asked ones are then `method` / `ratio`)."""
        g = self.guard
        if self.requested_method is None:
            asked = _method_label(self.method, self.ratio)
            if g is not None and g.rungs:
                rung = g.rungs[-1][0]
                answered = _method_label("full" if rung >= 1.0 else self.method, rung)
            else:
                answered = asked
        else:
            asked = _method_label(self.requested_method, self.requested_ratio)
            answered = _method_label(self.method, self.ratio)
        if g is None:
            return answered
        margin = "" if g.value is None or g.threshold is None else f"margin {g.value:.2f}"
        if g.rungs:
            return f"{answered} (escalated by the guard from {asked}: {margin} < {g.threshold:.2f})"
        if g.code == "margin_ok":
            return f"{answered} · guard: kept ({margin} ≥ {g.threshold:.2f})"
        if g.code in ("low_margin", "ceiling"):  # below the threshold, and no rung ran
            return f"{answered} · guard: kept ({margin} < {g.threshold:.2f}; {g.reason})"
        return f"{answered} · guard: {g.action}" + (f" ({g.reason})" if g.reason else "")


def _method_label(method: str, ratio: float | None) -> str:
    """'qcfuse @ 0.15'; a method without a ratio (full prefill, an adaptive budget) by name."""
    return method if ratio is None or method == "full" else f"{method} @ {ratio:.2f}"
