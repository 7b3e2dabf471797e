"""Answer-quality metrics: SQuAD-normalised F1 / EM / contains, ROUGE-L, first-token KL.

Text metrics take the max over gold aliases. Normalisation (SQuAD): lowercase, drop
punctuation and the articles a/an/the, squash whitespace.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", s).split())


def token_f1(pred: str, gold: str) -> float:
    p, g = normalize(pred).split(), normalize(gold).split()
    common = Counter(p) & Counter(g)
    same = sum(common.values())
    if not p or not g:
        return float(p == g)
    if same == 0:
        return 0.0
    prec, rec = same / len(p), same / len(g)
    return 2 * prec * rec / (prec + rec)


def exact_match(pred: str, gold: str) -> float:
    return float(normalize(pred) == normalize(gold))


def contains(pred: str, gold: str) -> float:
    """1 when the normalised gold appears in the normalised answer as whole words."""
    g = normalize(gold)
    return float(bool(g) and f" {g} " in f" {normalize(pred)} ")


def rouge_l(pred: str, ref: str) -> float:
    """ROUGE-L F1 over normalised word tokens (LCS)."""
    p, r = normalize(pred).split(), normalize(ref).split()
    if not p or not r:
        return float(p == r)
    prev = [0] * (len(r) + 1)
    for a in p:
        cur = [0]
        for j, b in enumerate(r):
            cur.append(prev[j] + 1 if a == b else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    prec, rec = lcs / len(p), lcs / len(r)
    return 2 * prec * rec / (prec + rec)


def best(metric, pred: str, golds: Sequence[str]) -> float:
    return max((metric(pred, g) for g in golds), default=0.0)


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(ref || other) in nats between the softmaxes of two (vocab,) logit vectors (fp32)."""
    p = torch.log_softmax(ref_logits.float(), -1)
    q = torch.log_softmax(logits.float(), -1)
    return float((p.exp() * (p - q)).sum())


def nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean negative log-likelihood of `targets` (G,) under `logits` (G, vocab)."""
    return float(torch.nn.functional.cross_entropy(logits.float(), targets.to(logits.device)))
