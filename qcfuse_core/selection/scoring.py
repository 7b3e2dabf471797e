"""Turning per-token scores into a recompute set: fixed ratio or adaptive budget.

Pure tensor code. Candidates are the chunk tokens (prefix never, glue and suffix always are
added later by `SelectionContext.finalize`):

    candidates:  positions (M,) int64, scores (M,) >= 0
    fixed:       the `budget` highest scores
    adaptive:    the fewest highest-scoring tokens whose share of the candidates' total
                 score reaches `target`, clamped to [floor_n, ceil_n]

Ties break toward the earlier position (stable sort), so a selection is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BUDGET_MODES = ("fixed", "adaptive")


@dataclass(frozen=True)
class AdaptiveBudget:
    """Cover `target` of the probed mass with at least `floor` and at most `ceiling` x context."""

    target: float = 0.8
    floor: float = 0.05
    ceiling: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.target <= 1.0:
            raise ValueError(f"target mass share must be in (0, 1], got {self.target}")
        if not 0.0 <= self.floor <= self.ceiling <= 1.0:
            raise ValueError(f"need 0 <= floor <= ceiling <= 1, got floor={self.floor}, ceiling={self.ceiling}")


def rank(scores: torch.Tensor) -> torch.Tensor:
    """(M,) -> indices by descending score, earlier index first among ties."""
    return torch.sort(-scores.float(), stable=True).indices


def top_budget(positions: torch.Tensor, scores: torch.Tensor, budget: int) -> torch.Tensor:
    """The `budget` best candidates' positions, sorted ascending."""
    if positions.shape != scores.shape:
        raise ValueError(f"positions {tuple(positions.shape)} and scores {tuple(scores.shape)} differ")
    k = max(0, min(int(budget), positions.numel()))
    return torch.sort(positions[rank(scores)[:k]]).values


def adaptive_count(scores: torch.Tensor, target: float, floor_n: int, ceil_n: int) -> int:
    """Fewest top tokens whose share of sum(scores) reaches `target`, clamped to [floor_n, ceil_n]."""
    M = scores.numel()
    if M == 0:
        return 0
    s = scores.float().clamp_min(0)[rank(scores)]
    total = float(s.sum())
    if total <= 0:
        need = floor_n
    else:
        cum = torch.cumsum(s, 0) / total
        need = int(torch.searchsorted(cum, torch.tensor([target - 1e-9]), right=False)[0]) + 1
    return max(0, min(M, max(floor_n, min(ceil_n, need))))


def covered_share(scores: torch.Tensor, chosen_mask: torch.Tensor) -> float:
    """Share of the candidates' total score held by the chosen ones (0 when all scores are 0)."""
    total = float(scores.float().clamp_min(0).sum())
    return float(scores.float().clamp_min(0)[chosen_mask].sum()) / total if total > 0 else 0.0


ALLOCATIONS = ("global", "chunk")


def chunk_quotas(masses: list[float], lengths: list[int], budget: int) -> list[int]:
    """Split `budget` tokens over chunks in proportion to each chunk's total score (its share
    of the probed mass), at most a chunk's length each; what a full chunk cannot take goes to
    the others by the same rule. Largest remainders round, earlier chunk first among ties.
    Sum == min(budget, sum(lengths)). All-zero masses split by length."""
    if len(masses) != len(lengths):
        raise ValueError("one mass per chunk length")
    quotas = [0] * len(lengths)
    left = max(0, min(int(budget), sum(lengths)))
    open_ = [i for i, n in enumerate(lengths) if n > 0]
    while left > 0 and open_:
        w = [max(0.0, float(masses[i])) for i in open_]
        if sum(w) <= 0:
            w = [float(lengths[i] - quotas[i]) for i in open_]
        total = sum(w)
        want = [left * x / total for x in w]
        give = [int(x) for x in want]
        for j in sorted(range(len(open_)), key=lambda j: (-(want[j] - give[j]), j))[: left - sum(give)]:
            give[j] += 1
        for j, i in enumerate(open_):
            quotas[i] += min(give[j], lengths[i] - quotas[i])
        left = max(0, min(int(budget), sum(lengths))) - sum(quotas)
        open_ = [i for i in open_ if quotas[i] < lengths[i]]
    return quotas
