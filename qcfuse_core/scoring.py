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
