"""What the chunk lookup answers about a request's prompt (`ChunkLookup.find`).

    pieces (prefix, chunk, text, suffix)  ->  LookedUp
                                                parts    one per non-empty piece, in prompt order:
                                                         its token ids, its chunk key (prefix and
                                                         chunks), where its cache is (`tier`, or
                                                         in memory as `chunk`), whether it was
                                                         there before this request (`hit`)
                                                hits     chunks served from a cache
                                                misses   chunks computed during the lookup

Nothing of a chunk is left to compute after the lookup: a miss is prefilled alone and stored
in it (`ChunkBuilder.build`), so its part holds the new cache in memory. What remains to
compute is the prompt's own text (glue, question, suffix: `LookedUp.fresh_tokens`) and the
rows the selection recomputes.

A prompt must fit the model's positions, generation included (`check_context`): a model asked
past its trained positions answers garbage without any error, so a request that does not
fit is refused before any cache is built for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qcfuse_core.types import ChunkKey, KVChunk

GLUE_CHARS = 256  # text pieces up to this long (separators, headers) are tokenised once, like chunks


@dataclass(frozen=True)
class Part:
    """One non-empty piece of the prompt after lookup."""

    kind: str  # prefix | chunk | text | suffix
    ids: torch.Tensor  # (n,) int64 on the host
    node_id: str | None = None
    key: ChunkKey | None = None  # prefix and chunks (not for `full`)
    tier: str | None = None  # gpu | host | disk where a tiered store holds it
    chunk: KVChunk | None = None  # an in-memory cache (the prefix; MemoryStore chunks; misses just built)
    hit: bool = False  # the chunk's cache existed before this request


@dataclass(frozen=True)
class LookedUp:
    """The prompt's parts and its chunk caches found (hits) or built now (misses)."""

    parts: tuple[Part, ...]
    hits: int
    misses: int

    @property
    def chunks(self) -> list[Part]:
        return [p for p in self.parts if p.kind == "chunk"]

    @property
    def num_tokens(self) -> int:
        return sum(int(p.ids.numel()) for p in self.parts)

    @property
    def fresh_tokens(self) -> int:
        """Tokens of the prompt's own text (glue, question, suffix): always computed."""
        return sum(int(p.ids.numel()) for p in self.parts if p.kind in ("text", "suffix"))


def context_error(prompt_tokens: int, new_tokens: int, limit: int, hint: str = "lower --top-k") -> str:
    gen = f" + {new_tokens:,} to generate" if new_tokens else ""
    return f"prompt is {prompt_tokens:,} tokens{gen}; the model takes {limit:,} - {hint}"


def check_context(limit: int | None, prompt_tokens: int, new_tokens: int = 0) -> None:
    """Raise ValueError unless `prompt_tokens + new_tokens <= limit` (None: no limit known)."""
    if limit is not None and prompt_tokens + new_tokens > limit:
        raise ValueError(context_error(prompt_tokens, new_tokens, limit))
