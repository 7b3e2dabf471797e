"""What the studio's run history shows of one mode: the median of its repeats (speed) and
its answer against full prefill's on the same model, question and chunks (quality).

Speed, over the N repeats of one mode (each one `engine.stream` call, caches built before):

    ttft_ms          median time to the first token: the lower middle one for an even N, so it
                     is one repeat's own (`representative`) and its waterfall adds up to it
    total_ms         median end-to-end time (first token + decoding)
    decode_tok_s     median decode rate: (new tokens - 1) / (total - TTFT); None for an
                     answer of one token (nothing was decoded after the first)

Quality, from the representative repeat (the median TTFT's) (greedy decoding on one machine answers the same every time;
`repeats_agree` says whether the repeats did):

    kl_first_token   KL(full || mode) in nats between the two first-token distributions
                     (full prefill's own: 0)
    token_match      share of the answer's tokens that match full's greedy answer, in order:
                     LCS(mode ids, full ids) / max(len): 1.0 = the same tokens
    answer_matches   the same text as full's answer (whitespace-normalised)

Everything here is computed in Python from the `FusionResult`s; the page only prints it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from qcfuse_core.eval.metrics import kl_divergence
from qcfuse_core.types import FusionResult


@dataclass(frozen=True)
class Speed:
    """Medians over one mode's repeats (all > 0 except decode_tok_s, which may be None)."""

    repeats: int
    ttft_ms: float
    total_ms: float
    decode_tok_s: float | None
    ttft_all_ms: tuple[float, ...]  # every repeat's TTFT, in run order

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ttft_all_ms"] = list(self.ttft_all_ms)
        return d


@dataclass(frozen=True)
class Quality:
    """One answer against full prefill's (same model, question, chunks, max_new_tokens)."""

    kl_first_token: float
    token_match: float
    answer_matches: bool
    repeats_agree: bool

    def to_dict(self) -> dict:
        return asdict(self)


def decode_rate(r: FusionResult) -> float | None:
    """Tokens per second after the first one; None when nothing was decoded after it."""
    decoded = len(r.token_ids) - 1
    span_ms = r.total_ms - r.ttft_ms
    if decoded < 1 or span_ms <= 0:
        return None
    return decoded / (span_ms / 1000.0)


def speed(repeats: Sequence[FusionResult]) -> Speed:
    """Medians of the repeats' TTFT, end-to-end time and decode rate."""
    if not repeats:
        raise ValueError("speed needs at least one repeat")
    rates = [x for x in (decode_rate(r) for r in repeats) if x is not None]
    return Speed(
        repeats=len(repeats),
        ttft_ms=round(representative(repeats).ttft_ms, 3),
        total_ms=round(statistics.median(r.total_ms for r in repeats), 3),
        decode_tok_s=round(statistics.median(rates), 2) if rates else None,
        ttft_all_ms=tuple(round(r.ttft_ms, 3) for r in repeats),
    )


def representative(repeats: Sequence[FusionResult]) -> FusionResult:
    """The repeat with the median TTFT (the lower middle one for an even count): its stages,
    details and answer stand for the mode."""
    if not repeats:
        raise ValueError("no repeats")
    mid = statistics.median_low(r.ttft_ms for r in repeats)
    return next(r for r in repeats if r.ttft_ms == mid)


def lcs_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common subsequence of two token-id lists (O(len(a) x len(b)))."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def token_match(ids: Sequence[int], full_ids: Sequence[int]) -> float:
    """LCS / the longer answer's length: the share of tokens that match full's, in order.
    Two empty answers match fully."""
    n = max(len(ids), len(full_ids))
    return 1.0 if n == 0 else lcs_length(ids, full_ids) / n


def same_text(a: str, b: str) -> bool:
    return " ".join(a.split()) == " ".join(b.split())


def quality(repeats: Sequence[FusionResult], full: FusionResult) -> Quality:
    """repeats[0] (the representative) against full prefill's answer `full`; the other
    repeats only say whether they answered the same. Both need `first_logits`."""
    r = repeats[0]
    if r.first_logits is None or full.first_logits is None:
        raise ValueError("quality needs both answers' first-token logits (FusionResult.first_logits)")
    if r.first_logits.shape != full.first_logits.shape:
        raise ValueError(
            f"first-token logits of different vocabularies: {tuple(r.first_logits.shape)} vs "
            f"{tuple(full.first_logits.shape)} (not the same model)"
        )
    kl = max(0.0, kl_divergence(full.first_logits, r.first_logits))  # >= 0; rounding can give -1e-9
    agree = all(x.token_ids == r.token_ids for x in repeats[1:])
    return Quality(
        round(kl, 6), round(token_match(r.token_ids, full.token_ids), 4), same_text(r.text, full.text), agree
    )


def drop_logits(r: FusionResult) -> FusionResult:
    """The result without its (vocab,) logits, for keeping: 1 MB each on a 262K vocabulary."""
    from dataclasses import replace

    return replace(r, first_logits=None) if isinstance(r.first_logits, torch.Tensor) else r
