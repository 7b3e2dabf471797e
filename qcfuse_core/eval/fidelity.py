"""Answer-level fidelity: how far a fused answer is from the one full prefill would have given.

One teacher-forced full-prefill forward over [prompt ; answer] gives full prefill's greedy
token at every answer position - the token full prefill would choose after the prompt and
the answer so far - with no decode loop:

    logits row T-1+i  ->  full's greedy choice for answer position i, given answer[:i]

From it (`measure`):

    first_agree     full prefill's first token is the answer's first token
    prefix          the length of the agreeing prefix: full prefill's own greedy answer
                    equals the fused one up to here (greedy decoding from full prefill
                    would produce exactly these tokens, then part)
    agree           the share of answer tokens full prefill would have chosen in place
                    (the answer-token agreement: a user's fidelity, README)
    split_margin    full prefill's p1 - p2 where they first part (None: they never do): a
                    small margin is a near tie, a large one a real departure

This is the measure `bench quality` reports as `answer_agree` and the engine's audit
(engine/audit.py) takes on live traffic. tests/test_fidelity.py holds it equal to a
decode-by-decode comparison (full prefill's cache stepped along the answer).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from qcfuse_core.model.adapter import ModelAdapter


@dataclass(frozen=True)
class AnswerFidelity:
    """One answer against full prefill (module docstring)."""

    tokens: int  # answer tokens compared
    first_agree: bool
    prefix: int  # agreeing prefix length (== tokens where every token agrees)
    agree: float  # share of answer tokens full prefill would have chosen (1.0 for an empty answer)
    split_margin: float | None  # full prefill's p1 - p2 at the first disagreement

    def to_dict(self) -> dict:
        return asdict(self)


def margins(logits: torch.Tensor) -> torch.Tensor:
    """(n, vocab) logits -> (n,) p1 - p2 of each row's softmax (fp32)."""
    top = torch.softmax(logits.detach().float(), -1).topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def from_logits(logits: torch.Tensor, answer: torch.Tensor) -> AnswerFidelity:
    """Full prefill's logits at the answer positions (n, vocab) - row i the distribution over
    answer[i] given the prompt and answer[:i] - and the answer ids (n,) -> AnswerFidelity."""
    n = int(answer.numel())
    if logits.shape[0] != n:
        raise ValueError(f"need one logits row per answer token: {logits.shape[0]} rows for {n} tokens")
    if n == 0:
        return AnswerFidelity(0, True, 0, 1.0, None)
    same = logits.argmax(-1).cpu() == answer.cpu()
    parted = (~same).nonzero()
    prefix = int(parted[0]) if parted.numel() else n
    split = None if prefix == n else float(margins(logits[prefix : prefix + 1])[0])
    return AnswerFidelity(n, bool(same[0]), prefix, float(same.float().mean()), split)


def full_logits(adapter: ModelAdapter, prompt_ids: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """One forward of [prompt ; answer[:-1]] by full prefill (HF's own forward, as a `full`
    request prefills) -> the logits at the answer's n positions (n, vocab) fp32."""
    prompt_ids, answer = torch.as_tensor(prompt_ids).reshape(-1), torch.as_tensor(answer).reshape(-1)
    n = int(answer.numel())
    if n == 0:
        return torch.empty(0, 0)
    ids = torch.cat([prompt_ids.cpu(), answer[:-1].cpu()]).to(torch.int64)
    logits, _ = adapter.hf_forward(ids, keep=n)
    return logits


def measure(adapter: ModelAdapter, prompt_ids: torch.Tensor, answer: list[int] | torch.Tensor) -> AnswerFidelity:
    """A fused request's prompt (T,) and answer ids -> its fidelity to full prefill, from one
    teacher-forced full-prefill forward (module docstring)."""
    ans = torch.as_tensor(list(answer) if not isinstance(answer, torch.Tensor) else answer, dtype=torch.int64)
    if ans.numel() == 0:
        return from_logits(torch.empty(0, 0), ans)
    return from_logits(full_logits(adapter, prompt_ids, ans), ans)
